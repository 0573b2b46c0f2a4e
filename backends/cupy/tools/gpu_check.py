"""Check and benchmark the CuPy backend on a CUDA GPU, printing a table last.

Runs, in order: a parallel build of every kernel module into CuPy's cache; the tensor-core
data-path probe; row kernels on the benchmark shapes (and ragged, masked ones) against float64
with poisoned outputs; cross-entropy and the VJPs against float64; attention forward against a
float64 materialized reference and the backward against float64 autograd of it (small cases
at every served head dimension besides 64 and 128 too); the conformance kit against
``backend="cupy"`` with its attention cases at the kernels' head dimensions (torch-cuda
target for bfloat16, float16 and float32; cupy target for float16 and float32; most cases run
at 64, so the attention and varlen operations' cases then run at each other served head
dimension on its own, torch-cuda target, bfloat16 and float16, and at head dimensions the
kernels serve zero-padded: (D, Dv) = (192, 128), (128, 192) and (40, 40)); then the benchmarks
(device-to-device copy; row kernels against torch, device time from CUDA graph replays and
eager calls; attention forward and backward against torch SDPA's flash and cuDNN backends;
split-KV decoding; cross-entropy).

Usage: ``python backends/cupy/tools/gpu_check.py [--out DIR] [--skip-bench] [--only STEPS]``; with
``--out`` the table is also written to ``DIR/benchmarks-cupy.md``.  ``--only sweep`` times
every alternative row configuration instead (not part of the default run);
``--only attention,backward,conformance-padded --skip-bench`` checks the zero-padded head
dimensions (with the rest of the attention checks) without the whole kit.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from softmaxkit.testing.tolerance import TOLERANCES, vjp_bound

TABLE: list[tuple[str, str, str]] = []  # (what, figure, note)
FAILURES: list[str] = []


def section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def guarded(fn: Any) -> Any:
    def run(*a: Any, **k: Any) -> Any:
        try:
            return fn(*a, **k)
        except Exception:
            FAILURES.append(f"{fn.__name__} crashed")
            traceback.print_exc()
            return None

    return run


def register_backend() -> None:
    from softmaxkit_cupy.manifest import manifest

    import softmaxkit as sk
    from softmaxkit import registry

    if "cupy" not in sk.backends():
        registry.register(manifest())


def timed(fn: Any, reps: int = 7, inner: int = 10, warmup: int = 3) -> float:
    """Median seconds per call of ``fn``: device events around ``inner`` back-to-back calls
    (so host overhead overlaps the device work, as in a real queue), ``reps`` times."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / inner)
    return statistics.median(times)


def graph_seconds(fn: Any, inner: int = 10, reps: int = 7) -> float:
    """Median device seconds per call of ``fn`` replayed from a captured CUDA graph of
    ``inner`` calls (no host launch cost between them)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / inner)
    del graph
    return statistics.median(times)


def host_seconds(fn: Any, calls: int = 200) -> float:
    """Host time per call of ``fn`` (launches are asynchronous; the queue is drained after)."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls


def _compile_one(job: tuple[str, tuple[str, ...]]) -> tuple[str, int, float]:
    from softmaxkit_cupy import compiler

    t0 = time.perf_counter()
    compiler.module(job[0], job[1])
    return job[0], len(job[1]), time.perf_counter() - t0


@guarded
def precompile() -> None:
    """Build every module (declared and alternative configurations) in parallel processes,
    filling CuPy's on-disk cache, so the steps after this load them instead of compiling."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from softmaxkit_cupy import configs

    section("precompile (parallel NVRTC builds into CuPy's cache)")
    jobs = [(f, tuple(n)) for f, n in configs.all_modules()]
    jobs.append(("attention.cu", configs.alternative_names()))
    jobs.append(("attention_bwd.cu", configs.backward_alternative_names()))
    jobs.append(("attention.cu", configs.decode_alternative_names()))
    jobs += [("attention.cu", (f"sk_mma_probe<{c}>",)) for c in ("sk_bf16", "__half")]
    for op in ("softmax", "log_softmax"):
        jobs.append(("rows.cu", configs.row_alternative_names(op, "bfloat16", "bfloat16")))
    jobs.sort(key=lambda j: -len(j[1]))
    t0 = time.perf_counter()
    workers = min(len(jobs), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for filename, count, sec in pool.map(_compile_one, jobs):
            print(f"{filename}: {count} kernels in {sec:.0f} s")
    print(f"{len(jobs)} modules in {time.perf_counter() - t0:.0f} s on {workers} processes")


@guarded
def probe() -> None:
    section("probe: cp.async + ldmatrix + mma.sync (bf16, fp16)")
    import cupy
    import torch
    from softmaxkit_cupy import compiler

    for ctype, tdtype in (("sk_bf16", torch.bfloat16), ("__half", torch.float16)):
        name = f"sk_mma_probe<{ctype}>"
        fn = compiler.function("attention.cu", (name,), name)
        q, k, v = (torch.randn(64, 128, device="cuda").to(tdtype) for _ in range(3))
        s = torch.full((64, 64), math.nan, device="cuda")
        o = torch.full((64, 128), math.nan, device="cuda")
        args = [np.uint64(t.data_ptr()) for t in (q, k, v, s, o)]
        fn((1,), (128,), tuple(args))
        cupy.cuda.Device().synchronize()
        s_ref = q.double() @ k.double().T
        p = s.to(tdtype).double()
        o_ref = p @ v.double()
        es = float((s.double() - s_ref).norm() / s_ref.norm())
        eo = float((o.double() - o_ref).norm() / o_ref.norm())
        ok = es < 1e-5 and eo < 1e-5
        print(f"{ctype}: S rel err {es:.2e}, O rel err {eo:.2e}: {'ok' if ok else 'WRONG'}")
        if not ok:
            FAILURES.append(f"probe {ctype}")


KIT_ATTENTION_OPS = {"attention", "attention_vjp", "merge_attention", "paged_attention"}
"""The kit's operations the attention kernels serve in bfloat16 and float16: a case of these
left unsupported in those dtypes is a failure."""


KIT_VARLEN_OPS = {"varlen_attention", "varlen_attention_vjp"}
"""The kit's packed variable-length operations, run with the attention ones at each head
dimension."""

PADDED_HEAD_DIMS = ((192, 128), (128, 192), (40, 40))
"""(D, Dv) pairs the kernels are not built for, served on zero-padded copies
(softmaxkit_cupy/head_dims.py): multi-head latent attention's value dimension both ways, and
a head dimension between built ones.  The kit's attention operations run at each on its own
(every case at that pair)."""


@guarded
def conformance(padded_only: bool = False) -> None:
    """The kit at the built head dimensions, then at :data:`PADDED_HEAD_DIMS` (only those with
    ``padded_only``)."""
    from softmaxkit_cupy.configs import ATTENTION_DTYPES, ATTENTION_HEAD_DIMS

    from softmaxkit.testing import check_backend

    # the attention cases at the head dimensions the kernels take (D == Dv); the kit runs most
    # of them at the first pair given, so 64 leads (as before) and every other head dimension
    # then runs the attention operations' cases on its own
    dims = sorted(ATTENTION_HEAD_DIMS, key=lambda d: d != 64)
    head_dims = tuple((d, d) for d in dims)
    attention_ops = KIT_ATTENTION_OPS | KIT_VARLEN_OPS
    runs = [(target, dtypes, head_dims, None)
            for target, dtypes in (("torch-cuda", ["bfloat16", "float16", "float32"]),
                                   ("cupy", ["float16", "float32"]))]
    runs += [("torch-cuda", list(ATTENTION_DTYPES), ((d, d),), attention_ops)
             for d in dims[1:]]
    padded = [("torch-cuda", list(ATTENTION_DTYPES), (pair,), attention_ops)
              for pair in PADDED_HEAD_DIMS]
    for target, dtypes, pairs, ops in padded if padded_only else runs + padded:
        what = f"{target}, head dims {pairs}" + (", attention operations" if ops else "")
        section(f"conformance kit, backend=cupy, target={what}")
        t0 = time.perf_counter()
        results = check_backend("cupy", target=target, ops=ops, dtypes=dtypes, head_dims=pairs)
        d, dv = pairs[0]
        label = target if ops is None else f"{target} D={d}" + (f" Dv={dv}" if dv != d else "")
        counts: dict[str, int] = {}
        for r in results:
            counts[r.status] = counts.get(r.status, 0) + 1
            if r.status == "failed":
                print(f"FAILED {r.case}[{r.dtype}] {r.ops}: {r.message[:400]}")
                FAILURES.append(f"{label} {r.case}[{r.dtype}]")
        ran = sorted({f"{r.case}[{r.dtype}]" for r in results if r.status == "passed"})
        print(f"passed: {', '.join(ran)}")
        unsupported = [r for r in results if r.status == "unsupported"]
        print(f"unsupported ({len(unsupported)}):")
        for r in unsupported:
            print(f"  {r.case}[{r.dtype}]: {' '.join(r.message.split())[:300]}")
            if r.dtype in ATTENTION_DTYPES and KIT_ATTENTION_OPS & set(r.ops):
                FAILURES.append(f"{label} {r.case}[{r.dtype}] unsupported")
        print(f"{label}: {counts} in {time.perf_counter() - t0:.1f} s")
        TABLE.append((f"conformance {label}", str(counts), ",".join(dtypes)))


ROW_SHAPES = [(32768, 4096), (4096, 32768), (262144, 128), (256, 524288)]


@guarded
def rows_check() -> None:
    section("row kernels vs float64 (poisoned outputs)")
    import array_api_compat.torch as xpt
    import torch
    from softmaxkit_cupy.rows import launch_rows

    import softmaxkit as sk

    tol = {dtype: TOLERANCES[str(dtype)[6:]]
           for dtype in (torch.bfloat16, torch.float16, torch.float32)}
    # ragged rows (scalar path) and masks (n % 3 == 1), the staged kernels among them
    shapes = ROW_SHAPES + [(1000, 1000), (37, 12345), (5, 200003), (64, 7), (3, 65536 + 8),
                           (7, 30001), (3, 400003), (9, 32768)]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, n in shapes:
            if dtype == torch.float32 and n > 262144:
                continue
            x0 = torch.randn(rows, n, device="cuda") * 4
            # the persistent kernel's rows also ascending (maxima rising late) and far from 0
            kinds = [("", x0)]
            if n > 262144 and dtype != torch.float32:
                kinds += [(" ascending", x0.sort(-1).values), (" offset", x0 * 100 + 3000)]
            for kind, xk in kinds:
                x = xk.to(dtype)
                w = None
                if n % 3 == 1:
                    w = torch.rand(rows, n, device="cuda") > 0.3
                x64 = x.double()
                for op in ("softmax", "log_softmax", "logsumexp"):
                    if op == "log_softmax" and dtype == torch.float32:
                        continue  # declined by can_run: left to backends that accumulate in double
                    shape = (rows,) if op == "logsumexp" else (rows, n)
                    out = torch.full(shape, math.nan, device="cuda", dtype=dtype)
                    launch_rows(op, xpt, x, w, out)
                    # float64 by the reference backend: masked rows follow the spec's policy
                    ref = getattr(sk, op)(x64, axis=-1, where=w, backend="reference")
                    got = out.double()
                    fin = torch.isfinite(ref)
                    same_inf = bool(torch.equal(got[~fin], ref[~fin]))
                    rtol, atol = tol[dtype]
                    excess = (got[fin] - ref[fin]).abs() - (atol + rtol * ref[fin].abs())
                    worst = float(excess.max()) if fin.any() else 0.0
                    ok = same_inf and not torch.isnan(got[fin]).any() and worst <= 0
                    if not ok:
                        FAILURES.append(f"rows {op} {dtype} {rows}x{n}{kind}")
                        print(f"WRONG {op} {dtype} {rows}x{n}{kind} mask={w is not None}: "
                              f"inf-match {same_inf} excess over bound {worst:.3g}")
        print(f"{dtype}: checked {len(shapes)} shapes x 3 ops")


@guarded
def grads_check() -> None:
    section("cross-entropy (fused gradient) and VJPs vs float64")
    import array_api_compat.torch as xpt
    import torch
    from softmaxkit_cupy import rows as kr
    from softmaxkit_cupy.configs import GRAD_CONFIGS

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rtol, atol = TOLERANCES[str(dtype)[6:]]
        for rows, n, eps, masked in ((4096, 32768, 0.0, False), (1000, 1000, 0.1, True),
                                     (77, 130, 0.0, True), (5, 20000, 0.2, False)):
            if n > GRAD_CONFIGS[-1].capacity(torch.finfo(dtype).bits // 8):
                continue  # declined by can_run
            x = (torch.randn(rows, n, device="cuda") * 3).to(dtype)
            t = torch.randint(0, n, (rows,), device="cuda")
            t[::7] = -100
            w = None
            x64 = x.double()
            if masked:
                w = torch.rand(rows, n, device="cuda") > 0.2
                w[torch.arange(rows), t.clamp(min=0)] = True
                x64 = x64.masked_fill(~w, -math.inf)
            valid = t != -100
            logp = torch.log_softmax(x64, -1)
            allowed = torch.ones_like(x64, dtype=torch.bool) if w is None else w
            count = allowed.sum(-1, keepdim=True).double()
            y = torch.zeros_like(x64)
            y[valid, t[valid]] = 1.0
            y = (1 - eps) * y + torch.where(allowed, eps / count, 0.0)
            terms = torch.where(y != 0, y * torch.where(y != 0, logp, 0.0), 0.0)
            loss_ref = torch.where(valid, -terms.sum(-1), 0.0)
            scale = 1.0 / float(valid.sum())
            grad_ref = torch.where(valid[:, None], (torch.exp(logp) - y) * scale, 0.0)
            loss, grad = kr.cross_entropy(
                xpt, logits=x, index=t, probs=None, where=w, ignore_index=-100,
                label_smoothing=eps, grad_scale=torch.tensor(scale, device="cuda"),
                out_dtype=dtype)
            lerr = float(((loss.double() - loss_ref).abs() / (1e-3 + loss_ref.abs())).max())
            # plus half the subnormal spacing: tiny gradients round to subnormals on store
            fi = torch.finfo(dtype)
            gerr = float(((grad.double() - grad_ref).abs()
                          - (atol * scale + rtol * grad_ref.abs()
                             + fi.smallest_normal * fi.eps / 2)).max())
            ok = lerr < 1e-4 and gerr <= 0
            print(f"cross_entropy {str(dtype)[6:]} {rows}x{n} eps={eps} mask={masked}: "
                  f"loss rel err {lerr:.2e}, grad excess {gerr:.2e} {'ok' if ok else 'WRONG'}")
            if not ok:
                FAILURES.append(f"cross_entropy {dtype} {rows}x{n}")
            p = torch.softmax(x64, -1)
            c = torch.randn(rows, n, device="cuda").to(dtype)
            g = kr.softmax_vjp(xpt, probs=p.to(dtype), cotangent=c, where=w, out_dtype=dtype)
            p_rep = p.to(dtype).double()
            g_ref = p_rep * (c.double() - (p_rep * c.double()).sum(-1, keepdim=True))
            # the spec's bound: it scales with p_i (|c_i| + sum_j p_j |c_j|), not |g_i|
            scale1 = p_rep * (c.double().abs()
                              + (p_rep * c.double().abs()).sum(-1, keepdim=True))
            e1 = float(((g.double() - g_ref).abs()
                        - vjp_bound(g_ref, scale1, n, str(dtype)[6:])).max())
            lp = logp.to(dtype)
            lp_rep = lp.double()
            ok_pos = torch.isfinite(lp_rep) if w is None else torch.isfinite(lp_rep) & w
            cz = torch.where(ok_pos, c.double(), 0.0)
            g2_ref = torch.where(ok_pos, cz - torch.exp(torch.where(ok_pos, lp_rep, -math.inf))
                                 * cz.sum(-1, keepdim=True), 0.0)
            g2 = kr.log_softmax_vjp(xpt, logprobs=lp, cotangent=c, where=w, out_dtype=dtype)
            # float32 accumulation of sum(c) errs by up to ~u N sum|c| (the spec's vjp_bound
            # scales with sum|c|, not |sum c|): 1e-6 exp(lp) sum|c| bounds it here
            carried = 1e-6 * (torch.exp(torch.where(ok_pos, lp_rep, -math.inf))
                              * cz.abs().sum(-1, keepdim=True))
            e2 = float(((g2.double() - g2_ref).abs()
                        - (atol + rtol * g2_ref.abs() + carried)).max())
            ok = e1 <= 0 and e2 <= 0
            print(f"vjps {str(dtype)[6:]} {rows}x{n}: softmax_vjp excess {e1:.2e}, "
                  f"log_softmax_vjp excess {e2:.2e} {'ok' if ok else 'WRONG'}")
            if not ok:
                FAILURES.append(f"vjp {dtype} {rows}x{n}")


@guarded
def bench_cross_entropy(copy_bw: float) -> None:
    import array_api_compat.torch as xpt
    import torch
    import torch.nn.functional as F
    from softmaxkit_cupy import rows as kr

    rows, n = 4096, 32768
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, n, (rows,), device="cuda")
    scale = torch.tensor(1.0 / rows, device="cuda")
    ours = timed(lambda: kr.cross_entropy(
        xpt, logits=x, index=t, probs=None, where=None, ignore_index=None,
        label_smoothing=0.0, grad_scale=scale, out_dtype=torch.bfloat16))
    xr = x.clone().requires_grad_(True)

    def peer() -> None:
        xr.grad = None
        F.cross_entropy(xr, t).backward()

    theirs = timed(peer, reps=5, inner=3)
    nbytes = 2 * x.numel() * x.element_size()
    bw = nbytes / ours / 1e9
    frac = f"{100 * bw / copy_bw:.0f}% of copy; " if copy_bw else ""
    TABLE.append(("cross_entropy + grad bf16 4096x32768", f"{ours * 1e6:.0f} us",
                  f"{bw:.0f} GB/s, {frac}torch fwd+bwd {theirs * 1e6:.0f} us"))
    print(TABLE[-1])


COMMON_CASES = [
    dict(b=2, hq=4, hk=4, lq=256, lk=256, d=128),
    dict(b=1, hq=8, hk=2, lq=300, lk=517, d=128, causal="bottom_right"),
    dict(b=1, hq=4, hk=1, lq=517, lk=300, d=64, causal="bottom_right"),
    dict(b=2, hq=4, hk=2, lq=200, lk=333, d=64, causal="top_left"),
    dict(b=1, hq=4, hk=4, lq=257, lk=700, d=128, window=(100, 20)),
    dict(b=1, hq=2, hk=2, lq=130, lk=190, d=128, mask=True),
    dict(b=1, hq=2, hk=1, lq=64, lk=1000, d=64, softcap=5.0, causal="bottom_right"),
    dict(b=1, hq=2, hk=2, lq=5, lk=3000, d=128),
]
"""Attention cases that both the forward and the backward check run."""

HEAD_DIM_CASES = [
    case
    for d in (32, 80, 96, 160, 192, 256)
    for case in (
        dict(b=1, hq=4, hk=2, lq=150, lk=201, d=d, causal="bottom_right"),
        dict(b=1, hq=2, hk=2, lq=70, lk=130, d=d, mask=True, softcap=3.0),
        dict(b=1, hq=2, hk=1, lq=100, lk=300, d=d, causal="top_left", window=(40, 10)),
    )
]
"""Small cases at the head dimensions other than 64 and 128, for both checks: causal with
grouped heads and ragged tiles, a boolean mask with softcap, a window."""

DECODE_HEAD_DIM_CASES = [
    case
    for d in (32, 80, 96, 160, 192, 256)
    for case in (
        dict(b=2, hq=8, hk=2, lq=1, lk=700, d=d),
        dict(b=1, hq=4, hk=1, lq=3, lk=500, d=d, mask=True, causal="bottom_right"),
    )
]
"""Split-KV decoding ((Hq / Hk) * Lq <= 16, Lk >= 256) at those head dimensions."""

PADDED_CASES = [
    case
    for d, dv in ((192, 128), (128, 192), (40, 40), (112, 112))
    for case in (
        dict(b=1, hq=4, hk=2, lq=150, lk=201, d=d, dv=dv, causal="bottom_right"),
        dict(b=1, hq=2, hk=2, lq=70, lk=130, d=d, dv=dv, mask=True, softcap=3.0),
        dict(b=2, hq=8, hk=2, lq=1, lk=700, d=d, dv=dv),
    )
]
"""Head dimensions the kernels serve on zero-padded copies (``dv`` the value dimension):
tiles with grouped heads, a mask with softcap, and split-KV decoding, for both checks."""


def _scores(qd, kd, scale, softcap):
    """Float64 scores of queries ``qd`` against keys ``kd`` (repeated over each group of
    query heads), soft-capped, and which of them the exclusions leave."""
    import torch

    g = qd.shape[1] // kd.shape[1]
    s = (qd @ kd.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s


def _allowed(s, causal, window, mask):
    """Which scores of ``s`` (``[B, Hq, Lq, Lk]``) causality, the window and ``mask`` allow."""
    import torch

    lq, lk = s.shape[-2:]
    off = 0 if causal == "top_left" else lk - lq
    i = torch.arange(lq, device="cuda")[:, None] + off
    j = torch.arange(lk, device="cuda")[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool, device="cuda")
    if causal:
        ok &= j <= i
    left, right = window
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    ok = ok.expand_as(s)
    return ok if mask is None else ok & mask


def _case_inputs(c, dtype, seed, with_dout=False):
    """``q, k, v`` (and ``dout``) of an attention case in ``dtype``, and its boolean mask
    (None, or one with a query row that allows no key)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dv = c.get("dv", c["d"])
    shapes = [(c["b"], c["hq"], c["lq"], c["d"]), (c["b"], c["hk"], c["lk"], c["d"]),
              (c["b"], c["hk"], c["lk"], dv)]
    if with_dout:
        shapes.append((c["b"], c["hq"], c["lq"], dv))
    arrays = [torch.randn(*shape, device="cuda", generator=gen).to(dtype) for shape in shapes]
    mask = None
    if c.get("mask"):
        mask = torch.rand(1, 1, c["lq"], c["lk"], device="cuda") > 0.5
        mask[..., min(3, c["lq"] - 1), :] = False  # a query row with no allowed key
        mask = mask.expand(c["b"], c["hq"], c["lq"], c["lk"])
    return (*arrays, mask)


def _materialized(q, k, v, scale, causal, window, mask, softcap):
    import torch

    qd, vd = q.double(), v.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = _scores(qd, k.double(), scale, softcap)
    ok = _allowed(s, causal, window, mask)
    s = s.masked_fill(~ok, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    p = torch.where(ok, p, 0.0)
    return p @ vd, lse


@guarded
def attention_check() -> None:
    section("attention forward vs float64 materialized")
    import array_api_compat.torch as xpt
    import torch
    from softmaxkit_cupy.attention import attention
    from softmaxkit_cupy.configs import ATTENTION_ALTERNATIVES

    cases = [
        *COMMON_CASES,
        dict(b=1, hq=2, hk=2, lq=100, lk=0, d=128),
        dict(b=1, hq=8, hk=2, lq=300, lk=517, d=128, causal="bottom_right", alt=0),
        dict(b=1, hq=2, hk=2, lq=130, lk=190, d=64, mask=True, alt=0),
        dict(b=1, hq=8, hk=2, lq=300, lk=517, d=128, causal="bottom_right", alt=1),
        dict(b=1, hq=4, hk=4, lq=257, lk=700, d=128, window=(100, 20), softcap=4.0, alt=1),
        dict(b=2, hq=4, hk=4, lq=256, lk=256, d=128, alt=1),
        dict(b=1, hq=4, hk=2, lq=300, lk=517, d=64, causal="top_left", softcap=3.0, alt=1),
        # split-KV decoding: (Hq / Hk) * Lq <= 16 and Lk >= 256
        dict(b=2, hq=8, hk=2, lq=1, lk=3000, d=128),
        dict(b=1, hq=4, hk=1, lq=4, lk=1000, d=64, causal="bottom_right"),
        dict(b=1, hq=8, hk=2, lq=3, lk=700, d=128, mask=True),
        dict(b=1, hq=4, hk=4, lq=2, lk=5000, d=128, window=(300, 0), softcap=3.0),
        *HEAD_DIM_CASES,
        *DECODE_HEAD_DIM_CASES,
        *PADDED_CASES,
    ]
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float16, 4e-3)):
        for c in cases:
            q, k, v, mask = _case_inputs(c, dtype, seed=1)
            scale = c["d"] ** -0.5
            causal = c.get("causal")
            window = c.get("window", (-1, -1))
            config = None
            if "alt" in c:
                config = [a for a in ATTENTION_ALTERNATIVES if a.head_dim == c["d"]][c["alt"]]
            out, lse = attention(xpt, q=q, k=k, v=v, scale=scale, causal=causal,
                                 window=window, mask=mask, softcap=c.get("softcap"),
                                 return_lse=True, config=config)
            ref, ref_lse = _materialized(q, k, v, scale, causal, window, mask, c.get("softcap"))
            empty = ~torch.isfinite(ref_lse)
            denom = max(float(ref.norm()), 1e-30)
            err = float((out.double() - ref).norm()) / denom if ref.numel() else 0.0
            lerr = float((lse[~empty].double() - ref_lse[~empty]).abs().max()) \
                if (~empty).any() else 0.0
            ok = (err <= tol and lerr <= 2e-3 and bool((lse[empty] == -math.inf).all())
                  and bool((out[empty] == 0).all()))
            print(f"{str(dtype)[6:]} {c}: out err {err:.2e} lse err {lerr:.2e} "
                  f"{'ok' if ok else 'WRONG'}")
            if not ok:
                FAILURES.append(f"attention {dtype} {c}")


def _materialized_grads(q, k, v, dout, scale, causal, window, mask, softcap):
    """(dq, dk, dv) in float64 by autograd of the materialized definition (excluded scores
    filled with a huge negative number so rows with no allowed key differentiate to 0)."""
    import torch

    qd, kd, vd = (a.detach().double().requires_grad_(True) for a in (q, k, v))
    s = _scores(qd, kd, scale, softcap)
    ok = _allowed(s, causal, window, mask)
    p = torch.softmax(s.masked_fill(~ok, -1e300), -1)
    p = torch.where(ok, p, 0.0)
    out = p @ vd.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return torch.autograd.grad(out, (qd, kd, vd), dout.double())


def _poison(*shapes_dtypes: Any) -> None:
    """Fill the caching allocator's next blocks with NaN, so outputs a kernel fails to write
    show up as NaN instead of stale zeros."""
    import torch

    junk = [torch.full(shape, math.nan, dtype=dt, device="cuda") for shape, dt in shapes_dtypes]
    del junk


BACKWARD_CASES = [
    *COMMON_CASES,
    dict(b=1, hq=4, hk=2, lq=333, lk=200, d=128, mask=True, causal="top_left"),
    dict(b=1, hq=8, hk=2, lq=300, lk=517, d=128, causal="bottom_right", alt=0),
    dict(b=1, hq=2, hk=2, lq=130, lk=190, d=64, mask=True, softcap=3.0, alt=0),
    dict(b=1, hq=4, hk=2, lq=257, lk=700, d=128, window=(100, 20), alt=1),
    *HEAD_DIM_CASES,
    *PADDED_CASES,
]


@guarded
def attention_vjp_check() -> None:
    section("attention backward vs float64 autograd of the materialized definition")
    import array_api_compat.torch as xpt
    import torch
    from softmaxkit_cupy.attention import attention, attention_vjp
    from softmaxkit_cupy.configs import BACKWARD_ALTERNATIVES
    from softmaxkit_cupy.head_dims import served_head_dim

    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float16, 4e-3)):
        for c in BACKWARD_CASES:
            q, k, v, dout, mask = _case_inputs(c, dtype, seed=2, with_dout=True)
            scale = c["d"] ** -0.5
            causal, window, softcap = c.get("causal"), c.get("window", (-1, -1)), c.get("softcap")
            config = None
            if "alt" in c:
                config = [a for a in BACKWARD_ALTERNATIVES if a.head_dim == c["d"]][c["alt"]]
            out, lse = attention(xpt, q=q, k=k, v=v, scale=scale, causal=causal, window=window,
                                 mask=mask, softcap=softcap, return_lse=True)
            width = served_head_dim(c["d"], c.get("dv", c["d"]))  # zero-padded to it
            _poison((q.shape, dtype), (k.shape, dtype), (v.shape, dtype),
                    ((c["b"] * c["hq"] * (c["lq"] + 128) * width,), torch.float32))
            got = attention_vjp(xpt, q=q, k=k, v=v, out=out, lse=lse, dout=dout, scale=scale,
                                causal=causal, window=window, mask=mask, softcap=softcap,
                                config=config)
            ref = _materialized_grads(q, k, v, dout, scale, causal, window, mask, softcap)
            errs = []
            ok = True
            for name, g_, r_ in zip(("dq", "dk", "dv"), got, ref, strict=True):
                finite = bool(torch.isfinite(g_).all())
                err = float((g_.double() - r_).norm() / max(float(r_.norm()), 1e-30))
                errs.append(f"{name} {err:.2e}" + ("" if finite else " NONFINITE"))
                ok = ok and finite and err <= tol
            if mask is not None:
                row = min(3, c["lq"] - 1)
                ok = ok and bool((got[0][:, :, row] == 0).all())
            label = {k_: v_ for k_, v_ in c.items() if k_ not in ("b",)}
            print(f"{str(dtype)[6:]} {label}: {', '.join(errs)} {'ok' if ok else 'WRONG'}")
            if not ok:
                FAILURES.append(f"attention_vjp {dtype} {c}")


def _sdpa_peers(flops, time_backend):
    """``"flash N"`` and ``"cudnn N"`` (TFLOP/s) of torch's SDPA backends, or why one failed;
    ``time_backend(backend)`` times torch's call under ``backend``, in seconds."""
    from torch.nn.attention import SDPBackend

    peers = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            tp = time_backend(backend)
            peers.append(f"{backend.name.split('_')[0].lower()} {flops / tp / 1e12:.0f}")
        except Exception as exc:
            peers.append(f"{backend.name}: {type(exc).__name__}")
    return peers


def _attention_row(direction, shape, causal, flops_per_s, peers):
    """Add (and print) a row of the attention benchmark to the table."""
    b, h, L, d = shape
    TABLE.append((f"attention {direction} bf16 B{b} H{h} L{L} D{d}{' causal' if causal else ''}",
                  f"{flops_per_s / 1e12:.0f} TFLOP/s", "; ".join(peers)))
    print(TABLE[-1])


@guarded
def bench_attention_vjp() -> None:
    import array_api_compat.torch as xpt
    import torch
    import torch.nn.functional as F
    from softmaxkit_cupy.attention import attention, attention_vjp
    from softmaxkit_cupy.configs import BACKWARD_ALTERNATIVES
    from torch.nn.attention import sdpa_kernel

    for b, h, L, d in ((4, 32, 4096, 128), (2, 16, 16384, 128)):
        q, k, v, dout = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        for causal in (False, True):
            flops = 2.5 * 4 * b * h * L * L * d / (2 if causal else 1)
            kw = dict(scale=d ** -0.5, causal="top_left" if causal else None, window=(-1, -1),
                      mask=None, softcap=None)
            out, lse = attention(xpt, q=q, k=k, v=v, return_lse=True, **kw)
            ours = timed(functools.partial(attention_vjp, xpt, q=q, k=k, v=v, out=out, lse=lse,
                                           dout=dout, **kw), reps=5, inner=3)
            peers = []
            for alt in BACKWARD_ALTERNATIVES:
                if alt.head_dim != d:
                    continue
                ta = timed(functools.partial(attention_vjp, xpt, q=q, k=k, v=v, out=out,
                                             lse=lse, dout=dout, config=alt, **kw),
                           reps=3, inner=2)
                peers.append(f"alt {alt.warps}w/{alt.block_m} {flops / ta / 1e12:.0f}")
            del out, lse

            def torch_backward(backend, causal=causal, q=q, k=k, v=v, dout=dout):
                qkv = tuple(a.clone().requires_grad_(True) for a in (q, k, v))
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(*qkv, is_causal=causal)
                return timed(functools.partial(torch.autograd.grad, o, qkv, dout,
                                               retain_graph=True), reps=5, inner=3)

            peers += _sdpa_peers(flops, torch_backward)
            _attention_row("bwd", (b, h, L, d), causal, flops / ours, peers)


@guarded
def bench_copy() -> float:
    import torch

    section("benchmarks")
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a))
    bw = 2 * a.numel() / t / 1e9
    TABLE.append(("device-to-device copy (1 GiB, read + write)", f"{bw:.0f} GB/s", ""))
    print(f"copy: {bw:.0f} GB/s")
    return bw


@guarded
def bench_rows(copy_bw: float) -> None:
    """Row kernels against torch on the benchmark shapes: device time from CUDA graph replays
    (the kernels alone), then eager calls (host dispatch included)."""
    import array_api_compat.torch as xpt
    import torch
    from softmaxkit_cupy import rows as kr
    from softmaxkit_cupy.configs import row_config

    for dtype in (torch.bfloat16, torch.float16):
        for rows, n in ROW_SHAPES:
            x = torch.randn(rows, n, device="cuda").to(dtype)
            nbytes = 2 * x.numel() * x.element_size()
            for op, peer in (("softmax", torch.softmax), ("log_softmax", torch.log_softmax)):
                call = functools.partial(getattr(kr, op), xpt, x=x, where=None, masked="zero",
                                         out_dtype=dtype)
                graph = graph_seconds(call)
                eager = timed(call)
                torch_graph = graph_seconds(functools.partial(peer, x, -1))
                host = host_seconds(call, calls=50)
                bw = nbytes / graph / 1e9
                config = row_config(n, 2, lean=True)
                TABLE.append((f"{op} {str(dtype)[6:]} {rows}x{n}", f"{bw:.0f} GB/s",
                              f"{100 * bw / copy_bw:.0f}% of copy; torch "
                              f"{nbytes / torch_graph / 1e9:.0f} GB/s; eager "
                              f"{nbytes / eager / 1e9:.0f} GB/s (host {host * 1e6:.0f} us/call); "
                              f"{config.describe()}"))
                print(TABLE[-1], flush=True)


def _row_excess(op: str, xpt: Any, x: Any, w: Any, config: Any) -> float:
    """The worst excess over the 16-bit bound of ``op`` by ``config`` on ``x`` (mask ``w``),
    against float64 with a NaN-poisoned output; NaN or inf mismatches count as excess."""
    import torch
    from softmaxkit_cupy.rows import launch_rows

    out = torch.full(x.shape, math.nan, device="cuda", dtype=x.dtype)
    launch_rows(op, xpt, x, w, out, config=config)
    ref64 = x.double() if w is None else x.double().masked_fill(~w, -math.inf)
    ref = torch.softmax(ref64, -1) if op == "softmax" else torch.log_softmax(ref64, -1)
    ref = torch.nan_to_num(ref, nan=0.0) if op == "softmax" else ref  # empty rows: 0
    if op == "log_softmax":
        ref = torch.where(torch.isnan(ref), -math.inf, ref)  # empty rows: -inf
    got = out.double()
    fin = torch.isfinite(ref)
    if not torch.equal(got[~fin], ref[~fin]) or torch.isnan(got[fin]).any():
        return math.inf
    rtol, atol = TOLERANCES[str(x.dtype)[6:]]
    excess = (got[fin] - ref[fin]).abs() - (atol + rtol * ref[fin].abs())
    return float(excess.max())


@guarded
def bench_rows_sweep(copy_bw: float) -> None:
    """Every row configuration that holds each benchmark shape's rows, timed from CUDA graphs
    (device time only), beside torch in the same way: which configuration to declare."""
    import array_api_compat.torch as xpt
    import torch
    from softmaxkit_cupy.configs import ROW16_CONFIGS, ROW_ALTERNATIVES, ROW_CONFIGS, row_config
    from softmaxkit_cupy.rows import launch_rows

    section("row configurations (graph replay, device time)")
    for dtype in (torch.bfloat16,):
        for rows, n in ROW_SHAPES:
            x = torch.randn(rows, n, device="cuda").to(dtype)
            nbytes = 2 * x.numel() * x.element_size()
            out = torch.empty_like(x)
            for op, peer in (("softmax", torch.softmax), ("log_softmax", torch.log_softmax)):
                default = row_config(n, 2, lean=True)
                found = []
                for config in sorted(set(ROW_CONFIGS + ROW16_CONFIGS + ROW_ALTERNATIVES),
                                     key=lambda c: (c.lean, c.threads, c.group, c.k, c.cluster,
                                                    c.staged, c.groups, c.mode)):
                    if config.capacity(2) < n or config.capacity(2) >= 4 * n:
                        continue
                    # correct first: this shape, and ragged masked rows up to the capacity
                    ragged = torch.randn(257, config.capacity(2) - 5, device="cuda").to(dtype)
                    keep = torch.rand(ragged.shape, device="cuda") > 0.2
                    keep[3] = False
                    bad = [f"{r}x{m}" for xx, ww in ((x, None), (ragged, keep))
                           for r, m in [tuple(xx.shape)]
                           if _row_excess(op, xpt, xx, ww, config) > 0]
                    if bad:
                        FAILURES.append(f"row sweep {op} {config} {bad}")
                        print(f"WRONG {op} {config} on {bad}")
                        continue
                    try:
                        sec = graph_seconds(functools.partial(
                            launch_rows, op, xpt, x, None, out, config=config))
                    except Exception as exc:
                        print(f"{op} {rows}x{n} {config}: {type(exc).__name__} {exc}")
                        continue
                    bw = nbytes / sec / 1e9
                    found.append((bw, config))
                    mark = " (declared)" if config == default else ""
                    print(f"{op} {str(dtype)[6:]} {rows}x{n} {config}: {bw:.0f} GB/s "
                          f"{100 * bw / copy_bw:.0f}% of copy{mark}", flush=True)
                tp = graph_seconds(functools.partial(peer, x, -1))
                best = max(found, key=lambda f: f[0])
                TABLE.append((f"graph {op} {str(dtype)[6:]} {rows}x{n}",
                              f"{best[0]:.0f} GB/s",
                              f"{100 * best[0] / copy_bw:.0f}% of copy by {best[1]}; "
                              f"torch {nbytes / tp / 1e9:.0f} GB/s"))
                print(TABLE[-1], flush=True)


@guarded
def bench_attention() -> None:
    import array_api_compat.torch as xpt
    import torch
    import torch.nn.functional as F
    from softmaxkit_cupy.attention import attention
    from softmaxkit_cupy.configs import ATTENTION_ALTERNATIVES
    from torch.nn.attention import sdpa_kernel

    for b, h, L, d in ((4, 32, 4096, 128), (2, 16, 16384, 128)):
        q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        for causal in (False, True):
            flops = 4 * b * h * L * L * d / (2 if causal else 1)
            qkv = (q, k, v)
            ours = timed(lambda causal=causal, qkv=qkv, d=d: attention(
                xpt, q=qkv[0], k=qkv[1], v=qkv[2], scale=d ** -0.5,
                causal="top_left" if causal else None, window=(-1, -1), mask=None,
                softcap=None, return_lse=True), reps=5, inner=3)
            peers = []
            for alt in ATTENTION_ALTERNATIVES:
                if alt.head_dim != d:
                    continue
                ta = timed(lambda causal=causal, qkv=qkv, d=d, alt=alt: attention(
                    xpt, q=qkv[0], k=qkv[1], v=qkv[2], scale=d ** -0.5,
                    causal="top_left" if causal else None, window=(-1, -1), mask=None,
                    softcap=None, return_lse=True, config=alt), reps=5, inner=3)
                peers.append(f"alt {alt.warps}w/{alt.block_n}/{alt.m_tiles}"
                             f"{'' if alt.mask else ' nomask'} "
                             f"{flops / ta / 1e12:.0f}")

            def torch_forward(backend, causal=causal, qkv=qkv):
                with sdpa_kernel(backend):
                    return timed(lambda: F.scaled_dot_product_attention(*qkv, is_causal=causal),
                                 reps=5, inner=3)

            peers += _sdpa_peers(flops, torch_forward)
            _attention_row("fwd", (b, h, L, d), causal, flops / ours, peers)


@guarded
def bench_decode(copy_bw: float) -> None:
    import array_api_compat.torch as xpt
    import torch
    import torch.nn.functional as F
    from softmaxkit_cupy.attention import attention
    from softmaxkit_cupy.configs import DECODE_ALTERNATIVES
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, hq, hk, lk, d = 64, 32, 8, 32768, 128
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hk, lk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    nbytes = 2 * k.numel() * k.element_size()
    ours = timed(lambda: attention(xpt, q=q, k=k, v=v, scale=d ** -0.5, causal=None,
                                   window=(-1, -1), mask=None, softcap=None, return_lse=False))
    peers = []
    for alt in DECODE_ALTERNATIVES:  # the other tile shapes and stage counts
        if alt.head_dim != d:
            continue
        ta = timed(lambda alt=alt: attention(
            xpt, q=q, k=k, v=v, scale=d ** -0.5, causal=None, window=(-1, -1), mask=None,
            softcap=None, return_lse=False, config=alt))
        peers.append(f"alt {alt.warps}w/{alt.stages} stages {nbytes / ta / 1e9:.0f} GB/s")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(backend):
                tp = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            peers.append(f"{backend.name.split('_')[0].lower()} {nbytes / tp / 1e9:.0f} GB/s")
        except Exception as exc:
            peers.append(f"{backend.name}: {type(exc).__name__}")
    bw = nbytes / ours / 1e9
    frac = f"{100 * bw / copy_bw:.0f}% of copy; " if copy_bw else ""
    TABLE.append((f"decode bf16 B{b} Hq{hq} Hk{hk} Lq1 Lk{lk} D{d} (k+v bytes)",
                  f"{bw:.0f} GB/s", frac + "; ".join(peers)))
    print(TABLE[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--only", default="",
                        help="comma-separated steps to run (default: all), e.g. "
                             "attention,backward,conformance,conformance-padded,"
                             "bench-attention,bench-backward,sweep")
    opts = parser.parse_args()
    steps = set(filter(None, opts.only.split(",")))

    def want(step: str) -> bool:
        return not steps or step in steps

    import cupy
    import torch

    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"cupy {cupy.__version__}; python {sys.version.split()[0]}")
    register_backend()
    t0 = time.perf_counter()
    precompile()
    if want("probe"):
        probe()
    if want("rows"):
        rows_check()
    if want("grads"):
        grads_check()
    if want("attention"):
        attention_check()
    if want("backward"):
        attention_vjp_check()
    if want("conformance"):
        conformance()
    elif want("conformance-padded"):  # on request: the kit at the zero-padded head dims only
        conformance(padded_only=True)
    print(f"checks took {time.perf_counter() - t0:.0f} s")
    if not opts.skip_bench:
        copy_bw = bench_copy() or 0.0
        if want("bench-rows"):
            bench_rows(copy_bw)
        if "sweep" in steps:  # on request only: it compares the alternatives
            bench_rows_sweep(copy_bw or 4200.0)
        if want("bench-attention"):
            bench_attention()
        if want("bench-backward"):
            bench_attention_vjp()
        if want("bench-decode"):
            bench_decode(copy_bw)
        if want("bench-xent"):
            bench_cross_entropy(copy_bw)
    print(f"total {time.perf_counter() - t0:.0f} s")
    lines = ["| what | measured | notes |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in TABLE]
    lines.append(f"\nfailures: {len(FAILURES)}" + (f" ({'; '.join(FAILURES)})" if FAILURES
                                                    else ""))
    table = "\n".join(lines)
    print("\n" + table)
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "benchmarks-cupy.md").write_text(table + "\n")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
