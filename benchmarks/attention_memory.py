"""Peak memory of the reference attention for one (batch, head): it grows with Lq * block.

The reference forward folds key tiles into a running summary, so besides its inputs and its
output it holds a few ``[Lq, block]`` tiles, never the ``[Lq, Lk]`` score matrix.  This script
measures the peak of the memory allocated during one call (numpy's allocations are visible to
:mod:`tracemalloc`; the inputs exist before tracing starts and are not counted) for several
tile sizes and sequence lengths, and prints it next to the size of one ``[Lq, block]`` float32
tile and of the whole score matrix.

Run: ``python benchmarks/attention_memory.py`` (Lq = Lk = 16384, float32, D = 64; about a
minute on two cores), or ``--quick`` for a smaller check.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import array_api_compat.numpy as xp
import numpy as np

from softmaxkit.reference.attention import attention

MIB = 2.0**20


def peak_bytes(lq: int, lk: int, d: int, block: int, seed: int = 0) -> tuple[int, float]:
    """Peak traced bytes and seconds of one reference forward with lse, for one head."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, lq, d), dtype=np.float32)
    k = rng.standard_normal((1, 1, lk, d), dtype=np.float32)
    v = rng.standard_normal((1, 1, lk, d), dtype=np.float32)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        out, lse = attention(xp, q=q, k=k, v=v, scale=d**-0.5, causal=None, window=(-1, -1),
                             mask=None, softcap=None, return_lse=True, block=block)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    seconds = time.perf_counter() - start
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    return peak, seconds


def main(argv: list[str] | None = None) -> None:
    """Print peak memory against Lq, Lk and block."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384, help="Lq = Lk (default 16384)")
    parser.add_argument("--dim", type=int, default=64, help="head dim D = Dv (default 64)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--quick", action="store_true", help="Lq = Lk = 4096, two blocks")
    opts = parser.parse_args(argv)
    n, d, blocks = opts.length, opts.dim, opts.blocks
    if opts.quick:
        n, blocks = 4096, [64, 256]
    runs = [(n, n, b) for b in blocks]
    base = blocks[len(blocks) // 2 - 1] if len(blocks) > 1 else blocks[0]
    runs += [(n // 4, n, base), (n, n // 4, base)]
    print(f"reference attention, float32, one head, D = Dv = {d}")
    print(f"{'Lq':>6} {'Lk':>6} {'block':>5} {'peak MiB':>9} {'tile MiB':>9} "
          f"{'peak/unit':>9} {'[Lq,Lk] MiB':>11} {'s':>6}")
    for lq, lk, block in runs:
        peak, seconds = peak_bytes(lq, lk, d, block)
        tile = 4 * lq * block
        unit = 4 * lq * (block + d)  # one score tile plus one [Lq, Dv] accumulator
        print(f"{lq:>6} {lk:>6} {block:>5} {peak / MIB:>9.1f} {tile / MIB:>9.2f} "
              f"{peak / unit:>9.2f} {4 * lq * lk / MIB:>11.0f} {seconds:>6.1f}")
    print("peak/unit = peak / (4 bytes * Lq * (block + Dv)): about constant, whatever Lk is")


if __name__ == "__main__":
    main()
