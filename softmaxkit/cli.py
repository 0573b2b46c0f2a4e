"""The ``softmaxkit`` command: ``info``, ``verify`` and ``bench``.

``softmaxkit info [--all]``
    what runs your arrays: for each device present here (``--all``: every device type a
    backend serves), the backend a small call of each operation and dtype gets; then the
    installed backends (and those that failed to load) and the dispatch table: the backends
    tried in order, and why the rest are not tried.
``softmaxkit verify [--backend NAME] [--target numpy|array_api_strict|...] [--jobs N]``
    the conformance kit against one backend (or every installed one), in this process or in
    N fresh ones: each case's status and how many checks it ran, then a count of passed,
    failed, unsupported and "ran nothing" cases per backend; the exit status is 1 when a
    case fails (a backend that fails to load fails every case).
``softmaxkit bench [--quick] [--ops ...] [--dtype ...] [--shapes ...] [--device cpu|cuda]
[--backends NAME ...]``
    times the operations on the default path next to the installed peers (see
    :mod:`softmaxkit.bench`), with ``--plot FILE.png`` for a chart; with ``--device cuda``
    and no ``--shapes``, the eager table of the large row shapes (figures as % of the copy
    bandwidth and ratios to torch, printed last).
``softmaxkit bench --calls [--device cpu|cuda] [--log FILE]``
    the cost of one call on small inputs, for each backend and the default dispatch, next to
    torch and SciPy (see :mod:`softmaxkit.callcost`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .dtypes import FLOAT_DTYPES
from .ops import OPERATIONS


def _devices_present() -> dict[str, str]:
    """The device types with a device here, each with the arrays that live there."""
    found = {"cpu": "numpy arrays and torch CPU tensors"}
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            found["cuda"] = (f"torch CUDA tensors and CuPy arrays; {n} device"
                             f"{'s' * (n > 1)}: {torch.cuda.get_device_name(0)}")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            found["mps"] = "torch MPS tensors"
    except ImportError:
        pass
    if "cuda" not in found:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                found["cuda"] = "CuPy arrays"
        except Exception:  # no CuPy, or no driver
            pass
    return found


def _info(args: argparse.Namespace) -> int:
    from .registry import ENV_BLOCK, ENV_PRIORITIZE, backends, candidates, failed_to_load

    found = backends()
    present = _devices_present()
    known = ["cpu", "cuda"]
    for b in found.values():
        for entry in b["serves"]:
            known += [d for d in entry["devices"] if d != "*" and d not in known]
    if args.device:
        devices = args.device
    elif args.all:
        devices = known
    else:
        devices = [d for d in known if d in present] + [d for d in present if d not in known]
    ops = args.op or list(OPERATIONS)
    dtypes = args.dtype or list(FLOAT_DTYPES)

    print("what runs your arrays here (the backend a small call gets; NAME? = the first "
          "candidate, whose hooks decide per call):")
    for device in devices:
        where_from = present.get(device, "no device of this type here")
        print(f"\n{device}: {where_from}")
        rows = [("  operation", *dtypes)]
        for op in ops:
            rows.append((f"  {op}", *(_winner(op, device, dtype, device in present)
                                      for dtype in dtypes)))
        _table(rows)
    hidden = [d for d in known if d not in devices]
    if hidden and not args.device:
        print(f"\n(no {', '.join(hidden)} device here: --all shows every device type)")

    print("\nbackends:")
    for name, b in found.items():
        prio = b["priority"]
        extras = [f"priority {prio.get('*', 0)}" if set(prio) <= {"*"} else f"priority {prio}"]
        if b["requires_opt_in"]:
            extras.append("opt-in only")
        hooks = [h for h in ("can_run", "should_run") if b[h]]
        if hooks:
            extras.append(" and ".join(hooks) + (" decide" if len(hooks) > 1 else " decides")
                          + " per call")
        print(f"  {name:<14} {b['source']}  ({'; '.join(extras)})")
        for entry in b["serves"]:
            e_ops = ",".join(entry["ops"]) if entry["ops"] != ["*"] else "all operations"
            e_devices = ",".join(entry["devices"]) if entry["devices"] != ["*"] else "any device"
            e_dtypes = ",".join(entry["dtypes"]) if entry["dtypes"] != ["*"] else "any dtype"
            own = f" (priority {entry['priority']})" if "priority" in entry else ""
            print(f"  {'':<14}   serves {e_ops} on {e_devices} for {e_dtypes}{own}")
    for name, reason in failed_to_load().items():
        print(f"  {name:<14} FAILED TO LOAD: {reason}")
    print(f"environment: {ENV_PRIORITIZE} and {ENV_BLOCK} are read at discovery")

    hooked = {n for n, b in found.items() if b["can_run"] or b["should_run"]}
    rows = [("  operation", "device", "dtype", "tried in order", "numpy runs on", "not tried")]
    for op in ops:
        for device in devices:
            for dtype in dtypes:
                order, left_out = candidates(op, device, dtype)
                not_tried = ", ".join(f"{n} ({_short(why)})" for n, why in left_out.items()
                                      if not why.startswith("does not serve"))
                tried = ", ".join(n + "?" * (n in hooked) for n in order)
                numpy_on = _sample_winner(op, "cpu", dtype) if device == "cpu" else ""
                rows.append((f"  {op}", device, dtype, tried or "-", numpy_on or "-",
                             not_tried or "-"))
    print("\ndispatch table: the first backend that accepts a call runs it; NAME? has "
          "can_run/should_run hooks that may decline a particular call; 'numpy runs on' asks "
          "them for a small numpy input")
    _table(rows)
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])


def _winner(op: str, device: str, dtype: str, present: bool) -> str:
    """The backend a small call of ``op`` gets on ``device`` (hooks asked, no kernel run);
    without a device or a way to build the call, the first candidate (``NAME?`` when its
    hooks decide per call)."""
    from .registry import backends, candidates

    if present:
        name = _sample_winner(op, device, dtype)
        if name:
            return name
    order, _ = candidates(op, device, dtype)
    if not order:
        return "none"
    found = backends()
    # a backend written for this device, before one that takes any device's arrays of its
    # own kind (Dask's)
    hooked = {n for n in order if found[n]["can_run"] or found[n]["should_run"]}
    first = next((n for n in order if any(device in e["devices"] for e in found[n]["serves"])),
                 next((n for n in order if n not in hooked), order[0]))
    return first + "?" * (first in hooked)


def _sample_winner(op: str, device: str, dtype: str) -> str:
    """The backend ``choose`` picks for a small call on ``device``; empty when no input can
    be built here (the library or dtype is missing, or the operation is a summary's)."""
    import array_api_compat

    from .ops import Call
    from .registry import NoBackendError, choose

    try:
        if device == "cpu":
            import numpy as np

            from .dtypes import lookup

            xp = array_api_compat.array_namespace(np.zeros(1))

            def make(shape: tuple[int, ...], dt: str) -> object:
                return np.zeros(shape, dtype=lookup(xp, dt))
        else:
            import torch

            if device not in ("cuda", "mps"):
                return ""
            xp = array_api_compat.array_namespace(torch.zeros(1))

            def make(shape: tuple[int, ...], dt: str) -> object:
                return torch.zeros(shape, dtype=getattr(torch, dt), device=device)

        args = _sample_args(op, make, dtype)
    except (ImportError, TypeError, AttributeError, RuntimeError):
        return ""
    if args is None:
        return ""
    try:
        return choose(Call(op, xp, device, dtype, args))[0].name
    except (NoBackendError, ImportError):
        return "none"


def _sample_args(op: str, make: Callable[[tuple[int, ...], str], Any],
                 dtype: str) -> dict[str, Any] | None:
    acc = "float64" if dtype == "float64" else "float32"
    x = make((2, 8), dtype)
    out_dtype = x.dtype  # type: ignore[attr-defined]
    q = make((1, 2, 4, 16), dtype)
    attn = {"q": q, "k": q, "v": q, "scale": 0.25, "causal": None, "window": (-1, -1),
            "mask": None, "softcap": None}
    return {
        "softmax": {"x": x, "where": None, "masked": "zero", "out_dtype": out_dtype},
        "log_softmax": {"x": x, "where": None, "masked": "zero", "out_dtype": out_dtype},
        "logsumexp": {"x": x, "b": None, "where": None, "return_sign": False,
                      "out_dtype": out_dtype},
        "cross_entropy": {"logits": x, "index": None, "probs": x, "where": None,
                          "ignore_index": None, "label_smoothing": 0.0, "grad_scale": None,
                          "out_dtype": out_dtype},
        "softmax_vjp": {"probs": x, "cotangent": x, "where": None, "out_dtype": out_dtype},
        "log_softmax_vjp": {"logprobs": x, "cotangent": x, "where": None,
                            "out_dtype": out_dtype},
        "attention": {**attn, "return_lse": False},
        "attention_vjp": {**attn, "out": q, "lse": make((1, 2, 4), acc), "dout": q},
    }.get(op)


def _short(reason: str) -> str:
    return "opt-in only" if reason.startswith("requires opt-in") else reason


def _kit_part(target_name: str, ops: list[str] | None, backend: str,
              indices: list[int]) -> list[Any]:
    """The results of the kit's cases ``indices`` for ``backend``, in a worker process."""
    from .testing import cases, run_cases, target

    selected = cases(target(target_name), ops)
    return list(run_cases(backend, [selected[i] for i in indices]))


def _kit_in_processes(names: list[str], selected: list[Any], target_name: str,
                      ops: list[str] | None, jobs: int) -> Iterator[tuple[str, Any]]:
    """``(backend, result)`` of every case, run in ``jobs`` fresh processes, each case's
    dtypes in one (so they share its compiled kernels), as each such group ends."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from .testing import CaseResult

    groups: dict[str, list[int]] = {}
    for i, c in enumerate(selected):
        groups.setdefault(c.name, []).append(i)
    # spawned, not forked: a CUDA context does not survive a fork
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {pool.submit(_kit_part, target_name, ops, name, indices): (name, indices)
                   for name in names for indices in groups.values()}
        for future in as_completed(futures):
            name, indices = futures[future]
            try:
                part = future.result()
            except Exception as exc:  # the worker raised or died: its cases fail, the rest go on
                part = [CaseResult(selected[i].name, selected[i].ops, selected[i].dtype,
                                   "failed", f"its worker process failed: {exc!r}")
                        for i in indices]
            for r in part:
                yield name, r


def _verify(args: argparse.Namespace) -> int:
    from .registry import backends, failed_to_load
    from .testing import STATUSES, cases, run_cases, target

    try:
        t = target(args.target)
    except ImportError as exc:
        print(f"target {args.target!r} is not available here: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    installed = {**failed_to_load(), **backends()}
    names = args.backend or list(installed)
    unknown = [n for n in names if n not in installed]
    if unknown:
        print(f"backend(s) {unknown} are not installed; installed: {sorted(installed)}",
              file=sys.stderr)
        return 2
    selected = cases(t, args.ops)
    head = ("backend", "case", "dtype", "status", "checks")
    widths = [max(len(head[0]), *map(len, names)),
              max([len(head[1]), *(len(c.name) for c in selected)]),
              max([len(head[2]), *(len(c.dtype) for c in selected)]),
              max(len(head[3]), *map(len, STATUSES)), len(head[4])]

    def line(cells: tuple[str, ...], detail: str) -> None:
        # each row as its case ends: a GPU backend compiling its kernels takes minutes
        print("  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
              + "  " + detail, flush=True)

    print(f"conformance on target {t.name} (device {t.device}); checks: the backend's results "
          "each case compared with the spec", flush=True)
    line(head, "detail")
    counts = {name: dict.fromkeys(STATUSES, 0) for name in names}
    if args.jobs > 1:
        results = _kit_in_processes(names, selected, args.target, args.ops, args.jobs)
    else:
        results = ((name, r) for name in names for r in run_cases(name, selected))
    for name, r in results:
        counts[name][r.status] += 1
        if r.status in ("unsupported", "ran nothing") and not args.verbose:
            continue
        detail = r.message.splitlines()[0][:100] if r.message else ""
        line((name, r.case, r.dtype, r.status.upper() if not r.passed else r.status,
              str(r.checks)), detail)
    for name, tally in counts.items():
        hidden = tally["unsupported"] + tally["ran nothing"]
        print(f"{name}: " + ", ".join(f"{tally[s]} {s}" for s in STATUSES)
              + ("" if args.verbose or not hidden else " (-v lists the last two)"))
        if name in failed_to_load():
            print(f"  {name} failed to load: {failed_to_load()[name]}")
        elif not tally["passed"] and not tally["failed"]:
            print(f"  nothing ran: {name} serves none of these cases on target {t.name}")
    return 1 if any(tally["failed"] for tally in counts.values()) else 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not ROWSxN, e.g. 4096x4096") from None
    if not 1 <= len(shape) <= 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r} must be N or ROWSxN, positive")
    return shape


def _write_log(path: str | None, text: str) -> None:
    if path:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
        print(f"full log written to {path}")


def _bench_calls(args: argparse.Namespace) -> int:
    from . import bench, callcost

    timings = callcost.run(
        device=args.device, ops=args.ops or callcost.OPS, dtypes=args.dtype or callcost.DTYPES,
        shapes=args.shapes or callcost.SHAPES,
        repeats=3 if args.quick else args.repeats or 7,
    )
    env = bench._environment(args.device, ["torch", "scipy", "jax"])
    full = callcost.table(timings)
    short = callcost.table(timings, full=False)
    _write_log(args.log, f"softmaxkit bench --calls\n{env}\n\n{full}\n\n{short}")
    print(full + "\n\n" + env + "\n" + short)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from . import bench, bench_cuda

    if args.device == "cuda" and not bench.cuda_available():
        print("--device cuda needs PyTorch with a visible CUDA device", file=sys.stderr)
        return 2
    if args.calls:
        return _bench_calls(args)
    if args.shapes and any(len(shape) != 2 for shape in args.shapes):
        print("softmaxkit bench: error: --shapes takes ROWSxN, e.g. 4096x4096 (a single N is "
              "for --calls)", file=sys.stderr)
        raise SystemExit(2)
    if args.ops and "cross_entropy" in args.ops:
        print("--ops cross_entropy is timed by --calls (and in the CUDA eager table)",
              file=sys.stderr)
        return 2
    eager = args.device == "cuda" and not args.shapes and not args.quick
    shapes = args.shapes or (bench.QUICK_SHAPES if args.quick else bench_cuda.EAGER_SHAPES if eager
                             else bench.DEFAULT_SHAPES)
    dtypes = args.dtype or (list(bench_cuda.EAGER_DTYPES) if eager else ["float32"])
    try:
        result = bench.run(
            ops=args.ops or list(bench.OPERATIONS),
            dtypes=dtypes,
            shapes=shapes,
            device=args.device,
            repeats=3 if args.quick else args.repeats or 5,
            min_time=0.002 if args.quick else 0.02,
            progress=not args.no_progress,
            backends=args.backends or (),
        )
    except AssertionError as exc:
        print(f"softmaxkit gave a wrong result, so nothing was timed: {exc}", file=sys.stderr)
        return 1
    text = result.table()
    if args.device == "cuda":
        summary = bench_cuda.eager_summary(result)
        if eager:
            summary += "\n\n" + bench_cuda.cross_entropy_eager()
        text += "\n\n" + summary
    _write_log(args.log, text)
    print(text)
    if args.plot:
        result.plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``softmaxkit`` command."""
    p = argparse.ArgumentParser(
        prog="softmaxkit", description="Inspect, verify and time softmaxkit's backends.")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="what runs your arrays: per device here, the backends "
                                       "and the dispatch table")
    info.add_argument("--op", nargs="+", choices=list(OPERATIONS), help="only these operations")
    info.add_argument("--device", nargs="+", help="only these device types")
    info.add_argument("--all", action="store_true",
                      help="every device type a backend serves, not only those present here")
    info.add_argument("--dtype", nargs="+", choices=FLOAT_DTYPES, help="only these dtypes")
    info.set_defaults(func=_info)

    verify = sub.add_parser("verify", help="run the conformance kit against backends")
    verify.add_argument("--backend", nargs="+", help="backend names (default: every installed)")
    verify.add_argument("--target", default="numpy",
                        help="array library and device: numpy, array_api_strict, torch-cpu, "
                             "torch-cuda, cupy (default numpy)")
    verify.add_argument("--ops", nargs="+", choices=list(OPERATIONS),
                        help="only cases of these operations")
    verify.add_argument("-v", "--verbose", action="store_true",
                        help="also list the unsupported cases and those that ran nothing")
    verify.add_argument("--jobs", type=_positive, default=1, metavar="N",
                        help="run the cases in N fresh processes (a GPU backend's kernels "
                             "compile side by side; rows come as each case ends, in any "
                             "order; default 1: in this process)")
    verify.set_defaults(func=_verify)

    b = sub.add_parser("bench", help="time the operations next to the installed peers")
    b.add_argument("--quick", action="store_true", help="small shapes: seconds, not minutes")
    b.add_argument("--calls", action="store_true",
                   help="per-call time on small inputs, each backend and the default dispatch "
                        "next to torch and SciPy (see softmaxkit.callcost)")
    b.add_argument("--ops", nargs="+",
                   choices=["softmax", "log_softmax", "logsumexp", "cross_entropy"])
    b.add_argument("--log", metavar="FILE", help="also write the full output to FILE")
    b.add_argument("--dtype", nargs="+", choices=FLOAT_DTYPES, help="default float32")
    b.add_argument("--shapes", nargs="+", type=_shape, help="ROWSxN, e.g. 4096x4096")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    b.add_argument("--repeats", type=int,
                   help="timed repeats, the median kept (default 5; --calls: 7 rounds)")
    b.add_argument("--backends", nargs="+", metavar="NAME",
                   help="also time these backends on their own, next to the default choice")
    b.add_argument("--plot", metavar="FILE.png", help="save a chart of GB/s")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``softmaxkit`` command with ``argv`` (default: ``sys.argv[1:]``)."""
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # the output was piped into a reader that stopped (head)
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
