"""Time float32 attention at each ``precision=`` beside torch SDPA's memory-efficient backend.

Eager forward calls, float32 B2 H16 at L1024 and L4096, D 64 and 128, causal and not:
``sk.attention`` at ``"float32"`` (the exact kernels the dispatch picks), ``"tf32x3"`` and
``"tf32"`` (the TF32 tensor-core kernels), the cupy backend's exact CUDA-core kernels
(kernels/attention_f32.cu) through their adapter whether served or not (``f32 cupy``), and
``torch.nn.functional.scaled_dot_product_attention`` under
``sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)``, each the median of
``triton.testing.do_bench``; TFLOP/s count 4 B H L^2 D, halved for causal.  The other tile
configurations (``configs.TF32_ALTERNATIVES``, ``configs.F32_ALTERNATIVES``) are checked and
timed too, through the adapters, so one run says which tiles to declare, and so are the tiles
for devices of less shared memory (``configs.FITTING_*``).  torch's
``allow_tf32`` is set False: it does not reach the efficient backend, whose float32 kernels
use CUTLASS's 3xTF32 products on sm_80 and later whatever it says.

Before timing, each L1024 configuration's outputs (on memory that held NaN) are compared with
float64 attention on the device: the relative Frobenius error of out and the largest lse
error (torch's lse is not returned, so "-").  Prints one line per configuration as it goes and
the table last.

Usage: ``python backends/cupy/tools/tf32_timing.py [D ...]`` (from the repository root; head
dims 64 and 128 by default).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from typing import Any

import torch

B, H = 2, 16
LENGTHS = (1024, 4096)
HEAD_DIMS = (64, 128)
PRECISIONS = ("float32", "tf32x3", "tf32")
EXACT = "f32 cupy"


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in float64 on the device, one head at a time."""
    outs, lses = [], []
    scale = q.shape[-1] ** -0.5
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = (q[b, h].double() @ k[b, h].double().T) * scale
            if causal:
                n = s.shape[-1]
                s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1),
                                  -math.inf)
            lse = torch.logsumexp(s, -1)
            outs.append(torch.exp(s - lse[:, None]) @ v[b, h].double())
            lses.append(lse)
    shape = q.shape[:2]
    return (torch.stack(outs).reshape(*shape, *outs[0].shape),
            torch.stack(lses).reshape(*shape, -1))


def label(config: Any) -> str:
    """A TF32 configuration's tiles: warps x query tiles, keys per tile (with the mask's code,
    with staged sums)."""
    return (f"{config.warps}w x{config.m_tiles} n{config.block_n}"
            f"{' masked' if config.mask else ''}{' staged' if config.staged else ''}")


def relerr(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(got.double() - want)
                 / torch.linalg.vector_norm(want))


def measure(length: int, d: int, causal: bool) -> dict:
    """One configuration: each call checked (at the first length) and timed."""
    import array_api_compat.torch as xp
    import triton.testing
    from softmaxkit_cupy.attention_f32 import attention as f32_attention
    from softmaxkit_cupy.attention_tf32 import attention as tf32_attention
    from softmaxkit_cupy.configs import (
        F32_ALTERNATIVES,
        FITTING_F32_CONFIGS,
        FITTING_TF32_CONFIGS,
        TF32_ALTERNATIVES,
        f32_config,
        tf32_config,
    )
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import softmaxkit as sk

    gen = torch.Generator(device="cuda").manual_seed(length + d + causal)
    q, k, v = (torch.randn(B, H, length, d, device="cuda", generator=gen) for _ in range(3))
    flops = 4 * B * H * length * length * d / (2 if causal else 1)

    def ours(precision: str) -> tuple[torch.Tensor, torch.Tensor]:
        return sk.attention(q, k, v, causal=causal, precision=precision, return_lse=True)

    def efficient() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return sdpa(q, k, v, is_causal=causal)

    def tiles(config: Any, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
        return tf32_attention(xp, q=q, k=k, v=v, scale=d ** -0.5,
                              causal="bottom_right" if causal else None, window=(-1, -1),
                              mask=None, softcap=None, return_lse=True, precision=precision,
                              config=config)

    def exact(config: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return f32_attention(xp, q=q, k=k, v=v, scale=d ** -0.5,
                             causal="bottom_right" if causal else None, window=(-1, -1),
                             mask=None, softcap=None, return_lse=True, config=config)

    calls = {p: (lambda p=p: ours(p)) for p in PRECISIONS}
    calls[EXACT] = lambda: exact(f32_config(d, d, False))
    calls["torch-efficient"] = efficient
    for c in (*FITTING_F32_CONFIGS.values(), *F32_ALTERNATIVES):
        c = replace(c, mask=False)  # as the dispatch takes an unmasked call
        if c.head_dim == d <= c.value_dim:  # tiles that hold the tool's calls (Dv = D)
            tile = f"{c.warps}w n{c.block_n} r{c.rows} x{c.lanes} v{c.v_stages} k{c.k_stages}"
            calls[f"{EXACT} {tile}"] = lambda c=c: exact(c)
    served = tf32_config(d, False)  # timed above as "tf32x3" and "tf32"
    fitting = [replace(c, mask=False) for c in FITTING_TF32_CONFIGS.values()]
    for c in (*fitting, *TF32_ALTERNATIVES):  # other tiles, through the adapter
        if c.head_dim == d:
            for p in PRECISIONS[1:]:
                if c.name(p) != served.name(p):  # staged or not, a tile's "tf32" is one kernel
                    calls[f"{p} {label(c)}"] = lambda c=c, p=p: tiles(c, p)
    checked = length == LENGTHS[0]
    want, want_lse = reference(q, k, v, causal) if checked else (None, None)
    errors, ran = {}, {}
    for name, fn in calls.items():
        junk = torch.full((B, H, length, d), math.nan, device="cuda")
        del junk  # the result's memory held NaN
        with sk.backend_opts(trace=True) as trace:
            got = fn()
        torch.cuda.synchronize()
        ran[name] = (f"{trace[-1].backend}:{(trace[-1].kernel or '').split('<')[0]}"
                     if trace else "torch" if name == "torch-efficient" else "adapter")
        out, lse = got if isinstance(got, tuple) else (got, None)
        if bool(out.isnan().any()):
            errors[name] = "NaN"
        elif checked:
            lerr = "-" if lse is None else f"{float((lse.double() - want_lse).abs().max()):.1e}"
            errors[name] = f"{relerr(out, want):.1e}/{lerr}"
        else:
            errors[name] = "unchecked"
    times = {name: float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
             for name, fn in calls.items()}
    return {"length": length, "d": d, "causal": causal, "times": times,
            "tflops": {n: flops / t / 1e9 for n, t in times.items()}, "errors": errors,
            "ran": ran}


def main() -> int:
    import softmaxkit as sk

    dims = [int(a) for a in sys.argv[1:]] or HEAD_DIMS

    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}; softmaxkit {sk.__version__}; "
          f"torch {torch.__version__}", flush=True)
    rows = []
    started = time.perf_counter()
    for length in LENGTHS:
        for d in dims:
            for causal in (False, True):
                row = measure(length, d, causal)
                rows.append(row)
                print(f"L{length} D{d} {'causal' if causal else 'full'}: " + "; ".join(
                    f"{n} {row['tflops'][n]:.1f} TFLOP/s, err {row['errors'][n]} "
                    f"({row['ran'][n]})" for n in row["times"]), flush=True)
    names = (*PRECISIONS, EXACT, "torch-efficient")
    print(f"\n({time.perf_counter() - started:.0f} s) float32 B{B} H{H}, eager forward: "
          "TFLOP/s (ratio to torch-efficient)")
    print("     L    D causal | " + " | ".join(f"{n:>17}" for n in names))
    for row in rows:
        peer = row["tflops"]["torch-efficient"]
        print(f"{row['length']:>6} {row['d']:>4} {str(row['causal']):>6} | " + " | ".join(
            f"{row['tflops'][n]:8.1f} ({row['tflops'][n] / peer:4.2f}x)" for n in names))
    print(f"\nerrors against float64 at L{LENGTHS[0]}: out relative Frobenius / lse max "
          "absolute (torch returns no lse)")
    print("     L    D causal | " + " | ".join(f"{n:>17}" for n in names))
    for row in rows:
        if row["length"] == LENGTHS[0]:
            print(f"{row['length']:>6} {row['d']:>4} {str(row['causal']):>6} | "
                  + " | ".join(f"{row['errors'][n]:>17}" for n in names))
    print("\nother tiles (configs.TF32_ALTERNATIVES, configs.F32_ALTERNATIVES), the declared "
          "ones first: TFLOP/s, error at L1024")
    for row in rows:
        others = [n for n in row["times"] if n not in names]
        if others:
            print(f"{row['length']:>6} {row['d']:>4} {str(row['causal']):>6} | " + "; ".join(
                f"{n}: {row['tflops'][n]:.1f} ({row['errors'][n]})"
                for n in (*PRECISIONS[1:], EXACT, *others)))
    bad = [r for r in rows if "NaN" in r["errors"].values()]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
