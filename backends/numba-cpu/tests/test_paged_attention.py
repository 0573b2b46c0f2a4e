"""numba-cpu paged attention: the split-KV path (chunks of pages, partial states merged by the
backend's merge_attention kernel) against the unsplit result and the float64 definition on
the gathered keys, and the chunks a window leaves out of reach never read."""

from __future__ import annotations

import array_api_compat.numpy as npx
import numpy as np
import pytest
from softmaxkit_numba_cpu import paged

import softmaxkit as sk
from softmaxkit.testing import materialized as ref
from softmaxkit.testing.paged_cases import make_cache, paged_definition

BOUNDS = {"float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12)}
"""dtype -> bounds on (out, lse): spec/semantics.md, "Attention tolerances"."""


def _call(q, k, v, table, lens, split_keys, group_keys=paged.GROUP_KEYS, **kw):
    kw = {"scale": 1 / np.sqrt(q.shape[-1]), "causal": None, "window": (-1, -1),
          "softcap": None, **kw}
    return paged.paged_attention(npx, q=q, k_pages=k, v_pages=v, block_table=table,
                                 seqlens=lens, return_lse=True, split_keys=split_keys,
                                 group_keys=group_keys, **kw)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("settings", [
    {"causal": "bottom_right"},
    {"causal": None, "window": (40, 3)},
    {"causal": "bottom_right", "softcap": 3.0},
], ids=["causal", "window", "softcap"])
def test_split_kv_equals_the_unsplit_result(dtype, settings):
    rng = np.random.default_rng(1)
    seqlens = [300, 0, 37, 129, 5]
    k64, v64, table, lens = make_cache(rng, seqlens, 8, 2, 16, 16)
    q64 = rng.normal(size=(len(seqlens), 4, 3, 16))
    q, k, v = (a.astype(dtype) for a in (q64, k64, v64))
    whole = _call(q, k, v, table, lens, 10**9, **settings)
    e_out, e_lse = paged_definition(q.astype(np.float64), k.astype(np.float64),
                                    v.astype(np.float64), table, lens, **settings)
    out_tol, lse_tol = BOUNDS[dtype]
    fin = np.isfinite(e_lse)
    # split into chunks of 1, 2 and 5 pages (and a limit below one page: one page a chunk);
    # the chunks every query sees whole run in batches of one, three or all of them
    for split, group in ((3, 10**9), (8, 24), (16, 0), (40, 10**9)):
        out, lse = _call(q, k, v, table, lens, split, group, **settings)
        assert ref.rel_frobenius(out, whole[0]) <= out_tol
        assert np.array_equal(lse == -np.inf, whole[1] == -np.inf)
        assert np.max(np.abs(lse[fin] - whole[1][fin])) <= lse_tol
        assert ref.rel_frobenius(out, e_out) <= out_tol
        assert np.max(np.abs(lse[fin] - e_lse[fin])) <= lse_tol
    assert np.all(whole[0][1] == 0) and np.all(whole[1][1] == -np.inf)


def test_pages_out_of_the_window_are_never_read():
    # a sliding window over a long cache: the pages before it hold NaN and are skipped
    rng = np.random.default_rng(2)
    k, v, table, lens = make_cache(rng, [640], 16, 1, 8, 8)
    q = rng.normal(size=(1, 2, 1, 8))
    e_out, e_lse = paged_definition(q, k, v, table, lens, None, window=(100, 0))
    k[table[0, :32]] = np.nan  # keys 0..511, all out of the window's reach (539..639)
    v[table[0, :32]] = np.nan
    out, lse = _call(q, k, v, table, lens, 128, window=(100, 0))
    np.testing.assert_allclose(out, e_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, e_lse, rtol=0, atol=1e-12)


def test_numpy_calls_are_served_by_numba_cpu():
    rng = np.random.default_rng(3)
    k, v, table, lens = make_cache(rng, [20, 3], 4, 2, 8, 8)
    q = rng.normal(size=(2, 2, 1, 8)).astype(np.float32)
    with sk.backend_opts(trace=True) as trace:
        sk.paged_attention(q, k.astype(np.float32), v.astype(np.float32), table, lens)
    assert [r.backend for r in trace] == ["numba-cpu"]


def test_long_prefills_get_longer_chunks_with_the_same_result(monkeypatch):
    # a budget of partial outputs below one chunk per sequence's 1024 keys lengthens the
    # chunks; the result is the same
    rng = np.random.default_rng(4)
    k, v, table, lens = make_cache(rng, [900, 260], 4, 1, 8, 8)
    q = rng.normal(size=(2, 2, 5, 8))
    whole = _call(q, k, v, table, lens, 10**9, causal="bottom_right")
    monkeypatch.setattr(paged, "PARTIAL_ELEMENTS", 2 * 2 * 5 * 8 * 3)  # three parts
    out, lse = _call(q, k, v, table, lens, 16, causal="bottom_right")
    np.testing.assert_allclose(out, whole[0], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, whole[1], rtol=0, atol=1e-12)
