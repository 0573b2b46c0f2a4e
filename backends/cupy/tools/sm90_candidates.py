"""Check and time the Hopper kernels built on request before they become defaults.

Three kernels of ``configs.py`` run only when asked for with ``config=`` until a device run
has checked them: the backward at head dimension 256 (``SM90_BACKWARD_ALTERNATIVES``, the
warpgroups splitting the columns) and the packed variable-length forward and backward on the
Hopper kernels (``SM90_VARLEN_ALTERNATIVES``, ``SM90_VARLEN_BACKWARD_ALTERNATIVES``).  On
an H100 / H200 this script checks each against float64 on small problems with fresh random
inputs, then times it, eagerly through the adapter, next to what runs by default (the
mma.sync kernels) and torch's peer in the same process (``triton.testing.do_bench``
medians):

* backward, bfloat16 B2 H16 L4096 D256, causal and not: TFLOP/s (10 B H L^2 D, halved for
  causal) of ``attention_vjp`` with each configuration and of torch SDPA's flash backward
  (``torch.autograd.grad`` of its output, less its forward);
* varlen forward, bfloat16 D64 / D128 / D256, 16 sequences of 1 to 4096 tokens, 16 heads,
  causal and not: milliseconds of ``varlen_attention`` with each configuration and of
  ``torch.nn.attention.varlen.varlen_attn``; and at D64 / D128 the backward
  (``varlen_attention_vjp``; torch's: the gradient through its call less its forward).
  The backward's float64 check is ``tests/test_sm90_bwd_gpu.py``'s.

Usage: ``python backends/cupy/tools/sm90_candidates.py``; exits 1 when a check fails.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

FAILURES: list[str] = []


def timed(fn) -> float:
    """Median milliseconds of eager calls of ``fn``."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))


def relerr(got, want) -> float:
    """||got - want|| / ||want|| in float64."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def backward() -> None:
    from softmaxkit_cupy.configs import SM90_BACKWARD_ALTERNATIVES

    candidate = next(c for c in SM90_BACKWARD_ALTERNATIVES if not c.mask)
    for causal in (None, "bottom_right"):
        _check_backward(candidate, causal)
        _time_backward(candidate, causal)


def _check_backward(candidate, causal) -> None:
    """float64 autograd on a small problem with grouped heads and ragged tiles."""
    import array_api_compat.torch as xp
    import torch.nn.functional as F
    from softmaxkit_cupy.attention import attention, attention_vjp

    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, dout = (torch.randn(1, s, n, 256, device="cuda", generator=g).to(torch.bfloat16)
                     for s, n in ((4, 333), (2, 517), (2, 517), (4, 333)))
    out, lse = attention(xp, q=q, k=k, v=v, scale=256 ** -0.5, causal=causal,
                         window=(-1, -1), mask=None, softcap=None, return_lse=True)
    got = attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, scale=256 ** -0.5,
                        causal=causal, window=(-1, -1), mask=None, softcap=None,
                        config=candidate)
    leaves = [a.double().requires_grad_() for a in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, enable_gqa=True,
                                         attn_mask=_bottom_right(333, 517) if causal else None)
    want = torch.autograd.grad(ref, leaves, dout.double())
    errors = [relerr(a, b) for a, b in zip(got, want, strict=True)]
    print(f"backward D256 causal={causal}: relative errors {errors}", flush=True)
    if not max(errors) < 2e-2:
        FAILURES.append(f"backward D256 causal={causal}: {errors}")


def _time_backward(candidate, causal) -> None:
    import array_api_compat.torch as xp
    import torch.nn.functional as F
    from softmaxkit_cupy.attention import attention, attention_vjp
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, n, d = 2, 16, 4096, 256
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    out, lse = attention(xp, q=q, k=k, v=v, scale=d ** -0.5, causal=causal, window=(-1, -1),
                         mask=None, softcap=None, return_lse=True)
    flops = 10 * b * h * n * n * d / (2 if causal else 1)
    row = []
    for name, config in (("mma.sync (default)", None), ("sm90 split columns", candidate)):
        t = timed(lambda config=config: attention_vjp(
            xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, scale=d ** -0.5, causal=causal,
            window=(-1, -1), mask=None, softcap=None, config=config))
        row.append(f"{name} {flops / t / 1e9:.0f}")
    qg, kg, vg = (a.clone().requires_grad_() for a in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fwd = timed(lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=bool(causal)))
        both = timed(lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=bool(causal)), (qg, kg, vg),
            dout))
    row.append(f"flash {flops / (both - fwd) / 1e9:.0f}")
    print(f"backward bf16 B{b} H{h} L{n} D{d} causal={bool(causal)} TFLOP/s: "
          + ", ".join(row), flush=True)


def _bottom_right(lq: int, lk: int):
    i = torch.arange(lq, device="cuda")[:, None] + lk - lq
    return torch.arange(lk, device="cuda")[None, :] <= i


def varlen() -> None:
    from softmaxkit_cupy.configs import (
        SM90_VARLEN_ALTERNATIVES,
        SM90_VARLEN_BACKWARD_ALTERNATIVES,
    )

    lens = [int(n) for n in np.random.default_rng(5).integers(1, 4097, size=16)]
    for config in SM90_VARLEN_ALTERNATIVES:
        backward = next((c for c in SM90_VARLEN_BACKWARD_ALTERNATIVES
                         if c.head_dim == config.head_dim), None)
        for causal in (None, "bottom_right"):
            _check_varlen(config, causal)
            _time_varlen(config, backward, causal, lens)


def _check_varlen(config, causal) -> None:
    """The float64 definition on a small packed batch."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy.varlen import varlen_attention

    from softmaxkit.testing.varlen_cases import packed_arrays, packed_reference

    d = config.head_dim
    arrays = packed_arrays(d, (70, 0, 300, 129), (130, 9, 300, 700), 4, 2, d, d)
    q, k, v = (torch.as_tensor(a, device="cuda").to(torch.bfloat16) for a in arrays[:3])
    cu_q, cu_k = (torch.as_tensor(a, device="cuda") for a in arrays[3:])
    out, _ = varlen_attention(xp, q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                              scale=d ** -0.5, causal=causal, window=(-1, -1), softcap=None,
                              return_lse=False, config=config)
    want, _ = packed_reference(*(a.double().cpu().numpy() for a in (q, k, v)), arrays[3],
                               arrays[4], scale=d ** -0.5, causal=causal)
    err = relerr(out.cpu(), torch.as_tensor(want))
    print(f"varlen D{d} causal={causal}: relative error {err:.2e}", flush=True)
    if not err < 2e-2:
        FAILURES.append(f"varlen D{d} causal={causal}: {err}")


def _time_varlen(config, backward, causal, lens: list[int]) -> None:
    """16 sequences of ``lens`` tokens, 16 heads: the forward, and the backward where a Hopper
    configuration is built for the head dimension."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy.varlen import varlen_attention, varlen_attention_vjp

    d, h = config.head_dim, 16
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lens)]), device="cuda")
    total = int(cu[-1])
    q, k, v, dout = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    opts = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, scale=d ** -0.5, causal=causal,
                window=(-1, -1), softcap=None)
    row = []
    for name, c in (("mma.sync (default)", None), ("sm90", config)):
        t = timed(lambda c=c: varlen_attention(xp, q=q, k=k, v=v, return_lse=False, config=c,
                                               **opts))
        row.append(f"{name} {t:.3f}")
    peer = _torch_varlen(q, k, v, cu, max(lens), causal is not None)
    if peer is not None:
        row.append(f"torch varlen {timed(peer):.3f}")
    print(f"varlen fwd bf16 D{d} H{h} {len(lens)} seqs ({total} tokens) "
          f"causal={causal is not None} ms: " + ", ".join(row), flush=True)
    if backward is None:
        return
    out, lse = varlen_attention(xp, q=q, k=k, v=v, return_lse=True, **opts)
    row = []
    for name, c in (("mma.sync (default)", None), ("sm90", backward)):
        t = timed(lambda c=c: varlen_attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse,
                                                   dout=dout, config=c, **opts))
        row.append(f"{name} {t:.3f}")
    if peer is not None:
        leaves = [a.clone().requires_grad_() for a in (q, k, v)]
        grad_peer = _torch_varlen(*leaves, cu, max(lens), causal is not None)
        both = timed(lambda: torch.autograd.grad(grad_peer(), leaves, dout))
        row.append(f"torch varlen {both - timed(grad_peer):.3f}")
    print(f"varlen bwd bf16 D{d} H{h} causal={causal is not None} ms: " + ", ".join(row),
          flush=True)


def _torch_varlen(q, k, v, cu, longest: int, causal: bool):
    """torch's varlen call on the same batch, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    cu32 = cu.to(torch.int32)

    def call():
        try:
            return varlen_attn(q, k, v, cu32, cu32, longest, longest, is_causal=causal)
        except TypeError:  # releases that spell causal as a window
            return varlen_attn(q, k, v, cu32, cu32, longest, longest,
                               window_size=(-1, 0) if causal else (-1, -1))

    try:
        call()
    except Exception as exc:  # noqa: BLE001  (the peer is reported, not required)
        print(f"torch varlen: {type(exc).__name__}: {exc}")
        return None
    return call


def main() -> int:
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    for step in (backward, varlen):
        try:
            step()
        except Exception as exc:  # noqa: BLE001  (a crash is a failure, reported at the end)
            FAILURES.append(f"{step.__name__} crashed: {type(exc).__name__}: {exc}")
    print("failures: " + (", ".join(FAILURES) if FAILURES else "0"))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
