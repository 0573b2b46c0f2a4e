"""Check and time the Hopper attention forward (kernels/attention_sm90.cu) on an H100 / H200.

Builds the kernels through the backend's own NVRTC path (``compiler.module``, sm_90a), runs
them with raw launches on fresh random inputs, outputs poisoned with NaN, against a float64
reference (causal in both alignments, GQA, rows with no allowed key, window with softcap,
boolean masks), then times bfloat16 and float16 B4 H32 L4096 (B2 at D = 256) forward passes,
causal and not, next to the mma.sync kernel (kernels/attention.cu) and torch SDPA's flash and
cuDNN backends, with ``triton.testing.do_bench`` (median; FLOPs 4 B H Lq Lk D, halved for
causal).  Prints a table last.

Usage: ``python backends/cupy/tools/sm90_check.py [--skip-bench]``.
"""

from __future__ import annotations

import argparse
import math
import traceback

import numpy as np
import torch
from softmaxkit_cupy import compiler
from softmaxkit_cupy.configs import (
    SM90_CONFIGS,
    SM90_MASKED_CONFIGS,
    Sm90Config,
    attention_config,
    sm90_names,
)
from softmaxkit_cupy.mask_bits import mask_bits

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def launch(config, dtype, q, k, v, mask, out, lse, scale, causal, window, softcap) -> None:
    """One forward launch with raw pointers (the adapter's argument list)."""
    name = config.name(dtype)
    if isinstance(config, Sm90Config):
        kernel = compiler.function("attention_sm90.cu", sm90_names(), name)
    else:
        kernel = compiler.function("attention.cu", (name,), name)
    shared = config.shared_bytes()
    kernel.max_dynamic_shared_size_bytes = shared
    b, hq, lq, _ = q.shape
    hk, lk = k.shape[1], k.shape[2]
    bits, ms = mask_bits(mask) if mask is not None else (None, (0, 0, 0))
    args = [np.uint64(t.data_ptr()) if t is not None else np.uint64(0)
            for t in (q, k, v, bits, out, lse)]
    for a in (q, k, v):
        args += [np.int64(s) for s in a.stride()[:3]]
    args += [np.int64(s) for s in ms]
    args += [np.int32(hq), np.int32(hk), np.int32(lq), np.int32(lk), np.float32(scale),
             np.float32(softcap or 0.0), np.int32(0 if causal == "top_left" else lk - lq),
             np.int32(causal is not None), np.int32(window[0]), np.int32(window[1])]
    grid = (-(-lq // config.block_m), hq, b)
    kernel(grid, (config.threads,), tuple(args), shared_mem=shared)


def reference(q, k, v, scale, causal, window, softcap, mask):
    """out and lse in float64 (spec "Attention")."""
    hq, lq, lk = q.shape[1], q.shape[2], k.shape[2]
    group = hq // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    offset = 0 if causal == "top_left" else lk - lq
    rel = (torch.arange(lk, device=q.device)[None, :]
           - torch.arange(lq, device=q.device)[:, None] - offset)
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal is not None:
        allowed &= rel <= 0
    if window[1] >= 0:
        allowed &= rel <= window[1]
    if window[0] >= 0:
        allowed &= rel >= -window[0]
    if mask is not None:
        allowed = allowed & mask
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v.double().repeat_interleave(group, 1), lse


CASES = [
    dict(b=2, hq=4, hk=4, lq=1000, lk=1000),
    dict(b=2, hq=4, hk=4, lq=1000, lk=1000, causal="bottom_right"),
    dict(b=1, hq=8, hk=2, lq=300, lk=1100, causal="bottom_right"),
    dict(b=1, hq=8, hk=2, lq=1100, lk=300, causal="bottom_right"),
    dict(b=1, hq=4, hk=1, lq=700, lk=450, causal="top_left"),
    dict(b=1, hq=2, hk=2, lq=77, lk=5),
    dict(b=1, hq=4, hk=2, lq=900, lk=1300, window=(200, 50)),
    dict(b=1, hq=4, hk=2, lq=900, lk=900, causal="bottom_right", window=(300, -1),
         softcap=20.0),
]


def check(config: Sm90Config, dtype: str, case: dict) -> bool:
    """One case against float64; prints the errors."""
    torch.manual_seed(case["lq"] + config.head_dim)
    dt = DTYPES[dtype]
    b, hq, hk, lq, lk, d = (*(case[n] for n in ("b", "hq", "hk", "lq", "lk")),
                            config.head_dim)
    q = torch.randn(b, hq, lq, d, device="cuda").to(dt)
    k = torch.randn(b, hk, lk, d, device="cuda").to(dt)
    v = torch.randn(b, hk, lk, d, device="cuda").to(dt)
    mask = None
    if config.mask:
        mask = torch.rand(b, hq, lq, lk, device="cuda") > 0.3
        mask[:, :, 5, :] = False  # a row with no allowed key
    causal, window = case.get("causal"), case.get("window", (-1, -1))
    softcap, scale = case.get("softcap"), d ** -0.5
    out = torch.full((b, hq, lq, d), math.nan, device="cuda", dtype=dt)
    lse = torch.full((b, hq, lq), math.nan, device="cuda")
    launch(config, dtype, q, k, v, mask, out, lse, scale, causal, window, softcap)
    ref, ref_lse = reference(q, k, v, scale, causal, window, softcap, mask)
    err = float((out.double() - ref).abs().max()) / float(ref.abs().max())
    fin = torch.isfinite(ref_lse)
    lerr = float((lse.double()[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
    ok = (not out.isnan().any() and not lse.isnan().any() and err < 1e-2 and lerr < 1e-3
          and bool((lse[~fin] == -math.inf).all()) and bool((out[~fin] == 0).all()))
    print(f"{'ok   ' if ok else 'WRONG'} {config.name(dtype)} {case}: out max rel "
          f"{err:.2e}, lse max abs {lerr:.2e}, rows with no key {int((~fin).sum())}")
    return ok


def bench(dtype: str, d: int, causal: str | None) -> str:
    """TFLOP/s of the Hopper kernel, the mma.sync kernel, flash and cuDNN on one shape."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dt = DTYPES[dtype]
    b, h, n = (2 if d == 256 else 4), 32, 4096
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dt) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(b, h, n, device="cuda")
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    row = {}
    for label, config in (("sm90", SM90_CONFIGS[d]),
                          ("mma.sync", attention_config(d, masked=False))):
        def run(config=config):
            launch(config, dtype, q, k, v, None, out, lse, d ** -0.5, causal, (-1, -1), None)

        run()
        row[label] = flops / triton.testing.do_bench(run, warmup=25, rep=200) / 1e9
    for label, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                           ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            def run():
                torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal is not None)

            run()
            row[label] = flops / triton.testing.do_bench(run, warmup=25, rep=200) / 1e9
    figures = " ".join(f"{k_} {v_:.0f}" for k_, v_ in row.items())
    return f"{dtype} B{b} H{h} L{n} D{d} {'causal' if causal else 'full'}: {figures} TFLOP/s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-bench", action="store_true")
    opts = parser.parse_args()
    compiler.module("attention_sm90.cu", sm90_names())  # one NVRTC build for sm_90a
    failures = []
    for config in (*SM90_CONFIGS.values(), *SM90_MASKED_CONFIGS.values()):
        for dtype in DTYPES:
            for case in CASES:
                try:
                    if not check(config, dtype, case):
                        failures.append(f"{config.name(dtype)} {case}")
                except Exception:
                    traceback.print_exc()
                    failures.append(f"{config.name(dtype)} {case}: raised")
    table = []
    if not opts.skip_bench:
        for dtype, d in (("bfloat16", 128), ("float16", 128), ("bfloat16", 64),
                         ("bfloat16", 256)):
            for causal in (None, "bottom_right"):
                table.append(bench(dtype, d, causal))
                print(table[-1], flush=True)
    print("==== sm90 attention forward ====")
    print(f"correctness: {len(failures)} failures" + "".join(f"\n  {f}" for f in failures))
    for line in table:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
