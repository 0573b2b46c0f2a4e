"""The Hopper attention backward (kernels/attention_bwd_sm90.cu) on a device of compute
capability 9.0, through ``sk.attention_vjp``, against float64 autograd (skipped without such a
device).

Each call's trace names the backward's main kernel: the sm_90a kernel at the head dimensions
it is built for, the mma.sync kernel at the others.
"""

from __future__ import annotations

import math

import pytest
from softmaxkit_cupy.configs import SM90_BACKWARD_ALTERNATIVES, SM90_BACKWARD_CONFIGS

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", autouse=True)
def _hopper() -> None:
    import cupy
    from softmaxkit_cupy.configs import SM90_CAPABILITY

    if int(cupy.cuda.Device().compute_capability) != SM90_CAPABILITY:
        pytest.skip("needs a device of compute capability 9.0")


def _reference(q, k, v, dout, scale, causal, window, softcap, mask):
    """(dq, dk, dv) in float64 by autograd from the 16-bit inputs (spec "Attention"); a row
    with no allowed key has output 0 and no gradient."""
    hq, lq, lk = q.shape[1], q.shape[2], k.shape[2]
    group = hq // k.shape[1]
    qd, kd, vd = (a.double().requires_grad_() for a in (q, k, v))
    s = qd @ kd.repeat_interleave(group, dim=1).transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    offset = 0 if causal == "top_left" else lk - lq
    rel = (torch.arange(lk, device=q.device)[None, :]
           - torch.arange(lq, device=q.device)[:, None] - offset)
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:
        allowed &= rel <= 0
    if right >= 0:
        allowed &= rel <= right
    if left >= 0:
        allowed &= rel >= -left
    if mask is not None:
        allowed = allowed & mask
    allowed = allowed.expand(s.shape)
    # excluded scores far below any allowed one (exp gives exactly 0), so that a row with no
    # allowed key stays finite; its probabilities are then zeroed
    p = torch.softmax(s.masked_fill(~allowed, -1e300), -1) * allowed.any(-1, keepdim=True)
    out = p @ vd.repeat_interleave(group, dim=1)
    out.backward(dout.double())
    return qd.grad, kd.grad, vd.grad


CASES = [
    dict(b=2, hq=4, hk=4, lq=512, lk=512),
    dict(b=1, hq=8, hk=2, lq=300, lk=1100, causal="bottom_right"),
    dict(b=1, hq=8, hk=2, lq=1100, lk=300, causal="bottom_right"),  # rows with no key
    dict(b=1, hq=4, hk=1, lq=700, lk=450, causal="top_left"),
    dict(b=1, hq=2, hk=2, lq=177, lk=250),
    dict(b=1, hq=2, hk=2, lq=77, lk=5),
    dict(b=1, hq=4, hk=2, lq=900, lk=1300, window=(200, 50)),
    dict(b=1, hq=4, hk=2, lq=900, lk=900, causal="bottom_right", window=(300, -1),
         softcap=20.0),
    dict(b=1, hq=4, hk=2, lq=500, lk=700, causal="bottom_right", mask=True),
    dict(b=1, hq=2, hk=2, lq=300, lk=300, mask=True),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", sorted(SM90_BACKWARD_CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_hopper_backward_matches_float64(dtype: str, d: int, case: dict) -> None:
    from softmaxkit_cupy.configs import sm90_backward_config

    import softmaxkit as sk

    q, k, v, dout, mask = _problem(dtype, d, case, d + case["lq"])
    causal = case.get("causal", False)
    window = case.get("window", (-1, -1))
    softcap = case.get("softcap")
    scale = d ** -0.5
    out, lse = sk.attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                            softcap=softcap, return_lse=True)
    with sk.backend_opts(trace=True) as trace:
        grads = sk.attention_vjp(q, k, v, out, lse, dout, scale=scale, causal=causal,
                                 window=window, mask=mask, softcap=softcap)
    torch.cuda.synchronize()
    hopper = sm90_backward_config(d, mask is not None)
    expected = hopper.name(dtype) if hopper is not None else "sk_attn_bwd<"
    assert trace[-1].backend == "cupy" and trace[-1].kernel.startswith(expected)

    _check(grads, _reference(q, k, v, dout, scale, causal, window, softcap, mask), dtype)


def _problem(dtype: str, d: int, case: dict, seed: int):
    """q, k, v, dout and the mask (or None) of ``case`` at head dim ``d``, fresh normal values
    rounded to ``dtype``; a masked case has a row with no allowed key."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    b, hq, hk, lq, lk = (case[n] for n in ("b", "hq", "hk", "lq", "lk"))

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(dt)

    q, k, v = randn(b, hq, lq, d), randn(b, hk, lk, d), randn(b, hk, lk, d)
    dout = randn(b, hq, lq, d)
    mask = None
    if case.get("mask"):
        mask = torch.rand(b, hq, lq, lk, device="cuda", generator=gen) > 0.3
        mask[:, :, 5, :] = False  # a row with no allowed key
    return q, k, v, dout, mask


def _check(grads, refs, dtype: str) -> None:
    """Each gradient in ``dtype``, NaN-free, within the dtype's relative error of float64."""
    tol = 2e-2 if dtype == "bfloat16" else 5e-3
    for got, ref in zip(grads, refs, strict=True):
        assert got.dtype == getattr(torch, dtype) and not got.isnan().any()
        err = float((got.double() - ref).norm()) / max(float(ref.norm()), 1e-30)
        assert err < tol, err


def test_hopper_backward_through_torch_autograd() -> None:
    """``sk.attention``'s autograd (which calls ``attention_vjp``) matches float64."""
    import softmaxkit as sk

    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, dout = (torch.randn(2, 4, 333, 128, device="cuda", generator=gen)
                     .to(torch.bfloat16) for _ in range(4))
    q, k, v = (a.requires_grad_() for a in (q, k, v))
    out = sk.attention(q, k, v, causal=True)
    out.backward(dout)
    torch.cuda.synchronize()
    refs = _reference(q.detach(), k.detach(), v.detach(), dout, 128 ** -0.5, "bottom_right",
                      (-1, -1), None, None)
    for got, ref in zip((q.grad, k.grad, v.grad), refs, strict=True):
        assert float((got.double() - ref).norm()) / float(ref.norm()) < 2e-2
    assert math.isfinite(float(q.grad.float().sum()))


VARLEN = [
    # (query lengths, key lengths, options): ragged tiles, a sequence without queries and one
    # without keys, both causal alignments, a window with softcap
    ((70, 0, 300, 1, 129), (130, 9, 64, 0, 700), {}),
    ((70, 0, 300, 1, 129), (130, 9, 64, 0, 700), {"causal": "bottom_right"}),
    ((300, 5, 257), (300, 40, 200), {"causal": "top_left"}),
    ((400, 64), (900, 64), {"window": (100, 20), "softcap": 8.0}),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", sorted(SM90_BACKWARD_CONFIGS))
@pytest.mark.parametrize(("lens_q", "lens_k", "kw"), VARLEN, ids=str)
def test_hopper_varlen_backward_matches_float64(dtype, d, lens_q, lens_k, kw) -> None:
    """The packed variable-length backward through ``sk.varlen_attention_vjp`` runs its main
    kernel on the Hopper kernel (``SM90_VARLEN_BACKWARD_CONFIGS``, named in the trace), from
    the float64 definition's (out, lse), against the float64 gradients of each sequence; the
    keys of a sequence without queries get zeros."""
    from softmaxkit_cupy.configs import SM90_VARLEN_BACKWARD_CONFIGS

    import softmaxkit as sk

    def vjp(q, k, v, out, lse, dout, cu_q, cu_k, rkw):
        with sk.backend_opts(trace=True) as trace:
            grads = sk.varlen_attention_vjp(q, k, v, out, lse, dout, cu_q, cu_k,
                                            **dict(rkw, causal=rkw["causal"] or False))
        expected = SM90_VARLEN_BACKWARD_CONFIGS[d].varlen_name(dtype)
        assert trace[-1].backend == "cupy" and trace[-1].kernel == expected
        return grads

    _varlen_against_float64(dtype, d, lens_q, lens_k, kw, d + 1, vjp)


def _varlen_against_float64(dtype, d, lens_q, lens_k, kw, seed, vjp) -> None:
    """``vjp(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, options)`` of packed
    sequences of ``lens_q`` and ``lens_k`` (grouped queries, Hq 4, Hk 2) at head dim ``d``,
    from the float64 definition's (out, lse), against the float64 gradients of each sequence;
    the keys of a sequence without queries get zeros."""
    import numpy as np

    from softmaxkit.testing.varlen_cases import (
        packed_arrays,
        packed_reference,
        packed_vjp_reference,
    )

    hq, hk = 4, 2
    q, k, v, cu_q, cu_k = packed_arrays(seed, lens_q, lens_k, hq, hk, d, d)
    dt = getattr(torch, dtype)
    tq, tk, tv = (torch.as_tensor(a, device="cuda").to(dt) for a in (q, k, v))
    q64, k64, v64 = (a.double().cpu().numpy() for a in (tq, tk, tv))
    dout = torch.as_tensor(np.random.default_rng(seed - 1).normal(size=(q.shape[0], hq, d)),
                           device="cuda").to(dt)
    rkw = {"scale": d ** -0.5, "window": kw.get("window", (-1, -1)),
           "softcap": kw.get("softcap"), "causal": kw.get("causal")}
    out64, lse64 = packed_reference(q64, k64, v64, cu_q, cu_k, **rkw)
    grads = vjp(tq, tk, tv, torch.as_tensor(out64, device="cuda").to(dt),
                torch.as_tensor(lse64, device="cuda").float(), dout,
                torch.as_tensor(cu_q, device="cuda"), torch.as_tensor(cu_k, device="cuda"), rkw)
    torch.cuda.synchronize()
    want = packed_vjp_reference(q64, k64, v64, dout.double().cpu().numpy(), cu_q, cu_k, **rkw)
    _check(grads, [torch.as_tensor(w, device="cuda") for w in want], dtype)
    for b in range(len(lens_q)):
        if lens_q[b] == 0:  # the keys of a sequence without queries
            k0, k1 = int(cu_k[b]), int(cu_k[b + 1])
            assert not grads[1][k0:k1].any() and not grads[2][k0:k1].any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("config", SM90_BACKWARD_ALTERNATIVES,
                         ids=lambda c: f"{c.head_dim}-{c.warpgroups}wg")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_hopper_backward_alternatives_match_float64(dtype: str, config, case: dict) -> None:
    """Each Hopper backward tile built on request only (``configs.SM90_BACKWARD_ALTERNATIVES``;
    with a boolean mask, its masked build), through the adapter's ``config=``, against float64
    gradients, its results written over memory that held NaN."""
    import dataclasses

    import array_api_compat.torch as xp
    from softmaxkit_cupy.attention import attention_vjp

    import softmaxkit as sk

    d = config.head_dim
    q, k, v, dout, mask = _problem(dtype, d, case, d + case["lq"] + 1)
    config = dataclasses.replace(config, mask=mask is not None)
    causal = case.get("causal") or None
    window = case.get("window", (-1, -1))
    softcap, scale = case.get("softcap"), d ** -0.5
    out, lse = sk.attention(q, k, v, scale=scale, causal=causal or False, window=window,
                            mask=mask, softcap=softcap, return_lse=True)
    poison = [a.new_full(a.shape, math.nan) for a in (q, k, v)]
    del poison  # the caching allocator hands these blocks to the gradients
    grads = attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, scale=scale,
                          causal=causal, window=window, mask=mask, softcap=softcap,
                          config=config)
    torch.cuda.synchronize()
    _check(grads, _reference(q, k, v, dout, scale, causal or False, window, softcap, mask),
           dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("config", SM90_BACKWARD_ALTERNATIVES,
                         ids=lambda c: f"{c.head_dim}-{c.warpgroups}wg")
@pytest.mark.parametrize(("lens_q", "lens_k", "kw"), VARLEN, ids=str)
def test_hopper_varlen_backward_alternatives_match_float64(dtype, config, lens_q, lens_k,
                                                           kw) -> None:
    """Each Hopper backward tile built on request only, packed (``varlen_attention_vjp`` of
    the adapter with ``config=``), against the float64 gradients of each sequence, its results
    written over memory that held NaN; the keys of a sequence without queries get zeros."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy.varlen import varlen_attention_vjp

    def vjp(q, k, v, out, lse, dout, cu_q, cu_k, rkw):
        poison = [a.new_full(a.shape, math.nan) for a in (q, k, v)]
        del poison  # the caching allocator hands these blocks to the gradients
        return varlen_attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout,
                                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, config=config, **rkw)

    _varlen_against_float64(dtype, config.head_dim, lens_q, lens_k, kw, config.head_dim + 3,
                            vjp)
