"""The vectorizable exponential used after the max subtraction: ``exp(z)`` for ``z <= 0``.

``exp(z) = 2**n * exp(r)`` with ``n = round(z * log2(e))`` and ``r = z - n * ln 2`` (ln 2 split
in two so ``r`` is exact to a few ulp, Cody and Waite); ``2**n`` is written into the
exponent field (:func:`~softmaxkit_numba_cpu.bits.scale_pow2`, which also rounds subnormal
results once) and ``exp(r)`` on ``|r| <= ln(2)/2`` is a polynomial:

* float32: ``1 + r + r**2 * Q(r)``, ``Q`` of degree 4 fitted for least maximum relative
  error (the fit alone is within 3.9e-9); the whole function, float32 rounding included, is
  within the bound stated in spec/semantics.md ("Numba CPU exp approximation") and tested;
* float64: the Taylor polynomial of degree 13 (truncation below 5e-18).

Inputs below the underflow threshold, ``-inf`` included, are clamped so the result is 0; the
functions are only called with ``z <= 0`` or ``-inf`` (NaN rows are handled before).  No
branch, no call: the loops that use them vectorize (8 float32 lanes with AVX2).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .bits import scale_pow2

# float32 constants
_LOG2E_32 = np.float32(1.4426950408889634)
_LN2_HI_32 = np.float32(0.693145751953125)  # 16 significant bits: n * _LN2_HI_32 is exact
_LN2_LO_32 = np.float32(1.428606765330187e-06)
_FLOOR_32 = np.float32(-104.0)  # exp(-104) < 2**-150: rounds to 0
_Q32 = (
    np.float32(0.49999994),
    np.float32(0.16666521),
    np.float32(0.04166839),
    np.float32(0.00836871),
    np.float32(0.00138146),
)

# float64 constants
_LOG2E_64 = 1.4426950408889634
_LN2_HI_64 = 6.93147180369123816490e-01  # 32 significant bits
_LN2_LO_64 = 1.90821492927058770002e-10
_FLOOR_64 = -746.0  # exp(-746) < 2**-1075: rounds to 0
_HALF_32 = np.float32(0.5)
_ONE_32 = np.float32(1.0)


@njit(fastmath={"contract"}, cache=True)
def exp_f32(z):
    """exp(z) for float32 ``z <= 0`` (or -inf), vectorizable."""
    z = z if z > _FLOOR_32 else _FLOOR_32
    nf = np.floor(z * _LOG2E_32 + _HALF_32)
    r = z - nf * _LN2_HI_32
    r = r - nf * _LN2_LO_32
    q = _Q32[4]
    q = q * r + _Q32[3]
    q = q * r + _Q32[2]
    q = q * r + _Q32[1]
    q = q * r + _Q32[0]
    p = (r * r) * q + r + _ONE_32
    return scale_pow2(p, nf)


@njit(fastmath={"contract"}, cache=True)
def exp_f64(z):
    """exp(z) for float64 ``z <= 0`` (or -inf), vectorizable."""
    z = z if z > _FLOOR_64 else _FLOOR_64
    nf = np.floor(z * _LOG2E_64 + 0.5)
    r = z - nf * _LN2_HI_64
    r = r - nf * _LN2_LO_64
    p = 1.0 / 6227020800.0
    p = p * r + 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = (r * r) * p + r + 1.0
    return scale_pow2(p, nf)


def exp_nonpos(z):  # pragma: no cover - replaced by the overload inside compiled code
    """exp(z) for ``z <= 0`` in the accumulator type of ``z``."""
    raise NotImplementedError


@overload(exp_nonpos, jit_options={"cache": True})
def _exp_nonpos(z):
    if z == types.float32:
        return lambda z: exp_f32(z)
    if z == types.float64:
        return lambda z: exp_f64(z)
    return None
