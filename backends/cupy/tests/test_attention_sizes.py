"""Attention calls with no query row or no key, served without a kernel launch.

Their results are fixed by the spec ("Attention": a row with no allowed key has out 0 and
lse -inf, and zero gradient) and allocated beside the inputs, so these checks run on any
machine with CPU PyTorch tensors standing in for CUDA ones; the float64 reference backend is
the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
from softmaxkit_cupy import attention as adapter

import softmaxkit as sk

torch = pytest.importorskip("torch")
import array_api_compat.torch as xp  # noqa: E402

# (q shape, k shape) with D = Dv
SHAPES = [
    ((1, 2, 4, 64), (1, 2, 0, 64)),    # no key: every row is empty
    ((2, 4, 3, 128), (2, 2, 0, 128)),  # no key, grouped-query
    ((1, 2, 0, 64), (1, 2, 5, 64)),    # no query row
    ((0, 2, 3, 64), (0, 1, 5, 64)),    # no batch
    ((2, 0, 3, 128), (2, 1, 5, 128)),  # no query head
    ((1, 2, 0, 64), (1, 2, 0, 64)),    # neither
]
OPTIONS = {"scale": 0.125, "causal": None, "window": (-1, -1), "mask": None, "softcap": None}


def _inputs(q_shape, k_shape, dtype):
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=s) for s in (q_shape, k_shape, k_shape)]
    return [torch.from_numpy(a).to(getattr(torch, dtype)) for a in arrays]


def _numpy(a):
    return a.to(torch.float64).numpy()


@pytest.mark.parametrize(("q_shape", "k_shape"), SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_forward_matches_the_reference(q_shape, k_shape, dtype):
    q, k, v = _inputs(q_shape, k_shape, dtype)
    out, lse = adapter.attention(xp, q=q, k=k, v=v, return_lse=True, **OPTIONS)
    e_out, e_lse = sk.attention(*map(_numpy, (q, k, v)), scale=0.125, return_lse=True,
                                backend="reference")
    assert out.dtype == q.dtype and out.device == q.device
    assert lse.dtype == torch.float32 and lse.device == q.device
    assert tuple(out.shape) == e_out.shape and tuple(lse.shape) == e_lse.shape
    np.testing.assert_array_equal(_numpy(out), e_out)
    np.testing.assert_array_equal(_numpy(lse), e_lse)
    if e_lse.size:
        assert np.all(e_lse == -np.inf)  # the rows with no key: out 0, lse -inf
    out_only, none = adapter.attention(xp, q=q, k=k, v=v, return_lse=False, **OPTIONS)
    assert none is None and tuple(out_only.shape) == e_out.shape


@pytest.mark.parametrize(("q_shape", "k_shape"), SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gradient_matches_the_reference(q_shape, k_shape, dtype):
    q, k, v = _inputs(q_shape, k_shape, dtype)
    q64, k64, v64 = map(_numpy, (q, k, v))
    out64, lse64 = sk.attention(q64, k64, v64, scale=0.125, return_lse=True,
                                backend="reference")
    dout64 = np.random.default_rng(1).normal(size=out64.shape)
    out, dout = (torch.from_numpy(a).to(q.dtype) for a in (out64, dout64))
    lse = torch.from_numpy(lse64).to(torch.float32)
    got = adapter.attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, **OPTIONS)
    expected = sk.attention_vjp(q64, k64, v64, out64, lse64, dout64, scale=0.125,
                                backend="reference")
    for name, g, e, like in zip(("dq", "dk", "dv"), got, expected, (q, k, v), strict=True):
        assert g.dtype == like.dtype and g.device == like.device, name
        assert tuple(g.shape) == tuple(like.shape) == e.shape, name
        np.testing.assert_array_equal(_numpy(g), e, err_msg=name)
    # no query row, but keys: their gradient is an explicit zero, not uninitialized memory
    if not q.numel() and k.numel():
        assert not got[1].any() and not got[2].any()
