"""Conformance cases for the row operations (softmax, log_softmax, logsumexp, cross_entropy,
softmax_vjp, log_softmax_vjp).

Three kinds of case, each run for every dtype the target has:

* the golden vectors of spec/vectors/ (mpmath), in the dtypes that represent their inputs;
* random rows against an extended-precision reference of the represented inputs, under the
  error bounds of spec/semantics.md ("Error bounds"), with masks and every policy;
* floating-point hygiene: no warning for any input whose answer is finite (fully masked rows
  included), results in the caller's array library and dtype, inputs left untouched.

The extended-precision references are in :mod:`softmaxkit.testing.row_references`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import softmaxkit as sk

from ..dtypes import dtype_name
from ..registry import BackendLoadError, NoBackendError
from . import vectors
from .kit import Target, Unsupported, case
from .row_references import (
    LD,
    _ref_cross_entropy,
    _rows,
    ref_log_softmax,
    ref_logsumexp,
    ref_softmax,
)
from .tolerance import (
    HUGE,
    assert_within,
    fit_range,
    log_bound,
    normalization_bound,
    softmax_bound,
    vjp_bound,
)

ROW_OPS = ("softmax", "log_softmax", "logsumexp", "cross_entropy", "softmax_vjp",
           "log_softmax_vjp")


# ------------------------------------------------------------------ helpers


@contextmanager
def strict_fp() -> Iterator[None]:
    """Turn every warning, and numpy's divide / overflow / invalid flags, into exceptions.

    Underflow stays silent: a shifted exponential below the smallest normal number is a
    probability below the format's resolution, and flushing it is the spec's behaviour.
    """
    with warnings.catch_warnings(), np.errstate(divide="raise", over="raise", invalid="raise"):
        warnings.simplefilter("error")
        yield


def _represented(t: Target, a: np.ndarray, dtype: str) -> tuple[Any, np.ndarray]:
    """``a`` on the target in ``dtype``, and the float64 values it represents there."""
    arr = t.asarray(a, dtype)
    return arr, t.to_numpy(arr)


def _masked(x: np.ndarray, where: np.ndarray | None) -> np.ndarray:
    return x if where is None else np.where(where, x, -np.inf)


def _same_library(t: Target, out: Any, what: str) -> None:
    import array_api_compat

    got = array_api_compat.array_namespace(out)
    want = array_api_compat.array_namespace(t.asarray(np.zeros(1), None))
    assert got is want, f"{what}: result is a {got.__name__} array, expected {want.__name__}"


def _check_dtype(out: Any, dtype: str, what: str) -> None:
    name = dtype_name(out.dtype)
    assert name == dtype, f"{what}: output dtype {name}, expected {dtype}"


def _run_parts(parts: dict[str, Callable[[], None]]) -> None:
    """Run each operation's part of a case.  A part whose operation the backend does not
    serve is skipped; the case is unsupported when some part was declined and no other part
    called the backend (a part with nothing to check in this dtype calls nothing)."""
    declined, ran = [], 0
    with sk.backend_opts() as trace:  # the runner's record of the backend's calls
        for op, part in parts.items():
            before = len(trace)
            try:
                part()
            except BackendLoadError:
                raise  # a backend that fails to load fails the case
            except NoBackendError as exc:
                declined.append(f"{op}: {exc}")
            ran += len(trace) - before
    if declined and not ran:
        raise Unsupported("; ".join(declined))


# ------------------------------------------------------------------ golden vectors


def _vector_cases(stem: str, dtype: str) -> Iterator[dict[str, Any]]:
    """The golden vectors of spec/vectors/``stem``.json whose inputs ``dtype`` represents."""
    yield from (v for v in vectors.load(stem) if dtype in v["dtypes"])


def _check_normalizer(t: Target, dtype: str, backend: str, log: bool) -> None:
    op = sk.log_softmax if log else sk.softmax
    for v in _vector_cases("log_softmax" if log else "softmax", dtype):
        what = f"{op.__name__} vector {v['name']}"
        x = vectors.array(v["x"], v["shape"])
        where = vectors.array(v["where"], v["shape"])
        axis = vectors.axis(v["axis"])
        xt = t.asarray(x, dtype)
        wt = None if where is None else t.asarray(where, None)
        if v["masked"] == "raise":
            try:
                op(xt, axis=axis, where=wt, masked="raise", backend=backend)
            except sk.EmptyRowError:
                continue
            raise AssertionError(f"{what}: masked='raise' did not raise EmptyRowError")
        out = op(xt, axis=axis, where=wt, masked=v["masked"], backend=backend)
        _check_dtype(out, dtype, what)
        expected = vectors.array(v["expected"], v["shape"])
        got = t.to_numpy(out)
        rows, _ = _rows(_masked(x, where), axis)
        if log:
            bound = log_bound(expected, max(rows.shape[-1], 1), dtype)
        else:
            erows, back = _rows(expected, axis)
            bound = back(softmax_bound(erows, rows, rows.shape[-1], dtype))
        assert_within(got, expected, bound, f"{what} [{dtype}]")


@case("softmax")
def case_softmax_vectors(t: Target, dtype: str, backend: str) -> None:
    """spec/vectors/softmax.json: seed example, sigmoid family, edges, policies."""
    _check_normalizer(t, dtype, backend, log=False)


@case("log_softmax")
def case_log_softmax_vectors(t: Target, dtype: str, backend: str) -> None:
    """spec/vectors/log_softmax.json."""
    _check_normalizer(t, dtype, backend, log=True)


@case("logsumexp")
def case_logsumexp_vectors(t: Target, dtype: str, backend: str) -> None:
    """spec/vectors/logsumexp.json: b weights, return_sign, keepdims, axis tuples, edges."""
    for v in _vector_cases("logsumexp", dtype):
        what = f"logsumexp vector {v['name']} [{dtype}]"
        a = vectors.array(v["a"], v["shape"])
        b = vectors.array(v["b"], v["b_shape"]) if v["b"] is not None else None
        shape = a.shape if b is None else np.broadcast_shapes(a.shape, b.shape)
        where = vectors.array(v["where"], shape)
        at = t.asarray(a, dtype)
        bt = None if b is None else t.asarray(b, dtype)
        wt = None if where is None else t.asarray(where, None)
        res = sk.logsumexp(at, axis=vectors.axis(v["axis"]), b=bt, keepdims=v["keepdims"],
                           return_sign=v["return_sign"], where=wt, backend=backend)
        lse = res[0] if v["return_sign"] else res
        _check_dtype(lse, dtype, what)
        expected = vectors.array(v["expected"], v["expected_shape"])
        n = max(math.prod(shape) // max(expected.size, 1), 1)
        assert_within(t.to_numpy(lse), expected, log_bound(expected, n, dtype), what)
        if v["return_sign"]:
            sign = vectors.array(v["sign"], v["expected_shape"])
            assert_within(t.to_numpy(res[1]), sign, 0.0, what + " sign")


@case("cross_entropy")
def case_cross_entropy_vectors(t: Target, dtype: str, backend: str) -> None:
    """spec/vectors/cross_entropy.json: index and probability targets, smoothing, ignore."""
    for v in _vector_cases("cross_entropy", dtype):
        what = f"cross_entropy vector {v['name']} [{dtype}]"
        x = vectors.array(v["logits"], v["shape"])
        where = vectors.array(v["where"], v["shape"])
        if v["target_kind"] == "index":
            target = t.asarray(np.asarray(v["target"], dtype=np.int64).reshape(
                v["target_shape"]), None)
        else:
            target = t.asarray(vectors.array(v["target"], v["target_shape"]), dtype)
        loss, grad = sk.cross_entropy(
            t.asarray(x, dtype), target, reduction=v["reduction"],
            ignore_index=v["ignore_index"], label_smoothing=v["label_smoothing"],
            where=None if where is None else t.asarray(where, None),
            return_grad=True, backend=backend,
        )
        _check_dtype(loss, dtype, what)
        _check_dtype(grad, dtype, what)
        n = x.shape[-1] + (x.shape[0] if v["reduction"] != "none" else 0)
        expected = vectors.array(v["loss"], v["loss_shape"])
        finite = np.abs(x[np.isfinite(x)])
        largest = finite.max() if finite.size else 0.0
        mag = np.abs(expected) + largest * (x.shape[0] if v["reduction"] == "sum" else 1)
        assert_within(t.to_numpy(loss), expected, log_bound(mag, n, dtype), what + " loss")
        g = vectors.array(v["grad"], v["shape"])
        scale = np.abs(g) + 2.0
        assert_within(t.to_numpy(grad), g, vjp_bound(g, scale, n, dtype), what + " grad")


@case("softmax_vjp", "log_softmax_vjp")
def case_vjp_vectors(t: Target, dtype: str, backend: str) -> None:
    """spec/vectors/vjp.json: dyadic probabilities, masked rows, -inf log-probabilities."""

    def part(op: str) -> Callable[[], None]:
        def run() -> None:
            for v in _vector_cases("vjp", dtype):
                if v["op"] == op:
                    _check_vjp_vector(t, dtype, backend, v)

        return run

    _run_parts({op: part(op) for op in ("softmax_vjp", "log_softmax_vjp")})


def _check_vjp_vector(t: Target, dtype: str, backend: str, v: dict[str, Any]) -> None:
    what = f"{v['op']} vector {v['name']} [{dtype}]"
    fn = getattr(sk, v["op"])
    primal = vectors.array(v["primal"], v["shape"])
    cot = vectors.array(v["cotangent"], v["shape"])
    where = vectors.array(v["where"], v["shape"])
    out = fn(t.asarray(primal, dtype), t.asarray(cot, dtype), axis=v["axis"],
             where=None if where is None else t.asarray(where, None), backend=backend)
    _check_dtype(out, dtype, what)
    expected = vectors.array(v["expected"], v["shape"])
    scale = np.abs(cot) + np.abs(cot).sum(-1, keepdims=True)
    if v["op"] == "log_softmax_vjp":
        scale = scale * (1 + np.where(np.isfinite(primal), np.abs(primal), 0))
    assert_within(t.to_numpy(out), expected,
                  vjp_bound(expected, scale, v["shape"][-1], dtype), what)


# ------------------------------------------------------------------ random rows


def _random_logits(seed: int, shape: tuple[int, ...], scale: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(scale=scale, size=shape)


SHAPES = (((7, 33), -1, 4.0), ((3, 5, 6), (0, 2), 10.0), ((2, 300), -1, 30.0), ((4,), None, 1.0))


@case("softmax", "log_softmax")
def case_random_rows(t: Target, dtype: str, backend: str) -> None:
    """softmax and log_softmax of random rows (several shapes, axes and logit scales)."""
    inputs = []
    for i, (shape, axis, scale) in enumerate(SHAPES):
        xt, x = _represented(t, _random_logits(i, shape, scale), dtype)
        inputs.append((shape, axis, xt, _rows(x, axis)[0]))

    def softmax_part() -> None:
        for shape, axis, xt, rows in inputs:
            n = rows.shape[-1]
            p = sk.softmax(xt, axis=axis, backend=backend)
            _check_dtype(p, dtype, "softmax")
            _same_library(t, p, "softmax")
            ref = ref_softmax(rows)
            got = _rows(t.to_numpy(p), axis)[0]
            assert_within(got, ref, softmax_bound(ref, rows, n, dtype),
                          f"softmax {shape} [{dtype}]")
            err = np.abs(got.sum(-1) - 1.0).max()
            assert err <= normalization_bound(n, dtype), (
                f"softmax {shape} [{dtype}]: |sum p - 1| = {err:.3g} exceeds "
                f"{normalization_bound(n, dtype):.3g}"
            )

    def log_softmax_part() -> None:
        for shape, axis, xt, rows in inputs:
            lp = sk.log_softmax(xt, axis=axis, backend=backend)
            _check_dtype(lp, dtype, "log_softmax")
            _same_library(t, lp, "log_softmax")
            ref = ref_log_softmax(rows)
            assert_within(_rows(t.to_numpy(lp), axis)[0], ref,
                          log_bound(ref, rows.shape[-1], dtype), f"log_softmax {shape} [{dtype}]")

    _run_parts({"softmax": softmax_part, "log_softmax": log_softmax_part})


@case("logsumexp")
def case_random_logsumexp(t: Target, dtype: str, backend: str) -> None:
    """logsumexp of random rows, with and without weights (some negative, some zero)."""
    rng = np.random.default_rng(7)
    for i, (shape, axis, scale) in enumerate(SHAPES):
        at, a = _represented(t, _random_logits(10 + i, shape, scale), dtype)
        rows, _ = _rows(a, axis)
        n = max(rows.shape[-1], 1)
        got = sk.logsumexp(at, axis=axis, backend=backend)
        _check_dtype(got, dtype, "logsumexp")
        ref, _ = ref_logsumexp(rows)
        assert_within(t.to_numpy(got).reshape(-1), ref, log_bound(ref, n, dtype),
                      f"logsumexp {shape} [{dtype}]")
        b_np = rng.choice([0.0, 0.5, 1.0, 2.0, -0.25], size=shape)
        bt, b = _represented(t, b_np, dtype)
        lse, sign = sk.logsumexp(at, axis=axis, b=bt, return_sign=True, keepdims=True,
                                 backend=backend)
        ref, ref_sign = ref_logsumexp(rows, _rows(b, axis)[0])
        # cancellation makes the relative error of the sum unbounded; compare where the sum
        # keeps at least half of its largest term's magnitude
        got = t.to_numpy(lse).reshape(-1)
        terms = np.abs(_rows(b, axis)[0]) * np.exp(rows - np.max(rows, -1, keepdims=True))
        with np.errstate(divide="ignore"):
            big = np.log(terms.sum(-1)) + np.max(rows, -1)
        stable = ref >= big - 1.0
        assert_within(t.to_numpy(sign).reshape(-1)[stable], ref_sign[stable], 0.0,
                      f"logsumexp sign {shape} [{dtype}]")
        assert_within(got[stable], ref[stable],
                      log_bound(np.abs(ref[stable]) + np.abs(big[stable]), n, dtype),
                      f"logsumexp weighted {shape} [{dtype}]")


@case("softmax", "log_softmax", "logsumexp")
def case_masks_and_policies(t: Target, dtype: str, backend: str) -> None:
    """where= masks (fully masked rows included) under every policy; where=False == -inf."""
    rng = np.random.default_rng(3)
    xt, x = _represented(t, _random_logits(3, (6, 9), 3.0), dtype)
    where = rng.random((6, 9)) < 0.6
    where[1] = False  # a fully masked row
    where[4] = True
    wt = t.asarray(where, None)
    xm = np.where(where, x, -np.inf)
    xmt = t.asarray(xm, dtype)  # exclusion by -inf logits has the same spec answer

    def normalizer(op: Callable, log: bool) -> Callable[[], None]:
        def run() -> None:
            name = op.__name__
            for masked in ("zero", "nan"):
                got = t.to_numpy(op(xt, axis=-1, where=wt, masked=masked, backend=backend))
                ref = ref_log_softmax(xm, masked) if log else ref_softmax(xm, masked)
                bound = log_bound(ref, 9, dtype) if log else softmax_bound(ref, xm, 9, dtype)
                assert_within(got, ref, bound, f"{name} masked={masked} [{dtype}]")
            got = t.to_numpy(op(xmt, axis=-1, backend=backend))
            ref = ref_log_softmax(xm) if log else ref_softmax(xm)
            bound = log_bound(ref, 9, dtype) if log else softmax_bound(ref, xm, 9, dtype)
            assert_within(got, ref, bound, f"{name} of -inf logits [{dtype}]")
            try:
                op(xt, axis=-1, where=wt, masked="raise", backend=backend)
            except sk.EmptyRowError:
                pass
            else:
                raise AssertionError(f"{name}: masked='raise' accepted a fully masked row")
            op(xt, axis=-1, where=t.asarray(np.ones((6, 9), bool), None), masked="raise",
               backend=backend)

        return run

    def logsumexp_part() -> None:
        ref, _ = ref_logsumexp(xm)
        for got in (sk.logsumexp(xt, axis=-1, where=wt, backend=backend),
                    sk.logsumexp(xmt, axis=-1, backend=backend)):
            assert_within(t.to_numpy(got), ref, log_bound(ref, 9, dtype),
                          f"logsumexp where= [{dtype}]")

    _run_parts({"softmax": normalizer(sk.softmax, False),
                "log_softmax": normalizer(sk.log_softmax, True),
                "logsumexp": logsumexp_part})


@case("softmax", "log_softmax")
def case_long_rows(t: Target, dtype: str, backend: str) -> None:
    """Rows of 4096: normalization, and no stagnation of a 16-bit accumulator."""
    xt, x = _represented(t, _random_logits(5, (2, 4096), 2.0), dtype)
    # equal logits: every probability is exactly 2**-12 in real arithmetic
    flat = t.asarray(np.full((1, 4096), 3.0), dtype)

    def softmax_part() -> None:
        got = t.to_numpy(sk.softmax(xt, axis=-1, backend=backend))
        err = np.abs(got.sum(-1) - 1.0).max()
        assert err <= normalization_bound(4096, dtype), f"|sum p - 1| = {err:.3g} [{dtype}]"
        got = t.to_numpy(sk.softmax(flat, axis=-1, backend=backend))
        ref = np.full((1, 4096), 2.0**-12)
        assert_within(got, ref, softmax_bound(ref, np.full((1, 4096), 3.0), 4096, dtype),
                      f"softmax of 4096 equal logits [{dtype}]")

    def log_softmax_part() -> None:
        ref = ref_log_softmax(x)
        assert_within(t.to_numpy(sk.log_softmax(xt, axis=-1, backend=backend)), ref,
                      log_bound(ref, 4096, dtype), f"log_softmax of 4096 [{dtype}]")
        lp = t.to_numpy(sk.log_softmax(flat, axis=-1, backend=backend))
        ref = np.full((1, 4096), -12 * math.log(2))
        assert_within(lp, ref, log_bound(ref, 4096, dtype),
                      f"log_softmax of 4096 equal logits [{dtype}]")

    _run_parts({"softmax": softmax_part, "log_softmax": log_softmax_part})


@case("cross_entropy")
def case_random_cross_entropy(t: Target, dtype: str, backend: str) -> None:
    """cross_entropy with index and probability targets, smoothing, ignore_index, reductions."""
    rng = np.random.default_rng(11)
    xt, x = _represented(t, _random_logits(11, (9, 13), 3.0), dtype)
    index = rng.integers(0, 13, size=9)
    index[[2, 5]] = -100
    valid = index != -100
    count = int(valid.sum())
    for smoothing in (0.0, 0.1):
        y = np.zeros((9, 13))
        y[np.arange(9)[valid], index[valid]] = 1.0
        y = (1 - smoothing) * y + smoothing / 13
        loss_ref, grad_ref = _ref_cross_entropy(x, y, valid)
        it = t.asarray(index, None)
        for reduction in ("none", "sum", "mean"):
            loss, grad = sk.cross_entropy(xt, it, reduction=reduction, ignore_index=-100,
                                          label_smoothing=smoothing, return_grad=True,
                                          backend=backend)
            scale = 1.0 / count if reduction == "mean" else 1.0
            expected = {"none": loss_ref, "sum": loss_ref.sum(),
                        "mean": loss_ref.sum() / count}[reduction]
            what = f"cross_entropy index {reduction} eps={smoothing} [{dtype}]"
            mag = np.abs(expected) + np.abs(x).max() * (9 if reduction == "sum" else 1)
            n = 13 + (9 if reduction != "none" else 0)
            assert_within(t.to_numpy(loss), expected, log_bound(mag, n, dtype), what)
            g = grad_ref * scale
            assert_within(t.to_numpy(grad), g,
                          vjp_bound(g, scale * (np.abs(y) + 1.0), 13, dtype), what + " grad")
    probs = rng.dirichlet(np.ones(13), size=9)
    pt, probs = _represented(t, probs, dtype)
    loss, grad = sk.cross_entropy(xt, pt, reduction="none", return_grad=True, backend=backend)
    loss_ref, grad_ref = _ref_cross_entropy(x, probs, np.ones(9, bool))
    mag = np.abs(loss_ref) + np.abs(x).max()
    assert_within(t.to_numpy(loss), loss_ref, log_bound(mag, 13, dtype), "cross_entropy probs")
    assert_within(t.to_numpy(grad), grad_ref, vjp_bound(grad_ref, np.abs(probs) + 1.0, 13,
                                                        dtype), "cross_entropy probs grad")


@case("cross_entropy")
def case_cross_entropy_label_range(t: Target, dtype: str, backend: str) -> None:
    """The kernel on class indices outside ``[0, C)`` (what a GPU call or a CUDA-graph capture
    hands it, unchecked): NaN loss and gradient rows, never a read of ``logits[index]``; the
    other rows as usual, with the gradient's scale a 0-d array (a mean's device count)."""
    from .. import arguments
    from ..dispatch import run
    from ..dtypes import accumulator_dtype

    rng = np.random.default_rng(17)
    xt, x = _represented(t, _random_logits(17, (8, 13), 3.0), dtype)
    index = rng.integers(0, 13, size=8)
    index[[0, 3]] = -100
    index[[1, 4, 6]] = (13, -1, 2**40)  # outside [0, 13), not ignore_index
    bad = np.zeros(8, bool)
    bad[[1, 4, 6]] = True
    valid = (index != -100) & ~bad
    xp = arguments.namespace(logits=xt)
    scale = xp.asarray(xp.full((), 0.25, dtype=accumulator_dtype(xp, xt.dtype),
                               device=getattr(xt, "device", None)))
    for smoothing in (0.0, 0.1):
        loss, grad = run("cross_entropy", xp, xt, backend, logits=xt,
                         index=t.asarray(index, None), probs=None, where=None,
                         ignore_index=-100, label_smoothing=smoothing, grad_scale=scale,
                         out_dtype=xt.dtype)
        loss, grad = t.to_numpy(loss), t.to_numpy(grad)
        what = f"cross_entropy labels outside [0, C) eps={smoothing} [{dtype}]"
        if not (np.isnan(loss[bad]).all() and np.isnan(grad[bad]).all()):
            raise AssertionError(f"{what}: rows with such labels must be NaN (loss and "
                                 f"gradient), got losses {loss[bad]}")
        if np.isnan(loss[~bad]).any() or np.isnan(grad[~bad]).any():
            raise AssertionError(f"{what}: NaN outside the rows with bad labels")
        y = np.zeros((8, 13))
        y[np.arange(8)[valid], index[valid]] = 1.0
        y = (1 - smoothing) * y + smoothing / 13
        loss_ref, grad_ref = _ref_cross_entropy(x, y, valid)
        mag = np.abs(loss_ref) + np.abs(x).max()
        assert_within(loss[~bad], loss_ref[~bad], log_bound(mag[~bad], 13, dtype), what)
        g = grad_ref[~bad] * 0.25
        assert_within(grad[~bad], g, vjp_bound(g, 0.25 * (np.abs(y[~bad]) + 1.0), 13, dtype),
                      what + " grad")


@case("softmax_vjp", "log_softmax_vjp")
def case_random_vjp(t: Target, dtype: str, backend: str) -> None:
    """VJPs of random rows against p * (g - <p, g>) and g - p * sum(g) in extended precision."""
    rng = np.random.default_rng(13)
    x = _random_logits(13, (5, 17), 3.0)
    pt, p = _represented(t, ref_softmax(x), dtype)
    lpt, lp = _represented(t, ref_log_softmax(x), dtype)
    gt, g = _represented(t, rng.normal(size=(5, 17)), dtype)
    gl = g.astype(LD)

    def softmax_vjp_part() -> None:
        got = t.to_numpy(sk.softmax_vjp(pt, gt, axis=-1, backend=backend))
        pl = p.astype(LD)
        ref = (pl * (gl - (pl * gl).sum(-1, keepdims=True))).astype(np.float64)
        scale = p * (np.abs(g) + (p * np.abs(g)).sum(-1, keepdims=True))
        assert_within(got, ref, vjp_bound(ref, scale, 17, dtype), f"softmax_vjp [{dtype}]")

    def log_softmax_vjp_part() -> None:
        got = t.to_numpy(sk.log_softmax_vjp(lpt, gt, axis=-1, backend=backend))
        ref = (gl - np.exp(lp.astype(LD)) * gl.sum(-1, keepdims=True)).astype(np.float64)
        scale = (np.abs(g) + np.exp(lp) * np.abs(g).sum(-1, keepdims=True)) * (1 + np.abs(lp))
        assert_within(got, ref, vjp_bound(ref, scale, 17, dtype), f"log_softmax_vjp [{dtype}]")

    _run_parts({"softmax_vjp": softmax_vjp_part, "log_softmax_vjp": log_softmax_vjp_part})


# ------------------------------------------------------------------ special rows

# +inf rows (one +inf; two), a NaN row holding +inf, and a +inf that where= excludes
INF_X = np.array([[1.0, np.inf, 2.0, -np.inf],
                  [np.inf, np.inf, 0.0, 1.0],
                  [np.nan, np.inf, 0.0, 0.0],
                  [np.inf, 1.0, 2.0, 3.0]])
INF_WHERE = np.array([[True] * 4, [True] * 4, [True] * 4, [False, True, True, True]])


@case(*ROW_OPS)
def case_infinite_rows(t: Target, dtype: str, backend: str) -> None:
    """The +inf row rules of every row operation (spec: "Policies at a glance"): softmax NaN,
    log_softmax NaN at the +inf positions and -inf elsewhere, logsumexp +inf, cross_entropy
    NaN loss and gradient, the VJPs by formula; a NaN makes the row NaN; a +inf excluded by
    where= is never read."""
    xt = t.asarray(INF_X, dtype)
    wt = t.asarray(INF_WHERE, None)
    xm = np.where(INF_WHERE, INF_X, -np.inf)
    n = INF_X.shape[-1]

    def normalizer(op: Callable, log: bool) -> Callable[[], None]:
        def run() -> None:
            ref = ref_log_softmax(xm) if log else ref_softmax(xm)
            got = t.to_numpy(op(xt, axis=-1, where=wt, backend=backend))
            bound = log_bound(ref, n, dtype) if log else softmax_bound(ref, xm, n, dtype)
            assert_within(got, ref, bound, f"{op.__name__} of +inf rows [{dtype}]")

        return run

    def logsumexp_part() -> None:
        ref, sign = ref_logsumexp(xm)
        lse, got_sign = sk.logsumexp(xt, axis=-1, where=wt, return_sign=True, backend=backend)
        assert_within(t.to_numpy(lse), ref, log_bound(ref, n, dtype), f"logsumexp [{dtype}]")
        assert_within(t.to_numpy(got_sign), sign, 0.0, f"logsumexp sign [{dtype}]")

    def cross_entropy_part() -> None:
        index = t.asarray(np.array([0, 2, 2, 1]), None)
        loss, grad = sk.cross_entropy(xt, index, where=wt, reduction="none", return_grad=True,
                                      backend=backend)
        y = np.eye(n)[[0, 2, 2, 1]]
        loss_ref, grad_ref = _ref_cross_entropy(xm, y, np.ones(4, bool))
        special = ~np.isfinite(ref_softmax(xm)).all(-1)
        loss_ref = np.where(special, np.nan, loss_ref)
        grad_ref = np.where(special[:, None], np.nan, grad_ref)
        what = f"cross_entropy of +inf rows [{dtype}]"
        assert_within(t.to_numpy(loss), loss_ref, log_bound(np.abs(loss_ref) + 3.0, n, dtype),
                      what)
        assert_within(t.to_numpy(grad), grad_ref, vjp_bound(grad_ref, 2.0, n, dtype),
                      what + " grad")

    def vjp_part(log: bool) -> Callable[[], None]:
        # the forward results of these rows, through the VJPs: NaN probabilities propagate,
        # -inf log-probabilities take no part
        def run() -> None:
            primal_t, primal = _represented(
                t, ref_log_softmax(xm) if log else ref_softmax(xm), dtype)
            gt, g = _represented(t, np.linspace(-1.0, 1.0, INF_X.size).reshape(INF_X.shape),
                                 dtype)
            gl, pl = g.astype(LD), primal.astype(LD)
            with np.errstate(invalid="ignore"):
                if log:
                    part = pl != -np.inf
                    total = np.where(part, gl, 0).sum(-1, keepdims=True)
                    ref = np.where(part, gl - np.exp(pl) * total, 0)
                else:
                    part = pl != 0
                    dot = np.where(part, pl * gl, 0).sum(-1, keepdims=True)
                    ref = np.where(part, pl * (gl - dot), 0)
            ref = ref.astype(np.float64)
            op = sk.log_softmax_vjp if log else sk.softmax_vjp
            got = op(primal_t, gt, axis=-1, where=wt, backend=backend)
            assert_within(t.to_numpy(got), ref, vjp_bound(ref, 4.0, n, dtype),
                          f"{op.__name__} of +inf rows [{dtype}]")

        return run

    _run_parts({"softmax": normalizer(sk.softmax, False),
                "log_softmax": normalizer(sk.log_softmax, True),
                "logsumexp": logsumexp_part, "cross_entropy": cross_entropy_part,
                "softmax_vjp": vjp_part(False), "log_softmax_vjp": vjp_part(True)})


# logsumexp weights next to +inf and NaN logits: b = 0 excludes its position (it contributes
# nothing, even at +inf or NaN); the signs of the weights at +inf decide the row
ZERO_WEIGHT_A = np.array([[np.inf, 1.0, 2.0, 3.0],
                          [np.nan, 1.0, 2.0, 3.0],
                          [np.inf, np.nan, 0.0, 1.0],
                          [np.inf, np.nan, 0.0, 1.0],
                          [np.inf, 0.0, 1.0, 2.0],
                          [np.inf, np.inf, 0.0, 1.0],
                          [np.inf, np.inf, 0.0, 1.0],
                          [-np.inf, 1.0, 2.0, 3.0]])
ZERO_WEIGHT_B = np.array([[0.0, 1.0, 1.0, 1.0],      # +inf at b = 0: lse of [1, 2, 3]
                          [0.0, 1.0, 1.0, 1.0],      # NaN at b = 0: the same
                          [0.0, 0.0, 1.0, 1.0],      # both: lse of [0, 1]
                          [0.0, 0.0, 0.0, 0.0],      # every weight 0: the empty row, -inf
                          [2.0, 1.0, 0.0, -1.0],     # +inf with b > 0: +inf, sign 1
                          [-1.0, -2.0, 1.0, 1.0],    # +inf with b < 0: NaN, or +inf sign -1
                          [1.0, -1.0, 1.0, 1.0],     # +inf with both signs: NaN
                          [np.nan, 1.0, 1.0, 1.0]])  # a NaN weight on -inf: NaN


@case("logsumexp")
def case_logsumexp_zero_weights(t: Target, dtype: str, backend: str) -> None:
    """logsumexp's weight rules at +inf and NaN logits (spec "logsumexp"): b = 0 excludes its
    position whatever its logit; the signs of the weights on +inf decide +inf, -1 or NaN; a
    NaN weight makes the row NaN."""
    at = t.asarray(ZERO_WEIGHT_A, dtype)
    bt = t.asarray(ZERO_WEIGHT_B, dtype)
    ref, sign = ref_logsumexp(ZERO_WEIGHT_A, ZERO_WEIGHT_B)
    n = ZERO_WEIGHT_A.shape[-1]
    what = f"logsumexp with zero weights [{dtype}]"
    lse, got_sign = sk.logsumexp(at, axis=-1, b=bt, return_sign=True, backend=backend)
    assert_within(t.to_numpy(lse), ref, log_bound(ref, n, dtype), what)
    assert_within(t.to_numpy(got_sign), sign, 0.0, what + " sign")
    plain = np.where(sign < 0, np.nan, ref)  # a negative sum has no real logarithm
    got = sk.logsumexp(at, axis=-1, b=bt, backend=backend)
    assert_within(t.to_numpy(got), plain, log_bound(plain, n, dtype), what + " no sign")
    # where= excluding the +inf and NaN logits agrees with zero weights there
    keep = t.asarray(ZERO_WEIGHT_B[:2] != 0, None)
    got = sk.logsumexp(t.asarray(ZERO_WEIGHT_A[:2], dtype), axis=-1,
                       b=t.asarray(ZERO_WEIGHT_B[:2], dtype), where=keep, backend=backend)
    assert_within(t.to_numpy(got), ref[:2], log_bound(ref[:2], n, dtype), what + " where=")


# ------------------------------------------------------------------ hygiene

# rows whose spec answers are finite (or -inf by definition): large gaps, -inf logits, a row
# of -inf logits and a row fully masked by where=; :func:`_edge_rows` adds rows that reach
# the dtype's largest numbers
EDGE_X = np.array([[20.0, 18.0, 17.0, -5.0],
                   [-np.inf, -np.inf, -np.inf, -np.inf],
                   [-np.inf, 1.0, -np.inf, 2.0],
                   [60.0, -60.0, 0.0, 0.5]])
EDGE_WHERE = np.array([[True] * 4, [True] * 4, [True] * 4, [False] * 4])


def _edge_rows(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """:data:`EDGE_X` and :data:`EDGE_WHERE` with rows at the ends of ``dtype``'s range:
    log-probabilities there fall below the range and round to ``-inf``, quietly."""
    top = HUGE[dtype]
    extreme = np.array([[top, -top, 0.0, 0.5], [-top, -top, -top, 0.0], [top, top, -top, 1.0]])
    return (np.concatenate([EDGE_X, extreme]),
            np.concatenate([EDGE_WHERE, np.ones((3, 4), bool)]))


@case(*ROW_OPS)
def case_no_warnings(t: Target, dtype: str, backend: str) -> None:
    """No floating-point warning and no NaN for inputs with finite answers (logits up to the
    dtype's largest numbers, fully masked rows included); fully masked rows give 0
    probabilities and 0 gradients."""
    edge_x, edge_where = _edge_rows(dtype)
    rows = edge_x.shape[0]
    xt = t.asarray(edge_x, dtype)
    wt = t.asarray(edge_where, None)
    empty = t.asarray(np.zeros((3, 0)), dtype)
    xm = np.where(edge_where, edge_x, -np.inf)
    pt = t.asarray(ref_softmax(xm), dtype)
    lpt = t.asarray(fit_range(ref_log_softmax(xm), dtype), dtype)
    ones = t.asarray(np.ones((rows, 4)), dtype)
    index = t.asarray(np.array([0, 1, 3, 2, 0, 3, 1]), None)
    masked_rows = [1, 3]

    def finite(value: Any, what: str, zero_rows: bool = False) -> None:
        got = t.to_numpy(value)
        assert not np.isnan(got).any(), f"{what}: NaN for an input whose answer is finite"
        if zero_rows:
            assert np.all(got[masked_rows] == 0), f"{what}: fully masked rows must be 0"

    def softmax_part() -> None:
        with strict_fp():
            p = sk.softmax(xt, axis=-1, where=wt, backend=backend)
            sk.softmax(empty, axis=-1, backend=backend)
        finite(p, "softmax", zero_rows=True)

    def log_softmax_part() -> None:
        with strict_fp():
            lp = sk.log_softmax(xt, axis=-1, where=wt, backend=backend)
            sk.log_softmax(empty, axis=-1, backend=backend)
        finite(lp, "log_softmax")

    def logsumexp_part() -> None:
        with strict_fp():
            lse = sk.logsumexp(xt, axis=-1, where=wt, backend=backend)
            signed = sk.logsumexp(xt, axis=-1, b=t.asarray(np.array([1.0, -1.0, 0.0, 2.0]),
                                                           dtype),
                                  return_sign=True, backend=backend)
            sk.logsumexp(empty, axis=-1, backend=backend)
        finite(lse, "logsumexp")
        finite(signed[1], "logsumexp sign")

    def cross_entropy_part() -> None:
        with strict_fp():
            _, grad = sk.cross_entropy(xt, index, where=wt, reduction="none", return_grad=True,
                                       backend=backend)
            _, smooth = sk.cross_entropy(xt, index, where=wt, label_smoothing=0.2,
                                         return_grad=True, backend=backend)
        finite(grad, "cross_entropy gradient", zero_rows=True)
        finite(smooth, "cross_entropy gradient with smoothing", zero_rows=True)

    def softmax_vjp_part() -> None:
        with strict_fp():
            g = sk.softmax_vjp(pt, ones, axis=-1, where=wt, backend=backend)
        finite(g, "softmax_vjp", zero_rows=True)

    def log_softmax_vjp_part() -> None:
        with strict_fp():
            g = sk.log_softmax_vjp(lpt, ones, axis=-1, where=wt, backend=backend)
        finite(g, "log_softmax_vjp", zero_rows=True)

    _run_parts({"softmax": softmax_part, "log_softmax": log_softmax_part,
                "logsumexp": logsumexp_part, "cross_entropy": cross_entropy_part,
                "softmax_vjp": softmax_vjp_part, "log_softmax_vjp": log_softmax_vjp_part})


@case("softmax", "log_softmax", "logsumexp", "cross_entropy")
def case_inputs_untouched(t: Target, dtype: str, backend: str) -> None:
    """The caller's arrays are never modified."""
    x = _random_logits(17, (3, 8), 2.0)
    x[0, 0] = -np.inf
    xt = t.asarray(x, dtype)
    before = t.to_numpy(xt).copy()
    where = np.ones((3, 8), bool)
    where[1, :2] = False
    wt = t.asarray(where, None)
    index = t.asarray(np.array([1, 2, 3]), None)

    def unchanged(call: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            call()
            np.testing.assert_array_equal(t.to_numpy(xt), before)
            np.testing.assert_array_equal(t.to_numpy(wt), where)
            np.testing.assert_array_equal(t.to_numpy(index), [1, 2, 3])

        return run

    _run_parts({
        "softmax": unchanged(lambda: sk.softmax(xt, axis=-1, where=wt, backend=backend)),
        "log_softmax": unchanged(lambda: sk.log_softmax(xt, axis=0, backend=backend)),
        "logsumexp": unchanged(lambda: sk.logsumexp(xt, axis=None, b=xt, return_sign=True,
                                                    backend=backend)),
        "cross_entropy": unchanged(lambda: sk.cross_entropy(xt, index, where=wt,
                                                            return_grad=True,
                                                            backend=backend)),
    })


@case("softmax", "log_softmax")
def case_output_dtype(t: Target, dtype: str, backend: str) -> None:
    """``dtype=`` converts the output; the accumulation stays float32 or wider."""
    xt, x = _represented(t, _random_logits(19, (3, 40), 5.0), dtype)
    # the result is the accumulated answer rounded to the output dtype
    acc = "float64" if dtype == "float64" else "float32"
    outs = [out for out in ("float16", "float32", "float64") if out in t.dtypes]

    def part(op: Callable, log: bool) -> Callable[[], None]:
        def run() -> None:
            ref = ref_log_softmax(x) if log else ref_softmax(x)
            for out in outs:
                got = op(xt, axis=-1, dtype=out, backend=backend)
                _check_dtype(got, out, f"{op.__name__} dtype={out}")
                bound_dtype = acc if out == "float64" else out
                bound = (log_bound(ref, 40, bound_dtype) if log
                         else softmax_bound(ref, x, 40, bound_dtype))
                assert_within(t.to_numpy(got), ref, bound, f"{op.__name__} {dtype} -> {out}")

        return run

    _run_parts({"softmax": part(sk.softmax, False), "log_softmax": part(sk.log_softmax, True)})
