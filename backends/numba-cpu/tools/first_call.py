"""First-call cost of each kernel in a fresh process: compile (cold cache) or load (warm).

Run twice with the same NUMBA_CACHE_DIR: the first run compiles (cold cache), the second
loads from the cache (warm).  Prints wall and CPU seconds per (operation, dtype)::

    NUMBA_CACHE_DIR=/tmp/nbcache python backends/numba-cpu/tools/first_call.py
"""

from __future__ import annotations

import argparse
import time

t_start = time.perf_counter()
c_start = time.process_time()

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import softmaxkit as sk  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,float64,float16,bfloat16")
    opts = parser.parse_args()
    rng = np.random.default_rng(0)
    calls = {
        "softmax": lambda x: sk.softmax(x, axis=-1, backend="numba-cpu"),
        "log_softmax": lambda x: sk.log_softmax(x, axis=-1, backend="numba-cpu"),
        "logsumexp": lambda x: sk.logsumexp(x, axis=-1, backend="numba-cpu"),
        "cross_entropy": lambda x: sk.cross_entropy(
            x, np.zeros(x.shape[0], dtype=np.int64), return_grad=True, backend="numba-cpu"
        ),
        "softmax_vjp": lambda x: sk.softmax_vjp(x, x, axis=-1),
        "log_softmax_vjp": lambda x: sk.log_softmax_vjp(x, x, axis=-1),
    }
    print(f"import: wall {time.perf_counter() - t_start:.2f} s, "
          f"cpu {time.process_time() - c_start:.2f} s")
    for name in opts.dtypes.split(","):
        dtype = ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)
        x = rng.normal(size=(4, 16)).astype(dtype)
        for op, fn in calls.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn(x)
            print(f"{op:16s} {name:9s} wall {time.perf_counter() - t0:6.2f} s  "
                  f"cpu {time.process_time() - c0:6.2f} s")
    print(f"total: wall {time.perf_counter() - t_start:.2f} s, "
          f"cpu {time.process_time() - c_start:.2f} s")


if __name__ == "__main__":
    main()
