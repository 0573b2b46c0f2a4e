"""paged_attention's frontend: metadata validation before any kernel, the empty-row rules,
the default alignment, and the refusal of a gradient it cannot give.

Numerical agreement with dense attention and the float64 definition is the conformance kit's
(softmaxkit/testing/paged_cases.py, run against the reference by
tests/test_conformance_reference.py); these tests also compare with the float64 definition
on gathered keys where they check results."""

from __future__ import annotations

import numpy as np
import pytest

import softmaxkit as sk
from softmaxkit.testing import materialized as ref
from softmaxkit.testing.paged_cases import make_cache, paged_definition

BACKENDS = ("reference", "numba-cpu")


def _cache(seqlens, page_size=4, hq=4, hk=2, lq=1, d=8, dv=6, seed=0):
    rng = np.random.default_rng(seed)
    k, v, table, lens = make_cache(rng, seqlens, page_size, hk, d, dv)
    q = rng.normal(size=(len(seqlens), hq, lq, d))
    return q, k, v, table, lens


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_length_sequence_and_short_sequences_follow_the_empty_row_rule(backend):
    # seqlens[1] = 0: no key; seqlens[2] = 2 < Lq = 4: with causal, the first two rows see
    # no key (bottom-right alignment, as attention with Lq > Lk); without causal, all see both
    q, k, v, table, lens = _cache([9, 0, 2], lq=4)
    for causal in (True, False):
        out, lse = sk.paged_attention(q, k, v, table, lens, causal=causal, return_lse=True,
                                      backend=backend)
        e_out, e_lse = paged_definition(q, k, v, table, lens, causal=causal)
        assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
        assert np.all((lse[2, :, :2] == -np.inf) == causal)
        assert np.all(out[2, :, :2] == 0) if causal else np.all(np.isfinite(lse[2]))
        np.testing.assert_allclose(out, e_out, rtol=1e-12, atol=1e-13)
        np.testing.assert_array_equal(lse == -np.inf, e_lse == -np.inf)
        fin = np.isfinite(e_lse)
        np.testing.assert_allclose(lse[fin], e_lse[fin], rtol=0, atol=1e-12)


def test_causal_defaults_to_false_as_in_flashinfer_and_flash_attn():
    q, k, v, table, lens = _cache([9, 5], lq=3)
    got = sk.paged_attention(q, k, v, table, lens)
    np.testing.assert_allclose(got, paged_definition(q, k, v, table, lens, causal=False)[0],
                               rtol=1e-12, atol=1e-13)
    # for decoding (Lq = 1) causal changes nothing: the query is the last position
    q1 = q[:, :, :1]
    np.testing.assert_array_equal(sk.paged_attention(q1, k, v, table, lens, backend="reference"),
                                  sk.paged_attention(q1, k, v, table, lens, causal=True,
                                                     backend="reference"))


def test_top_left_alignment_is_refused():
    q, k, v, table, lens = _cache([5])
    with pytest.raises(ValueError, match="causal='top_left'"):
        sk.paged_attention(q, k, v, table, lens, causal="top_left")


def _bad_inputs():
    q, k, v, table, lens = _cache([5, 9], page_size=4)  # 4 pages of 4 per row, pool of 7
    pool = k.shape[0]
    t_neg = table.copy()
    t_neg[1, 2] = -1  # the third page of sequence 1 is used (9 keys > 2 pages of 4)
    t_big = table.copy()
    t_big[0, 1] = pool
    short = np.array([5, 17], dtype=np.int32)  # 17 > 4 pages * 4
    neg = np.array([5, -1], dtype=np.int32)
    yield "block_table negative", (q, k, v, t_neg, lens), ValueError, r"block_table\[1, 2\] = -1"
    yield "block_table past the pool", (q, k, v, t_big, lens), ValueError, (
        rf"block_table\[0, 1\] = {pool} is outside the page pool \[0, {pool}\)")
    yield "seqlens beyond the pages", (q, k, v, table, short), ValueError, (
        r"seqlens\[1\] = 17 exceeds")
    yield "seqlens negative", (q, k, v, table, neg), ValueError, r"seqlens\[1\] = -1 is negative"
    yield "block_table int16", (q, k, v, table.astype(np.int16), lens), TypeError, (
        "block_table has dtype int16")
    yield "seqlens float", (q, k, v, table, lens.astype(np.float64)), TypeError, (
        "seqlens has dtype float64")
    yield "seqlens uint32", (q, k, v, table, lens.astype(np.uint32)), TypeError, (
        "seqlens has dtype uint32")
    yield "v_pages of another page size", (q, k, v[:, :, :2], table, lens), ValueError, (
        "v_pages of shape")
    yield "v_pages of another pool", (q, k, v[:-1], table, lens), ValueError, "v_pages of shape"
    yield "k_pages head dim", (q, k[..., :4], v, table, lens), ValueError, "head dim"
    yield "heads not grouped", (q[:, :3], k, v, table, lens), ValueError, "multiple"
    yield "block_table rows", (q, k, v, table[:1], lens), ValueError, "block_table of shape"
    yield "seqlens shape", (q, k, v, table, lens[:, None]), ValueError, "seqlens of shape"
    yield "q rank", (q[0], k, v, table, lens), ValueError, r"q must have shape \[B, Hq, Lq, D\]"


BAD = list(_bad_inputs())


@pytest.mark.parametrize("inputs, error, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_metadata_is_a_named_error_before_any_kernel(inputs, error, match):
    copies = [a.copy() for a in inputs]
    with sk.backend_opts(trace=True) as trace, pytest.raises(error, match=match):
        sk.paged_attention(*inputs, causal=True)
    assert trace == []  # no backend was chosen, so no kernel ran
    for a, c in zip(inputs, copies, strict=True):
        np.testing.assert_array_equal(a, c)


def test_unused_table_entries_may_hold_anything():
    # entries past a sequence's pages are never read: -1 and huge indices are padding
    q, k, v, table, lens = _cache([4, 1], page_size=4)
    table[:, 1:] = np.array([-7, 10**6, 2**31 - 1], dtype=np.int32)[: table.shape[1] - 1]
    out = sk.paged_attention(q, k, v, table, lens, backend="reference")
    np.testing.assert_allclose(out, paged_definition(q, k, v, table, lens)[0], rtol=1e-12,
                               atol=1e-13)


def test_metadata_of_int64_and_mixed_dtypes_and_an_empty_pool():
    q, k, v, table, lens = _cache([6, 3])
    want = sk.paged_attention(q, k, v, table, lens, backend="reference")
    got = sk.paged_attention(q, k, v, table.astype(np.int64), lens.astype(np.int64),
                             backend="reference")
    np.testing.assert_array_equal(got, want)
    # Python lists become numpy's default integers
    got = sk.paged_attention(q, k, v, table.tolist(), lens.tolist(), backend="reference")
    np.testing.assert_array_equal(got, want)
    # no page at all: every sequence is empty
    out, lse = sk.paged_attention(q, k[:0], v[:0], np.zeros((2, 0), np.int32),
                                  np.zeros(2, np.int32), return_lse=True, backend="reference")
    assert out.shape == (2, 4, 1, 6) and np.all(out == 0) and np.all(lse == -np.inf)


def test_torch_inputs_requiring_grad_are_refused():
    torch = pytest.importorskip("torch")
    q, k, v, table, lens = _cache([5, 2])
    tq = torch.tensor(q, requires_grad=True)
    args = (torch.tensor(k), torch.tensor(v), torch.tensor(table), torch.tensor(lens))
    with pytest.raises(NotImplementedError, match="paged_attention is not differentiable"):
        sk.paged_attention(tq, *args)
    with torch.no_grad():
        out = sk.paged_attention(tq, *args)
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    np.testing.assert_allclose(out.numpy(), paged_definition(q, k, v, table, lens)[0],
                               rtol=1e-12, atol=1e-13)


def test_float_promotion_and_lse_dtype():
    q, k, v, table, lens = _cache([6, 3])
    out, lse = sk.paged_attention(q.astype(np.float32), k.astype(np.float16), v, table, lens,
                                  return_lse=True, backend="reference")
    assert out.dtype == np.float64 and lse.dtype == np.float64
    out, lse = sk.paged_attention(q.astype(np.float16), k.astype(np.float16),
                                  v.astype(np.float16), table, lens, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_shapes(backend):
    q, k, v, table, lens = _cache([5, 0, 9], lq=2)
    cases = {
        "Lq=0": (q[:, :, :0], k, v, table, lens),
        "B=0": (q[:0], k, v, table[:0], lens[:0]),
        "Dv=0": (q, k, v[..., :0], table, lens),
        "page_size=0": (q, k[:, :, :0], v[:, :, :0], table, np.zeros(3, np.int32)),
    }
    for name, (qq, kk, vv, tt, ll) in cases.items():
        out, lse = sk.paged_attention(qq, kk, vv, tt, ll, causal=True, return_lse=True,
                                      backend=backend)
        e_out, e_lse = paged_definition(qq, kk, vv, tt, ll, causal=True) if len(ll) else (
            np.zeros(out.shape), np.zeros(lse.shape))
        assert out.shape == e_out.shape and lse.shape == e_lse.shape, name
        np.testing.assert_array_equal(lse == -np.inf, e_lse == -np.inf, err_msg=name)
        fin = np.isfinite(e_lse)
        np.testing.assert_allclose(lse[fin], e_lse[fin], rtol=0, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(out, e_out, rtol=1e-12, atol=1e-13, err_msg=name)


def test_jax_arrays_and_traced_metadata():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v, table, lens = _cache([5, 0, 9], lq=2)
    f32 = [a.astype(np.float32) for a in (q, k, v)]
    want = paged_definition(*(a.astype(np.float64) for a in f32), table, lens, causal=True)[0]
    got = sk.paged_attention(*(jnp.asarray(a) for a in (*f32, table, lens)), causal=True)
    assert isinstance(got, jax.Array)
    assert ref.rel_frobenius(np.asarray(got, dtype=np.float64), want) <= 1e-5
    # under jit the call runs in a host callback, where the traced metadata is concrete: it
    # is checked there, and a fault is the same named error, raised through JAX
    jitted = jax.jit(lambda *a: sk.paged_attention(*a, causal=True, return_lse=True))
    got, lse = jitted(*(jnp.asarray(a) for a in (*f32, table, lens)))
    assert ref.rel_frobenius(np.asarray(got, dtype=np.float64), want) <= 1e-5
    assert lse.dtype == jnp.float32 and lse.shape == (3, 4, 2)
    bad = lens.copy()
    bad[2] = 99
    with pytest.raises(Exception, match=r"seqlens\[2\] = 99 exceeds"):
        jax.block_until_ready(jitted(*(jnp.asarray(a) for a in (*f32, table, bad))))


def test_check_metadata_false_skips_the_check_and_its_read(monkeypatch):
    # the caller vouches for the metadata: neither check runs (no read back, no
    # synchronization on an accelerator), and valid metadata gives the checked call's result
    import softmaxkit.paged as paged

    q, k, v, table, lens = _cache([5, 9, 0], page_size=4, lq=2)
    want = sk.paged_attention(q, k, v, table, lens, causal=True, return_lse=True)

    def checked(*args, **kwargs):
        raise AssertionError("the metadata was checked")

    monkeypatch.setattr(paged, "_valid_on_device", checked)
    monkeypatch.setattr(paged, "_check_metadata", checked)
    for backend in BACKENDS:
        got = sk.paged_attention(q, k, v, table, lens, causal=True, return_lse=True,
                                 check_metadata=False, backend=backend)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13)
    with pytest.raises(AssertionError, match="was checked"):  # the default checks
        sk.paged_attention(q, k, v, table, lens, causal=True)
    with pytest.raises(TypeError, match="check_metadata must be True or False; got 'no'"):
        sk.paged_attention(q, k, v, table, lens, check_metadata="no")


def test_unchecked_metadata_under_jit():
    # the caller who vouches for the metadata skips its check in the callback too
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v, table, lens = _cache([5, 0, 9], lq=2)
    f32 = [a.astype(np.float32) for a in (q, k, v)]
    jitted = jax.jit(lambda *a: sk.paged_attention(*a, causal=True, check_metadata=False))
    got = jitted(*(jnp.asarray(a) for a in (*f32, table, lens)))
    want = paged_definition(*(a.astype(np.float64) for a in f32), table, lens, causal=True)[0]
    assert ref.rel_frobenius(np.asarray(got, dtype=np.float64), want) <= 1e-5


@pytest.mark.parametrize("inputs, error, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_metadata_of_torch_tensors_is_the_same_named_error(inputs, error, match):
    # arrays off the host are checked where they live: the fault is still named exactly
    torch = pytest.importorskip("torch")
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in inputs]
    with sk.backend_opts(trace=True) as trace, pytest.raises(error, match=match):
        sk.paged_attention(*tensors, causal=True)
    assert trace == []


def test_the_check_where_the_metadata_lives_agrees_with_the_host_check():
    torch = pytest.importorskip("torch")
    from array_api_compat import torch as xp

    from softmaxkit.paged import _check_metadata, _valid_on_device

    rng = np.random.default_rng(3)
    verdicts = set()
    for _ in range(300):
        b, max_pages, page_size = rng.integers(0, 4), rng.integers(0, 5), rng.integers(1, 5)
        pages = int(rng.integers(0, 7))  # an empty pool too: only empty sequences fit it
        table = rng.integers(-2, pages + 2, size=(b, max_pages)).astype(
            rng.choice([np.int32, np.int64]))
        lens = rng.integers(-1, max_pages * page_size + 3, size=b).astype(np.int32)
        try:
            _check_metadata(table.astype(np.int64), lens.astype(np.int64), pages, page_size)
            valid = True
        except ValueError:
            valid = False
        on_device = _valid_on_device(xp, torch.from_numpy(table), torch.from_numpy(lens),
                                     pages, int(page_size))
        assert on_device == valid, (table, lens, pages, page_size)
        verdicts.add(valid)
    assert verdicts == {True, False}


@pytest.mark.parametrize(("causal", "window", "lq"), [
    (None, (-1, -1), 1), ("bottom_right", (-1, -1), 3), ("bottom_right", (4, -1), 6),
    (None, (2, 1), 2), ("bottom_right", (-1, -1), 12),  # more queries than some sequences' keys
])
def test_dense_operands_give_the_paged_definition(causal, window, lq):
    """softmaxkit.paged_cache's gathered cache and mask under the reference's dense attention
    equal the float64 definition, on pages poisoned with NaN wherever no sequence reads."""
    import array_api_compat.numpy as xp

    from softmaxkit.paged_cache import dense_operands
    from softmaxkit.reference.attention import attention as dense
    from softmaxkit.testing.paged_cases import make_cache, paged_definition

    rng = np.random.default_rng(lq)
    k_pages, v_pages, table, lens = make_cache(rng, [7, 0, 10, 3], 4, 2, 8, 5)
    q = rng.normal(size=(4, 6, lq, 8))
    k, v, mask = dense_operands(xp, q=q, k_pages=k_pages, v_pages=v_pages, block_table=table,
                                seqlens=lens, causal=causal, window=window)
    assert k.shape == (4, 2, table.shape[1] * 4, 8) and v.shape[-1] == 5
    assert mask.shape == (4, 6, lq, table.shape[1] * 4)
    out, lse = dense(xp, q=q, k=k, v=v, scale=8 ** -0.5, causal=None, window=(-1, -1),
                     mask=mask, softcap=None, return_lse=True)
    want, want_lse = paged_definition(q, k_pages, v_pages, table, lens,
                                      causal=causal is not None, window=window)[:2]
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)
