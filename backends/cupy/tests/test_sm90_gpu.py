"""The Hopper attention forward (kernels/attention_sm90.cu) on a device of compute capability
9.0, through the default dispatch, against float64 (skipped without such a device).

Each call's trace names the kernel that ran: the sm_90a kernel wherever it is built, the
mma.sync kernel for the calls it is not built for (a boolean mask at head dimension 256).
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", autouse=True)
def _hopper() -> None:
    import cupy
    from softmaxkit_cupy.configs import SM90_CAPABILITY

    if str(cupy.cuda.Device().compute_capability) != SM90_CAPABILITY:
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
@pytest.mark.parametrize("d", [64, 128, 256])
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
