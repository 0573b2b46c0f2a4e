"""The cheap path of a repeated call: kept checks, cached decisions and the per-type routes
give what the full path gives, and never let a bad argument through."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import softmaxkit as sk
from softmaxkit.frameworks import route


@pytest.mark.parametrize("make", [np.asarray, torch.as_tensor], ids=["numpy", "torch"])
def test_a_kept_check_still_refuses_what_differs(make):
    x = make(np.arange(6.0, dtype=np.float32).reshape(2, 3))
    for _ in range(3):
        sk.softmax(x, axis=1)
        sk.logsumexp(x, axis=1)
    # equal to the kept axis, but not an int: still an error
    for bad in (1.0, np.float64(1.0)):
        with pytest.raises(TypeError, match="axis"):
            sk.softmax(x, axis=bad)
        with pytest.raises(TypeError, match="axis"):
            sk.logsumexp(x, axis=bad)
    with pytest.raises(sk.AxisError):
        sk.softmax(x, axis=2)
    # same shape, another dtype: checked afresh
    with pytest.raises(TypeError, match="complex"):
        sk.softmax(make(np.ones((2, 3), dtype=np.complex64)), axis=1)
    # integers still promote, and are not kept as if they were floating
    ints = make(np.arange(6).reshape(2, 3))
    assert sk.softmax(ints, axis=1).dtype != ints.dtype
    # a mask still goes through its checks
    with pytest.raises(TypeError, match="where"):
        sk.softmax(x, axis=1, where=make(np.ones((2, 3), dtype=np.float32)))


@pytest.mark.parametrize("make", [np.asarray, torch.as_tensor], ids=["numpy", "torch"])
def test_repeated_calls_agree_with_the_reference_and_never_alias(make):
    x = make(np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32))
    expected = sk.softmax(x, axis=-1, backend="reference")
    for _ in range(3):
        y = sk.softmax(x, axis=-1)
        assert type(y) is type(x)
        np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-6, atol=1e-7)
        y[...] = 0  # the result is the caller's own memory, not the input's
        assert float(x.sum()) != 0


def test_the_cached_decision_follows_backend_opts():
    x = np.ones((2, 5), np.float32)
    with sk.backend_opts(trace=True) as trace:
        sk.softmax(x, axis=-1)
    default = trace[-1].backend
    for _ in range(3):
        sk.softmax(x, axis=-1)
    with sk.backend_opts(prioritize="reference", trace=True) as trace:
        sk.softmax(x, axis=-1)
    assert trace[-1].backend == "reference"
    if default != "reference":
        with sk.backend_opts(disable=default, trace=True) as trace:
            sk.softmax(x, axis=-1)
        assert trace[-1].backend != default
    with sk.backend_opts(trace=True) as trace:
        sk.softmax(x, axis=-1)
    assert trace[-1].backend == default


def test_route_after_plain_arrays():
    x = np.ones(3)
    assert route(x, None) is None and route(x, None) is None
    t = torch.ones(3, requires_grad=True)
    assert route(x, t) is not None  # a tensor that requires grad still routes
    assert route([x, t]) is not None
    y = sk.softmax(t, axis=-1)
    y[0].backward()
    assert t.grad is not None
