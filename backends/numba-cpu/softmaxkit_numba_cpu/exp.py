"""The vectorizable exponential used after the max subtraction: ``exp(z)`` for ``z <= 0``.

``exp(z) = 2**n * exp(r)`` with ``n = round(z * log2(e))`` and ``r = z - n * ln 2`` (ln 2 split
in two so ``r`` is exact to a few ulp, Cody and Waite); ``exp(r)`` on ``|r| <= ln(2)/2`` is a
polynomial:

* float32: ``1 + r + r**2 * Q(r)``, ``Q`` of degree 4 fitted for least maximum relative
  error (the fit alone is within 3.9e-9); the whole function, float32 rounding included, is
  within the bound stated in spec/semantics.md ("Numba CPU exp approximation") and tested;
* float64: the Taylor polynomial of degree 13 (truncation below 5e-18).

``n`` is rounded by adding ``1.5 * 2**p`` (p = 23 or 52), which leaves ``n`` in the low bits
of the sum, so ``2**n`` is built from those bits by one integer add and one shift
(:func:`~softmaxkit_numba_cpu.bits.pow2_lifted`).  The row kernels use the *lifted* form,
``2**LIFT * exp(z)``: the scale ``2**(n + LIFT)`` is a normal number for every ``z`` down to
the underflow threshold, so there is no branch or select for subnormal results; the kernels
fold ``2**-LIFT`` into their final scaling.  :func:`exp_f32` / :func:`exp_f64` multiply by
``2**-LIFT`` at once, which rounds a subnormal result once.

Inputs below the underflow threshold, ``-inf`` included, are raised to it: :func:`exp_f32`
and :func:`exp_f64` give 0 there, :func:`exp_lifted` ``2**LIFT exp(floor)``, which is 0 once
the kernels remove ``2**LIFT`` and below a float32 ulp of any lifted sum (a row's sum is at
least ``2**LIFT``).  :func:`exp_nonpos` maps NaN to 0 as well (callers classify NaN rows
before); :func:`exp_lifted` lets NaN through, so a row kernel sees a NaN in its sum and needs
no separate NaN test in its hot loop.  No branch,
no call: the loops that use them vectorize (8 float32 lanes with AVX2).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .bits import pow2_lifted

LIFT32 = 32
"""``exp_lifted`` returns ``2**LIFT32 * exp(z)`` in float32 (at least 24 keeps it normal)."""
LIFT64 = 64
"""``exp_lifted`` returns ``2**LIFT64 * exp(z)`` in float64 (at least 55 keeps it normal)."""

# float32 constants
_LOG2E_32 = np.float32(1.4426950408889634)
_LN2_HI_32 = np.float32(0.693145751953125)  # 16 significant bits: n * _LN2_HI_32 is exact
_LN2_LO_32 = np.float32(1.428606765330187e-06)
_FLOOR_32 = np.float32(-104.0)  # exp(-104) < 2**-150: rounds to 0
_ROUND_32 = np.float32(12582912.0)  # 1.5 * 2**23: adding it rounds to an integer
_Q32 = (
    np.float32(0.49999994),
    np.float32(0.16666521),
    np.float32(0.04166839),
    np.float32(0.00836871),
    np.float32(0.00138146),
)
_ONE_32 = np.float32(1.0)
_UNLIFT_32 = np.float32(2.0**-LIFT32)

# float64 constants
_LOG2E_64 = 1.4426950408889634
_LN2_HI_64 = 6.93147180369123816490e-01  # 32 significant bits
_LN2_LO_64 = 1.90821492927058770002e-10
_FLOOR_64 = -746.0  # exp(-746) < 2**-1075: rounds to 0
_ROUND_64 = 6755399441055744.0  # 1.5 * 2**52
_UNLIFT_64 = 2.0**-LIFT64


@njit(inline="always")
def _reduce(z, log2e, rounding, ln2_hi, ln2_lo):
    """``(t, r)``: ``t = z * log2(e) + rounding`` holds ``n`` in its low bits, and
    ``r = z - n * ln 2`` (Cody and Waite).  Inlined, so it is compiled with its caller's
    flags, in its caller's float type."""
    t = z * log2e + rounding
    nf = t - rounding
    r = z - nf * ln2_hi
    return t, r - nf * ln2_lo


@njit(fastmath={"contract"}, cache=True)
def _core_f32(z):
    # z in [-104, 0] (or NaN); contract only: the rounding constant must not be reassociated
    t, r = _reduce(z, _LOG2E_32, _ROUND_32, _LN2_HI_32, _LN2_LO_32)
    q = _Q32[4]
    q = q * r + _Q32[3]
    q = q * r + _Q32[2]
    q = q * r + _Q32[1]
    q = q * r + _Q32[0]
    p = (r * r) * q + r + _ONE_32
    return p * pow2_lifted(t)


@njit(fastmath={"contract"}, cache=True)
def _core_f64(z):
    t, r = _reduce(z, _LOG2E_64, _ROUND_64, _LN2_HI_64, _LN2_LO_64)
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
    return p * pow2_lifted(t)


@njit(fastmath={"contract"}, cache=True)
def exp_f32(z):
    """exp(z) for float32 ``z <= 0`` (or -inf; NaN gives 0), vectorizable."""
    z = z if z > _FLOOR_32 else _FLOOR_32
    return _core_f32(z) * _UNLIFT_32


@njit(fastmath={"contract"}, cache=True)
def exp_f64(z):
    """exp(z) for float64 ``z <= 0`` (or -inf; NaN gives 0), vectorizable."""
    z = z if z > _FLOOR_64 else _FLOOR_64
    return _core_f64(z) * _UNLIFT_64


@njit(fastmath={"contract"}, cache=True)
def exp_lifted_f32(z):
    """``2**LIFT32 * exp(z)`` for float32 ``z <= 0`` (or -inf); NaN stays NaN."""
    # written as a comparison with the floor first: x86 max returns z when z is NaN
    z = _FLOOR_32 if _FLOOR_32 > z else z
    return _core_f32(z)


@njit(fastmath={"contract"}, cache=True)
def exp_lifted_f64(z):
    """``2**LIFT64 * exp(z)`` for float64 ``z <= 0`` (or -inf); NaN stays NaN."""
    z = _FLOOR_64 if _FLOOR_64 > z else z
    return _core_f64(z)


def exp_nonpos(z):  # pragma: no cover - replaced by the overload inside compiled code
    """exp(z) for ``z <= 0`` in the accumulator type of ``z``."""
    raise NotImplementedError


def exp_lifted(z):  # pragma: no cover
    """``2**LIFT * exp(z)`` for ``z <= 0`` in the accumulator type of ``z`` (NaN stays NaN)."""
    raise NotImplementedError


def _per_float(f32, f64):
    """An overload's implementation: ``f32`` for a float32 ``z``, ``f64`` for a float64 one."""

    def impl(z):
        if z == types.float32:
            return lambda z: f32(z)
        if z == types.float64:
            return lambda z: f64(z)
        return None

    return impl


overload(exp_nonpos, jit_options={"cache": True})(_per_float(exp_f32, exp_f64))
overload(exp_lifted, jit_options={"cache": True})(_per_float(exp_lifted_f32, exp_lifted_f64))


def lift(v):  # pragma: no cover
    """``LIFT``, the power of two of :func:`exp_lifted`, for the accumulator type of ``v``."""
    raise NotImplementedError


def unlift(v):  # pragma: no cover
    """``2.0**-LIFT`` (a float64) for the accumulator type of ``v``."""
    raise NotImplementedError


def _is64(v) -> bool:
    return v == types.float64 or (isinstance(v, types.Array) and v.dtype == types.float64)


@overload(lift, jit_options={"cache": True})
def _lift(v):
    value = LIFT64 if _is64(v) else LIFT32
    return lambda v: value


@overload(unlift, jit_options={"cache": True})
def _unlift(v):
    value = 2.0 ** -(LIFT64 if _is64(v) else LIFT32)
    return lambda v: value
