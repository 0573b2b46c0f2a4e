"""Attention on the CPU: softmaxkit (numba-cpu) next to torch's SDPA, same inputs, one process.

Times the forward (and with ``--backward`` the gradient: ``attention_vjp`` against torch's
autograd through SDPA) for float32 B1 H8 L2048 D64 by default, causal and not.  The two
libraries alternate call by call so that a burst of other load hits both; the median and
the best of ``--repeats`` calls are printed, with the largest difference from SDPA's output,
the forward's relative Frobenius error against SDPA in float64 (spec bound for float32:
1e-5), the load average, the thread counts and the OpenBLAS kernel in use::

    python backends/numba-cpu/tools/attention.py --repeats 9
    python backends/numba-cpu/tools/attention.py --threads 1 --cpu-time

On a shared machine the second form (one thread each, CPU time of the process) compares the
work each library does, whatever else runs meanwhile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numba
import numpy as np
import torch

import softmaxkit as sk


def alternate(fns: dict[str, Callable[[], object]], repeats: int,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of each function by ``clock``, called in turn ``repeats`` times after a warm-up."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return times


def blas_kernels() -> str:
    """The BLAS libraries loaded, with the kernel (architecture) each one runs."""
    import scipy.linalg.cython_blas  # noqa: F401  (the BLAS the numba-cpu kernels call)
    from threadpoolctl import threadpool_info

    found = [f"{os.path.basename(i['filepath'])}: {i.get('architecture', '?')}"
             for i in threadpool_info() if i["user_api"] == "blas"]
    return "; ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,8,2048,64", help="B,H,L,D")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backward", action="store_true", help="also time the gradient")
    parser.add_argument("--threads", type=int, help="threads for both libraries (default: all)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="measure the process's CPU time instead of wall-clock time")
    opts = parser.parse_args()
    if opts.threads:
        numba.set_num_threads(opts.threads)
        torch.set_num_threads(opts.threads)
    clock = time.process_time if opts.cpu_time else time.perf_counter
    b, h, n, d = (int(x) for x in opts.shape.split(","))
    rng = np.random.default_rng(0)
    q, k, v, g = (torch.from_numpy(rng.standard_normal((b, h, n, d), dtype=np.float32))
                  for _ in range(4))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    env = {name: os.environ.get(name) for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), numba "
          f"{numba.__version__} ({numba.get_num_threads()} threads); B{b} H{h} L{n} D{d} "
          f"float32; {'CPU' if opts.cpu_time else 'wall-clock'} ms; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"BLAS: {blas_kernels()}; environment: {env}")
    print(f"{'pass':9s}{'causal':7s}{'sk median':>10s}{'sdpa median':>12s}{'speed-up':>9s}"
          f"{'sk best':>9s}{'sdpa best':>10s}{'speed-up':>9s}{'max |diff|':>11s}"
          f"{'rel err f64':>12s}")

    def row(name: str, causal: bool, times: dict[str, list[float]], diff: float,
            rel: str = "") -> None:
        med = {key: 1e3 * statistics.median(t) for key, t in times.items()}
        best = {key: 1e3 * min(t) for key, t in times.items()}
        print(f"{name:9s}{causal!s:7s}{med['sk']:10.1f}{med['torch']:12.1f}"
              f"{med['torch'] / med['sk']:8.2f}x{best['sk']:9.1f}{best['torch']:10.1f}"
              f"{best['torch'] / best['sk']:8.2f}x{diff:11.1e}{rel}")

    for causal in (False, True):
        ours, lse = sk.attention(q, k, v, causal=causal, return_lse=True, backend="numba-cpu")
        diff = float((ours - sdpa(q, k, v, is_causal=causal)).abs().max())
        exact = sdpa(q.double(), k.double(), v.double(), is_causal=causal)
        err = float(torch.linalg.norm(ours.double() - exact) / torch.linalg.norm(exact))
        times = alternate({
            "sk": lambda c=causal: sk.attention(q, k, v, causal=c, backend="numba-cpu"),
            "torch": lambda c=causal: sdpa(q, k, v, is_causal=c),
        }, opts.repeats, clock)
        row("forward", causal, times, diff, f"{err:12.1e}")
        if not opts.backward:
            continue
        leaves = tuple(x.clone().requires_grad_() for x in (q, k, v))

        def torch_grad(c: bool = causal, xs: tuple = leaves) -> tuple[torch.Tensor, ...]:
            # forward and backward: the forward's saved state is what the backward needs
            return torch.autograd.grad(sdpa(*xs, is_causal=c), xs, g)

        def sk_grad(c: bool = causal) -> tuple[object, ...]:
            o, s = sk.attention(q, k, v, causal=c, return_lse=True, backend="numba-cpu")
            return sk.attention_vjp(q, k, v, o, s, g, causal=c, backend="numba-cpu")

        diff = max(float((a - e).abs().max()) for a, e in zip(sk_grad(), torch_grad(),
                                                               strict=True))
        row("fwd+bwd", causal,
            alternate({"sk": sk_grad, "torch": torch_grad}, opts.repeats, clock), diff)


if __name__ == "__main__":
    main()
