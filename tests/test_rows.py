"""The row operations against mpmath / extended-precision references, PyTorch's own losses and
gradients, and the dtype and edge rules of spec/semantics.md, on numpy, array_api_strict and
torch CPU arrays."""

from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
import scipy.special as ss
import torch

import softmaxkit as sk
from softmaxkit.testing.kit import target
from softmaxkit.testing.row_references import ref_log_softmax, ref_logsumexp, ref_softmax
from softmaxkit.testing.tolerance import assert_within, log_bound, softmax_bound

TARGETS = ("numpy", "array_api_strict", "torch-cpu")
ALL_DTYPES = ("float16", "bfloat16", "float32", "float64")


def target_dtypes():
    for name in TARGETS:
        t = target(name)
        for dtype in t.dtypes:
            yield pytest.param(t, dtype, id=f"{name}-{dtype}")


@pytest.fixture(params=TARGETS)
def t(request):
    return target(request.param)


@pytest.fixture(autouse=True)
def on_reference():
    """These tests pin down the frontend and the reference backend (fast backends are held to
    the same answers by the conformance kit)."""
    with sk.backend_opts(prioritize="reference"):
        yield


# ---------------------------------------------------------------- the seed's worked examples


@pytest.mark.parametrize("t, dtype", list(target_dtypes()))
def test_seed_fp16_example(t, dtype):
    """Logits 20, 18, 17, -5: the naive float16 softmax overflows; the stable one does not."""
    x = t.asarray(np.array([20.0, 18.0, 17.0, -5.0]), dtype)
    p = t.to_numpy(sk.softmax(x))
    mp.mp.dps = 30
    exps = [mp.exp(v) for v in (20, 18, 17, -5)]
    exact = np.array([float(e / mp.fsum(exps)) for e in exps])
    np.testing.assert_allclose(p[:3], [0.84380, 0.11420, 0.04201], atol=6e-5 if dtype in (
        "float32", "float64") else 4e-3)
    assert_within(p, exact, softmax_bound(exact, np.array([20.0, 18, 17, -5]), 4, dtype),
                  "seed example")
    if dtype in ("float32", "float64"):
        assert p[3] == pytest.approx(1.1718574e-11, rel=1e-6)


@pytest.mark.parametrize("z, expected", [(0.5, 0.622), (2.5, 0.924)])
@pytest.mark.parametrize("t, dtype", list(target_dtypes()))
def test_two_logit_family_is_sigmoid(t, dtype, z, expected):
    p = t.to_numpy(sk.softmax(t.asarray(np.array([0.0, z]), dtype)))
    sigmoid = 1.0 / (1.0 + math.exp(-z))
    assert p[1] == pytest.approx(sigmoid, rel=8e-3)
    if dtype in ("float32", "float64"):
        assert round(p[1], 3) == expected
    assert p[0] == pytest.approx(1 - sigmoid, rel=2e-2)


# ---------------------------------------------------------------- float64 against mpmath


def mp_row(row):
    mp.mp.dps = 40
    m = max(row)
    s = mp.fsum(mp.exp(mp.mpf(v) - m) for v in row)
    lse = m + mp.log(s)
    return [float(mp.exp(mp.mpf(v) - lse)) for v in row], [float(mp.mpf(v) - lse)
                                                           for v in row], float(lse)


@pytest.mark.parametrize("scale", [1.0, 30.0, 700.0])
def test_float64_against_mpmath(t, scale):
    if "float64" not in t.dtypes:
        pytest.skip("no float64")
    x = np.random.default_rng(int(scale)).normal(scale=scale, size=(3, 11))
    xt = t.asarray(x, "float64")
    p = t.to_numpy(sk.softmax(xt, axis=1))
    lp = t.to_numpy(sk.log_softmax(xt, axis=1))
    lse = t.to_numpy(sk.logsumexp(xt, axis=1))
    for i, row in enumerate(x.tolist()):
        mp_p, mp_lp, mp_lse = mp_row(row)
        np.testing.assert_allclose(p[i], mp_p, rtol=1e-13 * (1 + scale), atol=1e-300)
        np.testing.assert_allclose(lp[i], mp_lp, rtol=1e-14, atol=1e-14 * (1 + scale))
        assert lse[i] == pytest.approx(mp_lse, rel=1e-15, abs=1e-14)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_results_are_rounded_float32_results(dtype):
    """16-bit inputs accumulate in float32: the result is within one 16-bit rounding."""
    t = target("numpy")
    x = t.asarray(np.random.default_rng(2).normal(scale=4, size=(4, 2048)), dtype)
    x64 = t.to_numpy(x)
    got = t.to_numpy(sk.softmax(x, axis=-1))
    ref = ref_softmax(x64)
    u = 2.0**-11 if dtype == "float16" else 2.0**-8
    tiny = 2.0**-14 if dtype == "float16" else 2.0**-126
    assert np.all(np.abs(got - ref) <= (u * 1.01 + 2e-6) * ref + tiny)
    assert np.abs(got.astype(np.float64).sum(-1) - 1).max() < 2 * u


# ---------------------------------------------------------------- dtypes and libraries


def test_result_library_and_dtype(t):
    for dtype in t.dtypes:
        x = t.asarray(np.array([[1.0, 2.0], [3.0, 4.0]]), dtype)
        for out in (sk.softmax(x, axis=1), sk.log_softmax(x, axis=1),
                    sk.logsumexp(x, axis=1), sk.cross_entropy(x, t.asarray(np.array([0, 1]))),
                    sk.softmax_vjp(sk.softmax(x, axis=1), x, axis=1)):
            if out.ndim == 0 and isinstance(x, np.ndarray):
                # a 0-d result of a numpy input is a numpy scalar (spec "Dtypes")
                assert isinstance(out, np.generic)
            else:
                assert type(out) is type(x)
            assert out.dtype == x.dtype


def test_integer_bool_and_list_inputs_promote_to_default_float():
    ints = np.array([1, 2, 3])
    assert sk.softmax(ints).dtype == np.float64
    assert sk.softmax([1, 2, 3]).dtype == np.float64
    np.testing.assert_allclose(sk.softmax([1, 2, 3]), ref_softmax(np.array([[1.0, 2, 3]]))[0])
    assert sk.logsumexp(np.array([True, False])).dtype == np.float64
    assert float(sk.logsumexp(np.array([True, False]))) == pytest.approx(math.log(math.e + 1))
    # torch's default floating dtype is float32
    assert sk.softmax(torch.tensor([1, 2, 3])).dtype == torch.float32
    assert float(sk.softmax(3.0)) == 1.0


@pytest.mark.parametrize("out", ["float32", "float64", "float16", "bfloat16"])
def test_dtype_argument(out):
    x = np.random.default_rng(0).normal(size=(2, 7)).astype(np.float32)
    p = sk.softmax(x, axis=-1, dtype=out)
    lp = sk.log_softmax(x, axis=-1, dtype=out)
    assert sk.dtypes.dtype_name(p.dtype) == out
    assert sk.dtypes.dtype_name(lp.dtype) == out
    ref = ref_softmax(x.astype(np.float64))
    bound_dtype = "float32" if out == "float64" else out
    assert_within(p.astype(np.float64), ref, softmax_bound(ref, x, 7, bound_dtype), "dtype=")
    tp = sk.softmax(torch.from_numpy(x), axis=-1, dtype=torch.float64)
    assert tp.dtype == torch.float64


def test_logsumexp_result_dtype_follows_b():
    a = np.array([1.0, 2.0], dtype=np.float32)
    assert sk.logsumexp(a).dtype == np.float32
    assert sk.logsumexp(a, b=np.array([1.0, 2.0])).dtype == np.float64
    # integer weights promote as numpy promotes them (and as SciPy's result does)
    for int_dtype in (np.int8, np.int64):
        b = np.array([1, 2], dtype=int_dtype)
        assert sk.logsumexp(a, b=b).dtype == np.result_type(a, b) == ss.logsumexp(a, b=b).dtype


def test_dask_arrays_on_the_reference_path():
    da = pytest.importorskip("dask.array")
    x = np.random.default_rng(1).normal(size=(6, 5))
    x[1] = -np.inf
    where = np.ones((6, 5), bool)
    where[2] = False
    d = da.from_array(x, chunks=(3, 5))
    dw = da.from_array(where, chunks=(3, 5))
    p = sk.softmax(d, axis=-1, where=dw)
    assert isinstance(p, da.Array)
    ref = ref_softmax(np.where(where, x, -np.inf))
    np.testing.assert_allclose(np.asarray(p), ref, rtol=1e-14, atol=1e-300)
    lse = sk.logsumexp(d, axis=0, b=da.from_array(np.abs(x) + 1, chunks=(3, 5)))
    ref_lse, _ = ref_logsumexp(x.T, np.abs(x.T) + 1)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-14)
    loss = sk.cross_entropy(d, da.from_array(np.arange(6) % 5), reduction="none")
    assert isinstance(loss, da.Array)
    assert np.asarray(loss)[1] == np.inf  # every class excluded: the target has p = 0


# ---------------------------------------------------------------- axes and shapes


def test_axis_tuple_equals_merged_axes(t):
    x = np.random.default_rng(4).normal(size=(2, 3, 4))
    xt = t.asarray(x, "float32")
    p = t.to_numpy(sk.softmax(xt, axis=(0, 2)))
    merged = np.transpose(x, (1, 0, 2)).reshape(3, 8).astype(np.float32).astype(np.float64)
    ref = np.transpose(ref_softmax(merged).reshape(3, 2, 4), (1, 0, 2))
    np.testing.assert_allclose(p, ref, rtol=2e-6)
    lse = t.to_numpy(sk.logsumexp(xt, axis=(-1, 0), keepdims=True))
    assert lse.shape == (1, 3, 1)
    np.testing.assert_allclose(lse[0, :, 0], ref_logsumexp(merged)[0], rtol=2e-6)


def test_axis_none_and_empty_tuple():
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(sk.softmax(x), ref_softmax(x.reshape(1, 6)).reshape(2, 3))
    np.testing.assert_array_equal(sk.softmax(x, axis=()), np.ones((2, 3)))
    np.testing.assert_allclose(sk.logsumexp(x, axis=()), x)


@pytest.mark.parametrize("shape, axis", [((2, 0), -1), ((0, 3), -1), ((0, 3), 0), ((0,), None)])
def test_zero_size_arrays(t, shape, axis):
    x = t.asarray(np.zeros(shape), "float32")
    p = sk.softmax(x, axis=axis)
    assert tuple(p.shape) == shape
    lse = t.to_numpy(sk.logsumexp(x, axis=axis))
    expected_shape = tuple(n for i, n in enumerate(shape)
                           if axis is not None and i != axis % len(shape))
    assert lse.shape == expected_shape
    if shape[axis if axis is not None else 0] == 0:
        assert np.all(lse == -np.inf)


def test_empty_axis_under_raise_policy():
    with pytest.raises(sk.EmptyRowError, match="masked='raise'"):
        sk.softmax(np.zeros((2, 0)), axis=-1, masked="raise")
    assert sk.softmax(np.zeros((0, 3)), axis=-1, masked="raise").shape == (0, 3)


# ---------------------------------------------------------------- edge policies


def test_fully_masked_policies(t):
    x = t.asarray(np.array([[1.0, 2.0], [-np.inf, -np.inf]]), "float32")
    w = t.asarray(np.array([[False, False], [True, True]]))
    for where in (w, None):
        rows = [0, 1] if where is not None else [1]
        p = t.to_numpy(sk.softmax(x, axis=-1, where=where))
        assert np.all(p[rows] == 0)
        lp = t.to_numpy(sk.log_softmax(x, axis=-1, where=where))
        assert np.all(lp[rows] == -np.inf)
        assert np.all(np.isnan(t.to_numpy(sk.softmax(x, axis=-1, where=where,
                                                     masked="nan"))[rows]))
        assert np.all(np.isnan(t.to_numpy(sk.log_softmax(x, axis=-1, where=where,
                                                         masked="nan"))[rows]))
        with pytest.raises(sk.EmptyRowError, match="1 row|2 row"):
            sk.softmax(x, axis=-1, where=where, masked="raise")
    lse = t.to_numpy(sk.logsumexp(x, axis=-1, where=w))
    assert np.all(lse == -np.inf)


def test_nan_row_is_not_an_empty_row():
    x = np.array([[np.nan, -np.inf]])
    assert np.all(np.isnan(sk.softmax(x, axis=-1, masked="raise")))


def test_plus_inf_rows():
    p = sk.softmax(np.array([np.inf, 1.0, 2.0]))
    assert np.all(np.isnan(p))
    lp = sk.log_softmax(np.array([np.inf, 1.0, -np.inf]))
    assert np.isnan(lp[0]) and lp[1] == -np.inf and lp[2] == -np.inf
    assert sk.logsumexp(np.array([np.inf, 1.0])) == np.inf
    # +inf excluded by where= is never read
    np.testing.assert_allclose(sk.softmax(np.array([np.inf, 0.0, 0.0]),
                                          where=np.array([False, True, True])), [0, 0.5, 0.5])


@pytest.mark.parametrize("weights, expected, sign", [
    ([1.0, -1.0], np.nan, np.nan),  # inf - inf
    ([2.0, 1.0], np.inf, 1.0),
    ([-1.0, -3.0], np.inf, -1.0),
    ([0.0, -1.0], np.inf, -1.0),  # the zero weight excludes its +inf
    ([0.0, 0.0], -np.inf, 0.0),
])
def test_logsumexp_weights_on_plus_inf(weights, expected, sign):
    a = np.array([np.inf, np.inf, 1.0])
    b = np.array(weights + [1.0])
    if weights == [0.0, 0.0]:
        expected, sign = 1.0, 1.0
    lse, sgn = sk.logsumexp(a, b=b, return_sign=True)
    np.testing.assert_array_equal([lse, sgn], [expected, sign])


def test_logsumexp_where_and_b_zero_agree(t):
    a = np.random.default_rng(5).normal(size=(4, 6))
    w = np.random.default_rng(6).random((4, 6)) < 0.5
    at = t.asarray(a, "float64" if "float64" in t.dtypes else "float32")
    x1 = t.to_numpy(sk.logsumexp(at, axis=-1, where=t.asarray(w)))
    x2 = t.to_numpy(sk.logsumexp(at, axis=-1, b=t.asarray(w.astype(np.float64),
                                                         "float64" if "float64" in t.dtypes
                                                         else "float32")))
    np.testing.assert_allclose(x1, x2, rtol=1e-6)


# ---------------------------------------------------------------- cross_entropy vs torch


def torch_loss_and_grad(x, target, **kwargs):
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(xt, torch.as_tensor(target), **kwargs)
    loss.sum().backward()
    return loss.detach().numpy(), xt.grad.numpy()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_cross_entropy_matches_torch(reduction, smoothing):
    rng = np.random.default_rng(8)
    x = rng.normal(scale=3, size=(6, 5))
    index = rng.integers(0, 5, size=6)
    index[2] = -100
    loss, grad = sk.cross_entropy(x, index, reduction=reduction, ignore_index=-100,
                                  label_smoothing=smoothing, return_grad=True)
    ref_loss, ref_grad = torch_loss_and_grad(x, index, reduction=reduction,
                                             ignore_index=-100, label_smoothing=smoothing)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-12, atol=1e-14)
    probs = rng.dirichlet(np.ones(5), size=6)
    loss, grad = sk.cross_entropy(x, probs, reduction=reduction, label_smoothing=smoothing,
                                  return_grad=True)
    ref_loss, ref_grad = torch_loss_and_grad(x, probs, reduction=reduction,
                                             label_smoothing=smoothing)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-12, atol=1e-14)


def test_cross_entropy_class_axis_and_torch_inputs():
    rng = np.random.default_rng(9)
    x = rng.normal(size=(2, 4, 3))  # classes on axis 1, like torch's [N, C, d]
    index = rng.integers(0, 4, size=(2, 3))
    loss = sk.cross_entropy(torch.from_numpy(x), torch.from_numpy(index), axis=1)
    ref, _ = torch_loss_and_grad(x, index)
    assert isinstance(loss, torch.Tensor)
    assert float(loss) == pytest.approx(float(ref), rel=1e-12)


def test_cross_entropy_mean_over_zero_rows_is_zero():
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    loss, grad = sk.cross_entropy(x, np.array([-1, -1]), ignore_index=-1, return_grad=True)
    assert float(loss) == 0.0
    assert np.all(grad == 0)
    assert float(sk.cross_entropy(np.zeros((0, 3)), np.zeros(0, dtype=int))) == 0.0


def test_cross_entropy_target_on_excluded_class():
    x = np.array([[1.0, 2.0, 3.0], [0.0, -np.inf, 1.0]])
    where = np.array([[True, True, False], [True, True, True]])
    loss, grad = sk.cross_entropy(x, np.array([2, 1]), where=where, reduction="none",
                                  return_grad=True)
    np.testing.assert_array_equal(loss, [np.inf, np.inf])
    assert grad[0, 2] == 0 and grad[1, 1] == 0
    p = ref_softmax(np.array([[1.0, 2.0, -np.inf], [0.0, -np.inf, 1.0]]))
    np.testing.assert_allclose(grad, p, rtol=1e-15)


def test_cross_entropy_where_equals_minus_inf_logits():
    rng = np.random.default_rng(10)
    x = rng.normal(size=(5, 6))
    where = rng.random((5, 6)) < 0.7
    index = np.argmax(np.where(where, rng.random((5, 6)), -1), axis=1)
    a = sk.cross_entropy(x, index, where=where, label_smoothing=0.2, return_grad=True)
    b = sk.cross_entropy(np.where(where, x, -np.inf), index, label_smoothing=0.2,
                         return_grad=True)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-15)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-15, atol=1e-300)


def test_cross_entropy_seed_example_is_finite():
    """A confidently wrong prediction: a large finite loss, never inf (float16 included)."""
    for dtype in ALL_DTYPES:
        t = target("numpy")
        x = t.asarray(np.array([[20.0, 18.0, 17.0, -5.0]]), dtype)
        loss = float(t.to_numpy(sk.cross_entropy(x, np.array([3]))))
        assert loss == pytest.approx(25.169846, rel=4e-3)


# ---------------------------------------------------------------- VJPs vs torch autograd


def test_vjps_match_torch_autograd(t):
    dtype = "float64" if "float64" in t.dtypes else "float32"
    rng = np.random.default_rng(12)
    x = rng.normal(size=(3, 7))
    g = rng.normal(size=(3, 7))
    for fn, op, vjp in ((torch.softmax, sk.softmax, sk.softmax_vjp),
                        (torch.log_softmax, sk.log_softmax, sk.log_softmax_vjp)):
        xt = torch.tensor(x, requires_grad=True)
        fn(xt, dim=-1).backward(torch.tensor(g))
        y = op(t.asarray(x, dtype), axis=-1)
        got = t.to_numpy(vjp(y, t.asarray(g, dtype), axis=-1))
        np.testing.assert_allclose(got, xt.grad.numpy(), rtol=1e-6 if dtype == "float32"
                                   else 1e-13, atol=1e-6 if dtype == "float32" else 1e-15)


def test_vjp_of_masked_rows_is_zero():
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    where = np.array([[True, False, True], [False, False, False]])
    g = np.array([[1.0, 100.0, -1.0], [np.nan, 2.0, 3.0]])
    p = sk.softmax(x, axis=-1, where=where)
    lp = sk.log_softmax(x, axis=-1, where=where)
    for vjp, y in ((sk.softmax_vjp, p), (sk.log_softmax_vjp, lp)):
        out = vjp(y, g, axis=-1, where=where)
        assert out[0, 1] == 0 and np.all(out[1] == 0)
        assert np.all(np.isfinite(out))


def test_log_softmax_rows_reference_helpers_agree():
    """The test references themselves: log_softmax and softmax agree with each other."""
    x = np.random.default_rng(14).normal(scale=50, size=(4, 9))
    # exp of the float64-rounded log-probability carries its rounding error, |log p| * 2**-53
    np.testing.assert_allclose(np.exp(ref_log_softmax(x)), ref_softmax(x), rtol=1e-12)
    assert_within(sk.log_softmax(x, axis=-1), ref_log_softmax(x),
                  log_bound(ref_log_softmax(x), 9, "float64"), "log_softmax")
