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

from typing import Any

import array_api_compat

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


def head_dim_reason(d: int, dv: int) -> str | None:
    """Why the kernels cannot serve key dim ``d`` with value dim ``dv``, or None when they can
    (at :func:`served_head_dim`, padded if need be)."""
    if served_head_dim(d, dv) is not None:
        return None
    return (f"head dimensions D={d}, Dv={dv}: the attention kernels serve D and Dv from 1 to "
            f"{LARGEST} (zero-padded to the next of {ATTENTION_HEAD_DIMS})")


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
    zeros = xp.zeros((*a.shape[:-1], width - n), dtype=a.dtype,
                     device=array_api_compat.device(a))
    return xp.concat((a, zeros), axis=-1)


def narrow(a: Any, width: int) -> Any:
    """``a``'s first ``width`` columns along its last axis: a view (``a`` itself when it has
    ``width``), undoing :func:`pad` on a result."""
    return a if int(a.shape[-1]) == width else a[..., :width]
