"""Packed variable-length calls the adapter serves without a launch, and the padded layout of
the backward's work arrays.

A call with no query row or no key has results fixed by the spec ("Packed variable-length
attention": every row empty, out 0 and lse -inf, zero gradients), allocated beside the inputs,
so these checks run on any machine with CPU PyTorch tensors standing in for CUDA ones; the
reference backend is the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
from softmaxkit_cupy import varlen as adapter

import softmaxkit as sk

torch = pytest.importorskip("torch")
import array_api_compat.torch as xp  # noqa: E402

# (query lengths, key lengths, Hq, Hk, D)
SHAPES = [
    ((4, 2), (0, 0), 2, 2, 64),        # no key: every row is empty
    ((3, 0, 5), (0, 0, 0), 4, 2, 128),  # no key, grouped-query, a sequence without queries
    ((0, 0), (5, 3), 2, 1, 64),        # no query row: the keys get zero gradients
    ((), (), 2, 2, 128),               # no sequence
]
OPTIONS = {"scale": 0.125, "causal": "bottom_right", "window": (-1, -1), "softcap": None}


def _inputs(lens_q, lens_k, hq, hk, d, dtype):
    rng = np.random.default_rng(0)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64)
                  for lens in (lens_q, lens_k))
    shapes = ((int(cu_q[-1]), hq, d), (int(cu_k[-1]), hk, d), (int(cu_k[-1]), hk, d))
    arrays = [torch.from_numpy(rng.normal(size=s)).to(getattr(torch, dtype)) for s in shapes]
    return arrays, torch.from_numpy(cu_q), torch.from_numpy(cu_k)


def _numpy(a):
    return a.to(torch.float64).numpy()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_without_work_matches_the_reference(shape, dtype) -> None:
    (q, k, v), cu_q, cu_k = _inputs(*shape, dtype)
    out, lse = adapter.varlen_attention(xp, q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                        return_lse=True, **OPTIONS)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    e_out, e_lse = sk.varlen_attention(*(_numpy(a) for a in (q, k, v)), cu_q.numpy(),
                                       cu_k.numpy(), causal=True, scale=0.125,
                                       return_lse=True, backend="reference")
    assert out.shape == e_out.shape and lse.shape == e_lse.shape
    np.testing.assert_array_equal(_numpy(out), e_out)
    np.testing.assert_array_equal(lse.numpy(), e_lse)
    plain, none = adapter.varlen_attention(xp, q=q, k=k, v=v, cu_seqlens_q=cu_q,
                                           cu_seqlens_k=cu_k, return_lse=False, **OPTIONS)
    assert none is None and plain.shape == out.shape


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_without_work_is_zero(shape) -> None:
    (q, k, v), cu_q, cu_k = _inputs(*shape, "bfloat16")
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -float("inf"))
    grads = adapter.varlen_attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse,
                                         dout=torch.ones_like(q), cu_seqlens_q=cu_q,
                                         cu_seqlens_k=cu_k, **OPTIONS)
    for g, a in zip(grads, (q, k, v), strict=True):
        assert g.shape == a.shape and g.dtype == a.dtype
        assert bool(torch.all(g == 0))


@pytest.mark.parametrize("block_m", [32, 64, 128])
def test_padded_offsets_give_each_sequence_whole_tiles_of_its_own(block_m) -> None:
    lengths = np.array([3, 0, 64, 65, 128, 1, 0])
    cu_q = np.concatenate([[0], np.cumsum(lengths)])
    cu_pad = adapter.padded_offsets(cu_q, block_m)
    assert cu_pad.dtype == np.int64 and cu_pad[0] == 0 and cu_pad.shape == cu_q.shape
    rows = np.diff(cu_pad)
    assert np.all(cu_pad % block_m == 0)
    assert np.all(rows >= lengths) and np.all(rows < lengths + block_m)
    assert np.all((rows == 0) == (lengths == 0))
