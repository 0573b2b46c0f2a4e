"""Agreement with scipy.special on the same inputs; every difference is one that
spec/semantics.md lists under "Deliberate differences from SciPy"."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.special as ss

import softmaxkit as sk

SPEC = Path(__file__).resolve().parents[1] / "spec" / "semantics.md"
inf, nan = np.inf, np.nan


@pytest.fixture(autouse=True)
def on_reference():
    with sk.backend_opts(prioritize="reference"):
        yield


def scipy_call(fn, *args, **kwargs):
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def same(got, expected):
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-300, equal_nan=True)


ROWS = [
    [1.0, 2.0, 3.0],
    [1000.0, 1000.0, -1000.0],
    [-1e300, 0.0, 1e-300],
    [-inf, 1.0, 2.0],
    [inf, 1.0, 2.0],
    [inf, inf, -inf],
    [-inf, inf],
    [nan, 1.0, 2.0],
    [nan, inf, -inf],
    [0.5],
]


@pytest.mark.parametrize("row", ROWS, ids=str)
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp"])
def test_rows_with_infinities_and_nan(name, row):
    x = np.array(row)
    same(getattr(sk, name)(x), scipy_call(getattr(ss, name), x))


ARRAYS = {
    "2d": np.arange(12.0).reshape(3, 4) / 3 - 2,
    "3d": np.random.default_rng(0).normal(scale=5, size=(2, 3, 4)),
    "int": np.arange(6).reshape(2, 3),
}


@pytest.mark.parametrize("key", sorted(ARRAYS))
@pytest.mark.parametrize("axis", [None, 0, -1, (0, 1), (-1, 0)], ids=str)
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_normalizers_axes_and_integer_inputs(name, key, axis):
    x = ARRAYS[key]
    got = getattr(sk, name)(x, axis=axis)
    expected = scipy_call(getattr(ss, name), x, axis=axis)
    assert got.dtype == expected.dtype
    same(got, expected)


@pytest.mark.parametrize("key", sorted(ARRAYS))
@pytest.mark.parametrize("axis", [None, 0, -1, (0, 1), (-1, 0), ()], ids=str)
@pytest.mark.parametrize("keepdims", [False, True])
def test_logsumexp_axes_keepdims(key, axis, keepdims):
    x = ARRAYS[key]
    got = sk.logsumexp(x, axis=axis, keepdims=keepdims)
    expected = scipy_call(ss.logsumexp, x, axis=axis, keepdims=keepdims)
    assert got.dtype == np.asarray(expected).dtype
    same(got, expected)


B_CASES = [
    ([1.0, 2.0, 3.0], [1.0, 1.0, 1.0]),
    ([1.0, 2.0, 3.0], [3.0, -1.0, 0.5]),
    ([1.0, 2.0], [1.0, -1.0]),
    ([1.0, 1.0], [1.0, -1.0]),
    ([inf, 1.0], [0.0, 1.0]),
    ([nan, 1.0], [0.0, 1.0]),
    ([inf, inf], [1.0, -1.0]),
    ([inf, inf], [-1.0, -2.0]),
    ([inf, 1.0], [-1.0, 1.0]),
    ([1.0, 2.0], [nan, 1.0]),
    ([-inf, 1.0], [nan, 1.0]),
    ([-inf, -inf], [1.0, 1.0]),
    ([1000.0, 1000.0], [2.0, -1.0]),
    ([0.0, 0.0, 0.0], [0.0, 0.0, 0.0]),
]


@pytest.mark.parametrize("a, b", B_CASES, ids=str)
@pytest.mark.parametrize("return_sign", [False, True])
def test_logsumexp_b_and_return_sign(a, b, return_sign):
    a, b = np.array(a), np.array(b)
    got = sk.logsumexp(a, b=b, return_sign=return_sign)
    expected = scipy_call(ss.logsumexp, a, b=b, return_sign=return_sign)
    if return_sign:
        same(got[0], expected[0])
        same(got[1], expected[1])
    else:
        same(got, expected)


def test_logsumexp_b_broadcasting_and_lists():
    a = [[1, 2, 3], [4, 5, 6]]
    b = [0.5, -1.0, 2.0]
    for axis in (None, 0, 1):
        got = sk.logsumexp(a, axis=axis, b=b, return_sign=True)
        expected = scipy_call(ss.logsumexp, a, axis=axis, b=b, return_sign=True)
        same(got[0], expected[0])
        same(got[1], expected[1])
    # b may have more dimensions than a
    got = sk.logsumexp([1.0, 2.0], b=[[1.0, 2.0], [3.0, 4.0]], axis=-1)
    same(got, scipy_call(ss.logsumexp, [1.0, 2.0], b=[[1.0, 2.0], [3.0, 4.0]], axis=-1))


def test_float32_results_stay_float32():
    x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    for name in ("softmax", "log_softmax", "logsumexp"):
        got = getattr(sk, name)(x)
        expected = getattr(ss, name)(x)
        assert got.dtype == np.asarray(expected).dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=2e-6)


def test_empty_inputs():
    for shape, axis in (((0,), None), ((0,), -1), ((2, 0), -1), ((0, 3), -1), ((0, 3), 0)):
        x = np.zeros(shape)
        same(sk.logsumexp(x, axis=axis), scipy_call(ss.logsumexp, x, axis=axis))
        same(sk.logsumexp(x, axis=axis, keepdims=True),
             scipy_call(ss.logsumexp, x, axis=axis, keepdims=True))


# ------------------------------------------------------------------ deliberate differences


def spec_differences() -> str:
    text = SPEC.read_text()
    start = text.index("## Deliberate differences from SciPy")
    end = text.find("\n## ", start + 10)
    return text[start:] if end < 0 else text[start:end]


def listed(tag: str) -> None:
    assert re.search(rf"\*\*{re.escape(tag)}\b", spec_differences()), (
        f"{tag} is not listed under 'Deliberate differences from SciPy' in spec/semantics.md"
    )


def test_difference_fully_masked_rows_give_zero_not_nan():
    listed("S1")
    x = np.array([-inf, -inf])
    assert np.all(np.isnan(scipy_call(ss.softmax, x)))
    assert np.all(sk.softmax(x) == 0)
    assert np.all(np.isnan(scipy_call(ss.log_softmax, x)))
    assert np.all(sk.log_softmax(x) == -inf)
    # the "nan" policy gives SciPy's answer
    assert np.all(np.isnan(sk.softmax(x, masked="nan")))
    assert np.all(np.isnan(sk.log_softmax(x, masked="nan")))


def test_difference_empty_axis_returns_empty():
    listed("S2")
    x = np.zeros((2, 0))
    with pytest.raises(ValueError):
        scipy_call(ss.softmax, x, axis=-1)
    assert sk.softmax(x, axis=-1).shape == (2, 0)
    assert sk.log_softmax(x, axis=-1).shape == (2, 0)


def test_difference_complex_rejected():
    listed("S3")
    x = np.array([1 + 1j, 2.0])
    assert np.isfinite(scipy_call(ss.logsumexp, x))
    with pytest.raises(TypeError, match="complex"):
        sk.logsumexp(x)


def test_difference_empty_sum_sign_is_zero():
    listed("S4")
    x = np.zeros((0,))
    assert scipy_call(ss.logsumexp, x, return_sign=True)[1] == -1.0
    lse, sign = sk.logsumexp(x, return_sign=True)
    assert lse == -inf and sign == 0.0
    # an all -inf row already has sign 0 in SciPy: the empty row now agrees with it
    assert scipy_call(ss.logsumexp, np.array([-inf]), return_sign=True)[1] == 0.0


def test_no_difference_numpy_full_reductions_are_scalars():
    # the rule of spec "Dtypes": numpy scalars for numpy inputs, as SciPy returns
    assert not re.search(r"\*\*S5\b", spec_differences())
    for args in (([1.0, 2.0],), (np.array([[1.0, 2.0]]), (0, 1)), (np.float32([1.0]),)):
        got, expected = sk.logsumexp(*args), ss.logsumexp(*args)
        assert type(got) is type(expected) and isinstance(got, np.generic)
        assert got == expected
    lse, sign = sk.logsumexp([1.0, 2.0], return_sign=True)
    assert isinstance(lse, np.float64) and isinstance(sign, np.float64)
    assert isinstance(sk.softmax(np.float64(3.0)), np.float64)
    assert isinstance(sk.log_softmax(1.0), type(ss.log_softmax(1.0)))
    # a reduction that keeps an axis is an array, as in SciPy
    assert isinstance(sk.logsumexp([[1.0, 2.0]], axis=1), np.ndarray)
    assert isinstance(sk.logsumexp([1.0, 2.0], keepdims=True), np.ndarray)


def test_zero_dimensional_results_of_other_libraries_are_arrays():
    torch = pytest.importorskip("torch")
    got = sk.logsumexp(torch.tensor([1.0, 2.0]))
    assert isinstance(got, torch.Tensor) and got.shape == ()


def test_logsumexp_result_follows_the_library_promotion():
    torch = pytest.importorskip("torch")
    a32 = torch.tensor([2.0, 1.0])
    for int_dtype in (torch.int32, torch.int64):
        b = torch.tensor([1, -1], dtype=int_dtype)
        got = sk.logsumexp(a32, b=b)
        assert got.dtype == (a32 * b).dtype == torch.float32
        assert abs(float(got) - np.log(np.exp(2) - np.exp(1))) < 1e-6
        # integer logits with float32 weights: float32 as well
        assert sk.logsumexp(torch.tensor([2, 1], dtype=int_dtype), b=a32).dtype == torch.float32
    # numpy promotes float32 with int64 to float64, as SciPy's result does
    got = sk.logsumexp(np.float32([2.0, 1.0]), b=np.array([1, -1]))
    assert got.dtype == ss.logsumexp(np.float32([2.0, 1.0]), b=np.array([1, -1])).dtype
    assert got.dtype == np.float64


def test_difference_zero_weights_exclude_in_every_row():
    listed("S9")
    for a in ([inf], [nan], [inf, nan]):
        b = [0.0] * len(a)
        assert np.isnan(scipy_call(ss.logsumexp, a, b=b))
        assert sk.logsumexp(a, b=b) == -inf
        assert sk.logsumexp(a, b=b, return_sign=True) == (-inf, 0.0)
    # where another position has a weight, SciPy and softmaxkit agree
    assert sk.logsumexp([inf, 1.0], b=[0.0, 1.0]) == scipy_call(ss.logsumexp, [inf, 1.0],
                                                                  b=[0.0, 1.0]) == 1.0


def test_difference_16_bit_inputs_accumulate_in_float32():
    listed("S6")
    x = np.random.default_rng(0).normal(size=20000).astype(np.float16)
    exact = float(ss.logsumexp(x.astype(np.float64)))
    ours = float(sk.logsumexp(x))
    theirs = float(scipy_call(ss.logsumexp, x))
    # ours is the correctly rounded float16 value; SciPy's float16 arithmetic is one ulp off
    assert ours == float(np.float16(exact))
    assert abs(theirs - exact) > abs(ours - exact)


def test_difference_boolean_inputs_promote():
    listed("S8")
    x = np.array([[True, False], [False, False]])
    with pytest.raises(TypeError):
        scipy_call(ss.softmax, x)
    same(sk.softmax(x, axis=1), ss.softmax(x.astype(int), axis=1))
    same(sk.log_softmax(x), ss.log_softmax(x.astype(int)))
    same(sk.logsumexp(x, axis=0), ss.logsumexp(x, axis=0))


def test_difference_where_is_an_extension():
    listed("S7")
    x = np.array([1.0, 2.0, 3.0])
    where = np.array([True, False, True])
    same(sk.softmax(x, where=where)[[0, 2]], ss.softmax(x[[0, 2]]))
    assert sk.softmax(x, where=where)[1] == 0.0
