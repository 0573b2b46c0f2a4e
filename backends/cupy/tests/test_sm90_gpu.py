"""The Hopper attention forward (kernels/attention_sm90.cu) on a device of compute capability
9.0, through the default dispatch, against float64 (skipped without such a device).

Each call's trace names the kernel that ran: the sm_90a kernel wherever it is built, the
mma.sync kernel for the calls it is not built for (a boolean mask at head dimension 256).
"""

from __future__ import annotations

import math

import pytest
from softmaxkit_cupy.configs import SM90_ALTERNATIVES, SM90_CONFIGS

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", autouse=True)
def _hopper() -> None:
    import cupy
    from softmaxkit_cupy.configs import SM90_CAPABILITY

    if int(cupy.cuda.Device().compute_capability) != SM90_CAPABILITY:
        pytest.skip("needs a device of compute capability 9.0")


def _reference(q, k, v, scale, causal, window, softcap, mask):
    """out and lse in float64 from the 16-bit inputs (spec "Attention")."""
    hq, lq, lk = q.shape[1], q.shape[2], k.shape[2]
    group = hq // k.shape[1]
    kd = k.double().repeat_interleave(group, dim=1)
    vd = v.double().repeat_interleave(group, dim=1)
    s = q.double() @ kd.transpose(-1, -2) * scale
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
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]).nan_to_num(0.0) @ vd, lse


CASES = [
    dict(b=2, hq=4, hk=4, lq=1000, lk=1000),
    dict(b=2, hq=4, hk=4, lq=1000, lk=1000, causal="bottom_right"),
    dict(b=1, hq=8, hk=2, lq=300, lk=1100, causal="bottom_right"),
    dict(b=1, hq=8, hk=2, lq=1100, lk=300, causal="bottom_right"),  # rows with no key
    dict(b=1, hq=4, hk=1, lq=700, lk=450, causal="top_left"),
    dict(b=1, hq=2, hk=2, lq=77, lk=5),
    dict(b=1, hq=4, hk=2, lq=900, lk=1300, window=(200, 50)),
    dict(b=1, hq=4, hk=2, lq=900, lk=900, causal="bottom_right", window=(300, -1),
         softcap=20.0),
    dict(b=1, hq=4, hk=2, lq=500, lk=700, causal="bottom_right", mask=True),
    dict(b=1, hq=2, hk=2, lq=300, lk=300, mask=True),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", sorted(SM90_CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_hopper_forward_matches_float64(dtype: str, d: int, case: dict) -> None:
    from softmaxkit_cupy.configs import sm90_config

    import softmaxkit as sk

    gen = torch.Generator(device="cuda").manual_seed(d + case["lq"])
    dt = getattr(torch, dtype)
    b, hq, hk, lq, lk = (case[n] for n in ("b", "hq", "hk", "lq", "lk"))

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(dt)

    q, k, v = randn(b, hq, lq, d), randn(b, hk, lk, d), randn(b, hk, lk, d)
    mask = None
    if case.get("mask"):
        mask = torch.rand(b, hq, lq, lk, device="cuda", generator=gen) > 0.3
        mask[:, :, 5, :] = False  # a row with no allowed key
    causal = case.get("causal", False)
    window = case.get("window", (-1, -1))
    softcap = case.get("softcap")
    scale = d ** -0.5
    with sk.backend_opts(trace=True) as trace:
        out, lse = sk.attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                                softcap=softcap, return_lse=True)
    torch.cuda.synchronize()
    hopper = sm90_config(d, mask is not None)
    expected = hopper.name(dtype) if hopper is not None else "sk_attn_fwd<"
    assert trace[-1].backend == "cupy" and trace[-1].kernel.startswith(expected)

    ref, ref_lse = _reference(q, k, v, scale, causal, window, softcap, mask)
    assert not out.isnan().any() and not lse.isnan().any()
    empty = ~torch.isfinite(ref_lse)
    assert bool((lse[empty] == -math.inf).all()) and bool((out[empty] == 0).all())
    err = float((out.double() - ref).abs().max()) / float(ref.abs().max())
    assert err < (1e-2 if dtype == "bfloat16" else 2e-3), err
    if (~empty).any():
        assert float((lse[~empty].double() - ref_lse[~empty]).abs().max()) < 1e-3


VARLEN = [
    # (query lengths, key lengths, options): ragged tiles, a sequence without queries and one
    # without keys, both causal alignments, a window with softcap
    ((70, 0, 300, 1, 129), (130, 9, 64, 0, 700), {}),
    ((70, 0, 300, 1, 129), (130, 9, 64, 0, 700), {"causal": "bottom_right"}),
    ((300, 5, 257), (300, 40, 200), {"causal": "top_left"}),
    ((400, 64), (900, 64), {"window": (100, 20), "softcap": 8.0}),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", sorted(SM90_CONFIGS))
@pytest.mark.parametrize(("lens_q", "lens_k", "kw"), VARLEN, ids=str)
def test_hopper_varlen_forward_matches_float64(dtype, d, lens_q, lens_k, kw) -> None:
    """The packed variable-length forward through ``sk.varlen_attention`` runs on the Hopper
    kernel (named in the trace) and matches the float64 definition on each sequence; on
    memory that held NaN just before (buffers of out's and lse's sizes released to torch's
    caching allocator, which hands them back to the launch)."""
    import numpy as np
    from softmaxkit_cupy.configs import SM90_CONFIGS

    import softmaxkit as sk
    from softmaxkit.testing.varlen_cases import packed_arrays, packed_reference

    hq, hk = 4, 2
    q, k, v, cu_q, cu_k = packed_arrays(d, lens_q, lens_k, hq, hk, d, d)
    dt = getattr(torch, dtype)
    tq, tk, tv = (torch.as_tensor(a, device="cuda").to(dt) for a in (q, k, v))
    mq, mk = (torch.as_tensor(a, device="cuda") for a in (cu_q, cu_k))
    causal = kw.get("causal")
    window = kw.get("window", (-1, -1))
    softcap = kw.get("softcap")
    poison = [torch.full((q.shape[0], hq, d), math.nan, dtype=dt, device="cuda"),
              torch.full((q.shape[0], hq), math.nan, device="cuda")]
    del poison
    with sk.backend_opts(trace=True) as trace:
        out, lse = sk.varlen_attention(tq, tk, tv, mq, mk, scale=d ** -0.5,
                                       causal=causal or False, window=window,
                                       softcap=softcap, return_lse=True)
    torch.cuda.synchronize()
    assert trace[-1].backend == "cupy" and trace[-1].kernel == SM90_CONFIGS[d].varlen_name(dtype)
    rkw = {"scale": d ** -0.5, "window": window, "softcap": softcap, "causal": causal}
    want_out, want_lse = packed_reference(*(a.double().cpu().numpy() for a in (tq, tk, tv)),
                                          cu_q, cu_k, **rkw)
    got_out, got_lse = out.double().cpu().numpy(), lse.double().cpu().numpy()
    assert not np.isnan(got_out).any() and not np.isnan(got_lse).any()
    err = np.linalg.norm(got_out - want_out) / max(np.linalg.norm(want_out), 1e-30)
    assert err < (2e-2 if dtype == "bfloat16" else 4e-3), err
    empty = np.isneginf(want_lse)
    assert np.array_equal(np.isneginf(got_lse), empty) and np.all(got_out[empty] == 0)
    assert np.allclose(got_lse[~empty], want_lse[~empty], rtol=0, atol=1e-3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("config", SM90_ALTERNATIVES, ids=lambda c: f"{c.head_dim}-{c.block_n}")
@pytest.mark.parametrize("case", [c for c in CASES if not c.get("mask")],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_hopper_forward_alternatives_match_float64(dtype: str, config, case: dict) -> None:
    """Each Hopper forward tile built on request only (``configs.SM90_ALTERNATIVES``),
    through the adapter's ``config=``, against float64, its results written over memory that
    held NaN."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy.attention import attention

    d = config.head_dim
    gen = torch.Generator(device="cuda").manual_seed(d + case["lq"] + 1)
    dt = getattr(torch, dtype)
    b, hq, hk, lq, lk = (case[n] for n in ("b", "hq", "hk", "lq", "lk"))
    q, k, v = (torch.randn(*shape, device="cuda", generator=gen).to(dt)
               for shape in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, d)))
    causal, window = case.get("causal"), case.get("window", (-1, -1))
    softcap, scale = case.get("softcap"), d ** -0.5
    poison = torch.full((b, hq, lq, d), math.nan, dtype=dt, device="cuda")
    del poison  # the caching allocator hands this block to the output
    out, lse = attention(xp, q=q, k=k, v=v, scale=scale, causal=causal, window=window,
                         mask=None, softcap=softcap, return_lse=True, config=config)
    torch.cuda.synchronize()
    ref, ref_lse = _reference(q, k, v, scale, causal, window, softcap, None)
    empty = ~torch.isfinite(ref_lse)
    assert bool((lse[empty] == -math.inf).all()) and bool((out[empty] == 0).all())
    assert not out.isnan().any()
    err = float((out.double() - ref).abs().max()) / float(ref.abs().max())
    assert err < (1e-2 if dtype == "bfloat16" else 2e-3), err
    if (~empty).any():
        assert float((lse[~empty].double() - ref_lse[~empty]).abs().max()) < 1e-3
