"""Training calls on CUDA as users make them: ``sk.attention`` and ``sk.varlen_attention``
through torch autograd (the eager path, whose backward runs the call its forward checked),
under activation checkpointing, under ``torch.func.grad`` and per example under
``torch.func.vmap``, each against float64 gradients
of the definition (skipped without a CUDA device)."""

from __future__ import annotations

import numpy as np
import pytest

import softmaxkit as sk
from softmaxkit.testing import materialized as mat
from softmaxkit.testing.varlen_cases import packed_arrays, packed_vjp_reference

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)

torch = pytest.importorskip("torch")

TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}


def _loss(out, lse, dout, dlse):
    """<out, dout> + <lse, dlse> in float32, a keyless row's lse (-inf) left out."""
    used = torch.where(torch.isfinite(lse), lse * dlse, 0.0)
    return (out.float() * dout.float()).sum() + used.sum()


def _check(got, want, dtype: str, what: str) -> None:
    for name, g, w in zip("qkv", got, want, strict=True):
        err = mat.rel_frobenius(g.double().cpu().numpy(), w)
        assert err < TOL[dtype], f"{what}: d{name} relative error {err:.2e}"


def _dense_inputs(dtype: str, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, hq, hk, lq, lk, d = 2, 8, 2, 257, 300, 64
    dt = getattr(torch, dtype)
    q = torch.randn(b, hq, lq, d, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(b, hk, lk, d, device="cuda", generator=gen).to(dt) for _ in "kv")
    dout = torch.randn(b, hq, lq, d, device="cuda", generator=gen).to(dt)
    dlse = torch.randn(b, hq, lq, device="cuda", generator=gen)
    # keys 0..149 hidden from rows 0..9: with top-left causality rows 0..9 see no key at all
    mask = torch.ones(lq, lk, dtype=torch.bool, device="cuda")
    mask[:10, :150] = False
    return q, k, v, dout, dlse, mask


def _dense_reference(q, k, v, dout, dlse, mask):
    q64, k64, v64, do64, dl64 = (a.double().cpu().numpy() for a in (q, k, v, dout, dlse))
    m = mask.cpu().numpy()
    kw = {"causal": "top_left", "mask": m}
    _, lse = mat.attention(q64, k64, v64, **kw)
    dl64 = np.where(np.isfinite(lse), dl64, 0.0)
    return mat.attention_vjp(q64, k64, v64, do64, dlse=dl64, **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_attention_training_step_matches_float64(dtype: str) -> None:
    """Grouped heads, top-left causality, a mask that leaves rows without keys, a used lse:
    the eager backward, the same step under non-reentrant checkpointing, and (float32)
    ``torch.func.grad`` each give the float64 gradients."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, dout, dlse, mask = _dense_inputs(dtype, seed=3)
    want = _dense_reference(q, k, v, dout, dlse, mask)

    def step(q, k, v):
        out, lse = sk.attention(q, k, v, causal="top_left", mask=mask, return_lse=True)
        return _loss(out, lse, dout, dlse)

    leaves = [a.clone().requires_grad_() for a in (q, k, v)]
    step(*leaves).backward()
    _check([a.grad for a in leaves], want, dtype, "eager")
    assert not leaves[0].grad[..., :10, :].any()  # the keyless rows

    leaves = [a.clone().requires_grad_() for a in (q, k, v)]
    checkpoint(step, *leaves, use_reentrant=False).backward()
    _check([a.grad for a in leaves], want, dtype, "checkpointed")

    if dtype == "float32":
        got = torch.func.grad(step, argnums=(0, 1, 2))(q, k, v)
        _check(got, want, dtype, "torch.func.grad")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_varlen_training_step_matches_float64(dtype: str) -> None:
    """A packed batch with a sequence without queries, one whose query has no key, and
    bottom-right causality leaving the first rows of a sequence keyless, through autograd
    with a used lse; the keys of the sequence without queries get zero gradients."""
    lens_q, lens_k = (70, 0, 300, 1, 129), (130, 9, 64, 0, 700)
    hq, hk, d = 4, 2, 128
    q, k, v, cu_q, cu_k = packed_arrays(11, lens_q, lens_k, hq, hk, d, d)
    dt = getattr(torch, dtype)
    tq, tk, tv = (torch.as_tensor(a, device="cuda").to(dt) for a in (q, k, v))
    rng = np.random.default_rng(12)
    dout = torch.as_tensor(rng.normal(size=(q.shape[0], hq, d)), device="cuda").to(dt)
    dlse = torch.as_tensor(rng.normal(size=(q.shape[0], hq)), device="cuda").float()
    mq, mk = (torch.as_tensor(a, device="cuda") for a in (cu_q, cu_k))

    leaves = [a.clone().requires_grad_() for a in (tq, tk, tv)]
    out, lse = sk.varlen_attention(*leaves, mq, mk, causal="bottom_right", return_lse=True)
    _loss(out, lse, dout, dlse).backward()

    q64, k64, v64 = (a.double().cpu().numpy() for a in (tq, tk, tv))
    dl64 = np.where(np.isfinite(lse.detach().cpu().numpy()), dlse.double().cpu().numpy(), 0.0)
    want = packed_vjp_reference(q64, k64, v64, dout.double().cpu().numpy(), cu_q, cu_k,
                                dlse=dl64, scale=d ** -0.5, causal="bottom_right")
    _check([a.grad for a in leaves], want, dtype, "varlen eager")
    k0, k1 = int(cu_k[1]), int(cu_k[2])  # the sequence without queries
    assert not leaves[1].grad[k0:k1].any() and not leaves[2].grad[k0:k1].any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_per_example_gradients_through_torch_func(dtype: str) -> None:
    """``torch.func.vmap(torch.func.grad(loss))`` with k and v shared by the examples: one
    call on the GPU backend (its trace), and each example's dq, dk, dv the float64 gradients
    of its own loss."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    dt = getattr(torch, dtype)
    n, hq, hk, lq, lk, d = 3, 4, 2, 100, 130, 64
    q = torch.randn(n, hq, lq, d, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(hk, lk, d, device="cuda", generator=gen).to(dt) for _ in "kv")
    dout = torch.randn(n, hq, lq, d, device="cuda", generator=gen).to(dt)

    def loss(q, k, v, dout):
        return (sk.attention(q, k, v, causal=True).float() * dout.float()).sum()

    with sk.backend_opts(trace=True) as trace:
        got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)),
                              in_dims=(0, None, None, 0))(q, k, v, dout)
    assert {(t.op, t.backend) for t in trace} == {("attention", "cupy"),
                                                   ("attention_vjp", "cupy")}
    k64, v64 = (a.double().cpu().numpy() for a in (k, v))
    for i in range(n):
        want = mat.attention_vjp(q[i].double().cpu().numpy(), k64, v64,
                                 dout[i].double().cpu().numpy(), causal="bottom_right")
        _check([g[i] for g in got], want, dtype, f"example {i}")
