"""Time the exact float32 attention backward beside numba-cuda's and torch's efficient one.

Eager backward calls, float32 B2 H16 at L1024 and L4096, D 64 and 128, causal and not, each
from the same forward's out and lse: the cupy backend's CUDA-core kernel
(kernels/attention_f32.cu, sk_attn_bwd_f32) through its adapter (``f32 cupy``),
``sk.attention_vjp`` on numba-cuda's exact kernels (``numba-cuda``), and
torch autograd through ``scaled_dot_product_attention`` under
``sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)`` (``torch-efficient``, its backward alone:
``torch.autograd.grad`` with the graph kept), and the other tiles at the head dim
(``configs.F32_BACKWARD_ALTERNATIVES`` of D = Dv, through the adapter), each the median of
``triton.testing.do_bench``;
TFLOP/s count 2 B H L^2 (3 D + 2 Dv) (five products), halved for causal.  Before timing, each L1024
configuration's gradients (on memory that held NaN) are compared with float64 autograd on the
device: the worst relative Frobenius error of dq, dk, dv.

Usage: ``python backends/cupy/tools/f32_backward_timing.py [D or D/Dv ...]`` (from the
repository root; head dims 64 and 128 by default).
"""

from __future__ import annotations

import math
import sys
import time

import torch

B, H = 2, 16
LENGTHS = (1024, 4096)
HEAD_DIMS = (64, 128)
NAMES = ("f32 cupy", "numba-cuda", "torch-efficient")


def reference_grads(q, k, v, dout, causal: bool) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of float64 attention by autograd on the device."""
    q, k, v = (a.detach().double().requires_grad_() for a in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1),
                          -math.inf)
    out = torch.softmax(s, -1) @ v
    return torch.autograd.grad(out, (q, k, v), dout.double())


def measure(length: int, d: int, dv: int, causal: bool) -> dict:
    import array_api_compat.torch as xp
    import triton.testing
    from softmaxkit_cupy.attention_f32 import attention, attention_vjp
    from softmaxkit_cupy.configs import F32_BACKWARD_ALTERNATIVES
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import softmaxkit as sk

    gen = torch.Generator(device="cuda").manual_seed(length + d + dv + causal)
    q, k, v, dout = (torch.randn(B, H, length, w, device="cuda", generator=gen)
                     for w in (d, d, dv, dv))
    kw = dict(scale=d ** -0.5, causal="bottom_right" if causal else None, window=(-1, -1),
              mask=None, softcap=None)
    out, lse = attention(xp, q=q, k=k, v=v, return_lse=True, **kw)
    leaves = [a.detach().clone().requires_grad_() for a in (q, k, v)]
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        eff_out = sdpa(*leaves, is_causal=causal)
    calls = {
        "f32 cupy": lambda: attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout,
                                          **kw),
        "numba-cuda": lambda: sk.attention_vjp(q, k, v, out, lse, dout, causal=causal,
                                               backend="numba-cuda"),
        "torch-efficient": lambda: torch.autograd.grad(eff_out, leaves, dout,
                                                       retain_graph=True),
    }
    for c in F32_BACKWARD_ALTERNATIVES:
        if (c.head_dim, c.value_dim) == (d, dv):
            calls[f"f32 cupy {c.warps}w m{c.block_m} k{c.keys}"] = (
                lambda c=c: attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout,
                                          config=c, **kw))
    errors = {}
    if length == LENGTHS[0]:
        want = reference_grads(q, k, v, dout, causal)
        for name, fn in calls.items():
            junk = [torch.full(a.shape, math.nan, device="cuda") for a in (q, k, v)]
            del junk
            got = fn()
            errors[name] = max(float(torch.linalg.vector_norm(g.double() - w)
                                     / torch.linalg.vector_norm(w))
                               for g, w in zip(got, want, strict=True))
    flops = 2 * B * H * length * length * (3 * d + 2 * dv) / (2 if causal else 1)
    times = {n: float(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))
             for n, fn in calls.items()}
    return {"length": length, "d": d if d == dv else f"{d}/{dv}", "causal": causal,
            "errors": errors,
            "tflops": {n: flops / t / 1e9 for n, t in times.items()}}


def main() -> int:
    import softmaxkit as sk

    print(f"device: {torch.cuda.get_device_name()}; softmaxkit {sk.__version__}; "
          f"torch {torch.__version__}", flush=True)
    started = time.perf_counter()
    rows = []
    for length in LENGTHS:
        for dims in sys.argv[1:] or [str(d) for d in HEAD_DIMS]:
            d, dv = (int(x) for x in (dims.split("/") * 2)[:2])
            for causal in (False, True):
                row = measure(length, d, dv, causal)
                rows.append(row)
                print(f"L{length} D{dims} {'causal' if causal else 'full'}: " + "; ".join(
                    f"{n} {row['tflops'][n]:.1f} TFLOP/s"
                    + (f", err {row['errors'][n]:.1e}" if row["errors"] else "")
                    for n in row["tflops"]), flush=True)
    print(f"\n({time.perf_counter() - started:.0f} s) float32 B{B} H{H}, eager backward: "
          "TFLOP/s (ratio to torch-efficient)")
    print("     L       D causal | " + " | ".join(f"{n:>17}" for n in NAMES) + " | other tiles")
    for row in rows:
        peer = row["tflops"]["torch-efficient"]
        print(f"{row['length']:>6} {row['d']:>7} {str(row['causal']):>6} | " + " | ".join(
            f"{t:8.1f} ({t / peer:4.2f}x)" if n in NAMES else f"{n} {t:.1f} ({t / peer:4.2f}x)"
            for n, t in row["tflops"].items()))
    bad = [r for r in rows if r["errors"] and not all(e <= 1e-4 for e in r["errors"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
