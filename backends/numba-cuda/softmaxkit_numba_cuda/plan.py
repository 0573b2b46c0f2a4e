"""How a row of length N is spread over threads: the strategy by row length.

* short rows (up to 16 words per lane): a warp per row, several rows per block, reductions by
  shuffles;
* medium rows (up to 1024 threads x ``max_slots`` words): a block per row, the whole row held
  in registers between the reduction pass and the writing pass, so it is read once;
* long rows: a block per row walking the row in tiles; the writing pass reads each tile
  again (from L2 where it is still resident).

N counts words: single elements, or 8-byte words of 2 float32 / 4 bfloat16 values.  Each
thread holds ``slots`` words per tile at positions ``lane + threads * j``, so each load
instruction of a warp reads consecutive addresses (coalesced).  This module imports no
numba: the plan is plain arithmetic, tested on its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

WARP = 32
ROWS_PER_WARP_BLOCK = 8
MAX_THREADS = 1024
MAX_SLOTS = 32
SUBWARP = (8, 16)
"""Group sizes below a warp (several rows per warp), available through :data:`OVERRIDE`."""
OVERRIDE = "SOFTMAXKIT_NUMBA_CUDA_PLAN"
"""Environment variable ``"threads,slots"`` that forces a plan (for tests and tuning)."""


def _pow2_at_least(v: int) -> int:
    p = 1
    while p < v:
        p *= 2
    return p


@dataclass(frozen=True)
class Plan:
    """Threads per row, values per thread per tile, rows per block, tiles per row."""

    threads: int
    slots: int
    rows_per_block: int
    tiles: int

    @property
    def block(self) -> int:
        """Threads per block."""
        return self.threads * self.rows_per_block

    def grid(self, n_rows: int) -> int:
        """Blocks to launch for ``n_rows`` rows (at least one)."""
        return max(1, -(-n_rows // self.rows_per_block))

    @property
    def cached(self) -> bool:
        """Whether the row stays in registers between the two passes (read once)."""
        return self.tiles == 1


def make(threads: int, slots: int, n: int, warp_rows: int = ROWS_PER_WARP_BLOCK) -> Plan:
    """The plan with ``threads`` threads and ``slots`` values per thread for rows of ``n``.

    A warp-per-row plan (``threads == 32``) puts ``warp_rows`` rows in each block; groups of 8
    or 16 threads put proportionally more.
    """
    if (threads % WARP and threads not in SUBWARP) or not 0 < threads <= MAX_THREADS \
            or not 0 < slots <= 2 * MAX_SLOTS:
        raise ValueError(f"invalid plan: threads={threads}, slots={slots}")
    rows = warp_rows * WARP // threads if threads <= WARP else 1
    tiles = max(1, -(-n // (threads * slots)))
    return Plan(threads, slots, rows, tiles)


def choose(n: int, simulator: bool = False, max_slots: int = MAX_SLOTS) -> Plan:
    """The plan for rows of length ``n`` (see the module docstring).

    ``max_slots`` caps the values a thread holds: lower for float64 and for kernels that hold
    two arrays (the VJPs), so that the row stays in registers without spilling.
    """
    forced = os.environ.get(OVERRIDE)
    if forced:
        threads, slots = (int(v) for v in forced.split(","))
        return make(threads, slots, n)
    if simulator:  # few threads keep the simulator fast; long rows still take tiles
        if n <= 64:
            return make(SUBWARP[0], _pow2_at_least(max(1, -(-n // SUBWARP[0]))), n,
                        warp_rows=2)
        return make(2 * WARP, 2, n)
    if n <= min(16, max_slots) * WARP:
        return make(WARP, _pow2_at_least(max(1, -(-n // WARP))), n)
    if n <= MAX_THREADS * max_slots:
        per_thread = min(16, max_slots)
        threads = min(MAX_THREADS, max(2 * WARP, _pow2_at_least(-(-n // per_thread))))
        return make(threads, _pow2_at_least(-(-n // threads)), n)
    return make(MAX_THREADS, min(16, max_slots), n)
