"""Every bad input raises a clear error that names the argument; inputs are never modified."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import softmaxkit as sk


@pytest.fixture(autouse=True)
def on_reference():
    with sk.backend_opts(prioritize="reference"):
        yield


X = np.arange(6.0).reshape(2, 3)
IDX = np.array([0, 2])

BAD_CALLS = [
    # (call, exception type, words the message must contain)
    (lambda: sk.softmax(torch.zeros(2, 3), where=torch.ones(2, 3, dtype=torch.bool,
                                                           device="meta")),
     ValueError, ["x is on device cpu", "where is on device meta"]),
    (lambda: sk.attention(*(torch.zeros(1, 1, 2, 4, device=d) for d in ("cpu", "meta", "cpu"))),
     ValueError, ["q is on device cpu", "k is on device meta"]),
    (lambda: sk.softmax(X, axis=2), sk.AxisError, ["axis=2", "out of range"]),
    (lambda: sk.softmax(X, axis=-3), IndexError, ["axis=-3"]),
    (lambda: sk.log_softmax(X, axis=(0, 0)), sk.AxisError, ["axis", "repeats"]),
    (lambda: sk.logsumexp(X, axis=(1, -1)), ValueError, ["axis", "repeats"]),
    (lambda: sk.softmax(X, axis=1.5), TypeError, ["axis=1.5", "int"]),
    (lambda: sk.softmax(X, axis="last"), TypeError, ["axis"]),
    (lambda: sk.cross_entropy(X, IDX, axis=(0, 1)), TypeError, ["axis", "single int"]),
    (lambda: sk.cross_entropy(X, IDX, axis=None), TypeError, ["axis"]),
    (lambda: sk.softmax(X, where=np.ones((2, 3))), TypeError, ["where", "boolean"]),
    (lambda: sk.softmax(X, where=np.ones((3, 2), bool)), ValueError,
     ["where", "(3, 2)", "(2, 3)"]),
    (lambda: sk.logsumexp(X, where=[1, 0, 1]), TypeError, ["where", "boolean"]),
    (lambda: sk.logsumexp(X, b=np.ones((4,))), ValueError, ["b", "(4,)", "broadcast"]),
    (lambda: sk.attention(np.zeros((2, 3, 4)), np.zeros((2, 5, 4)), np.zeros((2, 5, 4)),
                          mask=np.ones((3, 5, 2), bool)),
     ValueError, ["mask", "(3, 5, 2)", "broadcast", "[..., 2, 3, 5]"]),
    (lambda: sk.softmax(X.astype(complex)), TypeError, ["x", "complex"]),
    (lambda: sk.logsumexp(np.array([1 + 2j])), TypeError, ["a", "complex"]),
    (lambda: sk.logsumexp(X, b=np.ones(3, complex)), TypeError, ["b", "complex"]),
    (lambda: sk.softmax(np.array(["a", "b"])), TypeError, ["x", "dtype"]),
    (lambda: sk.softmax(X, dtype="int32"), TypeError, ["dtype", "int32"]),
    (lambda: sk.softmax(X, dtype=np.int64), TypeError, ["dtype"]),
    (lambda: sk.softmax(X, masked="ignore"), ValueError, ["masked", "ignore", "zero"]),
    (lambda: sk.log_softmax(X, masked=None), ValueError, ["masked"]),
    (lambda: sk.cross_entropy(X, IDX, reduction="avg"), ValueError, ["reduction", "avg"]),
    (lambda: sk.cross_entropy(X, IDX, label_smoothing=1.5), ValueError,
     ["label_smoothing", "[0.0, 1.0]"]),
    (lambda: sk.cross_entropy(X, IDX, label_smoothing="x"), TypeError, ["label_smoothing"]),
    (lambda: sk.cross_entropy(X, np.array([0, 3])), ValueError, ["target", "[0, 3)"]),
    (lambda: sk.cross_entropy(X, np.array([-1, 0])), ValueError, ["target", "[0, 3)"]),
    (lambda: sk.cross_entropy(X, np.array([-1, 5]), ignore_index=-1), ValueError,
     ["target", "ignore_index=-1"]),
    (lambda: sk.cross_entropy(X, np.array([0, 1, 2])), ValueError, ["target", "shape"]),
    (lambda: sk.cross_entropy(X, np.ones((2, 4))), ValueError, ["target", "broadcast"]),
    (lambda: sk.cross_entropy(X, np.ones((2, 3)), ignore_index=0), ValueError,
     ["ignore_index", "class-index"]),
    (lambda: sk.cross_entropy(X, np.array([True, False])), TypeError, ["target", "bool"]),
    (lambda: sk.cross_entropy(np.array(1.0), np.array(0)), ValueError, ["logits"]),
    (lambda: sk.softmax_vjp(X, np.ones((3, 2))), ValueError, ["cotangent", "shape"]),
    (lambda: sk.log_softmax_vjp(X, np.ones((2, 3)), where=np.ones(3)), TypeError,
     ["where"]),
    (lambda: sk.softmax(torch.ones(3), where=np.ones(3, bool)), TypeError,
     ["x", "where", "array libraries"]),
    (lambda: sk.logsumexp(np.ones(3), b=torch.ones(3)), TypeError, ["a", "b"]),
    (lambda: sk.cross_entropy(torch.ones(2, 3), IDX), TypeError, ["logits", "target"]),
    (lambda: sk.softmax(np.array([[-np.inf, -np.inf]]), axis=-1, masked="raise"),
     sk.EmptyRowError, ["1 row", "masked='raise'"]),
]


@pytest.mark.parametrize("call, kind, words", BAD_CALLS, ids=range(len(BAD_CALLS)))
def test_bad_input_raises_a_clear_error(call, kind, words):
    with pytest.raises(kind) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_axis_error_is_both_value_and_index_error():
    with pytest.raises(ValueError):
        sk.softmax(X, axis=5)
    with pytest.raises(IndexError):
        sk.softmax(X, axis=5)


def test_empty_row_error_is_a_value_error():
    with pytest.raises(ValueError):
        sk.log_softmax(X, axis=-1, where=np.zeros(3, bool), masked="raise")


def snapshot(*arrays):
    return [a.copy() if isinstance(a, np.ndarray) else a.clone() for a in arrays]


def test_inputs_never_modified_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 5))
    x[0, 0] = -np.inf
    x[1, 1] = np.nan
    where = rng.random((4, 5)) < 0.7
    b = rng.normal(size=(4, 5))
    g = rng.normal(size=(4, 5))
    probs = rng.dirichlet(np.ones(5), size=4)
    idx = np.array([0, 1, -100, 4])
    before = snapshot(x, where, b, g, probs, idx)
    sk.softmax(x, axis=1, where=where)
    sk.log_softmax(x, axis=0, where=where, dtype="float32", masked="nan")
    sk.logsumexp(x, axis=(0, 1), b=b, where=where, return_sign=True, keepdims=True)
    sk.cross_entropy(x, idx, ignore_index=-100, where=where, label_smoothing=0.1,
                     return_grad=True)
    sk.cross_entropy(x, probs, return_grad=True, reduction="sum")
    sk.softmax_vjp(probs, g, axis=-1, where=where)
    sk.log_softmax_vjp(np.log(probs), g, axis=-1, where=where)
    for call in (lambda: sk.softmax(x, axis=-1, where=where & False, masked="raise"),
                 lambda: sk.cross_entropy(x, idx)):
        with pytest.raises(ValueError):
            call()
    for a, c in zip(before, (x, where, b, g, probs, idx), strict=True):
        np.testing.assert_array_equal(a, c)


def test_inputs_never_modified_torch():
    x = torch.randn(3, 4, dtype=torch.float64)
    x[0, 0] = -float("inf")
    where = torch.rand(3, 4) < 0.8
    idx = torch.tensor([0, 1, 2])
    before = snapshot(x, where, idx)
    sk.softmax(x, axis=-1, where=where)
    sk.logsumexp(x, axis=0, b=x, return_sign=True)
    sk.cross_entropy(x, idx, where=where, return_grad=True)
    for a, c in zip(before, (x, where, idx), strict=True):
        assert torch.equal(a, c)
