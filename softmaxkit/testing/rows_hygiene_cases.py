"""Floating-point hygiene of the row operations: no warning for any input whose answer is
finite (fully masked rows included), results in the caller's array library and dtype,
inputs left untouched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import softmaxkit as sk

from .kit import Target, case
from .row_checks import (
    ROW_OPS,
    check_dtype,
    random_logits,
    represented,
    run_parts,
    strict_fp,
)
from .row_references import (
    ref_log_softmax,
    ref_softmax,
)
from .tolerance import (
    HUGE,
    assert_within,
    fit_range,
    log_bound,
    softmax_bound,
)

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

    def finite(got: np.ndarray, what: str, zero_rows: bool = False) -> None:
        assert not np.isnan(got).any(), f"{what}: NaN for an input whose answer is finite"
        if zero_rows:
            assert np.all(got[masked_rows] == 0), f"{what}: fully masked rows must be 0"

    # each result is brought to numpy inside strict_fp, so that a lazy array (Dask) computes
    # there: its chunks' arithmetic is what the case checks
    def softmax_part() -> None:
        with strict_fp():
            p = t.to_numpy(sk.softmax(xt, axis=-1, where=wt, backend=backend))
            t.to_numpy(sk.softmax(empty, axis=-1, backend=backend))
        finite(p, "softmax", zero_rows=True)

    def log_softmax_part() -> None:
        with strict_fp():
            lp = t.to_numpy(sk.log_softmax(xt, axis=-1, where=wt, backend=backend))
            t.to_numpy(sk.log_softmax(empty, axis=-1, backend=backend))
        finite(lp, "log_softmax")

    def logsumexp_part() -> None:
        with strict_fp():
            lse = t.to_numpy(sk.logsumexp(xt, axis=-1, where=wt, backend=backend))
            signed = sk.logsumexp(xt, axis=-1, b=t.asarray(np.array([1.0, -1.0, 0.0, 2.0]),
                                                           dtype),
                                  return_sign=True, backend=backend)
            t.to_numpy(signed[0])
            sign = t.to_numpy(signed[1])
            t.to_numpy(sk.logsumexp(empty, axis=-1, backend=backend))
        finite(lse, "logsumexp")
        finite(sign, "logsumexp sign")

    def cross_entropy_part() -> None:
        with strict_fp():
            loss, grad = sk.cross_entropy(xt, index, where=wt, reduction="none",
                                          return_grad=True, backend=backend)
            t.to_numpy(loss)
            grad = t.to_numpy(grad)
            loss, smooth = sk.cross_entropy(xt, index, where=wt, label_smoothing=0.2,
                                            return_grad=True, backend=backend)
            t.to_numpy(loss)
            smooth = t.to_numpy(smooth)
        finite(grad, "cross_entropy gradient", zero_rows=True)
        finite(smooth, "cross_entropy gradient with smoothing", zero_rows=True)

    def softmax_vjp_part() -> None:
        with strict_fp():
            g = t.to_numpy(sk.softmax_vjp(pt, ones, axis=-1, where=wt, backend=backend))
        finite(g, "softmax_vjp", zero_rows=True)

    def log_softmax_vjp_part() -> None:
        with strict_fp():
            g = t.to_numpy(sk.log_softmax_vjp(lpt, ones, axis=-1, where=wt, backend=backend))
        finite(g, "log_softmax_vjp", zero_rows=True)

    run_parts({"softmax": softmax_part, "log_softmax": log_softmax_part,
                "logsumexp": logsumexp_part, "cross_entropy": cross_entropy_part,
                "softmax_vjp": softmax_vjp_part, "log_softmax_vjp": log_softmax_vjp_part})


@case("softmax", "log_softmax", "logsumexp", "cross_entropy")
def case_inputs_untouched(t: Target, dtype: str, backend: str) -> None:
    """The caller's arrays are never modified."""
    x = random_logits(17, (3, 8), 2.0)
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

    run_parts({
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
    xt, x = represented(t, random_logits(19, (3, 40), 5.0), dtype)
    # the result is the accumulated answer rounded to the output dtype
    acc = "float64" if dtype == "float64" else "float32"
    outs = [out for out in ("float16", "float32", "float64") if out in t.dtypes]

    def part(op: Callable, log: bool) -> Callable[[], None]:
        def run() -> None:
            ref = ref_log_softmax(x) if log else ref_softmax(x)
            for out in outs:
                got = op(xt, axis=-1, dtype=out, backend=backend)
                check_dtype(got, out, f"{op.__name__} dtype={out}")
                bound_dtype = acc if out == "float64" else out
                bound = (log_bound(ref, 40, bound_dtype) if log
                         else softmax_bound(ref, x, 40, bound_dtype))
                assert_within(t.to_numpy(got), ref, bound, f"{op.__name__} {dtype} -> {out}")

        return run

    run_parts({"softmax": part(sk.softmax, False), "log_softmax": part(sk.log_softmax, True)})
