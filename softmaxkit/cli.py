"""The ``softmaxkit`` command: ``info``, ``verify`` and ``bench``.

``softmaxkit info``
    the installed backends and the dispatch table: for each operation, device type and dtype,
    the backend that wins, the others that could run it, and why the rest are not tried.
``softmaxkit verify [--backend NAME] [--target numpy|array_api_strict|torch-cpu|...]``
    the conformance kit against one backend (or every installed one): each case's status and
    how many checks it ran, then a count of passed, failed, unsupported and "ran nothing"
    cases per backend; the exit status is 1 when a case fails (a backend that fails to load
    fails every case).
``softmaxkit bench [--quick] [--ops ...] [--dtype ...] [--shapes ...] [--device cpu|cuda]
[--backends NAME ...]``
    times the operations on the default path next to the installed peers (see
    :mod:`softmaxkit.bench`), with ``--plot FILE.png`` for a chart.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .dtypes import FLOAT_DTYPES
from .ops import OPERATIONS


def _info(args: argparse.Namespace) -> int:
    from .registry import ENV_BLOCK, ENV_PRIORITIZE, backends, candidates

    found = backends()
    print("backends:")
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
            ops = ",".join(entry["ops"]) if entry["ops"] != ["*"] else "all operations"
            devices = ",".join(entry["devices"]) if entry["devices"] != ["*"] else "any device"
            dtypes = ",".join(entry["dtypes"]) if entry["dtypes"] != ["*"] else "any dtype"
            own = f" (priority {entry['priority']})" if "priority" in entry else ""
            print(f"  {'':<14}   serves {ops} on {devices} for {dtypes}{own}")
    print(f"environment: {ENV_PRIORITIZE} and {ENV_BLOCK} are read at discovery")

    devices = ["cpu", "cuda"]
    for b in found.values():
        for entry in b["serves"]:
            devices += [d for d in entry["devices"] if d != "*" and d not in devices]
    ops = args.op or list(OPERATIONS)
    devices = args.device or devices
    dtypes = args.dtype or list(FLOAT_DTYPES)
    hooked = {n for n, b in found.items() if b["can_run"] or b["should_run"]}
    rows = [("operation", "device", "dtype", "tried in order", "numpy runs on", "not tried")]
    for op in ops:
        for device in devices:
            for dtype in dtypes:
                order, left_out = candidates(op, device, dtype)
                not_tried = ", ".join(f"{n} ({_short(why)})" for n, why in left_out.items()
                                      if not why.startswith("does not serve"))
                tried = ", ".join(n + "?" * (n in hooked) for n in order)
                numpy_on = _numpy_winner(op, dtype) if device == "cpu" else ""
                rows.append((op, device, dtype, tried or "-", numpy_on or "-", not_tried or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    print("\ndispatch table: the first backend that accepts a call runs it; NAME? has "
          "can_run/should_run hooks that may decline a particular call; 'numpy runs on' asks "
          "them for a small numpy input")
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[5])
    return 0


def _numpy_winner(op: str, dtype: str) -> str:
    """The backend a small numpy call of a row operation gets here (hooks asked, no kernel
    run); empty for the operations whose inputs this does not build."""
    import array_api_compat.numpy as xp
    import numpy as np

    from .dtypes import lookup
    from .ops import Call
    from .registry import NoBackendError, choose

    try:
        x = np.zeros((2, 8), dtype=lookup(xp, dtype))
    except (ImportError, TypeError):  # bfloat16 without ml_dtypes
        return ""
    common = {"x": x, "where": None, "out_dtype": x.dtype}
    args = {
        "softmax": {**common, "masked": "zero"},
        "log_softmax": {**common, "masked": "zero"},
        "logsumexp": {**common, "b": None, "return_sign": False},
    }.get(op)
    if args is None:
        return ""
    try:
        return choose(Call(op, xp, "cpu", dtype, args))[0].name
    except (NoBackendError, ImportError) as exc:
        return f"none ({exc})".splitlines()[0]


def _short(reason: str) -> str:
    return "opt-in only" if reason.startswith("requires opt-in") else reason


def _verify(args: argparse.Namespace) -> int:
    from .registry import backends, failed_to_load
    from .testing import STATUSES, check_backend, target

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
    rows = [("backend", "case", "dtype", "status", "checks", "detail")]
    counts: dict[str, dict[str, int]] = {}
    for name in names:
        tally = counts.setdefault(name, dict.fromkeys(STATUSES, 0))
        for r in check_backend(name, target=t, ops=args.ops):
            tally[r.status] += 1
            if r.status in ("unsupported", "ran nothing") and not args.verbose:
                continue
            detail = r.message.splitlines()[0][:100] if r.message else ""
            rows.append((name, r.case, r.dtype, r.status.upper() if not r.passed else r.status,
                         str(r.checks), detail))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    print(f"conformance on target {t.name} (device {t.device}); checks: the backend's results "
          "each case compared with the spec")
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[5])
    for name, tally in counts.items():
        hidden = tally["unsupported"] + tally["ran nothing"]
        print(f"{name}: " + ", ".join(f"{tally[s]} {s}" for s in STATUSES)
              + ("" if args.verbose or not hidden else " (-v lists the last two)"))
        if name in failed_to_load():
            print(f"  {name} failed to load: {failed_to_load()[name]}")
        elif not tally["passed"] and not tally["failed"]:
            print(f"  nothing ran: {name} serves none of these cases on target {t.name}")
    return 1 if any(tally["failed"] for tally in counts.values()) else 0


def _shape(text: str) -> tuple[int, int]:
    try:
        rows, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not ROWSxN, e.g. 4096x4096") from None
    if rows < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r} must be positive")
    return rows, n


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    if args.device == "cuda" and not bench.cuda_available():
        print("--device cuda needs PyTorch with a visible CUDA device", file=sys.stderr)
        return 2
    shapes = args.shapes or (bench.QUICK_SHAPES if args.quick else bench.DEFAULT_SHAPES)
    try:
        result = bench.run(
            ops=args.ops or list(bench.OPERATIONS),
            dtypes=args.dtype or ["float32"],
            shapes=shapes,
            device=args.device,
            repeats=3 if args.quick else args.repeats,
            min_time=0.002 if args.quick else 0.02,
            progress=not args.no_progress,
            backends=args.backends or (),
        )
    except AssertionError as exc:
        print(f"softmaxkit gave a wrong result, so nothing was timed: {exc}", file=sys.stderr)
        return 1
    print(result.table())
    if args.plot:
        result.plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``softmaxkit`` command."""
    p = argparse.ArgumentParser(
        prog="softmaxkit", description="Inspect, verify and time softmaxkit's backends.")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="print the backends and the dispatch table")
    info.add_argument("--op", nargs="+", choices=list(OPERATIONS), help="only these operations")
    info.add_argument("--device", nargs="+", help="only these device types")
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
    verify.set_defaults(func=_verify)

    b = sub.add_parser("bench", help="time the operations next to the installed peers")
    b.add_argument("--quick", action="store_true", help="small shapes: seconds, not minutes")
    b.add_argument("--ops", nargs="+", choices=["softmax", "log_softmax", "logsumexp"])
    b.add_argument("--dtype", nargs="+", choices=FLOAT_DTYPES, help="default float32")
    b.add_argument("--shapes", nargs="+", type=_shape, help="ROWSxN, e.g. 4096x4096")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    b.add_argument("--repeats", type=int, default=5, help="timed repeats (the median is kept)")
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
