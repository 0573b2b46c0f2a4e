"""Property tests (hypothesis) of the row operations in float64: shift invariance,
normalization, merge of masks, softmax == exp(log_softmax), and gradients against central
finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import softmaxkit as sk

FAST = settings(max_examples=40, deadline=None)


@pytest.fixture(autouse=True)
def on_reference():
    with sk.backend_opts(prioritize="reference"):
        yield


finite = st.floats(-50, 50, allow_nan=False, allow_infinity=False)
shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=5)


@st.composite
def logits(draw, elements=finite):
    return draw(hnp.arrays(np.float64, draw(shapes), elements=elements))


@st.composite
def logits_and_axis(draw):
    x = draw(logits())
    axis = draw(st.sampled_from([None, -1, 0, tuple(range(x.ndim))]))
    return x, axis


@FAST
@given(logits_and_axis(), st.floats(-1e3, 1e3))
def test_shift_invariance(data, c):
    x, axis = data
    p = sk.softmax(x, axis=axis)
    np.testing.assert_allclose(sk.softmax(x + c, axis=axis), p, rtol=1e-9, atol=1e-12)
    lse = sk.logsumexp(x, axis=axis)
    np.testing.assert_allclose(sk.logsumexp(x + c, axis=axis), lse + c,
                               rtol=1e-12, atol=1e-9)


@FAST
@given(logits_and_axis())
def test_normalization_and_range(data):
    x, axis = data
    p = sk.softmax(x, axis=axis)
    assert np.all((p >= 0) & (p <= 1))
    total = np.sum(p, axis=axis)
    np.testing.assert_allclose(total, 1.0, rtol=0, atol=64 * 2.0**-53 * max(x.size, 1))
    lse = np.asarray(sk.logsumexp(x, axis=axis))
    m = np.max(x, axis=axis)
    n = x.size // max(lse.size, 1)
    assert np.all(lse >= m - 1e-12) and np.all(lse <= m + np.log(n) + 1e-12)


@FAST
@given(logits_and_axis())
def test_softmax_is_exp_of_log_softmax(data):
    x, axis = data
    np.testing.assert_allclose(np.exp(sk.log_softmax(x, axis=axis)), sk.softmax(x, axis=axis),
                               rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(sk.log_softmax(x, axis=axis),
                               x - np.asarray(sk.logsumexp(x, axis=axis, keepdims=True)),
                               rtol=1e-12, atol=1e-12)


@st.composite
def masked_logits(draw):
    x = draw(logits())
    where = draw(hnp.arrays(bool, x.shape))
    return x, where


@FAST
@given(masked_logits(), st.sampled_from(["zero", "nan"]))
def test_where_false_is_a_minus_inf_logit(data, masked):
    x, where = data
    minus_inf = np.where(where, x, -np.inf)
    for op in (sk.softmax, sk.log_softmax):
        a = op(x, axis=-1, where=where, masked=masked)
        b = op(minus_inf, axis=-1, masked=masked)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sk.logsumexp(x, axis=-1, where=where),
                                  sk.logsumexp(minus_inf, axis=-1))
    # b = 0 is a third spelling of the same exclusion for logsumexp
    np.testing.assert_array_equal(sk.logsumexp(x, axis=-1, b=where.astype(float)),
                                  sk.logsumexp(minus_inf, axis=-1))


@FAST
@given(masked_logits())
def test_masked_rows_follow_the_policy(data):
    x, where = data
    p = sk.softmax(x, axis=-1, where=where)
    empty = ~where.any(-1)
    assert np.all(p[empty] == 0)
    assert np.all(p[~where] == 0)
    np.testing.assert_allclose(p[~empty].sum(-1), 1.0, atol=1e-13)
    assert np.all(np.asarray(sk.logsumexp(x, axis=-1, where=where))[empty] == -np.inf)


def central_difference(f, x, g, eps=1e-6):
    """d <g, f(x)> / dx by central differences, one coordinate at a time."""
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += eps
        down[i] -= eps
        out[i] = (np.sum(g * f(up)) - np.sum(g * f(down))) / (2 * eps)
    return out


small = st.floats(-5, 5, allow_nan=False)
small_rows = hnp.arrays(np.float64, st.tuples(st.integers(1, 3), st.integers(1, 5)),
                        elements=small)
GRAD = settings(max_examples=20, deadline=None)


@GRAD
@given(small_rows, st.integers(0, 2**31))
def test_vjps_against_finite_differences(x, seed):
    g = np.random.default_rng(seed).normal(size=x.shape)
    p = sk.softmax(x, axis=-1)
    np.testing.assert_allclose(sk.softmax_vjp(p, g, axis=-1),
                               central_difference(lambda v: sk.softmax(v, axis=-1), x, g),
                               rtol=1e-6, atol=1e-8)
    lp = sk.log_softmax(x, axis=-1)
    np.testing.assert_allclose(sk.log_softmax_vjp(lp, g, axis=-1),
                               central_difference(lambda v: sk.log_softmax(v, axis=-1), x, g),
                               rtol=1e-6, atol=1e-8)


@GRAD
@given(small_rows, st.integers(0, 2**31), st.sampled_from(["mean", "sum", "none"]),
       st.sampled_from([0.0, 0.2]))
def test_cross_entropy_gradient_against_finite_differences(x, seed, reduction, smoothing):
    rng = np.random.default_rng(seed)
    index = rng.integers(0, x.shape[1], size=x.shape[0])
    if x.shape[0] > 1:
        index[0] = -1

    def loss(v):
        return sk.cross_entropy(v, index, reduction=reduction, ignore_index=-1,
                                label_smoothing=smoothing)

    _, grad = sk.cross_entropy(x, index, reduction=reduction, ignore_index=-1,
                               label_smoothing=smoothing, return_grad=True)
    np.testing.assert_allclose(grad, central_difference(loss, x, 1.0), rtol=1e-6, atol=1e-8)
    probs = rng.dirichlet(np.ones(x.shape[1]), size=x.shape[0])
    _, grad = sk.cross_entropy(x, probs, reduction=reduction, return_grad=True)
    np.testing.assert_allclose(
        grad, central_difference(lambda v: sk.cross_entropy(v, probs, reduction=reduction),
                                 x, 1.0), rtol=1e-6, atol=1e-8)


@GRAD
@given(masked_logits(), st.integers(0, 2**31))
def test_masked_vjps_against_finite_differences(data, seed):
    x, where = data
    x = np.clip(x, -5, 5)
    g = np.random.default_rng(seed).normal(size=x.shape)
    p = sk.softmax(x, axis=-1, where=where)
    got = sk.softmax_vjp(p, g, axis=-1, where=where)
    fd = central_difference(lambda v: sk.softmax(v, axis=-1, where=where), x, g)
    np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-8)
    assert np.all(got[~where] == 0)
