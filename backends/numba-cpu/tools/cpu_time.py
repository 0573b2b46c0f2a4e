"""CPU time per call, one thread each: numba-cpu against torch and a numpy copy.

CPU time (``time.thread_time``) counts only the cycles this thread ran, so the figures stay
meaningful on a machine shared with other work, where wall-clock times of threaded code are
not.  Both libraries run on one thread (``numba.set_num_threads(1)``,
``torch.set_num_threads(1)``); the minimum over ``--repeats`` calls is kept::

    python backends/numba-cpu/tools/cpu_time.py
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numba
import numpy as np
import torch

import softmaxkit as sk

SHAPES = ((4096, 4096), (32768, 512), (256, 65536))


def cpu_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return 1e3 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    numba.set_num_threads(1)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"{'shape':12s} {'dtype':9s} {'op':12s} {'sk ms':>8s} {'torch ms':>9s} "
          f"{'x torch':>8s} {'copy ms':>8s} {'% copy bw':>9s}")
    for shape in SHAPES:
        x32 = rng.standard_normal(shape, dtype=np.float32)
        for dtype, tdtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                              ("float16", torch.float16)):
            x = x32.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
            xt = torch.from_numpy(x32).to(tdtype)
            dst = np.empty_like(x)
            copy = cpu_ms(lambda x=x, dst=dst: np.copyto(dst, x), opts.repeats)
            ops = [("softmax", sk.softmax, torch.softmax)]
            if dtype == "float32":
                ops += [("log_softmax", sk.log_softmax, torch.log_softmax),
                        ("logsumexp", sk.logsumexp, torch.logsumexp)]
            for name, ours, theirs in ops:
                t_sk = cpu_ms(lambda f=ours, x=x: f(x, axis=-1), opts.repeats)
                t_torch = cpu_ms(lambda f=theirs, xt=xt: f(xt, -1), opts.repeats)
                written = 0 if name == "logsumexp" else 1  # logsumexp writes one per row
                bw = (1 + written) / 2 * copy / t_sk  # the copy reads and writes once
                print(f"{shape[0]}x{shape[1]:<7d} {dtype:9s} {name:12s} {t_sk:8.2f} "
                      f"{t_torch:9.2f} {t_torch / t_sk:7.2f}x {copy:8.2f} {bw:8.0%}")


if __name__ == "__main__":
    main()
