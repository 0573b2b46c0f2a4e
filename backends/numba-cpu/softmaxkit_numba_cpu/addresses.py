"""The row kernels over memory given by its address: torch CPU tensors without a numpy view.

A contiguous float32 or float64 tensor's rows are ``x.data_ptr()``, ``R`` rows of ``N``
elements; its result is ``torch.empty_like(x)``, written through its own address.  A
``Tensor.numpy()`` view, ``np.empty`` and ``torch.from_numpy`` cost about 2 us of a call's
host time (more right after a threaded kernel, whose rows evicted the caches), as much as a
small row's kernel.  Each function here makes the ``[R, N]`` arrays over the two addresses
and calls the kernel of :mod:`.row_kernels` of the same name, unchanged.
"""

from __future__ import annotations

import numba
from numba import njit, types
from numba.extending import intrinsic

from . import row_kernels as k


@intrinsic
def _pointer(typingctx, address, dtype):
    """A pointer to elements of ``dtype`` (a numpy dtype) at integer ``address``."""
    result = types.CPointer(dtype.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(result))

    return result(address, dtype), codegen


@njit(cache=True)
def rows_at(address, r, n, dtype):
    """The C-contiguous ``[r, n]`` array of ``dtype`` at ``address``."""
    return numba.carray(_pointer(address, dtype), (r, n))


@njit(cache=True)
def lanes_at(address, r, dtype):
    """The ``[r]`` array of ``dtype`` at ``address``."""
    return numba.carray(_pointer(address, dtype), (r,))


@njit(cache=True)
def softmax_ser(x, o, r, n, dtype, w, masked_nan):
    k.softmax_ser(rows_at(x, r, n, dtype), w, 0, False, masked_nan, rows_at(o, r, n, dtype))


@njit(cache=True)
def softmax_par(x, o, r, n, dtype, w, masked_nan, threads):
    k.softmax_par(rows_at(x, r, n, dtype), w, 0, False, masked_nan, rows_at(o, r, n, dtype),
                  threads)


@njit(cache=True)
def log_softmax_ser(x, o, r, n, dtype, w, masked_nan):
    k.log_softmax_ser(rows_at(x, r, n, dtype), w, 0, False, masked_nan,
                      rows_at(o, r, n, dtype))


@njit(cache=True)
def log_softmax_par(x, o, r, n, dtype, w, masked_nan, threads):
    k.log_softmax_par(rows_at(x, r, n, dtype), w, 0, False, masked_nan,
                      rows_at(o, r, n, dtype), threads)


@njit(cache=True)
def logsumexp_ser(x, lse, sign, r, n, dtype, w):
    k.logsumexp_ser(rows_at(x, r, n, dtype), w, 0, False, lanes_at(lse, r, dtype),
                    lanes_at(sign, r, dtype))


@njit(cache=True)
def logsumexp_par(x, lse, sign, r, n, dtype, w, threads):
    k.logsumexp_par(rows_at(x, r, n, dtype), w, 0, False, lanes_at(lse, r, dtype),
                    lanes_at(sign, r, dtype), threads)
