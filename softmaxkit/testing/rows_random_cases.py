"""Conformance cases for the row operations: random rows against an extended-precision
reference of the represented inputs (:mod:`softmaxkit.testing.row_references`), under the
error bounds of spec/semantics.md ("Error bounds"), with masks and every policy."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

import softmaxkit as sk

from .kit import Target, case
from .row_checks import (
    check_dtype,
    random_logits,
    represented,
    run_parts,
    same_library,
)
from .row_references import (
    LD,
    _ref_cross_entropy,
    _rows,
    ref_log_softmax,
    ref_logsumexp,
    ref_softmax,
)
from .tolerance import (
    assert_within,
    log_bound,
    normalization_bound,
    softmax_bound,
    vjp_bound,
)

SHAPES = (((7, 33), -1, 4.0), ((3, 5, 6), (0, 2), 10.0), ((2, 300), -1, 30.0), ((4,), None, 1.0))


@case("softmax", "log_softmax")
def case_random_rows(t: Target, dtype: str, backend: str) -> None:
    """softmax and log_softmax of random rows (several shapes, axes and logit scales)."""
    inputs = []
    for i, (shape, axis, scale) in enumerate(SHAPES):
        xt, x = represented(t, random_logits(i, shape, scale), dtype)
        inputs.append((shape, axis, xt, _rows(x, axis)[0]))

    def softmax_part() -> None:
        for shape, axis, xt, rows in inputs:
            n = rows.shape[-1]
            p = sk.softmax(xt, axis=axis, backend=backend)
            check_dtype(p, dtype, "softmax")
            same_library(t, p, "softmax")
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
            check_dtype(lp, dtype, "log_softmax")
            same_library(t, lp, "log_softmax")
            ref = ref_log_softmax(rows)
            assert_within(_rows(t.to_numpy(lp), axis)[0], ref,
                          log_bound(ref, rows.shape[-1], dtype), f"log_softmax {shape} [{dtype}]")

    run_parts({"softmax": softmax_part, "log_softmax": log_softmax_part})


@case("logsumexp")
def case_random_logsumexp(t: Target, dtype: str, backend: str) -> None:
    """logsumexp of random rows, with and without weights (some negative, some zero)."""
    rng = np.random.default_rng(7)
    for i, (shape, axis, scale) in enumerate(SHAPES):
        at, a = represented(t, random_logits(10 + i, shape, scale), dtype)
        rows, _ = _rows(a, axis)
        n = max(rows.shape[-1], 1)
        got = sk.logsumexp(at, axis=axis, backend=backend)
        check_dtype(got, dtype, "logsumexp")
        ref, _ = ref_logsumexp(rows)
        assert_within(t.to_numpy(got).reshape(-1), ref, log_bound(ref, n, dtype),
                      f"logsumexp {shape} [{dtype}]")
        b_np = rng.choice([0.0, 0.5, 1.0, 2.0, -0.25], size=shape)
        bt, b = represented(t, b_np, dtype)
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
    xt, x = represented(t, random_logits(3, (6, 9), 3.0), dtype)
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

    run_parts({"softmax": normalizer(sk.softmax, False),
                "log_softmax": normalizer(sk.log_softmax, True),
                "logsumexp": logsumexp_part})


@case("softmax", "log_softmax")
def case_long_rows(t: Target, dtype: str, backend: str) -> None:
    """Rows of 4096: normalization, and no stagnation of a 16-bit accumulator."""
    xt, x = represented(t, random_logits(5, (2, 4096), 2.0), dtype)
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

    run_parts({"softmax": softmax_part, "log_softmax": log_softmax_part})


@case("cross_entropy")
def case_random_cross_entropy(t: Target, dtype: str, backend: str) -> None:
    """cross_entropy with index and probability targets, smoothing, ignore_index, reductions."""
    rng = np.random.default_rng(11)
    xt, x = represented(t, random_logits(11, (9, 13), 3.0), dtype)
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
    pt, probs = represented(t, probs, dtype)
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
    xt, x = represented(t, random_logits(17, (8, 13), 3.0), dtype)
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
    x = random_logits(13, (5, 17), 3.0)
    pt, p = represented(t, ref_softmax(x), dtype)
    lpt, lp = represented(t, ref_log_softmax(x), dtype)
    gt, g = represented(t, rng.normal(size=(5, 17)), dtype)
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

    run_parts({"softmax_vjp": softmax_vjp_part, "log_softmax_vjp": log_softmax_vjp_part})
