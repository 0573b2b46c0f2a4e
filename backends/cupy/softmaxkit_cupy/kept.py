"""Launches kept for repeated calls of one kind.

A training loop calls attention with the same shapes, strides, dtype and options step after
step, and on a GPU such a call's cost is the host's: choosing the tiles, naming the kernels,
computing the grids and the strides.  A :class:`Launch` holds all of that for one kernel of a
kind of call, everything but the arrays' addresses; an adapter keeps the launches of a call
under a key of what decided them (:func:`keep`, :func:`kept`) and, for a later call of the same
key whose arrays are aligned as the kernels need (:func:`aligned`), runs them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import interop

LIMIT = 256
"""Kinds of call kept at most; past it the store starts afresh (a loop uses few kinds)."""

_store: dict[tuple[Any, ...], Any] = {}


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a kind of call: the kernel (a ``cupy.RawKernel``), its grid and
    block, its parameter list (:mod:`.launches` codes), its dynamic shared memory, and its
    arguments after the leading addresses, which each call gives."""

    kernel: Any
    grid: int | tuple[int, int, int]
    threads: int
    codes: str
    args: tuple[Any, ...]
    shared: int = 0

    def __call__(self, like: Any, *addresses: int) -> None:
        """Launch on ``like``'s device and current stream with ``addresses`` first."""
        interop.launch(self.kernel, like, self.grid, self.threads, self.codes,
                       (*addresses, *self.args), self.shared)


def kept(key: tuple[Any, ...] | None) -> Any:
    """What :func:`keep` kept under ``key`` (None: nothing, or no key)."""
    return None if key is None else _store.get(key)


def keep(key: tuple[Any, ...] | None, value: Any) -> None:
    """Keep ``value`` under ``key`` (nothing without a key)."""
    if key is None:
        return
    if len(_store) >= LIMIT:
        _store.clear()
    _store[key] = value


def in_place(key: tuple[Any, ...] | None, given: tuple[Any, ...],
             used: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``key`` where a call's launches read the arrays it was given (each of ``used`` is the
    one of ``given``), else None: a copy made for one call is no later call's array."""
    return key if all(u is g for u, g in zip(used, given, strict=True)) else None


def torch_key(*arrays: Any) -> tuple[Any, ...] | None:
    """The part of a key that PyTorch tensors ``arrays`` give: their shapes, strides, dtype and
    device; None where they are not all tensors (CuPy arrays take the general path)."""
    if not all(interop.is_torch(a) for a in arrays):
        return None
    first = arrays[0]
    return (first.dtype, first.get_device(), *(a.shape for a in arrays),
            *(a.stride() for a in arrays))


def aligned(*arrays: Any) -> bool:
    """Whether the arrays' first elements are 16-byte aligned, as the kernels read rows (the
    other conditions of reading in place are the shapes' and strides', in the key)."""
    return all(a.data_ptr() % 16 == 0 for a in arrays)
