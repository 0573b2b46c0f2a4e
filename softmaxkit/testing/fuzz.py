"""Differential fuzzing: hypothesis draws inputs, a backend's answers meet the spec's.

For one backend, operation and target, :func:`fuzz` draws inputs with hypothesis (shapes,
non-contiguous views, axes, dtypes, masks, weights, targets, and special values: +-inf, NaN,
+-0, the dtype's largest and subnormal numbers, rows of one special value), runs the backend
strictly (``backend=``), and compares every result with an extended-precision reference of the
*represented* inputs under the bounds of :mod:`softmaxkit.testing.tolerance` (attention under
the spec's attention tolerances), forward and backward; summaries are compared with their
float64 definition, and merges of reference summaries of a row's chunks with the whole
row's.  A draw that the backend declines (its ``can_run`` hook says no) is counted, not
compared.  :func:`fuzz_all` does this for every
installed backend and every operation it serves on the target's device; on a GPU machine::

    python -m softmaxkit.testing.fuzz --target torch-cuda --backend numba-cuda cupy
    python -m softmaxkit.testing.fuzz --target cupy --backend cupy numba-cuda

prints one line per (backend, operation) and exits 1 on any disagreement.  This module draws
the inputs and runs the fuzzing; :mod:`softmaxkit.testing.fuzz_checks` holds the comparisons.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from ..registry import BackendLoadError, NoBackendError, _load, register, registry
from .fuzz_checks import CHECKS
from .kit import HEAD_DIMS, Target, target
from .tolerance import HUGE, TINY

ROW_OPS = ("softmax", "log_softmax", "logsumexp", "cross_entropy", "softmax_vjp",
           "log_softmax_vjp")
ATTENTION_OPS = ("attention", "attention_vjp")
SUMMARY_OPS = ("summarize", "merge")
OPS = ROW_OPS + SUMMARY_OPS + ATTENTION_OPS
"""The operations the fuzzer draws inputs for."""


# ------------------------------------------------------------------ drawing inputs


def _specials(dtype: str) -> list[float]:
    top = HUGE[dtype]
    return [math.inf, -math.inf, math.nan, 0.0, -0.0, top, -top, top / 4, -top / 4,
            TINY[dtype] / 4, -TINY[dtype] / 4]


@st.composite
def _values(draw: st.DrawFn, shape: tuple[int, ...], dtype: str, *, specials: bool = True,
            scale: float = 20.0, huge: bool = True) -> np.ndarray:
    """Float64 values of ``shape``: moderate numbers with a few special ones, and sometimes a
    row (along the last axis) of one special value."""
    size = math.prod(shape)
    seed = draw(st.integers(0, 2**32 - 1))
    a = np.random.default_rng(seed).normal(scale=draw(st.sampled_from([1.0, scale])),
                                           size=shape)
    if not specials or not size:
        return a
    pool = _specials(dtype) if huge else [v for v in _specials(dtype)
                                          if not math.isfinite(v) or abs(v) < 1e3]
    flat = a.reshape(-1)
    for _ in range(draw(st.integers(0, 3))):
        flat[draw(st.integers(0, size - 1))] = draw(st.sampled_from(pool))
    if a.ndim and a.shape[-1] and draw(st.booleans()) and draw(st.booleans()):
        rows = a.reshape(-1, a.shape[-1])
        rows[draw(st.integers(0, rows.shape[0] - 1))] = draw(st.sampled_from(pool))
    return a


@st.composite
def _shape_and_axis(draw: st.DrawFn, *, tuples: bool = True, none: bool = True,
                    min_side: int = 0) -> tuple[tuple[int, ...], Any]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(min_side, 6)) for _ in range(ndim))
    choices: list[Any] = [draw(st.integers(-ndim, ndim - 1))]
    if none:
        choices.append(None)
    if tuples and ndim >= 2:
        choices.append(tuple(draw(st.permutations(range(ndim)))[:2]))
    return shape, draw(st.sampled_from(choices))


VIEWS = ("contiguous", "strided", "transposed")


# ------------------------------------------------------------------ strategies per operation


def _mask(draw: st.DrawFn, shape: tuple[int, ...]) -> np.ndarray | None:
    if not draw(st.booleans()):
        return None
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).random(shape) < draw(st.sampled_from([0.3, 0.8]))


@st.composite
def _row_example(draw: st.DrawFn, op: str, dtypes: Sequence[str]) -> dict[str, Any]:
    dtype = draw(st.sampled_from(list(dtypes)))
    ex: dict[str, Any] = {"op": op, "dtype": dtype}
    if op == "cross_entropy":
        shape, axis = draw(_shape_and_axis(tuples=False, none=False))
        # differences of logits must stay inside the accumulator's range for a finite loss
        ex["x"] = draw(_values(shape, dtype, huge=False))
    elif op in ("softmax_vjp", "log_softmax_vjp"):
        shape, axis = draw(_shape_and_axis(tuples=False))
        ex["x"] = draw(_values(shape, dtype))
        ex["cotangent"] = draw(_values(shape, dtype, scale=3.0, huge=False))
    else:
        shape, axis = draw(_shape_and_axis())
        ex["x"] = draw(_values(shape, dtype))
    ex["axis"] = axis
    ex["view"] = draw(st.sampled_from(VIEWS))
    ex["where"] = _mask(draw, shape)
    ex["masked"] = draw(st.sampled_from(["zero", "nan"]))
    if op == "logsumexp":
        if draw(st.booleans()):
            seed = draw(st.integers(0, 2**32 - 1))
            choices = [0.0, 1.0, 0.5, 2.0] + ([-1.0, -0.25] if draw(st.booleans()) else [])
            b = np.random.default_rng(seed).choice(choices, size=shape)
            if b.size and draw(st.booleans()):
                b.reshape(-1)[draw(st.integers(0, b.size - 1))] = draw(
                    st.sampled_from([math.nan, 0.0]))
            ex["b"] = b
        else:
            ex["b"] = None
        ex["keepdims"] = draw(st.booleans())
        ex["return_sign"] = draw(st.booleans())
    if op == "cross_entropy":
        c = shape[axis]
        rows_shape = tuple(s for i, s in enumerate(shape) if i != axis % len(shape))
        ex["reduction"] = draw(st.sampled_from(["none", "sum", "mean"]))
        ex["label_smoothing"] = draw(st.sampled_from([0.0, 0.1]))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        if c and draw(st.booleans()):
            index = rng.integers(0, c, size=rows_shape)
            ex["ignore_index"] = draw(st.sampled_from([None, -100]))
            if ex["ignore_index"] is not None and index.size:
                index.reshape(-1)[rng.integers(0, index.size)] = -100
            ex["index"], ex["probs"] = index, None
        else:
            ex["index"], ex["probs"], ex["ignore_index"] = None, rng.random(shape), None
    return ex


@st.composite
def _summary_example(draw: st.DrawFn, op: str, dtypes: Sequence[str]) -> dict[str, Any]:
    dtype = draw(st.sampled_from(list(dtypes)))
    r, n = draw(st.integers(0, 4)), draw(st.integers(1, 8))
    ex: dict[str, Any] = {"op": op, "dtype": dtype,
                          "x": draw(_values((r, n), dtype, huge=False)),
                          "view": draw(st.sampled_from(VIEWS)), "where": _mask(draw, (r, n))}
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ex["values"] = rng.normal(size=(r, n, draw(st.integers(1, 3)))) if draw(
        st.booleans()) else None
    inner = sorted(set(draw(st.lists(st.integers(1, n), max_size=2)))) if n > 1 else []
    ex["cuts"] = [0, *[c for c in inner if c < n], n]
    return ex


@st.composite
def _attention_example(draw: st.DrawFn, op: str, dtypes: Sequence[str],
                       head_dims: Sequence[tuple[int, int]]) -> dict[str, Any]:
    dtype = draw(st.sampled_from(list(dtypes)))
    d, dv = draw(st.sampled_from(list(head_dims)))
    b, hk, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    lq, lk = draw(st.integers(1, 6)), draw(st.integers(1, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # scores of moderate spread: the spec's relative Frobenius tolerances of the gradients
    # assume a softmax that is not one-hot (a peaked row makes them ill-conditioned)
    spread = draw(st.sampled_from([0.5, 1.0]))
    ex: dict[str, Any] = {
        "op": op, "dtype": dtype,
        "q": rng.normal(scale=spread, size=(b, hk * group, lq, d)),
        "k": rng.normal(scale=spread, size=(b, hk, lk, d)),
        "v": rng.normal(size=(b, hk, lk, dv)),
        "causal": draw(st.sampled_from([False, True, "top_left"])),
        "window": draw(st.sampled_from([None, (2, 0), (1, 3), (-1, 1)])),
        "softcap": draw(st.sampled_from([None, 5.0])),
        "scale": draw(st.sampled_from([None, 2.0 / math.sqrt(d)])),
        "view": draw(st.sampled_from(("contiguous", "strided"))),
        "mask": _mask(draw, (lq, lk)),
    }
    if op == "attention_vjp":
        ex["dout"] = rng.normal(size=(b, hk * group, lq, dv))
    return ex


# ------------------------------------------------------------------ running


@dataclass
class FuzzResult:
    """The outcome of fuzzing one backend's operation on one target.

    Attributes
    ----------
    backend, op, target
        What was fuzzed, and where.
    dtypes
        The dtypes drawn (those the backend serves and the target has).
    examples
        Inputs drawn (shrinking included).
    compared
        Inputs the backend ran and whose results were compared.
    declined
        Inputs the backend's ``can_run`` hook declined.
    failure
        The first disagreement (after shrinking), with the input; empty when none.
    """

    backend: str
    op: str
    target: str
    dtypes: tuple[str, ...]
    examples: int = 0
    compared: int = 0
    declined: int = 0
    failure: str = ""

    @property
    def ok(self) -> bool:
        """No disagreement (and nothing crashed)."""
        return not self.failure


def _describe(ex: dict[str, Any]) -> str:
    with np.printoptions(threshold=60, precision=6):
        return ", ".join(f"{k}={v!r}" for k, v in ex.items())


def fuzz(
    backend: str,
    op: str,
    target_name: str | Target = "numpy",
    *,
    max_examples: int = 50,
    seed: int | None = 0,
    dtypes: Iterable[str] | None = None,
    head_dims: Iterable[tuple[int, int]] | None = None,
) -> FuzzResult:
    """Fuzz ``backend``'s ``op`` on a target against the spec's reference.

    Parameters
    ----------
    backend : str
        A registered backend's name; every call names it (``backend=``), so nothing falls
        back.
    op : str
        One of :data:`OPS`.
    target_name : str or Target, optional
        Where the inputs live: a name of :data:`softmaxkit.testing.kit.TARGETS`.
    max_examples : int, optional
        Inputs drawn (before shrinking a failure).
    seed : int or None, optional
        Hypothesis' seed, for a reproducible run; ``None`` explores new inputs each time.
    dtypes : iterable of str, optional
        Only these dtypes (default: every dtype the backend serves and the target has).
    head_dims : iterable of (int, int), optional
        ``(D, Dv)`` pairs for attention (default: the target's).

    Returns
    -------
    FuzzResult
        Counts, and the first disagreement found (empty when none).
    """
    if op not in CHECKS:
        raise ValueError(f"op={op!r} is not fuzzed: expected one of {OPS}")
    t = target_name if isinstance(target_name, Target) else target(target_name)
    chosen = registry().get(backend)
    if chosen is None:
        raise ValueError(f"backend={backend!r} is not registered")
    wanted = set(dtypes) if dtypes is not None else None
    served = tuple(d for d in t.dtypes if chosen.serves_key(op, t.device, d)
                   and (wanted is None or d in wanted))
    result = FuzzResult(backend, op, t.name, served)
    if not served:
        return result
    pairs = tuple(head_dims) if head_dims is not None else (t.head_dims or HEAD_DIMS)
    if op in ATTENTION_OPS:
        strategy = _attention_example(op, served, pairs)
    elif op in SUMMARY_OPS:
        strategy = _summary_example(op, served)
    else:
        strategy = _row_example(op, served)
    check = CHECKS[op]

    @settings(max_examples=max_examples, deadline=None, database=None, print_blob=False,
              derandomize=False, report_multiple_bugs=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(strategy)
    def run(ex: dict[str, Any]) -> None:
        result.examples += 1
        try:
            with np.errstate(all="ignore"):  # the references' own special values
                check(t, backend, ex)
        except BackendLoadError:
            raise
        except NoBackendError:
            result.declined += 1
            return
        except Exception as exc:
            raise AssertionError(f"{type(exc).__name__}: {exc}\n  input: {_describe(ex)}"
                                 ) from None
        result.compared += 1

    if seed is not None:
        run = hypothesis_seed(seed)(run)
    try:
        run()
    except AssertionError as exc:
        result.failure = str(exc)
    return result


def serving(op: str, t: Target) -> list[str]:
    """The registered backends that serve ``op`` on the target's device in some dtype."""
    return [name for name, b in registry().items()
            if any(b.serves_key(op, t.device, d) for d in t.dtypes)]


def fuzz_all(
    target_name: str | Target = "numpy",
    *,
    backends: Iterable[str] | None = None,
    ops: Iterable[str] | None = None,
    max_examples: int = 50,
    seed: int | None = 0,
    head_dims: Iterable[tuple[int, int]] | None = None,
    report: Callable[[FuzzResult], None] | None = None,
) -> list[FuzzResult]:
    """:func:`fuzz` every backend serving each operation on the target.

    Parameters
    ----------
    target_name, max_examples, seed, head_dims
        As for :func:`fuzz`.
    backends : iterable of str, optional
        Only these backends (default: every registered one serving the operation).
    ops : iterable of str, optional
        Only these operations (default :data:`OPS`).
    report : callable, optional
        Called with each result as soon as it is known.

    Returns
    -------
    list of FuzzResult
    """
    t = target_name if isinstance(target_name, Target) else target(target_name)
    names = list(backends) if backends is not None else None
    results = []
    for op in ops or OPS:
        for name in serving(op, t):
            if names is not None and name not in names:
                continue
            r = fuzz(name, op, t, max_examples=max_examples, seed=seed, head_dims=head_dims)
            if report is not None:
                report(r)
            results.append(r)
    return results


def _line(r: FuzzResult) -> str:
    status = "ok" if r.ok else "DISAGREES"
    line = (f"{r.backend:<12} {r.op:<16} {r.target:<11} {status:<9} {r.compared:>4} compared, "
            f"{r.declined:>3} declined, {r.examples:>4} drawn  ({', '.join(r.dtypes)})")
    return line + ("" if r.ok else "\n    " + r.failure.replace("\n", "\n    "))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m softmaxkit.testing.fuzz``: fuzz backends on a target; exit 1 on any
    disagreement, 2 when nothing was compared."""
    p = argparse.ArgumentParser(prog="python -m softmaxkit.testing.fuzz",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="numpy", help="numpy, torch-cpu, torch-cuda, cupy, ...")
    p.add_argument("--backend", nargs="+", help="backend names (default: every one serving)")
    p.add_argument("--ops", nargs="+", choices=OPS, help="only these operations")
    p.add_argument("--examples", type=int, default=100, help="inputs per backend and op")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (-1: random)")
    p.add_argument("--manifest", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="register a backend from its manifest function first (a backend on "
                        "sys.path whose entry point is not installed); repeatable")
    args = p.parse_args(argv)
    for path in args.manifest:
        manifest = _load(path)()
        if manifest["name"] not in registry():
            register(manifest)
    try:
        t = target(args.target)
    except ImportError as exc:
        print(f"target {args.target!r} is not available here: {exc}", file=sys.stderr)
        return 2
    print(f"differential fuzzing on target {t.name} (device {t.device}), "
          f"{args.examples} inputs per backend and operation")
    results = fuzz_all(t, backends=args.backend, ops=args.ops, max_examples=args.examples,
                       seed=None if args.seed < 0 else args.seed,
                       report=lambda r: print(_line(r), flush=True))
    bad = [r for r in results if not r.ok]
    compared = sum(r.compared for r in results)
    print(f"{len(results)} backend/operation pairs, {compared} inputs compared, "
          f"{len(bad)} disagreements")
    if bad:
        return 1
    return 0 if compared else 2


if __name__ == "__main__":
    sys.exit(main())
