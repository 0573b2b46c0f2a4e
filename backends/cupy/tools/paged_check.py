"""Paged attention on the CuPy backend: conformance kit, random checks against float64, and a
decode benchmark.  Run on a CUDA GPU with softmaxkit and softmaxkit-cupy installed:
``python backends/cupy/tools/paged_check.py``.  Prints a summary and exits non-zero on any
failure.
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

import softmaxkit as sk

FAILURES: list[str] = []
SUMMARY: list[str] = []


def fail(what: str) -> None:
    FAILURES.append(what)
    print(f"FAIL {what}", flush=True)


def _build(job):
    from softmaxkit_cupy import compiler

    t0 = time.perf_counter()
    compiler.module(*job)
    return len(job[1]), time.perf_counter() - t0


def precompile() -> None:
    """The paged kernels' module and the merge's (the dense attention module) built at once in
    two processes, into CuPy's on-disk cache."""
    from softmaxkit_cupy import configs

    jobs = [("attention.cu", configs.paged_names()), ("attention.cu", configs.attention_names())]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        for count, sec in pool.map(_build, jobs):
            print(f"built {count} kernels in {sec:.0f} s", flush=True)


# ---- a. the conformance kit's paged cases --------------------------------------------------

def conformance(head_dims: tuple[int, ...]) -> None:
    from softmaxkit.testing import check_backend

    counts: dict[str, int] = {}
    for d in head_dims:  # the kit runs its attention cases at the first head-dim pair given
        results = check_backend("cupy", target="torch-cuda", ops=("paged_attention",),
                                dtypes=["bfloat16", "float16", "float32"], head_dims=[(d, d)])
        for r in results:
            counts[r.status] = counts.get(r.status, 0) + 1
            label = f"kit {r.case}[{r.dtype}] D={d}"
            if r.status == "failed":
                fail(f"{label}: {r.message[:600]}")
            elif r.status == "unsupported":
                print(f"unsupported {label}: {' '.join(r.message.split())[:200]}")
                if r.dtype != "float32":  # the kernel's dtypes must all run on it
                    fail(f"{label} unsupported")
    SUMMARY.append(f"conformance (torch-cuda, D {head_dims}): {counts}")
    print(SUMMARY[-1], flush=True)


# ---- b. random checks against a float64 reference ------------------------------------------

def make_cache(gen, lens, page_size, hk, d, dtype):
    """Pools poisoned with NaN outside the sequences, pages at shuffled places, -1 padding."""
    need = [-(-n // page_size) for n in lens]
    pool = sum(need) + 3
    k = torch.full((pool, hk, page_size, d), math.nan, dtype=dtype, device="cuda")
    v = torch.full_like(k, math.nan)
    table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    order = torch.randperm(pool, generator=gen)
    start = 0
    for b, (n, m) in enumerate(zip(lens, need, strict=True)):
        table[b, :m] = order[start:start + m]
        start += m
        for j in range(m):
            rows = min(page_size, n - j * page_size)
            p = int(table[b, j])
            k[p, :, :rows] = torch.randn(hk, rows, d, generator=gen).to(dtype)
            v[p, :, :rows] = torch.randn(hk, rows, d, generator=gen).to(dtype)
    return k, v, table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def reference(q, k, v, table, lens, scale, causal, window, softcap):
    """float64 (out, lse) from each sequence's gathered keys and values."""
    b_, hq, lq, d = q.shape
    hk, page_size = k.shape[1], k.shape[2]
    out = torch.zeros(b_, hq, lq, d, dtype=torch.float64, device="cuda")
    lse = torch.full((b_, hq, lq), -math.inf, dtype=torch.float64, device="cuda")
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        pages = table[b, :-(-n // page_size)].long()
        kd, vd = (x[pages].permute(1, 0, 2, 3).reshape(hk, -1, d)[:, :n].double()
                  .repeat_interleave(hq // hk, dim=0) for x in (k, v))
        s = scale * q[b].double() @ kd.transpose(1, 2)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(lq, device="cuda")[:, None]
        j = torch.arange(n, device="cuda")[None, :]
        diag = i + n - lq
        left, right = window
        ok = torch.ones(lq, n, dtype=torch.bool, device="cuda")
        if causal:
            ok &= j <= diag
        if left >= 0:
            ok &= j >= diag - left
        if right >= 0:
            ok &= j <= diag + right
        s = s.masked_fill(~ok, -math.inf)
        row = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(row.isinf(), 0.0, row)[..., None])
        out[b] = p @ vd
        lse[b] = row
    return out, lse


CONFIGS = [  # (B, Hq, Hk, Lq, page_size, options)
    (3, 4, 2, 1, 16, {}),
    (4, 8, 8, 2, 64, {"causal": True}),
    (2, 16, 2, 2, 16, {"causal": True, "window": (100, 0)}),
    (3, 4, 1, 4, 64, {"causal": True, "softcap": 30.0}),
    (5, 32, 8, 4, 16, {"softcap": 20.0, "window": (300, 2)}),
    (2, 2, 2, 1, 16, {"long": True}),
    (2, 8, 2, 3, 16, {"long": True, "causal": True, "window": (1000, 0)}),  # window's pages
    (3, 8, 2, 4, 64, {"causal": True, "int64": True, "lse_base": 2}),
]


def random_checks(head_dims: tuple[int, ...]) -> None:
    from softmaxkit.testing.attention_cases import ATTENTION_TOLERANCES

    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    ran = 0
    for dtype_name in ("bfloat16", "float16"):
        dtype = getattr(torch, dtype_name)
        out_tol, lse_tol, _ = ATTENTION_TOLERANCES[dtype_name]
        for d in head_dims:
            for b, hq, hk, lq, ps, opts in CONFIGS:
                if opts.get("long"):
                    lens = [40000 + int(rng.integers(1, ps)), 17]
                else:
                    lens = [int(n) for n in rng.integers(2, 3000, size=b)]
                    if b >= 3:  # an empty sequence and a one-key one
                        lens[0], lens[-1] = 0, 1
                    lens = [n + (n > 1 and n % ps == 0) for n in lens]  # off page boundaries
                k, v, table, seqlens = make_cache(gen, lens, ps, hk, d, dtype)
                q = torch.randn(b, hq, lq, d, generator=gen).to(dtype).cuda()
                causal, window = opts.get("causal", False), opts.get("window", (-1, -1))
                softcap, scale = opts.get("softcap"), d ** -0.5 * 1.3
                if opts.get("int64"):
                    table, seqlens = table.long(), seqlens.long()
                base = opts.get("lse_base", "e")
                label = (f"{dtype_name} D{d} B{b} Hq{hq} Hk{hk} Lq{lq} S{ps} lens {lens} "
                         f"{ {n: o for n, o in opts.items() if n != 'long'} }")
                try:
                    with sk.backend_opts(trace=True) as trace:
                        out, lse = sk.paged_attention(
                            q, k, v, table, seqlens, scale=scale, causal=causal,
                            window=window if window != (-1, -1) else None, softcap=softcap,
                            return_lse=True, lse_base=base)
                    torch.cuda.synchronize()
                except Exception:
                    traceback.print_exc()
                    fail(f"random {label}: raised")
                    continue
                ran += 1
                if trace[-1].backend != "cupy":
                    fail(f"random {label}: ran on {trace[-1].backend}, not cupy "
                         f"({trace[-1].declined})")
                e_out, e_lse = reference(q, k, v, table, seqlens, scale, causal, window,
                                         softcap)
                got_lse = lse.double() * (math.log(2.0) if base == 2 else 1.0)
                got = out.double()
                empty = e_lse.isinf()
                problems = []
                if out.dtype != dtype or lse.dtype != torch.float32:
                    problems.append(f"dtypes {out.dtype}, {lse.dtype}")
                if not bool((got[empty] == 0).all() and (got_lse[empty] == -math.inf).all()):
                    problems.append("empty rows not exactly (0, -inf)")
                full = ~empty
                if bool(got[full].isnan().any() or got_lse[full].isnan().any()):
                    problems.append("NaN where the reference is finite")
                if bool(full.any()):
                    rel = float((got[full] - e_out[full]).norm() / e_out[full].norm())
                    lse_err = float((got_lse[full] - e_lse[full]).abs().max())
                    if not rel <= out_tol:
                        problems.append(f"out rel Frobenius {rel:.2e} > {out_tol}")
                    if not lse_err <= lse_tol:
                        problems.append(f"lse abs {lse_err:.2e} > {lse_tol}")
                if problems:
                    fail(f"random {label}: {'; '.join(problems)}")
    SUMMARY.append(f"random checks: {ran} calls (each must run on cupy), "
                   f"{sum(f.startswith('random') for f in FAILURES)} failed")
    print(SUMMARY[-1], flush=True)


# ---- c. decode benchmark ---------------------------------------------------------------------

def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device torch copy."""
    from triton.testing import do_bench

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    c = torch.empty_like(a)
    return 2 * a.numel() / (do_bench(lambda: c.copy_(a), return_mode="median") / 1e3)


def benchmark() -> None:
    import array_api_compat.torch as xpt
    from softmaxkit_cupy import paged as adapter
    from triton.testing import do_bench

    copy_bw = copy_bandwidth()
    b, hq, hk, d, length, ps = 64, 32, 8, 128, 32768, 16
    per = length // ps
    gen = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(b * per, hk, ps, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    table = torch.randperm(b * per, device="cuda", generator=gen).reshape(b, per).int()
    lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    nbytes = 2 * k.numel() * k.element_size()

    def call():
        return sk.paged_attention(q, k, v, table, lens)

    with sk.backend_opts(trace=True) as trace:
        paged_out = call()
    chosen = trace[-1].backend
    if chosen != "cupy":
        fail(f"benchmark: default dispatch chose {chosen} ({trace[-1].declined})")
    eager = do_bench(call, return_mode="median") / 1e3
    kernels = do_bench(lambda: adapter.paged_attention(
        xpt, q=q, k_pages=k, v_pages=v, block_table=table, seqlens=lens, scale=d ** -0.5,
        causal=None, window=(-1, -1), softcap=None, return_lse=False),
        return_mode="median") / 1e3
    kd, vd = (x[table.long()].permute(0, 2, 1, 3, 4).reshape(b, hk, length, d)
              for x in (k, v))
    with sk.backend_opts(trace=True) as trace:
        dense_out = sk.attention(q, kd, vd)
    dense = do_bench(lambda: sk.attention(q, kd, vd), return_mode="median") / 1e3
    if not torch.allclose(paged_out.float(), dense_out.float(), atol=2e-2, rtol=2e-2):
        fail("benchmark: paged and dense decode results differ")
    gbs = nbytes / eager / 1e9
    SUMMARY.extend([
        f"copy (1 GiB, read + write): {copy_bw / 1e9:.0f} GB/s",
        f"paged decode bf16 B{b} Hq{hq} Hk{hk} D{d} L{length} S{ps}, default dispatch "
        f"({chosen}), eager: {eager * 1e6:.0f} us, {gbs:.0f} GB/s of K+V, "
        f"{100 * gbs * 1e9 / copy_bw:.0f}% of copy (bar 80%)",
        f"  the adapter alone (no frontend host checks): {kernels * 1e6:.0f} us, "
        f"{nbytes / kernels / 1e9:.0f} GB/s, {100 * nbytes / kernels / copy_bw:.0f}% of copy",
        f"  dense decode on the gathered K/V ({trace[-1].backend}): {dense * 1e6:.0f} us, "
        f"{nbytes / dense / 1e9:.0f} GB/s, {100 * nbytes / dense / copy_bw:.0f}% of copy",
    ])
    print("\n".join(SUMMARY[-4:]), flush=True)
    if gbs * 1e9 < 0.8 * copy_bw:
        fail(f"benchmark: {100 * gbs * 1e9 / copy_bw:.0f}% of copy, under the 80% bar")


def main() -> int:
    import cupy
    from softmaxkit_cupy.configs import ATTENTION_HEAD_DIMS

    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; cupy {cupy.__version__}")
    if "cupy" not in sk.backends():
        from softmaxkit_cupy.manifest import manifest

        from softmaxkit import registry

        registry.register(manifest())
    t0 = time.perf_counter()
    steps = (("precompile", precompile), ("conformance", lambda: conformance(ATTENTION_HEAD_DIMS)),
             ("random checks", lambda: random_checks(ATTENTION_HEAD_DIMS)),
             ("benchmark", benchmark))
    for name, step in steps:
        print(f"\n== {name} ==", flush=True)
        try:
            step()
        except Exception:
            traceback.print_exc()
            fail(f"{name} crashed")
    print("\n== summary ==")
    print("\n".join(SUMMARY))
    print(f"{len(FAILURES)} failures in {time.perf_counter() - t0:.0f} s")
    for f in FAILURES:
        print(f"  {f[:800]}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
