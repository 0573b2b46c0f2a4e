"""Attention, its gradient and the merges of partial states: the reference backend.

References: the float64 materialized definition (softmaxkit.testing.materialized), PyTorch's
scaled_dot_product_attention with explicit boolean masks, and central finite differences in
float64 for every gradient.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import softmaxkit as sk
from softmaxkit.reference import attention as ref_kernels
from softmaxkit.testing import cases
from softmaxkit.testing import materialized as ref

OPS = ("attention", "attention_vjp", "merge_attention", "merge_attention_vjp")


def _qkv(seed, q_shape, k_shape, dv=None, dtype=np.float64):
    rng = np.random.default_rng(seed)
    v_shape = k_shape[:-1] + (dv or k_shape[-1],)
    return tuple(rng.normal(size=s).astype(dtype) for s in (q_shape, k_shape, v_shape))


@pytest.mark.parametrize("target", ["numpy", "array_api_strict"])
def test_conformance_cases_pass_on_reference(target):
    results = [c for c in cases(target, ops=OPS)]
    assert results, "no attention cases registered"
    for c in results:
        if c.dtype in c.target.dtypes:
            c.run("reference")


# --- against PyTorch SDPA --------------------------------------------------------------------

torch = pytest.importorskip("torch")
F = torch.nn.functional


@pytest.mark.parametrize("lq, lk", [(7, 7), (5, 12), (12, 5)])
@pytest.mark.parametrize("hq, hk", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_matches_torch_sdpa(lq, lk, hq, hk, causal):
    q, k, v = _qkv(lq * 100 + lk, (2, hq, lq, 16), (2, hk, lk, 16), dv=8)
    rng = np.random.default_rng(1)
    mask = rng.random((2, hq, lq, lk)) < 0.7
    mask[0, 0, 1] = False  # a fully masked row: PyTorch's math path returns 0 there too
    full = mask & ref.allowed_mask(lq, lk, None if not causal else causal, None)
    expected = F.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(full),
        enable_gqa=True,
    ).numpy()
    got = sk.attention(q, k, v, mask=mask, causal=causal)
    np.testing.assert_allclose(got, expected, rtol=1e-11, atol=1e-12)
    # torch in, torch out, same dtype
    got_t = sk.attention(*(torch.from_numpy(a).float() for a in (q, k, v)),
                         mask=torch.from_numpy(mask), causal=causal)
    assert isinstance(got_t, torch.Tensor) and got_t.dtype == torch.float32
    assert ref.rel_frobenius(got_t.double().numpy(), expected) < 1e-5


@pytest.mark.parametrize("d, dv", [(16, 16), (64, 32), (128, 128), (256, 256)])
def test_windows_masks_and_head_dims_match_torch_sdpa(d, dv):
    q, k, v = _qkv(d, (2, 6, 9, d), (2, 3, 14, d), dv=dv)
    padding = np.ones((2, 1, 1, 14), dtype=bool)
    padding[1, ..., 10:] = False  # key padding for the second sequence
    window = (3, 2)
    full = padding & ref.allowed_mask(9, 14, "bottom_right", window)
    expected = F.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(full),
        enable_gqa=True,
    ).numpy()
    got = sk.attention(q, k, v, mask=padding, causal=True, window=window)
    np.testing.assert_allclose(got, expected, rtol=1e-11, atol=1e-12)


def test_top_left_is_torch_is_causal():
    q, k, v = _qkv(3, (1, 2, 4, 16), (1, 2, 9, 16))
    expected = F.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), is_causal=True).numpy()
    np.testing.assert_allclose(sk.attention(q, k, v, causal="top_left"), expected,
                               rtol=1e-11, atol=1e-12)


def test_gradients_match_torch_autograd():
    q, k, v = _qkv(4, (2, 4, 6, 16), (2, 2, 9, 16), dv=8)
    mask = np.random.default_rng(2).random((6, 9)) < 0.7
    mask[2] = False
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    full = torch.from_numpy(mask & ref.allowed_mask(6, 9, "bottom_right", None))
    tout = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=full, enable_gqa=True)
    dout = np.random.default_rng(5).normal(size=tout.shape)
    tout.backward(torch.from_numpy(dout))
    out, lse = sk.attention(q, k, v, mask=mask, causal=True, return_lse=True)
    dq, dk, dv = sk.attention_vjp(q, k, v, out, lse, dout, mask=mask, causal=True)
    for got, t in ((dq, tq), (dk, tk), (dv, tv)):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-9, atol=1e-11)


# --- semantics --------------------------------------------------------------------------------


def test_empty_rows_give_zero_out_minus_inf_lse_and_zero_gradient():
    q, k, v = _qkv(6, (1, 1, 6, 16), (1, 1, 3, 16))
    # bottom-right causal with Lq > Lk: the first Lq - Lk = 3 queries see no key
    out, lse = sk.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(out[..., :3, :] == 0) and np.all(lse[..., :3] == -np.inf)
    assert np.all(np.isfinite(lse[..., 3:]))
    dq, dk, dv = sk.attention_vjp(q, k, v, out, lse, np.ones_like(out), causal=True)
    assert np.all(dq[..., :3, :] == 0)
    e_dq, e_dk, e_dv = ref.attention_vjp(q, k, v, np.ones_like(out), causal="bottom_right")
    np.testing.assert_allclose(dk, e_dk, atol=1e-12)
    np.testing.assert_allclose(dv, e_dv, atol=1e-12)


def test_no_keys_at_all():
    q, k, v = _qkv(7, (2, 3, 16), (2, 0, 16), dv=4)
    out, lse = sk.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 3, 4) and np.all(out == 0) and np.all(lse == -np.inf)


def test_sixteen_bit_inputs_accumulate_in_float32():
    q, k, v = _qkv(8, (1, 2, 5, 32), (1, 2, 70, 32), dtype=np.float16)
    out, lse = sk.attention(q, k, v, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    e_out, e_lse = ref.attention(q, k, v)
    assert ref.rel_frobenius(out, e_out) < 1e-3
    assert np.max(np.abs(lse - e_lse)) < 1e-5  # the lse is never rounded to 16 bits


@pytest.mark.parametrize("dtype, out_tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_long_rows_stay_within_the_spec_bounds(dtype, out_tol):
    q, k, v = _qkv(23, (1, 2, 16, 128), (1, 1, 5000, 128), dtype=dtype)
    q = q * 4  # peaked rows: scores spread over tens of units
    out, lse = sk.attention(q, k, v, causal=True, window=(3000, -1), return_lse=True)
    e_out, e_lse = ref.attention(q, k, v, causal="bottom_right", window=(3000, -1))
    assert ref.rel_frobenius(out, e_out) < out_tol
    assert np.max(np.abs(lse - e_lse)) < out_tol


def test_lse_base_two_and_scale():
    q, k, v = _qkv(9, (2, 4, 16), (2, 6, 16))
    _, lse_e = sk.attention(q, k, v, scale=0.3, return_lse=True)
    _, lse_2 = sk.attention(q, k, v, scale=0.3, return_lse=True, lse_base=2)
    np.testing.assert_allclose(lse_2 * math.log(2.0), lse_e, rtol=1e-14)
    np.testing.assert_allclose(lse_e, ref.attention(q, k, v, scale=0.3)[1], rtol=1e-13)


def test_window_equals_explicit_mask():
    q, k, v = _qkv(10, (1, 2, 9, 16), (1, 2, 13, 16))
    for window in ((2, 1), (0, -1), (-1, 3)):
        explicit = ref.allowed_mask(9, 13, None, window)
        np.testing.assert_allclose(sk.attention(q, k, v, window=window),
                                   sk.attention(q, k, v, mask=explicit), atol=1e-14)


def test_causal_true_is_window_left_unbounded_right_zero():
    q, k, v = _qkv(11, (1, 1, 5, 16), (1, 1, 8, 16))
    np.testing.assert_array_equal(sk.attention(q, k, v, causal=True),
                                  sk.attention(q, k, v, window=(-1, 0)))


def test_tile_size_does_not_change_the_operator():
    q, k, v = _qkv(12, (1, 2, 7, 16), (1, 2, 50, 16))
    kw = dict(scale=0.25, causal="bottom_right", window=(20, -1), mask=None, softcap=3.0,
              return_lse=True)
    whole = ref_kernels.attention(np, q=q, k=k, v=v, block=50, **kw)
    for block in (1, 7, 16):
        tiled = ref_kernels.attention(np, q=q, k=k, v=v, block=block, **kw)
        np.testing.assert_allclose(tiled[0], whole[0], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(tiled[1], whole[1], rtol=1e-13)


def test_peak_memory_grows_with_block_not_with_keys():
    # the whole score matrix of one head would be Lq * Lk * 4 bytes = 16 MiB
    lq = lk = 2048
    q, k, v = _qkv(13, (1, 1, lq, 32), (1, 1, lk, 32), dtype=np.float32)
    tracemalloc.start()
    try:
        ref_kernels.attention(np, q=q, k=k, v=v, scale=0.2, causal=None, window=(-1, -1),
                              mask=None, softcap=None, return_lse=True, block=64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < lq * lk * 4 / 4, f"peak {peak} bytes is not O(Lq * block)"


# --- merges -----------------------------------------------------------------------------------


def _partials(q, k, v, bounds, mask=None):
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        m = None if mask is None else mask[..., lo:hi]
        o, s = sk.attention(q, k[..., lo:hi, :], v[..., lo:hi, :], mask=m, return_lse=True)
        outs.append(o)
        lses.append(s)
    return outs, lses


@st.composite
def _splits(draw):
    lk = draw(st.integers(1, 24))
    cuts = sorted(draw(st.lists(st.integers(0, lk), max_size=5)))
    bounds = [0, *cuts, lk]
    n = len(bounds) - 1
    order = draw(st.permutations(range(n)))
    how = draw(st.sampled_from(["n-ary", "sequential", "reversed", "tree"]))
    seed = draw(st.integers(0, 2**16))
    return lk, bounds, list(order), how, seed


def _tree_merge(parts, rng):
    parts = list(parts)
    while len(parts) > 1:
        i = int(rng.integers(0, len(parts) - 1))
        (oa, la), (ob, lb) = parts[i], parts[i + 1]
        parts[i:i + 2] = [sk.merge_attention(oa, la, ob, lb)]
    return parts[0]


@settings(max_examples=60, deadline=None)
@given(_splits())
def test_any_split_merged_in_any_order_matches_the_whole(split):
    lk, bounds, order, how, seed = split
    q, k, v = _qkv(seed, (2, 2, 3, 16), (2, 2, lk, 16), dv=5)
    mask = np.random.default_rng(seed).random((2, 2, 3, lk)) < 0.6
    expected = sk.attention(q, k, v, mask=mask, return_lse=True)
    outs, lses = _partials(q, k, v, bounds, mask)
    parts = [(outs[i], lses[i]) for i in order]
    if how == "n-ary":
        got = sk.merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
    elif how in ("sequential", "reversed"):
        seq = parts if how == "sequential" else parts[::-1]
        got = seq[0]
        for o, s in seq[1:]:
            got = sk.merge_attention(got[0], got[1], o, s)
    else:
        got = _tree_merge(parts, np.random.default_rng(seed))
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isinf(got[1]), np.isinf(expected[1]))
    fin = np.isfinite(expected[1])
    np.testing.assert_allclose(got[1][fin], expected[1][fin], rtol=1e-13, atol=1e-13)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from([np.float32, np.float64]))
def test_merge_with_empty_is_exactly_the_identity(seed, dtype):
    rng = np.random.default_rng(seed)
    out = rng.normal(size=(4, 3)).astype(dtype)
    lse = rng.normal(scale=10.0, size=(4,)).astype(dtype)
    junk = np.full((4, 3), np.nan, dtype=dtype)
    empty = np.full((4,), -np.inf, dtype=dtype)
    for got in (sk.merge_attention(out, lse, junk, empty),
                sk.merge_attention(junk, empty, out, lse)):
        np.testing.assert_array_equal(got[0], out)
        np.testing.assert_array_equal(got[1], lse)


def test_two_empty_states_give_zero_and_minus_inf():
    out, lse = sk.merge_attention(np.ones((2, 3)), np.full(2, -np.inf),
                                  np.ones((2, 3)), np.full(2, -np.inf))
    assert np.all(out == 0) and np.all(lse == -np.inf)
    out, lse = sk.merge_attention(np.ones((2, 3)), np.full(2, np.inf),
                                  np.ones((2, 3)), np.full(2, np.inf), empty_lse=np.inf)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_merge_states_axis_and_base_two():
    rng = np.random.default_rng(14)
    outs, lses = rng.normal(size=(2, 5, 3, 4)), rng.normal(size=(2, 5, 3))
    out0, lse0 = sk.merge_attention_states(np.moveaxis(outs, 1, 0), np.moveaxis(lses, 1, 0))
    out1, lse1 = sk.merge_attention_states(outs, lses, axis=1)
    np.testing.assert_allclose(out0, out1, rtol=1e-15)
    out2, lse2 = sk.merge_attention_states(outs, lses / math.log(2.0), axis=1, lse_base=2)
    np.testing.assert_allclose(out2, out1, rtol=1e-14)
    np.testing.assert_allclose(lse2 * math.log(2.0), lse1, rtol=1e-14)


def test_split_kv_decoding_with_torch_tensors():
    q, k, v = _qkv(15, (1, 4, 1, 32), (1, 2, 40, 32))
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    outs, lses = _partials(tq, tk, tv, (0, 13, 26, 40))
    out, lse = sk.merge_attention_states(torch.stack(outs), torch.stack(lses))
    e_out, e_lse = ref.attention(q, k, v)
    np.testing.assert_allclose(out.numpy(), e_out, rtol=1e-12)
    np.testing.assert_allclose(lse.numpy(), e_lse, rtol=1e-13)


# --- gradients against finite differences in float64 -----------------------------------------


def _fd_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        xp_, xm = x.copy(), x.copy()
        xp_[i] += eps
        xm[i] -= eps
        g[i] = (f(xp_) - f(xm)) / (2 * eps)
    return g


@pytest.mark.parametrize("kw", [
    {},
    {"causal": True},
    {"causal": "top_left", "window": (1, 1)},
    {"softcap": 2.0, "scale": 0.9},
    {"mask": np.array([[True, False, True, True, False],
                       [False, False, False, False, False],
                       [True, True, False, True, True]])},
], ids=["plain", "causal", "window", "softcap", "mask"])
def test_attention_vjp_matches_finite_differences(kw):
    q, k, v = _qkv(16, (1, 2, 3, 4), (1, 1, 5, 4), dv=3)
    dout = np.random.default_rng(17).normal(size=(1, 2, 3, 3))
    out, lse = sk.attention(q, k, v, return_lse=True, **kw)
    got = sk.attention_vjp(q, k, v, out, lse, dout, **kw)

    def loss(qq, kk, vv):
        return float(np.sum(sk.attention(qq, kk, vv, **kw) * dout))

    expected = (
        _fd_grad(lambda x: loss(x, k, v), q),
        _fd_grad(lambda x: loss(q, x, v), k),
        _fd_grad(lambda x: loss(q, k, x), v),
    )
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-8)


def test_attention_vjp_unbroadcasts_leading_dims():
    q, k, v = _qkv(18, (3, 2, 4, 8), (1, 2, 5, 8))
    dout = np.ones((3, 2, 4, 8))
    out, lse = sk.attention(q, k, v, return_lse=True)
    dq, dk, dv = sk.attention_vjp(q, k, v, out, lse, dout)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    e = ref.attention_vjp(q, np.broadcast_to(k, (3, 2, 5, 8)), np.broadcast_to(v, (3, 2, 5, 8)),
                          dout)
    np.testing.assert_allclose(dk, e[1].sum(0, keepdims=True), rtol=1e-11, atol=1e-13)


def test_the_reference_gradient_of_a_forward_s_own_out_and_lse():
    """``materialized.attention_vjp(..., out=, lse=)``: with the exact forward's out and lse it
    is the definition's gradient; with a perturbed forward's it is the backend's gradient of
    that forward (float64 arithmetic both), not the definition's; a row with no key stays 0;
    one of the two alone is refused."""
    q, k, v = _qkv(19, (1, 4, 9, 8), (1, 2, 11, 8))
    dout = np.random.default_rng(20).normal(size=(1, 4, 9, 8))
    mask = np.ones((9, 11), dtype=bool)
    mask[3] = False
    out, lse = ref.attention(q, k, v, mask=mask)
    for got, want in zip(ref.attention_vjp(q, k, v, dout, mask=mask, out=out, lse=lse),
                         ref.attention_vjp(q, k, v, dout, mask=mask), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    rng = np.random.default_rng(21)
    out2 = out * (1 + 1e-3 * rng.normal(size=out.shape))
    lse2 = lse + 1e-3 * rng.normal(size=lse.shape)
    own = ref.attention_vjp(q, k, v, dout, mask=mask, out=out2, lse=lse2)
    backend = sk.attention_vjp(q, k, v, out2, lse2, dout, mask=mask, backend="reference")
    definition = ref.attention_vjp(q, k, v, dout, mask=mask)
    for got, o, d in zip(backend, own, definition, strict=True):
        np.testing.assert_allclose(got, o, rtol=1e-11, atol=1e-13)
        assert np.abs(got - d).max() > 1e-5
    assert not own[0][:, :, 3].any()
    with pytest.raises(ValueError, match="out and lse"):
        ref.attention_vjp(q, k, v, dout, mask=mask, out=out)


@pytest.mark.parametrize("base", ["e", 2])
def test_merge_attention_vjp_matches_finite_differences(base):
    rng = np.random.default_rng(19)
    outs = rng.normal(size=(3, 4, 2))
    lses = rng.normal(scale=2.0, size=(3, 4))
    lses[0, 1] = -np.inf
    dout, dlse = rng.normal(size=(4, 2)), rng.normal(size=(4,))

    def loss(o, s):
        out, lse = sk.merge_attention_states(o, s, lse_base=base)
        return float(np.sum(out * dout) + np.sum(np.where(np.isinf(lse), 0.0, lse) * dlse))

    douts, dlses = sk.merge_attention_vjp(outs, lses, dout, dlse, lse_base=base)
    finite = np.isfinite(lses)
    e_outs = _fd_grad(lambda o: loss(o, lses), outs)
    np.testing.assert_allclose(douts, e_outs, rtol=1e-7, atol=1e-9)

    def loss_finite(s_fin):
        s = lses.copy()
        s[finite] = s_fin
        return loss(outs, s)

    e_lses = _fd_grad(loss_finite, lses[finite].copy())
    np.testing.assert_allclose(dlses[finite], e_lses, rtol=1e-7, atol=1e-9)
    assert np.all(dlses[~finite] == 0) and np.all(douts[0, 1] == 0)


# --- arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, error, words", [
    ({"causal": "diagonal"}, ValueError, "causal"),
    ({"window": (2,)}, TypeError, "window"),
    ({"window": (-2, 0)}, ValueError, "window"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"lse_base": 10}, ValueError, "lse_base"),
    ({"mask": np.ones((3, 5), dtype=np.int8)}, TypeError, "mask"),
    ({"mask": np.ones((4, 5), dtype=bool)}, ValueError, "mask"),
])
def test_bad_arguments_name_themselves(kw, error, words):
    q, k, v = _qkv(20, (2, 3, 8), (2, 5, 8))
    with pytest.raises(error, match=words):
        sk.attention(q, k, v, **kw)


def test_bad_shapes():
    q, k, v = _qkv(21, (3, 4, 8), (2, 5, 8))
    with pytest.raises(ValueError, match="multiple"):
        sk.attention(q, k, v)
    q, k, v = _qkv(21, (2, 4, 8), (2, 5, 6))
    with pytest.raises(ValueError, match="head dim"):
        sk.attention(q, k, v)
    with pytest.raises(ValueError, match="shape"):
        sk.merge_attention(np.ones((2, 3)), np.ones(3), np.ones((2, 3)), np.ones(2))
    with pytest.raises(ValueError, match="empty_lse"):
        sk.merge_attention_states(np.ones((2, 3)), np.ones(2), empty_lse=0.0)


def test_inputs_are_not_modified():
    q, k, v = _qkv(22, (2, 3, 8), (2, 5, 8))
    copies = [a.copy() for a in (q, k, v)]
    out, lse = sk.attention(q, k, v, causal=True, return_lse=True)
    sk.attention_vjp(q, k, v, out, lse, np.ones_like(out), causal=True)
    for a, c in zip((q, k, v), copies, strict=True):
        np.testing.assert_array_equal(a, c)
