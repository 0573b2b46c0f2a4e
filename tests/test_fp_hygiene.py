"""No floating-point warning and no NaN for any valid input whose spec answer is finite:
rows with -inf logits, fully masked rows, empty axes, huge logits, every dtype."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import softmaxkit as sk
from softmaxkit.testing.kit import target
from softmaxkit.testing.row_checks import strict_fp
from softmaxkit.testing.tolerance import HUGE


@pytest.fixture(autouse=True)
def on_reference():
    with sk.backend_opts(prioritize="reference"):
        yield


# finite logits, -inf (an excluded position) and the extremes of float64
elements = st.one_of(
    st.floats(-1e300, 1e300, allow_nan=False, allow_infinity=False),
    st.just(-np.inf),
    st.sampled_from([0.0, -0.0, 700.0, -745.0, 1e-320, 1.7976931348623157e308,
                     -1.7976931348623157e308]),
)


@st.composite
def finite_answer_inputs(draw):
    shape = draw(st.tuples(st.integers(0, 4), st.integers(0, 6)))
    x = draw(hnp.arrays(np.float64, shape, elements=elements))
    where = draw(hnp.arrays(bool, shape))
    return x, where


@settings(max_examples=60, deadline=None)
@given(finite_answer_inputs(), st.sampled_from(["float16", "bfloat16", "float32", "float64"]))
def test_no_warning_for_finite_answers(data, dtype):
    x, where = data
    t = target("numpy")
    # logits up to the dtype's largest: a log-probability below its range rounds to -inf,
    # without a warning
    limit = HUGE[dtype]
    x = np.where(np.isfinite(x), np.clip(x, -limit, limit), x)
    xt = t.asarray(x, dtype)
    # a loss reaches max |x_i - x_j|: it is finite in the dtype for logits up to half its
    # largest (beyond, the loss itself rounds to inf)
    half = limit / 2
    x_ce = t.asarray(np.where(np.isfinite(x), np.clip(x, -half, half), x), dtype)
    idx = np.zeros(x.shape[0], dtype=np.int64)
    g = np.ones(x.shape, dtype=xt.dtype)
    with strict_fp():
        p = sk.softmax(xt, axis=-1, where=where)
        lp = sk.log_softmax(xt, axis=-1, where=where)
        lse = sk.logsumexp(xt, axis=-1, where=where)
        sk.logsumexp(xt, axis=-1, b=where.astype(xt.dtype), return_sign=True)
        if x.shape[1]:
            loss, grad = sk.cross_entropy(x_ce, idx, where=where, reduction="none",
                                          return_grad=True, label_smoothing=0.1)
        gp = sk.softmax_vjp(p, g, axis=-1, where=where)
        glp = sk.log_softmax_vjp(lp, g, axis=-1, where=where)
    for name, value in (("softmax", p), ("log_softmax", lp), ("logsumexp", lse),
                        ("softmax_vjp", gp), ("log_softmax_vjp", glp)):
        assert not np.isnan(np.asarray(value, dtype=np.float64)).any(), name
    if x.shape[1]:
        assert not np.isnan(np.asarray(grad, dtype=np.float64)).any()
        assert not np.isnan(np.asarray(loss, dtype=np.float64)).any()


def test_fully_masked_rows_every_op_every_dtype():
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        t = target("numpy")
        x = t.asarray(np.array([[-np.inf, -np.inf, -np.inf], [1.0, 2.0, 3.0]]), dtype)
        where = np.array([[True, True, True], [False, False, False]])
        with strict_fp():
            p = sk.softmax(x, axis=-1, where=where)
            lp = sk.log_softmax(x, axis=-1, where=where)
            lse = sk.logsumexp(x, axis=-1, where=where)
            loss, grad = sk.cross_entropy(x, np.array([0, 1]), where=where, return_grad=True,
                                          reduction="none")
            gp = sk.softmax_vjp(p, np.ones((2, 3), dtype=x.dtype), axis=-1, where=where)
            glp = sk.log_softmax_vjp(lp, np.ones((2, 3), dtype=x.dtype), axis=-1, where=where)
        assert np.all(np.asarray(p, np.float64) == 0)
        assert np.all(np.asarray(lp, np.float64) == -np.inf)
        assert np.all(np.asarray(lse, np.float64) == -np.inf)
        assert np.all(np.asarray(loss, np.float64) == np.inf)
        for g in (grad, gp, glp):
            assert np.all(np.asarray(g, np.float64) == 0)


def test_reference_float16_log_softmax_at_the_ends_of_the_range():
    """The log-probability -131008 is below float16's range: -inf, and no overflow warning."""
    x = np.array([65504.0, -65504.0, 0.0], dtype=np.float16)
    with strict_fp():
        lp = sk.log_softmax(x, backend="reference")
    np.testing.assert_array_equal(lp, np.array([0.0, -np.inf, -65504.0], dtype=np.float16))
    # -65519.9 still rounds to the largest finite float16; -65520 is where rounding overflows
    x = np.array([0.0, -65519.9, -65520.0], dtype=np.float32)
    with strict_fp():
        lp = sk.log_softmax(x, dtype="float16", backend="reference")
    np.testing.assert_array_equal(lp, np.array([0.0, -65504.0, -np.inf], dtype=np.float16))
