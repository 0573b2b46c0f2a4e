"""Packed variable-length attention on numba-cuda (``softmaxkit_numba_cuda/varlen.py``): the
unpacking into padded batches, their masks and the packing back, on the host; the whole path
on a CUDA device (skipped without one).

The host tests put the reference backend's dense attention in place of the kernels, which
cannot run here (the simulator runs them in ``test_cuda_simulator.py``; the kit's varlen
cases run them on a GPU: ``softmaxkit verify --backend numba-cuda --target torch-cuda``): it
takes the same padded operands and mask, so what is checked is the adapter's gather, mask and
packing, against the reference's varlen attention in float64.
"""

from __future__ import annotations

import array_api_compat.numpy as xp
import numpy as np
import pytest
from softmaxkit_numba_cuda import varlen

from softmaxkit.reference import varlen as reference
from softmaxkit.reference.attention import attention as dense
from softmaxkit.reference.attention import attention_vjp as dense_vjp
from softmaxkit.testing.varlen_cases import packed_arrays

LENGTHS = ((2, 0, 4, 1, 3, 5), (0, 3, 6, 5, 2, 5))
"""Query and key lengths: sequence 0 has queries and no keys, sequence 1 keys and no queries
(the poisoned sequences: they stay out of the padded batch, whose padding slots read token
0, which is theirs); sequences 2 to 5 put their queries on their keys ``Lk - Lq`` = 2, 4,
-1 (more queries than keys) and 0, none of them equal to ``Lk_max - Lq_max`` = 1, so an
alignment to the padded lengths shows."""
BATCH = ((4, 1, 3, 5), (6, 5, 2, 5))
"""The lengths of the sequences in the padded batch: those with queries and keys."""

SETTINGS = {
    "plain": ((4, 2), {}, "int64"),
    "causal": ((4, 2), {"causal": "bottom_right"}, "int32"),
    "causal-top-left": ((4, 2), {"causal": "top_left"}, "int64"),
    "window": ((3, 1), {"window": (2, 1)}, "int64"),
    "causal-window": ((4, 2), {"causal": "bottom_right", "window": (1, -1)}, "int32"),
    "top-left-window": ((2, 2), {"causal": "top_left", "window": (2, 2)}, "int64"),
    "softcap": ((4, 2), {"causal": "bottom_right", "softcap": 2.0, "scale": 1.0}, "int64"),
}
"""(Hq, Hk), options and the cumulative lengths' dtype of each host check."""


@pytest.fixture
def dense_calls(monkeypatch):
    """The adapter's dense calls, each one's arguments recorded, run by the reference."""
    calls: list[dict] = []

    def forward(**kw):
        calls.append(kw)
        return dense(**kw)

    def backward(**kw):
        calls.append(kw)
        return dense_vjp(**kw)

    monkeypatch.setattr(varlen, "attention", forward)
    monkeypatch.setattr(varlen, "attention_vjp", backward)
    return calls


def _arguments(name: str, poisoned: bool = False) -> dict:
    """The adapter's arguments for :data:`SETTINGS` ``[name]`` on float64 operands of
    :data:`LENGTHS`, and an upstream gradient ``dout``.  ``poisoned``: NaN in every value no
    result may read: the queries and ``dout`` of sequence 0 (no keys), the keys and values of
    sequence 1 (no queries)."""
    heads, kw, index = SETTINGS[name]
    q, k, v, cu_q, cu_k = packed_arrays(3, *LENGTHS, *heads, 8, 6, index_dtype=index)
    dout = np.random.default_rng(5).normal(size=(q.shape[0], q.shape[1], v.shape[2]))
    if poisoned:
        for a, cu in ((q, cu_q), (dout, cu_q)):
            a[cu[0]:cu[1]] = np.nan
        for a in (k, v):
            a[cu_k[1]:cu_k[2]] = np.nan
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "scale": q.shape[-1] ** -0.5, "causal": None, "window": (-1, -1), "softcap": None}
    return args | kw | {"dout": dout}


def _check_padding(call: dict) -> None:
    """The padded operands hold 0 past each sequence's length (lse -inf), and the mask
    allows no padding row and no padding key."""
    lq, lk = BATCH
    rows = np.arange(max(lq))[None, :] >= np.array(lq)[:, None]  # [B, Lq_max] padding
    keys = np.arange(max(lk))[None, :] >= np.array(lk)[:, None]
    for name in ("q", "out", "dout"):
        if name in call:
            assert np.all(call[name].transpose(0, 2, 1, 3)[rows] == 0), name
    for name in ("k", "v"):
        assert np.all(call[name].transpose(0, 2, 1, 3)[keys] == 0), name
    if "lse" in call:
        assert np.all(call["lse"].transpose(0, 2, 1)[rows] == -np.inf)
    mask = call["mask"]
    assert mask.shape[:2] == (len(lq), call["q"].shape[1])
    assert not mask.transpose(0, 2, 1, 3)[rows].any()
    assert not mask.transpose(0, 3, 1, 2)[keys].any()
    if call["causal"] != "top_left":  # Lk - Lq differs between the sequences: mask only
        assert call["causal"] is None and call["window"] == (-1, -1)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_adapter_matches_the_reference_varlen(dense_calls, name):
    """Forward and gradient through the padded batch and its mask equal the reference's
    per-sequence attention, and no NaN of the poisoned sequences reaches any result."""
    args = _arguments(name, poisoned=True)
    dout = args.pop("dout")
    out, lse = varlen.varlen_attention(xp=xp, return_lse=True, **args)
    want_out, want_lse = reference.varlen_attention(xp, return_lse=True, **args)
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)
    tq0, tk1 = LENGTHS[0][0], slice(LENGTHS[1][0], sum(LENGTHS[1][:2]))
    assert np.all(out[:tq0] == 0) and np.all(lse[:tq0] == -np.inf)  # no keys
    plain, none = varlen.varlen_attention(xp=xp, return_lse=False, **args)
    assert none is None
    np.testing.assert_array_equal(plain, out)

    grads = varlen.varlen_attention_vjp(xp=xp, out=want_out, lse=want_lse, dout=dout, **args)
    wants = reference.varlen_attention_vjp(xp, out=want_out, lse=want_lse, dout=dout, **args)
    for what, got, want in zip(("dq", "dk", "dv"), grads, wants, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, what
        assert np.isfinite(got).all(), f"{what}: NaN of a poisoned sequence leaked"
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13, err_msg=what)
    assert np.all(grads[0][:tq0] == 0)  # rows without keys
    assert np.all(grads[1][tk1] == 0) and np.all(grads[2][tk1] == 0)  # keys without rows
    assert len(dense_calls) == 3  # two forwards, one gradient: one batch
    for call in dense_calls:
        _check_padding(call)


BATCHINGS = {
    # (lengths, dense calls, whether each call has a mask and the band passed to the kernel)
    "ranges": (((70, 0, 5, 130, 64, 3), (65, 4, 0, 140, 64, 9)),
               [(True, False), (False, True), (False, True)]),
    "self-attention": (((40, 7, 64, 0, 100, 90), (40, 7, 64, 0, 100, 90)),
                       [(True, True), (True, True)]),
    "shifted": (((5, 20, 33), (8, 23, 36)), [(True, True)]),
    "equal": (((16, 16, 0, 16), (20, 20, 3, 20)), [(False, True)]),
    "equal-queries": (((8, 8, 8), (3, 10, 6)), [(True, False)]),
    "equal-keys": (((3, 10, 6), (8, 8, 8)), [(True, False)]),
}
"""Lengths that put the sequences in several batches (the ranges up to 64, 65 to 128 and 129
to 256: one with Lk - Lq of 0 and 6, two of one sequence), share one Lk - Lq in every batch
(0 in self-attention, or 3), are all equal, or equal on one side only; and how the adapter
then calls the kernel."""


@pytest.mark.parametrize("kw", [{"causal": "bottom_right"}, {"causal": "top_left"},
                                {"window": (3, 2)}, {"causal": "bottom_right", "window": (9, 0),
                                                     "softcap": 3.0}],
                         ids=["causal", "top-left", "window", "causal-window-softcap"])
@pytest.mark.parametrize("name", sorted(BATCHINGS))
def test_batches_by_length_and_shared_bands(dense_calls, name, kw):
    """The sequences are batched by the range of their lengths; a batch whose sequences
    share their band passes it to the kernel, one of equal lengths needs no mask; forward and
    gradient still equal the reference's varlen."""
    (lens_q, lens_k), expected = BATCHINGS[name]
    q, k, v, cu_q, cu_k = packed_arrays(7, lens_q, lens_k, 4, 2, 8, 6)
    dout = np.random.default_rng(8).normal(size=(q.shape[0], 4, 6))
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "scale": 0.4,
            "causal": None, "window": (-1, -1), "softcap": None} | kw
    out, lse = varlen.varlen_attention(xp=xp, return_lse=True, **args)
    want_out, want_lse = reference.varlen_attention(xp, return_lse=True, **args)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)
    grads = varlen.varlen_attention_vjp(xp=xp, out=want_out, lse=want_lse, dout=dout, **args)
    wants = reference.varlen_attention_vjp(xp, out=want_out, lse=want_lse, dout=dout, **args)
    for what, got, want in zip(("dq", "dk", "dv"), grads, wants, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13, err_msg=what)
    calls = dense_calls[:len(expected)]
    assert len(dense_calls) == 2 * len(expected)  # the forward's calls, then the gradient's
    shared = [(c["mask"] is not None, c["causal"] == args["causal"]
               and c["window"] == args["window"]) for c in calls]
    if args["causal"] == "top_left":  # every top-left band is shared
        expected = [(masked, True) for masked, _ in expected]
    assert shared == expected


def test_int32_and_int64_lengths_give_the_same_result(dense_calls):
    args = _arguments("causal-window")
    del args["dout"]
    wide = dict(args, cu_seqlens_q=args["cu_seqlens_q"].astype(np.int64),
                cu_seqlens_k=args["cu_seqlens_k"].astype(np.int64))
    assert args["cu_seqlens_q"].dtype == np.int32
    for a, b in zip(varlen.varlen_attention(xp=xp, return_lse=True, **args),
                    varlen.varlen_attention(xp=xp, return_lse=True, **wide), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("lens_q", "lens_k"), [
    ((), ()),  # B = 0
    ((0, 0), (2, 3)),  # Tq = 0
    ((1, 2), (0, 0)),  # Tk = 0
    ((2, 0, 1), (0, 3, 0)),  # no sequence with both queries and keys
])
def test_calls_where_no_row_sees_a_key_launch_nothing(monkeypatch, lens_q, lens_k):
    def launched(**kw):
        raise AssertionError("a dense kernel ran for a call with no query row or no key")

    monkeypatch.setattr(varlen, "attention", launched)
    monkeypatch.setattr(varlen, "attention_vjp", launched)
    q, k, v, cu_q, cu_k = packed_arrays(0, lens_q, lens_k, 4, 2, 8, 6, dtype=np.float32)
    tq = q.shape[0]
    kw = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "scale": 0.5,
          "causal": "bottom_right", "window": (-1, -1), "softcap": None}
    out, lse = varlen.varlen_attention(xp=xp, return_lse=True, **kw)
    assert out.shape == (tq, 4, 6) and out.dtype == np.float32 and np.all(out == 0)
    assert lse.shape == (tq, 4) and lse.dtype == np.float32 and np.all(lse == -np.inf)
    assert varlen.varlen_attention(xp=xp, return_lse=False, **kw)[1] is None
    grads = varlen.varlen_attention_vjp(xp=xp, out=out, lse=lse, dout=np.ones_like(out), **kw)
    for g, a in zip(grads, (q, k, v), strict=True):
        assert g.shape == a.shape and g.dtype == a.dtype and np.all(g == 0)


def _gpu() -> bool:
    from softmaxkit_numba_cuda.primitives import SIMULATOR, cuda

    return not SIMULATOR and cuda.is_available()


@pytest.mark.skipif("not _gpu()")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_varlen_on_the_gpu_matches_the_reference(name, dtype):
    """``sk.varlen_attention`` and its gradient on torch CUDA tensors on numba-cuda (asked
    for: the registry puts cupy's exact packed kernels first in float32), against the float64
    reference on the host, on the poisoned operands: the kernels skip excluded keys, so no NaN
    reaches any result."""
    torch = pytest.importorskip("torch")
    import softmaxkit as sk

    args = _arguments(name, poisoned=True)
    dout = args.pop("dout")
    opts = {"scale": args["scale"], "softcap": args["softcap"],
            "causal": args["causal"] or False,
            "window": None if args["window"] == (-1, -1) else args["window"],
            "backend": "numba-cuda"}
    want_out, want_lse = reference.varlen_attention(xp, return_lse=True, **args)
    wants = reference.varlen_attention_vjp(xp, out=want_out, lse=want_lse, dout=dout, **args)

    def cuda(a):
        t = torch.asarray(a, device="cuda")
        return t.to(getattr(torch, dtype)) if t.is_floating_point() else t

    q, k, v, cu_q, cu_k = (cuda(args[key]) for key in ("q", "k", "v", "cu_seqlens_q",
                                                         "cu_seqlens_k"))
    with sk.backend_opts(trace=True) as trace:
        out, lse = sk.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **opts)
        grads = sk.varlen_attention_vjp(q, k, v, cuda(want_out), cuda(want_lse), cuda(dout),
                                        cu_q, cu_k, **opts)
    assert [(r.op, r.backend) for r in trace] == [("varlen_attention", "numba-cuda"),
                                                  ("varlen_attention_vjp", "numba-cuda")]
    # spec "Attention", Tolerances: out and lse, then each gradient
    bound, grad_bound = {"float32": (1e-5, 1e-4), "float64": (1e-12, 1e-10)}[dtype]

    def close(what, got, want, bound):
        got = got.double().cpu().numpy()
        assert np.isfinite(got).all(), f"{what}: NaN of a poisoned sequence leaked"
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= bound, f"{what}: relative Frobenius error {err:.3g} > {bound}"

    close("out", out, want_out, bound)
    lse_h = lse.double().cpu().numpy()
    empty = want_lse == -np.inf
    assert np.array_equal(lse_h == -np.inf, empty), "rows with no allowed key differ"
    np.testing.assert_allclose(lse_h[~empty], want_lse[~empty], rtol=0, atol=bound)
    for what, got, want in zip(("dq", "dk", "dv"), grads, wants, strict=True):
        close(what, got, want, grad_bound)
    # the sequence without keys and the keys without queries: exactly 0
    tq0, tk1 = LENGTHS[0][0], slice(LENGTHS[1][0], sum(LENGTHS[1][:2]))
    assert not out[:tq0].any() and not grads[0][:tq0].any()
    assert not grads[1][tk1].any() and not grads[2][tk1].any()
