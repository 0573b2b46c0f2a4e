"""Which head dimensions the attention kernels run a call at, and the zero padding that gets
a call there.

The kernels are built for the head dimensions of :data:`~.configs.ATTENTION_HEAD_DIMS`, with
the value dimension equal to the key dimension (D = Dv).  A call at any other ``D, Dv`` up to
the largest of them runs at the smallest built one ``P >= max(D, Dv)`` on copies of its
arrays with zero columns appended up to ``P``:

- q and k: each score ``q . k`` gains ``P - D`` products ``0 * 0 = +0``, so it is unchanged
  exactly, and the scale (resolved by the frontend) is passed as given, never derived from P;
- v: the output's extra columns are 0 and are sliced off (``out[..., :Dv]``); lse is
  unchanged;
- the gradient's out and dout: the row term ``sum(dout * out)`` gains only ``0 * 0`` too;
  dq and dk are sliced to D, dv to Dv.

The cost: the kernels do the work of width P (the score products at P instead of D, the
output's at P instead of Dv, extra work in proportion to ``P / max(D, Dv)`` or more), and each
padded array is copied on every call (for paged attention each padded page pool, whole).  A
call already at a built head dimension with D = Dv takes none of this: :func:`pad` and
:func:`narrow` return the arrays themselves.

The helpers use only the array API (``xp.zeros``, ``xp.concat``, slicing), so they serve
CuPy arrays and PyTorch CUDA tensors alike and can be checked with NumPy on the CPU.  The
padded copies are new C-contiguous arrays of ``P`` (a multiple of 16) elements per row:
their rows are 16-byte aligned, as the kernels need.  This module imports no CuPy.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import array_api_compat

from . import interop
from .configs import ATTENTION_HEAD_DIMS

LARGEST = max(ATTENTION_HEAD_DIMS)
"""The largest head dimension served (D and Dv alike)."""


def served_head_dim(d: int, dv: int) -> int | None:
    """The head dimension the kernels run a call of key dim ``d`` and value dim ``dv`` at.

    Parameters
    ----------
    d : int
        The head dimension of q and k.
    dv : int
        The head dimension of v (and of the output).

    Returns
    -------
    int or None
        The smallest of :data:`~.configs.ATTENTION_HEAD_DIMS` at least ``max(d, dv)``; None
        when ``d`` or ``dv`` is below 1 or ``max(d, dv)`` exceeds :data:`LARGEST`.
    """
    if d < 1 or dv < 1:
        return None
    return next((p for p in sorted(ATTENTION_HEAD_DIMS) if p >= max(d, dv)), None)


SM90_PADDED_FROM = frozenset({160, 192})
"""Head dims the mma.sync kernels are built for whose calls run faster on the Hopper forward
zero-padded to its next head dim: 160 at 192 (on an H100, 160 zero-padded to 256 ran 1.02-1.19x
the mma.sync kernel; on the tiles of 192 its forward ran at 1.09-1.21x torch's flash backend,
against 0.90-1.00x padded to 256 in an earlier run; docs/benchmarks-attention.md); with a mask,
at the next masked Hopper tiles where there are any.  At 80 the mma.sync kernels stay faster
(the H200 grid).  32, 96 and 192 have Hopper tiles of their own."""

SM90_BACKWARD_PADDED_FROM = frozenset({160})
"""The same for the Hopper backward: 160 at 192 (bfloat16 B4 H32 L4096 on an H100, the
backward padded against mma.sync's best tiles at the call's width in one run: 1.30-1.40x;
docs/benchmarks-attention.md).  32, 96 and 192 have Hopper tiles of their own."""


def sm90_width(d: int, dv: int, built: Collection[int],
               padded_from: Collection[int] = SM90_PADDED_FROM) -> int | None:
    """The head dimension a Hopper kernel built for the head dims ``built`` runs a call of
    key dim ``d`` and value dim ``dv`` at (zero-padded), or None where the mma.sync kernels
    serve it better.

    The call runs at :func:`served_head_dim` when that is built, from ``padded_from`` at the
    next built head dim, else not on the Hopper kernel (None).
    """
    served = served_head_dim(d, dv)
    if served in built:
        return served
    if served in padded_from:
        return next((p for p in sorted(built) if p >= max(d, dv)), None)
    return None


def head_dim_reason(d: int, dv: int, split: bool = False) -> str | None:
    """Why the kernels cannot serve key dim ``d`` with value dim ``dv``, or None when they can
    (at :func:`served_head_dim`, padded if need be; with ``split``, a value dimension above
    :data:`LARGEST` in :func:`value_blocks`, a call each)."""
    if served_head_dim(d, dv) is not None or (split and value_blocks(d, dv)):
        return None
    more = " (Dv above it in blocks of value columns)" if split else ""
    return (f"head dimensions D={d}, Dv={dv}: the attention kernels serve D and Dv from 1 to "
            f"{LARGEST}{more} (zero-padded to the next of {ATTENTION_HEAD_DIMS})")


def value_blocks(d: int, dv: int) -> list[tuple[int, int]] | None:
    """The column ranges ``[start, stop)`` of v that a call of value dimension ``dv`` above
    :data:`LARGEST` runs in, one kernel call each, or None when one call serves it.

    The output is column-separable (``out[:, a:b] = P v[:, a:b]``) and so is the gradient:
    with ``dP = sum over blocks of dout_blk v_blk^T`` and the row term ``D = sum of
    rowsum(dout_blk * out_blk)``, the score gradient ``P (dP - D)`` is the sum of the blocks'
    ``P (dP_blk - D_blk)``, so dq and dk are the sums of the blocks' and dv their
    concatenation.  Each block recomputes the scores: the cost is one call per block.  The
    blocks are as equal as they can be (fewer padded columns): 257 columns run as 129 + 128.
    """
    if not 1 <= d <= LARGEST or dv <= LARGEST:
        return None
    count = -(-dv // LARGEST)
    size = -(-dv // count)
    return [(a, min(a + size, dv)) for a in range(0, dv, size)]


def pad_width(d: int, dv: int) -> int | None:
    """The width a call of key dim ``d`` and value dim ``dv`` is padded to, or None when it
    runs as it is (``d == dv``, a built head dimension).

    Raises
    ------
    ValueError
        If no kernel serves ``d`` and ``dv`` (:func:`head_dim_reason`; ``can_run`` declines
        such calls, so only a direct call of an adapter gets here).
    """
    width = served_head_dim(d, dv)
    if width is None:
        raise ValueError(head_dim_reason(d, dv))
    return None if width == d == dv else width


def config_width(config: Any, d: int, dv: int) -> int | None:
    """The width a call of key dim ``d`` and value dim ``dv`` is padded to on the tiles
    ``config`` asked for explicitly (an adapter's ``config=``: one built for a head dimension
    at least ``max(d, dv)``), or None when it runs as it is: the tiles' head dimension.

    Raises
    ------
    ValueError
        If the tiles' head dimension is below ``max(d, dv)``.
    """
    if config.head_dim < max(d, dv):
        raise ValueError(f"tiles of head dim {config.head_dim} cannot run D={d}, Dv={dv}")
    return None if config.head_dim == d == dv else config.head_dim


def pad(xp: Any, a: Any, width: int) -> Any:
    """``a`` with zero columns appended along its last axis up to ``width``.

    Parameters
    ----------
    xp : namespace
        ``a``'s array namespace (array API).
    a : array
        Any shape ``[..., n]`` with ``n <= width``.
    width : int
        The last axis' length wanted.

    Returns
    -------
    array
        ``a`` itself when ``n == width``; else a new C-contiguous array ``[..., width]`` of
        ``a``'s dtype on ``a``'s device, ``a`` in its first ``n`` columns and +0 after.
        (CuPy allocates on its current device whatever ``device=`` says: the caller makes
        ``a``'s device current.)
    """
    n = int(a.shape[-1])
    if n == width:
        return a
    if n > width:
        raise ValueError(f"cannot pad a last axis of {n} down to {width}")
    if interop.is_torch(a):  # one kernel, where zeros and their concatenation take two
        import torch.nn.functional

        return torch.nn.functional.pad(a, (0, width - n))
    zeros = xp.zeros((*a.shape[:-1], width - n), dtype=a.dtype,
                     device=array_api_compat.device(a))
    return xp.concat((a, zeros), axis=-1)


def narrow(a: Any, width: int) -> Any:
    """``a``'s first ``width`` columns along its last axis: a view (``a`` itself when it has
    ``width``), undoing :func:`pad` on a result."""
    return a if int(a.shape[-1]) == width else a[..., :width]


def _widths(width: int | tuple[int, int]) -> tuple[int, int]:
    """The (key, value) widths of ``width``: one for both, or a pair."""
    return (width, width) if isinstance(width, int) else width


def forward_padded(xp: Any, width: int | tuple[int, int] | None, run: Any, q: Any, k: Any,
                   v: Any) -> Any:
    """``(out, lse)`` of ``run(q, k, v)`` at ``width`` (:func:`pad_width`, or a (key, value)
    pair of widths; None: on the arrays as given): q and k zero-padded to the key width, v to
    the value width, the output sliced back to v's width."""
    if width is None:
        return run(q, k, v)
    wk, wv = _widths(width)
    out, lse = run(pad(xp, q, wk), pad(xp, k, wk), pad(xp, v, wv))
    return narrow(out, int(v.shape[-1])), lse


def gradients_padded(
    xp: Any, width: int | tuple[int, int] | None, run: Any, q: Any, k: Any, v: Any, out: Any,
    dout: Any,
) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of ``run(q, k, v, out, dout)`` at ``width`` (as
    :func:`forward_padded`'s): q and k zero-padded to the key width, v, out and dout to the
    value width, each gradient sliced back to its operand's width."""
    if width is None:
        return run(q, k, v, out, dout)
    wk, wv = _widths(width)
    grads = run(pad(xp, q, wk), pad(xp, k, wk), *(pad(xp, a, wv) for a in (v, out, dout)))
    return tuple(narrow(g, int(a.shape[-1])) for g, a in zip(grads, (q, k, v), strict=True))


def forward_in_blocks(xp: Any, blocks: list[tuple[int, int]], run: Any, v: Any) -> Any:
    """``(out, lse)`` of a forward whose value columns run in ``blocks``
    (:func:`value_blocks`): ``run(v_block) -> (out_block, lse)`` on each; the outputs are
    concatenated, the lse (the same for every block) is the first block's."""
    parts = [run(v[..., a:b]) for a, b in blocks]
    return xp.concat([out for out, _ in parts], axis=-1), parts[0][1]


def gradients_in_blocks(
    xp: Any, blocks: list[tuple[int, int]], run: Any, v: Any, out: Any, dout: Any,
) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of a gradient whose value columns run in ``blocks``
    (:func:`value_blocks`): ``run(v_block, out_block, dout_block, first) -> (dq, dk,
    dv_block)`` on each, ``first`` true for the first block alone (a term the whole call adds
    to each row once, as the lse's cotangent, goes with it); dq and dk are the blocks' sums,
    added in float32 (float64 for float64) and rounded once to their dtype, dv the
    concatenation of the blocks'."""
    parts = [run(v[..., a:b], out[..., a:b], dout[..., a:b], i == 0)
             for i, (a, b) in enumerate(blocks)]

    def summed(i: int) -> Any:
        dtype = parts[0][i].dtype
        wide = xp.float64 if dtype == xp.float64 else xp.float32
        total = xp.astype(parts[0][i], wide)
        for part in parts[1:]:
            total = total + xp.astype(part[i], wide)
        return xp.astype(total, dtype)

    return summed(0), summed(1), xp.concat([part[2] for part in parts], axis=-1)
