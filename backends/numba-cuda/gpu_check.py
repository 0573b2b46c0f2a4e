"""Check and benchmark the numba-cuda backend on a CUDA GPU, in one run.

1. the conformance kit on the ``torch-cuda`` and ``cupy`` targets (default plans, and with
   a forced small plan so that the multi-tile path runs on the kit's shapes too);
2. the benchmark shapes, checked against float64 references computed by torch on fresh
   random inputs, with the outputs' memory poisoned before each checked call;
3. timings side by side in this run: a device-to-device copy (the bandwidth ceiling),
   softmaxkit (dispatched to numba-cuda) and torch, eager and replayed from a CUDA graph;
4. a table in markdown, printed last and written to ``$OUT/benchmarks-cuda.md``.

Run from the repository root::

    python backends/numba-cuda/gpu_check.py [--quick] [--skip-conformance] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

OUT = os.environ.get("OUT", "/tmp/softmaxkit-gpu-check")
ROW_OPS = ["softmax", "log_softmax", "logsumexp", "cross_entropy", "softmax_vjp",
           "log_softmax_vjp", "summarize", "merge"]
SHAPES = [(32768, 4096), (4096, 32768), (262144, 128), (256, 524288)]
CE_SHAPES = [(4096, 32768), (4096, 128256)]


def log(*args: Any) -> None:
    print(*args, flush=True)


# -- conformance -------------------------------------------------------------------------------


def ensure_registered() -> None:
    """Register the backend from its manifest when its entry point is not installed."""
    from softmaxkit import registry

    if "numba-cuda" not in registry.registry():
        from softmaxkit_numba_cuda.manifest import manifest

        registry.register(manifest())
        log("numba-cuda registered from its manifest (the entry point is not installed)")


def conformance_worker(target: str) -> None:
    """Run the kit on ``target`` (in a subprocess) and print one JSON line per case."""
    from softmaxkit.testing import check_backend

    ensure_registered()
    for r in check_backend("numba-cuda", target=target, ops=ROW_OPS):
        print("RESULT " + json.dumps(
            {"case": r.case, "dtype": r.dtype, "status": r.status, "message": r.message[:400]}
        ), flush=True)


def conformance(forced_plans: bool = True) -> list[dict[str, Any]]:
    """The kit on both CUDA targets, default and forced multi-tile plans, in parallel."""
    runs = []
    for target in ("torch-cuda", "cupy"):
        for forced in (None, "64,2") if forced_plans else (None,):
            env = dict(os.environ)
            if forced:
                env["SOFTMAXKIT_NUMBA_CUDA_PLAN"] = forced
            proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", target], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            runs.append((target, forced or "default", proc))
    rows = []
    for target, plan, proc in runs:
        out, _ = proc.communicate(timeout=300)
        with open(os.path.join(OUT, f"conformance-{target}-{plan.replace(',', 'x')}.log"),
                  "w") as f:
            f.write(out)
        got = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not got:
            log(f"conformance {target} plan={plan}: worker failed (rc={proc.returncode})")
            log(out[-3000:])
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


# -- checks on the benchmark shapes ------------------------------------------------------------


def poison(shape: tuple[int, ...], dtype: Any) -> None:
    """Fill a block of the caching allocator with NaN and free it, so the next result of this
    size lands on NaN: an element the kernel does not write shows up as an error."""
    import torch

    t = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del t


def relerr(got: Any, ref: Any) -> float:
    import torch

    got = got.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))


def check_rows(op: str, x: Any) -> float:
    import torch

    import softmaxkit as sk

    x64 = x.double()
    if op == "logsumexp":
        ref = torch.logsumexp(x64, -1)
        poison((x.shape[0],), x.dtype)
        got = sk.logsumexp(x, axis=-1, backend="numba-cuda")
    elif op == "softmax":
        ref = torch.softmax(x64, -1)
        poison(tuple(x.shape), x.dtype)
        got = sk.softmax(x, axis=-1, backend="numba-cuda")
    else:
        ref = torch.log_softmax(x64, -1)
        poison(tuple(x.shape), x.dtype)
        got = sk.log_softmax(x, axis=-1, backend="numba-cuda")
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


# -- benchmarks --------------------------------------------------------------------------------


def bench_rows(op: str, x: Any) -> dict[str, Any]:
    """Check, then time softmaxkit and torch on ``op`` over the rows of ``x``."""
    import torch

    import softmaxkit as sk

    err = check_rows(op, x)
    ours = {"softmax": sk.softmax, "log_softmax": sk.log_softmax,
            "logsumexp": sk.logsumexp}[op]
    theirs = {"softmax": torch.softmax, "log_softmax": torch.log_softmax,
              "logsumexp": torch.logsumexp}[op]
    nbytes = x.numel() * x.element_size()
    traffic = nbytes if op == "logsumexp" else 2 * nbytes
    t_eager = timed(lambda: ours(x, axis=-1))
    t_graph = timed_graph(lambda: ours(x, axis=-1))
    t_torch = timed(lambda: theirs(x, -1))
    return {
        "op": op, "dtype": str(x.dtype).split(".")[-1],
        "shape": f"{x.shape[0]}x{x.shape[1]}",
        "relerr": err, "eager": traffic / t_eager / 1e9,
        "graph": traffic / t_graph / 1e9 if t_graph else None,
        "torch": traffic / t_torch / 1e9, "t_us": (t_graph or t_eager) * 1e6,
    }


def bench_ce(x: Any, target: Any) -> dict[str, Any]:
    """Check, then time the fused cross-entropy (loss and gradient) against torch's."""
    import array_api_compat.torch as xpt
    import torch
    import torch.nn.functional as F
    from softmaxkit_numba_cuda import kernels

    import softmaxkit as sk

    err_loss, err_grad = check_ce(x, target)
    scale = torch.full((), 1.0 / x.shape[0], dtype=torch.float32, device="cuda")
    xt = x.detach().clone().requires_grad_(True)

    def fused() -> Any:
        return kernels.cross_entropy(
            xp=xpt, logits=x, index=target, probs=None, where=None, ignore_index=None,
            label_smoothing=0.0, grad_scale=scale, out_dtype=x.dtype)

    def public() -> Any:
        return sk.cross_entropy(x, target, return_grad=True)

    def torch_ce() -> Any:
        xt.grad = None
        F.cross_entropy(xt, target).backward()

    t_fused = timed(fused)
    t_graph = timed_graph(fused)
    t_public = timed(public)
    t_torch = timed(torch_ce)
    traffic = 2 * x.numel() * x.element_size()
    return {
        "op": "cross_entropy+grad", "dtype": str(x.dtype).split(".")[-1],
        "shape": f"{x.shape[0]}x{x.shape[1]}", "relerr": max(err_loss, err_grad),
        "eager": traffic / t_fused / 1e9,
        "graph": traffic / t_graph / 1e9 if t_graph else None,
        "torch": traffic / t_torch / 1e9, "t_us": (t_graph or t_fused) * 1e6,
        "public_us": t_public * 1e6, "torch_us": t_torch * 1e6,
    }


def copy_bandwidth() -> float:
    """GB/s (read + write) of a 1 GiB device-to-device copy by torch."""
    import torch

    src = torch.randn(128 * 2**20, device="cuda")
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() * 4 / t / 1e9


def bandwidth_table(quick: bool) -> tuple[list[dict[str, Any]], float]:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(1234)
    copy_gbs = copy_bandwidth()
    log(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    rows = []
    shapes = SHAPES if not quick else [(4096, 4096), (1024, 32768), (65536, 128), (64, 524288)]
    for dtype in (torch.float32, torch.bfloat16):
        for shape in shapes:
            x = (torch.randn(shape, device="cuda", generator=gen) * 3).to(dtype)
            for op in ("softmax", "log_softmax", "logsumexp"):
                try:
                    rows.append(bench_rows(op, x))
                    log(json.dumps(rows[-1]))
                except Exception:
                    log(f"{op} {dtype} {shape}: " + traceback.format_exc())
    for shape in CE_SHAPES if not quick else [(1024, 32768)]:
        try:
            x = (torch.randn(shape, device="cuda", generator=gen) * 3).to(torch.bfloat16)
            target = torch.randint(0, shape[1], (shape[0],), device="cuda", generator=gen)
            rows.append(bench_ce(x, target))
            log(json.dumps(rows[-1]))
        except Exception:
            log(f"cross_entropy {shape}: " + traceback.format_exc())
    return rows, copy_gbs


SWEEP = {
    ("float32", (32768, 4096)): ["128,16", "256,8", "512,4", "1024,2"],
    ("bfloat16", (32768, 4096)): ["64,16", "128,8", "256,4", "512,2"],
    ("float32", (4096, 32768)): ["1024,16", "1024,8", "512,16", "512,8"],
    ("bfloat16", (4096, 32768)): ["1024,8", "1024,4", "512,8", "256,8"],
    ("float32", (262144, 128)): ["32,2", "16,4", "8,8", "32,1"],
    ("bfloat16", (262144, 128)): ["32,1", "16,2", "8,4", "8,2"],
    ("float32", (256, 524288)): ["1024,8", "1024,4", "512,8", "256,8"],
    ("bfloat16", (256, 524288)): ["1024,4", "1024,2", "512,4", "1024,8"],
}
"""Plans ("threads,slots", slots in 8-byte words) timed for softmax on each shape."""


def sweep() -> list[dict[str, Any]]:
    """softmax under each plan of :data:`SWEEP`: checked, then timed from a CUDA graph."""
    import torch
    from softmaxkit_numba_cuda import plan

    import softmaxkit as sk

    gen = torch.Generator(device="cuda").manual_seed(99)
    out = []
    for (dname, shape), variants in SWEEP.items():
        x = (torch.randn(shape, device="cuda", generator=gen) * 3).to(getattr(torch, dname))
        traffic = 2 * x.numel() * x.element_size()
        for variant in variants:
            os.environ[plan.OVERRIDE] = variant
            try:
                err = check_rows("softmax", x)
                t = timed_graph(lambda x=x: sk.softmax(x, axis=-1, backend="numba-cuda"))
                out.append({"dtype": dname, "shape": f"{shape[0]}x{shape[1]}",
                            "plan": variant, "relerr": err, "gbs": traffic / t / 1e9})
                log(json.dumps(out[-1]))
            except Exception:
                log(f"sweep {dname} {shape} {variant}: " + traceback.format_exc()[-800:])
            finally:
                os.environ.pop(plan.OVERRIDE, None)
    return out


def markdown(rows: list[dict[str, Any]], copy_gbs: float, conf: list[dict[str, Any]],
             device: str, sweep_rows: list[dict[str, Any]] | None = None) -> str:
    lines = [
        f"Device: {device}. Device-to-device copy: {copy_gbs:.0f} GB/s (bytes read + written).",
        "",
        "GB/s count bytes read + written (softmax, log_softmax, cross_entropy: logits read, "
        "gradient written), bytes read for logsumexp. `graph`: softmaxkit calls replayed from "
        "a CUDA graph (kernel throughput); `eager`: plain Python calls (launch overhead "
        "included); torch eager. relerr: ||out - ref|| / ||ref|| against float64.",
        "",
        "| op | dtype | rows x cols | relerr | softmaxkit graph GB/s | eager GB/s | "
        "torch GB/s | graph / copy | vs torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        best = r["graph"] or r["eager"]
        lines.append(
            f"| {r['op']} | {r['dtype']} | {r['shape']} | {r['relerr']:.1e} | "
            f"{best:.0f} | {r['eager']:.0f} | {r['torch']:.0f} | {best / copy_gbs:.0%} | "
            f"{best / r['torch']:.2f}x |"
        )
    if sweep_rows:
        lines += ["", "softmax under other plans (threads, 8-byte words per thread), CUDA graph:",
                  "", "| dtype | rows x cols | plan | relerr | GB/s | / copy |",
                  "|---|---|---|---|---|---|"]
        for r in sweep_rows:
            lines.append(f"| {r['dtype']} | {r['shape']} | {r['plan']} | {r['relerr']:.1e} | "
                         f"{r['gbs']:.0f} | {r['gbs'] / copy_gbs:.0%} |")
    if conf:
        passed = sum(r["status"] == "passed" for r in conf)
        failed = sum(r["status"] == "failed" for r in conf)
        unsupported = sum(r["status"] == "unsupported" for r in conf)
        lines += ["", f"Conformance kit (torch-cuda and cupy targets, default and forced "
                  f"multi-tile plans): {passed} passed, {failed} failed, "
                  f"{unsupported} unsupported."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--skip-conformance", action="store_true")
    parser.add_argument("--default-plans", action="store_true",
                        help="run the kit with the default plans only")
    parser.add_argument("--sweep", action="store_true", help="also time softmax under other plans")
    args = parser.parse_args()
    if args.worker:
        conformance_worker(args.worker)
        return
    os.makedirs(OUT, exist_ok=True)
    import numpy
    import torch

    device = torch.cuda.get_device_name()
    log(f"{device}; python {sys.version.split()[0]}; numpy {numpy.__version__}; "
        f"torch {torch.__version__}")
    t0 = time.time()
    import numba
    from softmaxkit_numba_cuda import kernels  # noqa: F401  (applies the numpy 2.5 shim)

    log(f"numba {numba.__version__}; numpy has row_stack: {hasattr(numpy, 'row_stack')}")
    ensure_registered()
    conf = [] if args.skip_conformance else conformance(not args.default_plans)
    log(f"conformance done in {time.time() - t0:.0f} s")
    rows, copy_gbs = bandwidth_table(args.quick)
    sweep_rows = sweep() if args.sweep else []
    table = markdown(rows, copy_gbs, conf, device, sweep_rows)
    with open(os.path.join(OUT, "benchmarks-cuda.md"), "w") as f:
        f.write(table)
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump({"rows": rows, "copy_gbs": copy_gbs, "conformance": conf,
                   "sweep": sweep_rows}, f, indent=1)
    log(f"total {time.time() - t0:.0f} s")
    log(table)


if __name__ == "__main__":
    main()
