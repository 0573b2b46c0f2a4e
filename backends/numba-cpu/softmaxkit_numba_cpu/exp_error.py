"""Measure the error of :func:`~softmaxkit_numba_cpu.exp.exp_f32` against float64 ``exp``.

The float64 exponential of a float32 input is accurate to about 1e-16 relative, far below
the float32 errors measured, so it serves as the exact value.  Used by the tests (on a
stride of the float32 inputs) and by ``python -m softmaxkit_numba_cpu.exp_error`` (on every
float32 input in [-104, 0], the range that can occur after the max subtraction; below it
the result is 0).
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from numba import njit, prange

from .bits import f32_from_bits
from .exp import exp_f32

TINY = 2.0**-126
"""Smallest positive normal float32: below it results are subnormal."""
SUBNORMAL_STEP = 2.0**-149
"""Spacing of the float32 subnormals."""
REL_BOUND = 2.0**-23
"""The bound of spec/semantics.md: ``|e(z) - exp(z)| <= REL_BOUND * exp(z) + ABS_BOUND``."""
ABS_BOUND = 2.0**-150


@njit(parallel=True, cache=True)
def _scan(first: int, last: int, stride: int):
    """Errors over the float32 bit patterns ``first, first + stride, ... <= last``.

    Returns (max relative error where exp(z) >= 2**-126, max absolute error in units of
    2**-149 where exp(z) < 2**-126, max of error / bound, count of inputs).
    """
    count = (last - first) // stride + 1
    chunks = 64
    rel = np.zeros(chunks)
    sub = np.zeros(chunks)
    ratio = np.zeros(chunks)
    for c in prange(chunks):
        lo = c * count // chunks
        hi = (c + 1) * count // chunks
        for i in range(lo, hi):
            z = f32_from_bits(first + i * stride)
            got = np.float64(exp_f32(z))  # float() would keep float32 here
            exact = math.exp(np.float64(z))
            err = abs(got - exact)
            ratio[c] = max(ratio[c], err / (REL_BOUND * exact + ABS_BOUND))
            if exact >= TINY:
                rel[c] = max(rel[c], err / exact)
            else:
                sub[c] = max(sub[c], err / SUBNORMAL_STEP)
    return rel.max(), sub.max(), ratio.max(), count


def negative_bits(value: float) -> int:
    """The bit pattern of the float32 ``value`` (used for the negative range)."""
    return int(np.array(value, dtype=np.float32).view(np.uint32))


def scan(lowest: float = -104.0, stride: int = 1) -> tuple[float, float, float, int]:
    """Errors of exp_f32 over float32 ``z`` in ``[lowest, 0]``, every ``stride``-th value.

    Returns
    -------
    tuple
        ``(max relative error for normal results, max absolute error in units of 2**-149
        for subnormal results, max of error / bound (at most 1 when the bound holds),
        number of inputs)``.
    """
    # negative floats: bit patterns grow with magnitude, from -0.0 (0x80000000) to lowest
    return _scan(negative_bits(-0.0), negative_bits(lowest), stride)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stride", type=int, default=1, help="1 = every float32 input")
    opts = parser.parse_args()
    rel, sub, ratio, count = scan(stride=opts.stride)
    print(f"{count} float32 inputs in [-104, 0]")
    print(f"error / (2**-23 * exp(z) + 2**-150): max {ratio:.3f}")
    print(f"normal results:    max relative error {rel:.3e} = {rel / 2.0**-24:.3f} * 2**-24")
    print(f"subnormal results: max absolute error {sub:.3f} * 2**-149")


if __name__ == "__main__":
    main()
