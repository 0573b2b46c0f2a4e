"""Check and benchmark the numba-cuda backend on a CUDA GPU, in one run.

1. the conformance kit on the ``torch-cuda`` and ``cupy`` targets, with the default plans and
   with a forced small plan (``64,1``) under which the kit's longer rows are split across
   blocks, one process per (target, plan, dtype);
2. each benchmark shape checked against a float64 reference computed by torch on fresh random
   inputs (softmax and log_softmax also on the same rows sorted ascending, one shifted by 3000
   and one a quarter -inf: :func:`hard_rows`), the outputs' memory poisoned with NaN before
   each checked call; a relerr above :data:`RELERR_LIMIT` is an error;
3. timings side by side in this run: a device-to-device copy (the bandwidth ceiling),
   softmaxkit (dispatched to numba-cuda) and torch, eager and replayed from a CUDA graph;
   with ``--sweep``, other row plans too;
4. a table in markdown, printed last and written to ``$OUT/benchmarks-cuda.md``.

Kernels compile on the CPU (numba), which takes seconds per kernel, so the work runs in
worker processes that compile in parallel (on a few rows of each shape, which take the same
plan) and take turns, under one lock, for everything that runs on the GPU at full size.

Run from the repository root::

    python backends/numba-cuda/tools/gpu_check.py [--quick] [--skip-conformance] [--sweep] \
        [--shapes 4096x32768,256x524288]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

OUT = os.environ.get("OUT", "/tmp/softmaxkit-gpu-check")
KIT_OPS = ["softmax", "log_softmax", "logsumexp", "cross_entropy", "softmax_vjp",
           "log_softmax_vjp", "summarize", "merge", "merge_attention"]
SHAPES = [(32768, 4096), (4096, 32768), (262144, 128), (256, 524288)]
QUICK_SHAPES = [(4096, 4096), (1024, 32768), (65536, 128), (64, 524288)]
CE_SHAPES = [(4096, 32768), (4096, 128256)]
MERGE_SHAPES = [(8, 64 * 32, 128)]
"""merge_attention (parts, rows, Dv): 8 key splits of a decode step, 64 x 32 query rows."""
FORCED_KIT_PLAN = "64,1"
PLAN_ENV = "SOFTMAXKIT_NUMBA_CUDA_PLAN"
"""The backend's settings (backends/numba-cuda/README.md), read when a worker imports it."""
STAGED_ENV = "SOFTMAXKIT_NUMBA_CUDA_STAGED"
STAGE_PLAN_ENV = "SOFTMAXKIT_NUMBA_CUDA_STAGE_PLAN"
CLUSTER_ENV = "SOFTMAXKIT_NUMBA_CUDA_CLUSTER"
PERSIST_ENV = "SOFTMAXKIT_NUMBA_CUDA_PERSIST"

def log(*args: Any) -> None:
    print(*args, flush=True)


def ensure_registered() -> None:
    """Register the backend from its manifest when its entry point is not installed."""
    from softmaxkit import registry

    if "numba-cuda" not in registry.registry():
        from softmaxkit_numba_cuda.manifest import manifest

        registry.register(manifest())


# -- conformance -------------------------------------------------------------------------------


def conformance_worker(target: str, dtype: str, group: int = 0, groups: int = 1) -> None:
    """Run every ``groups``-th case of the kit (from ``group``) on ``target`` for ``dtype`` and
    print one JSON line per case."""
    from softmaxkit.testing import kit

    ensure_registered()
    for i, c in enumerate(kit.cases(target, KIT_OPS, [dtype])):
        if i % groups != group:
            continue
        status, message = "passed", ""
        try:
            c.run("numba-cuda")
        except kit.Unsupported as exc:
            status, message = "unsupported", str(exc)
        except AssertionError as exc:
            status, message = "failed", str(exc)
        except Exception as exc:  # a crash is a failure, with its type
            status, message = "failed", f"{type(exc).__name__}: {exc}"
        print("RESULT " + json.dumps(
            {"case": c.name, "dtype": c.dtype, "status": status, "message": message[:400]}
        ), flush=True)


def conformance(forced_plans: bool = True, timeout: float = 200.0) -> list[dict[str, Any]]:
    """The kit on both CUDA targets, default and forced plans, every dtype, in parallel; a
    worker still running after ``timeout`` seconds is stopped and reported."""
    runs = []
    for target in ("torch-cuda", "cupy"):
        for forced in (None, FORCED_KIT_PLAN) if forced_plans else (None,):
            for dtype in ("float16", "bfloat16", "float32", "float64"):
                if target == "cupy" and dtype == "bfloat16":
                    continue  # CuPy has no bfloat16
                if forced and dtype in ("float16", "float64") and target == "cupy":
                    continue  # the split paths are the same code for every storage dtype
                env = dict(os.environ)
                env.pop(PLAN_ENV, None)
                if forced:
                    env[PLAN_ENV] = forced
                groups = 2  # compiling is the slow part: two processes per worker
                for group in range(groups):
                    proc = subprocess.Popen(
                        [sys.executable, __file__, "--worker", target, dtype, str(group),
                         str(groups)], env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    runs.append((target, forced or "default", dtype, proc))
    rows = []
    deadline = time.time() + timeout
    for target, plan, dtype, proc in runs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += "\nstopped: out of time"
            rows.append({"case": "(worker)", "dtype": dtype, "status": "failed",
                         "message": "stopped: out of time", "target": target, "plan": plan})
        if proc.returncode:
            with open(os.path.join(OUT, "conformance-failures.log"), "a") as f:
                f.write(f"== {target} plan={plan} {dtype}\n{out}\n")
        got = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not got:
            log(f"conformance {target} plan={plan} {dtype}: worker failed "
                f"(rc={proc.returncode})\n{out[-3000:]}")
        for r in got:
            r.update(target=target, plan=plan)
            rows.append(r)
            if r["status"] == "failed":
                log(f"FAILED {target} plan={plan} {r['case']}[{r['dtype']}]: {r['message']}")
    return rows


# -- timing ------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], iters: int = 10, reps: int = 7) -> float:
    """Median seconds per call of ``fn`` over ``reps`` event-timed loops of ``iters`` calls."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def timed_graph(fn: Callable[[], Any], iters: int = 10, reps: int = 7) -> float | None:
    """Like :func:`timed`, replaying ``fn`` captured in a CUDA graph (no launch overhead)."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        torch.cuda.synchronize()
    except Exception as exc:  # capture is not possible for every library
        log(f"graph capture failed: {type(exc).__name__}: {exc}")
        return None
    return timed(graph.replay, iters=1, reps=reps) / iters


def copy_bandwidth() -> float:
    """GB/s (read + write) of a 1 GiB device-to-device copy by torch."""
    import torch

    src = torch.randn(128 * 2**20, device="cuda")
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() * 4 / t / 1e9


# -- checks ------------------------------------------------------------------------------------


def poison(shape: tuple[int, ...], dtype: Any) -> None:
    """Fill a block of the caching allocator with NaN and free it, so the next result of this
    size lands on NaN: an element the kernel does not write shows up as an error."""
    import torch

    t = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del t


def relerr(got: Any, ref: Any) -> float:
    """``||got - ref|| / ||ref||`` over the finite entries of ``ref``; infinite unless ``got``
    is finite there and equal to ``ref`` elsewhere (-inf of log_softmax, say)."""
    import torch

    got = got.double()
    fin = torch.isfinite(ref)
    if not torch.isfinite(got[fin]).all() or not torch.equal(got[~fin], ref[~fin]):
        return float("inf")
    return float(torch.linalg.vector_norm(got[fin] - ref[fin])
                 / torch.linalg.vector_norm(ref[fin]))


RELERR_LIMIT = {"float32": 1e-5, "bfloat16": 1e-2}
"""Largest relerr a checked result may have: far above the kernels' (about 1e-7 and 2e-3) and
far below a wrong result's."""


def hard_rows(x: Any) -> Any:
    """``x`` with its rows sorted ascending, so each thread's maximum rises in every copy
    group; row 1 also shifted by 3000, row 2's first quarter -inf (copy groups that land while
    the maximum is -inf)."""
    import torch

    h = torch.sort(x.float(), dim=-1).values
    h[1] += 3000.0
    h[2, :h.shape[1] // 4] = float("-inf")
    return h.to(x.dtype)


def run_rows(op: str, x: Any) -> Any:
    import softmaxkit as sk

    return getattr(sk, op)(x, axis=-1, backend="numba-cuda")


def check_rows(op: str, x: Any) -> float:
    import torch

    x64 = x.double()
    ref = {"softmax": torch.softmax, "log_softmax": torch.log_softmax,
           "logsumexp": torch.logsumexp}[op](x64, -1)
    poison(tuple(ref.shape), x.dtype)
    got = run_rows(op, x)
    assert got.dtype == x.dtype and got.device == x.device
    return relerr(got, ref)


def check_ce(x: Any, target: Any) -> tuple[float, float]:
    import torch

    import softmaxkit as sk

    x64 = x.double().requires_grad_(True)
    ref_loss = torch.nn.functional.cross_entropy(x64, target)
    ref_loss.backward()
    poison(tuple(x.shape), x.dtype)
    loss, grad = sk.cross_entropy(x, target, return_grad=True, backend="numba-cuda")
    return relerr(loss.reshape(1), ref_loss.detach().reshape(1)), relerr(grad, x64.grad)


# -- benchmark jobs (worker processes) -----------------------------------------------------------


PLAN_OPTIONS = {"cluster": CLUSTER_ENV, "persist": PERSIST_ENV}
"""Plan options ``<prefix><value>`` of :func:`use_plan` and the setting each one sets."""


def use_plan(plan: str | None) -> None:
    """Force ``plan`` through the backend's settings, before the worker imports it:
    ``"threads,slots"``, then comma-separated options: ``staged`` (the plan of the rows
    staged in shared memory), ``registers`` (the register kernels, no staging), ``clusterN``
    (rows of up to N chunks clustered; ``cluster0``: no clusters, the chunks exchange through
    device memory), ``persist0`` (no persistent cluster grid; ``persistwide``: 128 KB chunks,
    one cluster a row; ``persistall``: rows of fewer chunks too)."""
    if not plan:
        return
    parts = plan.split(",")
    os.environ[STAGE_PLAN_ENV if "staged" in parts else PLAN_ENV] = ",".join(parts[:2])
    for extra in parts[2:]:
        if extra in ("staged", "registers"):
            os.environ[STAGED_ENV] = "1" if extra == "staged" else "0"
        else:
            prefix = next(p for p in PLAN_OPTIONS if extra.startswith(p))
            os.environ[PLAN_OPTIONS[prefix]] = extra[len(prefix):]

def _random(shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=gen) * 3).to(getattr(torch, dtype))


def rows_job(dtype: str, shape: tuple[int, int], ops: tuple[str, ...], plan: str | None,
             lock: Any, seed: int) -> list[dict[str, Any]]:
    """Check then time ``ops`` on rows of ``shape`` (with a forced ``plan`` in a sweep)."""
    import torch


    use_plan(plan)
    ensure_registered()
    for op in ops:  # compile on a few rows of the same length (the same plan)
        run_rows(op, _random((2, shape[1]), dtype, seed))
    torch.cuda.synchronize()
    out = []
    with lock:
        x = _random(shape, dtype, seed)
        nbytes = x.numel() * x.element_size()
        hard = hard_rows(x)
        for op in ops:
            try:
                err = check_rows(op, x)
                if op != "logsumexp":
                    err = max(err, check_rows(op, hard))
                if not err <= RELERR_LIMIT[dtype]:
                    raise AssertionError(f"relerr {err:.2e} above {RELERR_LIMIT[dtype]:.0e}")
                traffic = nbytes if op == "logsumexp" else 2 * nbytes
                theirs = {"softmax": torch.softmax, "log_softmax": torch.log_softmax,
                          "logsumexp": torch.logsumexp}[op]
                t_graph = timed_graph(lambda op=op: run_rows(op, x))
                row = {"op": op, "dtype": dtype, "shape": f"{shape[0]}x{shape[1]}",
                       "plan": plan or "default", "relerr": err,
                       "graph": traffic / t_graph / 1e9 if t_graph else None}
                if not plan:
                    t_eager = timed(lambda op=op: run_rows(op, x))
                    t_torch = timed(lambda theirs=theirs: theirs(x, -1))
                    row.update(eager=traffic / t_eager / 1e9, torch=traffic / t_torch / 1e9)
                out.append(row)
            except Exception:
                out.append({"op": op, "dtype": dtype, "shape": f"{shape[0]}x{shape[1]}",
                            "plan": plan or "default", "error": traceback.format_exc()[-1500:]})
    return out


def ce_job(shape: tuple[int, int], plan: str | None, lock: Any, seed: int) -> list[dict]:
    """Check then time the fused cross-entropy (loss and gradient) against torch's."""
    import array_api_compat.torch as xpt
    import torch
    import torch.nn.functional as F
    from softmaxkit_numba_cuda import rows as adapters

    import softmaxkit as sk

    use_plan(plan)
    ensure_registered()

    def fused(x: Any, target: Any, scale: Any) -> Any:
        return adapters.cross_entropy(
            xp=xpt, logits=x, index=target, probs=None, where=None, ignore_index=None,
            label_smoothing=0.0, grad_scale=scale, out_dtype=x.dtype)

    small = _random((2, shape[1]), "bfloat16", seed)
    small_t = torch.zeros(2, dtype=torch.int64, device="cuda")
    fused(small, small_t, torch.ones((), device="cuda"))
    sk.cross_entropy(small, small_t, return_grad=True, backend="numba-cuda")
    torch.cuda.synchronize()
    with lock:
        try:
            x = _random(shape, "bfloat16", seed)
            gen = torch.Generator(device="cuda").manual_seed(seed + 1)
            target = torch.randint(0, shape[1], (shape[0],), device="cuda", generator=gen)
            err_loss, err_grad = check_ce(x, target)
            scale = torch.full((), 1.0 / x.shape[0], dtype=torch.float32, device="cuda")
            xt = x.detach().clone().requires_grad_(True)

            def torch_ce() -> Any:
                xt.grad = None
                F.cross_entropy(xt, target).backward()

            t_graph = timed_graph(lambda: fused(x, target, scale))
            row = {"op": "cross_entropy+grad", "dtype": "bfloat16",
                   "shape": f"{shape[0]}x{shape[1]}", "plan": plan or "default",
                   "relerr": max(err_loss, err_grad)}
            traffic = 2 * x.numel() * x.element_size()
            row["graph"] = traffic / t_graph / 1e9 if t_graph else None
            if not plan:
                t_fused = timed(lambda: fused(x, target, scale))
                t_public = timed(lambda: sk.cross_entropy(x, target, return_grad=True,
                                                          backend="numba-cuda"))
                t_torch = timed(torch_ce)
                row.update(eager=traffic / t_fused / 1e9, torch=traffic / t_torch / 1e9,
                           public_us=t_public * 1e6, torch_us=t_torch * 1e6,
                           fused_us=(t_graph or t_fused) * 1e6)
            return [row]
        except Exception:
            return [{"op": "cross_entropy+grad", "dtype": "bfloat16",
                     "shape": f"{shape[0]}x{shape[1]}", "plan": plan or "default",
                     "error": traceback.format_exc()[-1500:]}]


def merge_job(dtype: str, shape: tuple[int, int, int], lock: Any, seed: int) -> list[dict]:
    """Check then time merge_attention_states against the reference backend on the GPU."""
    import torch

    import softmaxkit as sk

    ensure_registered()
    parts, rows, dv = shape
    acc = torch.float64 if dtype == "float64" else torch.float32

    def inputs(r: int) -> tuple[Any, Any]:
        outs = _random((parts, r, dv), dtype, seed)
        gen = torch.Generator(device="cuda").manual_seed(seed + 2)
        lses = (torch.randn((parts, r), device="cuda", generator=gen) * 4).to(acc)
        lses[0, ::7] = -float("inf")  # empty parts
        lses[:, 3] = -float("inf")  # a row with every part empty
        return outs, lses

    sk.merge_attention_states(*inputs(8), backend="numba-cuda")
    torch.cuda.synchronize()
    with lock:
        try:
            outs, lses = inputs(rows)
            ref_out, ref_lse = sk.merge_attention_states(outs.double(), lses.double(),
                                                         backend="reference")
            poison((rows, dv), outs.dtype)
            out, lse = sk.merge_attention_states(outs, lses, backend="numba-cuda")
            assert bool(torch.all(out[3] == 0)) and bool(torch.all(lse[3] == -float("inf")))
            fin = torch.isfinite(ref_lse)
            err = max(relerr(out, ref_out), relerr(lse[fin], ref_lse[fin]))
            traffic = (outs.numel() * outs.element_size() + lses.numel() * lses.element_size()
                       + out.numel() * out.element_size() + lse.numel() * lse.element_size())
            t_graph = timed_graph(lambda: sk.merge_attention_states(outs, lses,
                                                                    backend="numba-cuda"))
            t_ref = timed(lambda: sk.merge_attention_states(outs, lses, backend="reference"))
            return [{"op": "merge_attention", "dtype": dtype,
                     "shape": f"{parts}x{rows}x{dv}", "plan": "default", "relerr": err,
                     "graph": traffic / t_graph / 1e9 if t_graph else None,
                     "eager": None, "torch": traffic / t_ref / 1e9}]
        except Exception:
            return [{"op": "merge_attention", "dtype": dtype, "shape": f"{parts}x{rows}x{dv}",
                     "plan": "default", "error": traceback.format_exc()[-1500:]}]


def _job(args: tuple) -> list[dict[str, Any]]:
    import torch

    kind, params, lock = args
    torch.cuda.empty_cache()  # the previous job's arrays
    try:
        run = {"rows": rows_job, "ce": ce_job, "merge": merge_job, "profile": profile_job}
        return run[kind](*params, lock=lock, seed=1234)
    except Exception:
        return [{"op": kind, "dtype": "", "shape": str(params[:2]), "plan": "",
                 "error": traceback.format_exc()[-1500:]}]


SWEEP = {
    ("float32", (256, 524288)): ["256,16,staged,persistwide"],
    ("float32", (4096, 32768)): ["256,16,staged,cluster0"],
    ("bfloat16", (4096, 32768)): ["128,32,staged,persistall"],
}
"""Plans ("threads,slots[,options]", slots in 16-byte words, see :func:`use_plan`) timed for
softmax and log_softmax next to the default plans: 128 KB chunks without words kept in
registers at 256 x 524288 float32, the exchange through device memory instead of clusters at
4096 x 32768 float32, and bfloat16 rows of 32768 (one chunk) on the persistent grid."""
CE_SWEEP: dict[tuple[int, int], list[str]] = {
    (4096, 32768): ["256,16,staged", "128,4,registers"],
}


def profile_job(lock: Any, seed: int) -> list[dict[str, Any]]:
    """Where the time of an eager call goes on the host: cProfile of repeated calls."""
    import cProfile
    import io
    import pstats

    import torch

    ensure_registered()
    x = _random((65536, 128), "bfloat16", seed)
    run_rows("softmax", x)
    torch.cuda.synchronize()
    with lock:
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        for _ in range(200):
            run_rows("softmax", x)
        prof.disable()
        torch.cuda.synchronize()
        per_call = (time.perf_counter() - start) / 200 * 1e6
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with open(os.path.join(OUT, "profile.txt"), "w") as f:
        f.write(f"eager softmax 65536x128 bfloat16: {per_call:.0f} us per call\n")
        f.write(text.getvalue())
    return [{"op": "profile", "dtype": "bfloat16", "shape": "65536x128", "plan": "profile",
             "per_call_us": per_call}]


def jobs(quick: bool, sweep: bool, lock: Any, shapes: set[str] | None = None) -> list[tuple]:
    """The jobs of a run; ``shapes`` (``"RxC"`` names) keeps only the jobs on those shapes."""

    def kept(shape: tuple[int, ...]) -> bool:
        return shapes is None or "x".join(map(str, shape)) in shapes

    ops = ("softmax", "log_softmax", "logsumexp")
    todo = []
    for dtype in ("float32", "bfloat16"):
        for shape in QUICK_SHAPES if quick else SHAPES:
            if kept(shape):
                todo.append(("rows", (dtype, shape, ops, None), lock))
    for shape in [(1024, 32768)] if quick else CE_SHAPES:
        if kept(shape):
            todo.append(("ce", (shape, None), lock))
    for dtype in ("float32", "bfloat16"):
        for shape in MERGE_SHAPES:
            if kept(shape):
                todo.append(("merge", (dtype, shape), lock))
    if sweep:
        for (dtype, shape), plans in SWEEP.items():
            for plan in plans:
                if kept(shape):
                    todo.append(("rows", (dtype, shape, ("softmax", "log_softmax"), plan),
                                 lock))
        for shape, plans in CE_SWEEP.items():
            for plan in plans:
                if kept(shape):
                    todo.append(("ce", (shape, plan), lock))
    return todo


# -- report ------------------------------------------------------------------------------------


def markdown(rows: list[dict[str, Any]], copy_gbs: float, conf: list[dict[str, Any]],
             device: str) -> str:
    lines = [
        f"Device: {device}. Device-to-device copy: {copy_gbs:.0f} GB/s (bytes read + written).",
        "",
        "GB/s count bytes read + written (softmax, log_softmax, cross_entropy: logits read, "
        "gradient written; merge_attention: every input and output), bytes read for "
        "logsumexp. `graph`: softmaxkit calls replayed from a CUDA graph (kernel throughput); "
        "`eager`: plain Python calls (launch overhead included); torch eager (for "
        "merge_attention: the reference backend on the GPU). relerr: ||out - ref|| / ||ref|| "
        "against float64.",
        "",
        "| op | dtype | rows x cols | relerr | softmaxkit graph GB/s | eager GB/s | "
        "torch GB/s | graph / copy | vs torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("plan", "default") != "default" or "error" in r:
            continue
        best = r.get("graph") or r.get("eager")
        if not best:
            continue
        eager = f"{r['eager']:.0f}" if r.get("eager") else "-"
        lines.append(
            f"| {r['op']} | {r['dtype']} | {r['shape']} | {r['relerr']:.1e} | "
            f"{best:.0f} | {eager} | {r['torch']:.0f} | {best / copy_gbs:.0%} | "
            f"{best / r['torch']:.2f}x |")
    swept = [r for r in rows if r.get("plan", "default") != "default" and r.get("graph")]
    if swept:
        lines += ["", "Other plans (threads, 16-byte words per thread), CUDA graph:", "",
                  "| op | dtype | rows x cols | plan | relerr | GB/s | / copy |",
                  "|---|---|---|---|---|---|---|"]
        for r in swept:
            lines.append(f"| {r['op']} | {r['dtype']} | {r['shape']} | {r['plan']} | "
                         f"{r['relerr']:.1e} | {r['graph']:.0f} | {r['graph'] / copy_gbs:.0%} |")
    for r in rows:
        if "per_call_us" in r:
            lines.append(f"\nEager call on the host: softmax {r['shape']} {r['dtype']} takes "
                         f"{r['per_call_us']:.0f} us per call (profile in profile.txt).")
        if "public_us" in r:
            lines.append(f"\ncross_entropy {r['shape']}: fused kernel {r['fused_us']:.0f} us, "
                         f"public call (eager) {r['public_us']:.0f} us, torch forward + "
                         f"backward {r['torch_us']:.0f} us.")
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", f"Errors: {len(errors)} (see the log)."]
    if conf:
        passed = sum(r["status"] == "passed" for r in conf)
        failed = sum(r["status"] == "failed" for r in conf)
        unsupported = sum(r["status"] == "unsupported" for r in conf)
        lines += ["", f"Conformance kit (torch-cuda and cupy targets, default plans and "
                  f"{FORCED_KIT_PLAN} forced): {passed} passed, {failed} failed, "
                  f"{unsupported} unsupported."]
    return "\n".join(lines) + "\n"


ORDER = {"softmax": 0, "log_softmax": 1, "logsumexp": 2, "cross_entropy+grad": 3,
         "merge_attention": 4}


def _row_key(r: dict[str, Any]) -> tuple:
    shapes = [f"{a}x{b}" for a, b in SHAPES + QUICK_SHAPES + CE_SHAPES]
    shape = r.get("shape", "")
    return (r.get("plan") != "default", ORDER.get(r.get("op"), 9) >= 3,
            r.get("dtype") != "float32", shapes.index(shape) if shape in shapes else 99,
            ORDER.get(r.get("op"), 9), r.get("plan", ""))


def run_jobs(job: Callable[[tuple], list[dict[str, Any]]], todo: list[tuple], workers: int,
             deadline: float, first: Callable[[], Any], lock: Any, ctx: Any) -> tuple[Any, list]:
    """Run ``job`` over ``todo`` in ``workers`` processes; ``first()`` runs under ``lock``
    while they start.  Stops at ``deadline`` (``time.time()``), keeping what came back."""
    rows: list[dict[str, Any]] = []
    pool = ctx.Pool(workers, maxtasksperchild=1)  # a fresh process (and settings) per job
    try:
        pending = pool.imap_unordered(job, todo)
        with lock:
            ceiling = first()
        while True:
            try:
                got = pending.next(timeout=max(1.0, deadline - time.time()))
            except StopIteration:
                break
            except multiprocessing.TimeoutError:
                log(f"out of time: {len(todo) - len(rows)} jobs or fewer left undone")
                break
            for r in got:
                log(json.dumps(r))
            rows.extend(got)
    finally:
        pool.terminate()
    return ceiling, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--skip-conformance", action="store_true")
    parser.add_argument("--default-plans", action="store_true",
                        help="run the kit with the default plans only")
    parser.add_argument("--sweep", action="store_true", help="also time other row plans")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the host side of eager calls")
    parser.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1),
                        help="worker processes")
    parser.add_argument("--shapes", help="comma-separated RxC shapes: only the jobs on them")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds for the whole run; unfinished work is reported as such")
    args = parser.parse_args()
    if args.worker:
        target, dtype, group, groups = args.worker
        conformance_worker(target, dtype, int(group), int(groups))
        return
    t0 = time.time()
    os.makedirs(OUT, exist_ok=True)
    import numpy
    import torch

    device = torch.cuda.get_device_name()
    log(f"{device}; python {sys.version.split()[0]}; numpy {numpy.__version__}; "
        f"torch {torch.__version__}")
    conf = ([] if args.skip_conformance
            else conformance(not args.default_plans, timeout=0.55 * args.budget))
    log(f"conformance done in {time.time() - t0:.0f} s")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        lock = manager.Lock()
        todo = jobs(args.quick, args.sweep, lock,
                    set(args.shapes.split(",")) if args.shapes else None)
        if args.profile:
            todo.append(("profile", (), lock))
        copy_gbs, rows = run_jobs(_job, todo, args.jobs, t0 + args.budget - 15, copy_bandwidth,
                                  lock, ctx)
    log(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    rows.sort(key=_row_key)
    table = markdown(rows, copy_gbs, conf, device)
    with open(os.path.join(OUT, "benchmarks-cuda.md"), "w") as f:
        f.write(table)
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump({"rows": rows, "copy_gbs": copy_gbs, "conformance": conf}, f, indent=1)
    log(f"total {time.time() - t0:.0f} s")
    log(table)


if __name__ == "__main__":
    main()
