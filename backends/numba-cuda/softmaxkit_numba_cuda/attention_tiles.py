"""The attention kernels' micro-tiles and the shared memory a block of them takes.

Plain arithmetic, without numba, so the manifest's ``can_run`` reads it too: the kernels of
:mod:`.attention_kernels` are built for these tiles, and a device whose blocks may take less
shared memory than a tile needs gets a smaller one (:func:`tiles_within`), or, where even the
smallest does not fit, the call is declined (:func:`smallest_shared`).
"""

from __future__ import annotations

from collections.abc import Callable

LANES = 16
"""Threads a block; lanes of a row group (the threads that share a micro-tile's rows)."""
MAX_HEAD_DIM = 256
"""The largest key or value head dimension the kernels are built for."""


def _columns(n: int) -> int:
    """Columns of ``n`` a lane owns (at least one, so a zero dimension still compiles)."""
    return max(1, -(-n // LANES))


FORWARD_TILES = {"float32": ((64, (4, 4)), (128, (4, 2)), (256, (2, 2))),
                 "float64": ((64, (4, 2)), (128, (2, 2)), (256, (2, 1)))}
"""Accumulator -> (largest head dimension, (rows, keys) of a thread's score micro-tile) of the
forward: 64 x 64 tiles where three blocks fit a multiprocessor, narrower ones for larger heads."""
BACKWARD_TILES = {"float32": ((64, (4, 2)), (128, (2, 2)), (256, (2, 1))),
                  "float64": ((64, (2, 2)), (128, (2, 1)), (256, (1, 1)))}
"""The same for the backward: (keys, queries) of a thread's micro-tile of ``S^T``."""


def tiles(table: dict, acc_name: str, d: int, dv: int) -> tuple[int, int]:
    """The micro-tile of ``table`` for head dimensions ``d``, ``dv``."""
    widest = max(d, dv)
    for limit, tile in table[acc_name]:
        if widest <= limit:
            return tile
    raise ValueError(f"head dimensions above {MAX_HEAD_DIM} are not supported ({d}, {dv})")


def forward_shared(acc_name: str, d: int, dv: int, rm: int, cn: int) -> int:
    """Bytes of dynamic shared memory of :func:`forward`: Q^T, K^T, V^T and P."""
    bm, bn = LANES * rm, LANES * cn
    words = d * (bm + 1) + (d + LANES * _columns(dv)) * (bn + 1) + bm * (bn + 1)
    return words * (8 if acc_name == "float64" else 4)


def backward_shared(acc_name: str, d: int, dv: int, rn: int, cm: int) -> int:
    """Bytes of dynamic shared memory of :func:`backward`: K^T, V^T, Q^T, dO^T, P, dS and the
    query tile's lse and delta."""
    bn, bm = LANES * rn, LANES * cm
    dp, dvp = LANES * _columns(d), LANES * _columns(dv)
    words = (dp + dvp) * (bn + 1) + (dp + dvp + 2 * bn) * (bm + 1) + 2 * bm
    return words * (8 if acc_name == "float64" else 4)


def _table_and_size(backward: bool) -> tuple[dict, Callable[[str, int, int, int, int], int]]:
    return (BACKWARD_TILES, backward_shared) if backward else (FORWARD_TILES, forward_shared)


def tiles_within(acc_name: str, d: int, dv: int, limit: int,
                 backward: bool = False) -> tuple[int, int]:
    """The micro-tile of the forward (or the ``backward``) for ``d``, ``dv`` (:func:`tiles`),
    halved until its block's shared memory fits ``limit`` bytes (a device below the H200's
    227 KB: 99 KB on compute capability 8.6, 8.9 and 12.0).  The larger extent is halved
    first, the second of equal ones, so the tiles stay among those of the tables."""
    table, size = _table_and_size(backward)
    a, b = tiles(table, acc_name, d, dv)
    while size(acc_name, d, dv, a, b) > limit and (a, b) != (1, 1):
        if b >= a and b > 1:
            b //= 2
        else:
            a //= 2
    return a, b


def smallest_shared(acc_name: str, d: int, dv: int, backward: bool) -> int:
    """The shared memory a block of the forward (or the backward) takes on the smallest tile
    :func:`tiles_within` may give: what a device must offer for the call to run."""
    return _table_and_size(backward)[1](acc_name, d, dv, 1, 1)
