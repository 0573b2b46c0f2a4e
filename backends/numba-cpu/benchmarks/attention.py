"""Attention forward on the CPU: softmaxkit (numba-cpu) next to torch's SDPA, same inputs.

Prints the median time of each over ``--repeats`` runs and the largest difference of the
outputs, for float32 B1 H8 L2048 D64 by default, causal and not::

    python backends/numba-cpu/benchmarks/attention.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import softmaxkit as sk


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,8,2048,64", help="B,H,L,D")
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    b, h, n, d = (int(v) for v in opts.shape.split(","))
    rng = np.random.default_rng(0)
    q, k, v = (torch.from_numpy(rng.standard_normal((b, h, n, d), dtype=np.float32))
               for _ in range(3))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; shape B{b} H{h} "
          f"L{n} D{d} float32")
    print(f"{'causal':8s} {'softmaxkit ms':>14s} {'torch sdpa ms':>14s} {'speed-up':>9s} "
          f"{'max |diff|':>11s}")
    for causal in (False, True):
        ours = sk.attention(q, k, v, causal=causal, backend="numba-cpu")
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        diff = float((ours - ref).abs().max())
        t_sk = median_ms(lambda c=causal: sk.attention(q, k, v, causal=c, backend="numba-cpu"),
                         opts.repeats)
        t_torch = median_ms(
            lambda c=causal: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=c), opts.repeats)
        print(f"{causal!s:8s} {t_sk:14.1f} {t_torch:14.1f} {t_torch / t_sk:8.2f}x "
              f"{diff:11.2e}")


if __name__ == "__main__":
    main()
