"""The vectorized exponential against float64 exp: the bound of spec/semantics.md."""

from __future__ import annotations

import math

import numpy as np
import pytest
from numba import njit
from softmaxkit_numba_cpu.exp import LIFT32, LIFT64, exp_f32, exp_f64, exp_lifted
from softmaxkit_numba_cpu.exp_error import ABS_BOUND, REL_BOUND, TINY, scan
from softmaxkit_numba_cpu.lanes import FASTMATH


# the kernels' fast-math flags: the rounding constant must survive them
@njit(fastmath=FASTMATH, cache=True)
def _apply32(z):
    out = np.empty(z.size, dtype=np.float32)
    for i in range(z.size):
        out[i] = exp_f32(z[i])
    return out


@njit(fastmath=FASTMATH, cache=True)
def _lifted(z):
    out = np.empty_like(z)
    for i in range(z.size):
        out[i] = exp_lifted(z[i])
    return out


@njit(fastmath=FASTMATH, cache=True)
def _apply64(z):
    out = np.empty(z.size, dtype=np.float64)
    for i in range(z.size):
        out[i] = exp_f64(z[i])
    return out


def test_bound_over_float32_range():
    # every 61st float32 in [-104, 0] (about 18 million inputs), through the same loop form
    # the kernels use; `python -m softmaxkit_numba_cpu.exp_error` checks every input
    rel, sub, ratio, count = scan(stride=61)
    assert count > 10_000_000
    assert ratio <= 1.0, f"error exceeds 2**-23 exp(z) + 2**-150 by a factor {ratio}"
    assert rel <= REL_BOUND
    assert sub <= 1.0  # at most one subnormal step


def test_special_inputs():
    z = np.array([0.0, -0.0, -1e-45, -np.inf, -200.0, -104.0, -103.9, -87.33654, -87.3366,
                  -1e-8, -0.34657359, -0.34657362], dtype=np.float32)
    got = _apply32(z)
    exact = np.exp(z.astype(np.float64))
    assert got[0] == 1.0 and got[1] == 1.0 and got[2] == 1.0
    assert got[3] == 0.0 and got[4] == 0.0 and got[5] == 0.0
    assert got[6] > 0.0  # exp(-103.9) is about 1.2e-45: the smallest subnormal, not zero
    err = np.abs(got.astype(np.float64) - exact)
    assert np.all(err <= REL_BOUND * exact + ABS_BOUND)


def test_subnormal_results_round_once():
    # results below 2**-126 are rounded once to the subnormal grid
    z = np.linspace(-103.97, -87.4, 100_001, dtype=np.float32)
    got = _apply32(z).astype(np.float64)
    exact = np.exp(z.astype(np.float64))
    assert np.all(exact < TINY * 1.01)
    assert np.all(np.abs(got - exact) <= REL_BOUND * exact + ABS_BOUND)


@pytest.mark.parametrize("low", [-745.0, -30.0, -1.0])
def test_float64_exp(low):
    z = np.linspace(low, 0.0, 200_001)
    got = _apply64(z)
    exact = np.exp(z)  # libm: within an ulp of exp
    normal = exact >= np.finfo(np.float64).tiny
    rel = np.abs(got[normal] - exact[normal]) / exact[normal]
    assert rel.max() <= 4 * 2.0**-53
    assert np.all(np.abs(got[~normal] - exact[~normal]) <= 2 * 2.0**-1074)
    assert _apply64(np.array([-np.inf, -800.0, 0.0]))[:2].tolist() == [0.0, 0.0]
    assert math.isclose(_apply64(np.array([0.0]))[0], 1.0, rel_tol=0, abs_tol=0)


@pytest.mark.parametrize("dtype, lift", [(np.float32, LIFT32), (np.float64, LIFT64)])
def test_lifted_exponential_is_exp_times_a_power_of_two(dtype, lift):
    # what the row kernels sum and store: 2**LIFT exp(z), a normal number down to the
    # underflow threshold, equal to exp(z) * 2**LIFT wherever exp(z) itself is normal
    low = -87.0 if dtype == np.float32 else -700.0
    z = np.linspace(low, 0.0, 100_001).astype(dtype)
    got = _lifted(z)
    apply = _apply32 if dtype == np.float32 else _apply64
    assert np.array_equal(got * dtype(2.0**-lift), apply(z))
    assert np.all(got >= np.finfo(dtype).tiny)
    # at and below the underflow threshold (-inf included): a constant that is 0 unlifted
    floor = -104.0 if dtype == np.float32 else -746.0
    edge = _lifted(np.array([floor, 2 * floor, -np.inf], dtype=dtype))
    assert edge[0] > 0 and np.all(edge == edge[0]) and edge[0] * dtype(2.0**-lift) == 0
    # NaN goes through (the kernels find NaN rows by their sums); exp_f32 maps it to 0
    assert np.isnan(_lifted(np.array([np.nan], dtype=dtype))[0])
    assert apply(np.array([np.nan], dtype=dtype))[0] == 0
