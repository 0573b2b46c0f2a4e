"""Conformance cases for the row operations' special rows: +inf and NaN rows, and
logsumexp's zero weights."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import softmaxkit as sk

from .kit import Target, case
from .row_checks import (
    ROW_OPS,
    represented,
    run_parts,
)
from .row_references import (
    LD,
    _ref_cross_entropy,
    ref_log_softmax,
    ref_logsumexp,
    ref_softmax,
)
from .tolerance import (
    assert_within,
    log_bound,
    softmax_bound,
    vjp_bound,
)

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
            primal_t, primal = represented(
                t, ref_log_softmax(xm) if log else ref_softmax(xm), dtype)
            gt, g = represented(t, np.linspace(-1.0, 1.0, INF_X.size).reshape(INF_X.shape),
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

    run_parts({"softmax": normalizer(sk.softmax, False),
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
