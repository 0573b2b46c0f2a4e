"""Sequence-sharded attention on Dask arrays against single-machine attention: queries and
keys in chunks, grouped-query heads, Lq != Lk both ways, causal alignments, windows, masks
that empty whole query rows, softcap; and the shape of the graph (pairs that the causal
geometry empties are never computed)."""

from __future__ import annotations

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
import dask  # noqa: E402

import softmaxkit as sk  # noqa: E402

SHAPES = [(37, 53), (53, 37), (1, 30)]


@pytest.fixture(autouse=True)
def _threads():
    with dask.config.set(scheduler="threads"):
        yield


def _problem(lq: int, lk: int, seed: int, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, 4, lq, 8)).astype(dtype)
    k = rng.normal(size=(2, 2, lk, 8)).astype(dtype)
    v = rng.normal(size=(2, 2, lk, 5)).astype(dtype)
    mask = rng.random((2, 4, lq, lk)) > 0.3
    mask[:, :, :2] = False  # query rows with no allowed key
    lazy = (da.from_array(q, chunks=(1, 2, 10, 8)), da.from_array(k, chunks=(2, 1, 12, 4)),
            da.from_array(v, chunks=(2, 2, 12, 5)), da.from_array(mask, chunks=(2, 4, 7, 9)))
    return (q, k, v, mask), lazy


@pytest.mark.parametrize("lq,lk", SHAPES)
@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("window", [None, (5, 3), (-1, 2)])
def test_sharded_attention_matches_single_machine(lq, lk, causal, window):
    (q, k, v, mask), (qd, kd, vd, md) = _problem(lq, lk, seed=lq * lk)
    for use_mask, softcap in ((False, None), (True, 3.0)):
        kw = dict(causal=causal, window=window, softcap=softcap, return_lse=True)
        out, lse = sk.attention(q, k, v, mask=mask if use_mask else None, backend="reference",
                                **kw)
        got = sk.attention(qd, kd, vd, mask=md if use_mask else None, **kw)
        assert all(isinstance(a, da.Array) for a in got)
        got_out, got_lse = dask.compute(*got)
        np.testing.assert_allclose(got_out, out, rtol=1e-11, atol=1e-13)
        np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(lse))
        finite = np.isfinite(lse)
        np.testing.assert_allclose(got_lse[finite], lse[finite], rtol=1e-12)


def test_float32_within_the_spec_bounds():
    (q, k, v, _), (qd, kd, vd, _) = _problem(64, 96, seed=5, dtype=np.float32)
    out, lse = dask.compute(*sk.attention(qd, kd, vd, causal=True, return_lse=True))
    assert out.dtype == np.float32 and lse.dtype == np.float32
    ref, ref_lse = sk.attention(q.astype(np.float64), k.astype(np.float64),
                                v.astype(np.float64), causal=True, return_lse=True,
                                backend="reference")
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
    assert np.max(np.abs(lse - ref_lse)) < 1e-5


def test_pairs_the_causal_mask_empties_are_not_computed():
    q = da.zeros((1, 1, 64, 4), chunks=(1, 1, 16, 4))
    k = da.zeros((1, 1, 64, 4), chunks=(1, 1, 16, 4))
    v = da.zeros((1, 1, 64, 4), chunks=(1, 1, 16, 4))
    with sk.backend_opts(trace=True) as trace, dask.config.set(scheduler="synchronous"):
        sk.attention(q, k, v, causal=True).compute()
    chunk_calls = [r for r in trace if r.op == "attention" and r.backend != "dask"]
    assert len(chunk_calls) == 4 * 5 // 2  # the lower triangle of 4 x 4 blocks, diagonal too
    assert {r.backend for r in trace if r.op == "attention"} >= {"dask"}
