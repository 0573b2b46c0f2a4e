"""Chunked (Dask) arrays for the conformance kit, and random chunked problems.

:func:`dask_target` is a :class:`~softmaxkit.testing.Target` whose arrays are Dask arrays of
numpy chunks, split into several chunks along the last axis, so every case of the kit runs
across chunk boundaries.  :func:`random_rows` draws problems whose chunk boundaries, masks and
special values are random, for comparing a chunked backend with the single-machine result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .kit import Target


def dask_target(pieces: int = 3) -> Target:
    """A target of Dask arrays cut into ``pieces`` chunks along the last axis (needs dask)."""
    import array_api_compat.dask.array as xp
    import dask.array as da

    from ..dtypes import lookup

    def asarray(a: np.ndarray, dtype: str | None = None) -> Any:
        a = np.asarray(a)
        if dtype:
            a = a.astype(lookup(np, dtype))
        if a.ndim == 0:
            return da.from_array(a)
        size = max(1, -(-a.shape[-1] // pieces))
        return da.from_array(a, chunks=a.shape[:-1] + (size,))

    def to_numpy(a: Any) -> np.ndarray:
        out = np.asarray(a.compute() if hasattr(a, "compute") else a)
        floating = out.dtype.kind == "f" or out.dtype.name == "bfloat16"
        return out.astype(np.float64) if floating else out

    return Target(f"dask-{pieces}", xp, asarray, to_numpy)


@dataclass
class Rows:
    """One random problem: logits, optional mask and weights, and a chunking for each."""

    x: np.ndarray
    where: np.ndarray | None
    b: np.ndarray | None
    chunks: tuple[int, tuple[int, ...]]
    where_chunks: tuple[int, int]
    b_chunks: tuple[int, int]

    def dask(self) -> tuple[Any, Any, Any]:
        """``(x, where, b)`` as Dask arrays, each with its own chunking (needs dask)."""
        import dask.array as da

        def lazy(a: np.ndarray | None, chunks: Any) -> Any:
            return None if a is None else da.from_array(a, chunks=chunks)

        return (lazy(self.x, self.chunks), lazy(self.where, self.where_chunks),
                lazy(self.b, self.b_chunks))


def random_chunking(n: int, rng: np.random.Generator, most: int = 8) -> tuple[int, ...]:
    """Chunk sizes summing to ``n``, with boundaries drawn at random (single-element chunks too)."""
    if n <= 1:
        return (n,)
    cuts = rng.choice(np.arange(1, n), size=int(rng.integers(0, min(n - 1, most) + 1)),
                      replace=False)
    edges = [0, *sorted(int(c) for c in cuts), n]
    return tuple(b - a for a, b in zip(edges[:-1], edges[1:], strict=True))


def random_rows(seed: int) -> Rows:
    """A random problem: float16/32/64 logits of a few rows, offsets up to 1000 in magnitude,
    NaN / +inf / -inf sprinkled in, masks that may empty the first half of every row (so whole
    chunks are masked) or a whole row, and weights of either sign with zeros."""
    rng = np.random.default_rng(seed)
    dtype = str(rng.choice(["float16", "float32", "float64"]))
    rows, n = int(rng.integers(1, 5)), int(rng.integers(1, 40))
    scale = float(rng.choice([1.0, 4.0, 30.0]))
    offset = float(rng.choice([0.0, 100.0, -1000.0])) if dtype != "float16" else 0.0
    x = rng.normal(size=(rows, n)) * scale + offset
    for value in (np.nan, np.inf, -np.inf):
        if rng.random() < 0.3:
            k = int(rng.integers(1, 3))
            x[rng.integers(0, rows, k), rng.integers(0, n, k)] = value
    x = x.astype(dtype)
    where = None
    if rng.random() < 0.6:
        where = rng.random((rows, n)) > float(rng.choice([0.0, 0.3, 0.9]))
        if rng.random() < 0.5:
            where[:, : n // 2] = False  # whole chunks masked
        if rng.random() < 0.3:
            where[rng.integers(0, rows)] = False  # a whole row masked
    b = None
    if rng.random() < 0.7:
        b = rng.normal(size=(rows, n)) if rng.random() < 0.5 else rng.random((rows, n))
        b[rng.random((rows, n)) < 0.2] = 0.0
        b = b.astype(str(rng.choice([dtype, "float64"])))
    return Rows(
        x=x,
        where=where,
        b=b,
        chunks=(int(rng.integers(1, rows + 1)), random_chunking(n, rng)),
        where_chunks=(rows, int(rng.integers(1, n + 1))),
        b_chunks=(1, int(rng.integers(1, n + 1))),
    )


def dies_once(block: Any, marker: str, chunk: int = 2, block_info: Any = None) -> Any:
    """Fault injection for cluster tests: pass ``block`` through, except that the first task
    to load chunk ``chunk`` (along the last axis) creates the file ``marker`` and ends its
    worker process at once, as a crash would.  Use with ``dask.array.map_blocks``; once the
    marker exists, every call passes the block through."""
    import os

    if block_info is not None and block_info[0]["chunk-location"][-1] == chunk \
            and not os.path.exists(marker):
        with open(marker, "w"):
            pass
        os._exit(1)
    return block
