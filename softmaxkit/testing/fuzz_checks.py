"""How the fuzzer (:mod:`softmaxkit.testing.fuzz`) compares a backend's answer with the
spec's: one check per operation in :data:`CHECKS`.

A check takes the target, the backend's name and a drawn example (a dict of numpy inputs and
options), places the inputs on the target as drawn (contiguous or a view), runs the backend
strictly (``backend=``) and compares its result with an extended-precision reference of the
*represented* inputs under the bounds of :mod:`softmaxkit.testing.tolerance`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import softmaxkit as sk

from . import materialized
from .attention_cases import check_forward, check_grads
from .kit import Target
from .row_references import (
    LD,
    _ref_log_softmax_ext,
    _rows,
    ref_log_softmax,
    ref_logsumexp,
    ref_softmax,
)
from .summary_cases import SUMMARY_RTOL, definition
from .tolerance import assert_within, fit_range, log_bound, softmax_bound, vjp_bound


def _place(t: Target, a: np.ndarray, dtype: str | None, view: str) -> Any:
    """``a`` on the target as a contiguous array, a stride-2 view, or a transposed view."""
    if view == "strided" and a.ndim:
        return t.asarray(np.repeat(a, 2, axis=-1), dtype)[..., ::2]
    if view == "transposed" and a.ndim >= 2:
        axes = tuple(reversed(range(a.ndim)))
        return t.xp.permute_dims(t.asarray(np.ascontiguousarray(np.transpose(a)), dtype), axes)
    return t.asarray(a, dtype)


def _represented(t: Target, a: np.ndarray, dtype: str, view: str) -> tuple[Any, np.ndarray]:
    arr = _place(t, a, dtype, view)
    return arr, t.to_numpy(arr)


def _masked(x: np.ndarray, where: np.ndarray | None) -> np.ndarray:
    return x if where is None else np.where(where, x, -np.inf)


def _normalizer(log: bool) -> Callable[[Target, str, dict[str, Any]], None]:
    def check(t: Target, backend: str, ex: dict[str, Any]) -> None:
        dtype, axis, masked = ex["dtype"], ex["axis"], ex["masked"]
        xt, x = _represented(t, ex["x"], dtype, ex["view"])
        wt = None if ex["where"] is None else t.asarray(ex["where"], None)
        op = sk.log_softmax if log else sk.softmax
        got = t.to_numpy(op(xt, axis=axis, where=wt, masked=masked, backend=backend))
        rows, back = _rows(_masked(x, ex["where"]), axis)
        n = max(rows.shape[-1], 1)
        ref = ref_log_softmax(rows, masked) if log else ref_softmax(rows, masked)
        bound = log_bound(ref, n, dtype) if log else softmax_bound(ref, rows, n, dtype)
        assert_within(got, back(fit_range(ref, dtype)), back(bound), f"{op.__name__} [{dtype}]")

    return check


def _check_logsumexp(t: Target, backend: str, ex: dict[str, Any]) -> None:
    dtype, axis, where = ex["dtype"], ex["axis"], ex["where"]
    at, a = _represented(t, ex["x"], dtype, ex["view"])
    bt, b = (None, np.ones_like(a)) if ex["b"] is None else _represented(t, ex["b"], dtype,
                                                                         "contiguous")
    wt = None if where is None else t.asarray(where, None)
    res = sk.logsumexp(at, axis=axis, b=bt, where=wt, keepdims=ex["keepdims"],
                       return_sign=ex["return_sign"], backend=backend)
    lse, sign = res if ex["return_sign"] else (res, None)
    rows, _ = _rows(_masked(a, where), axis)
    brows, _ = _rows(b if where is None else np.where(where, b, 0.0), axis)
    raw, ref_sign = ref_logsumexp(rows, brows)
    ref = raw
    if not ex["return_sign"]:
        ref = np.where(ref_sign < 0, np.nan, ref)  # a negative sum has no real logarithm
    # cancelling weights make the sum's relative error unbounded: rows with a negative weight
    # are compared where the sum keeps at least half of its terms' magnitude, or the answer
    # is special (NaN or +inf, exact)
    with np.errstate(all="ignore"):
        live = (rows > -np.inf) & (brows != 0)
        clean = np.where(np.isfinite(rows), rows, -np.inf)
        m = np.max(clean, -1, keepdims=True) if rows.shape[-1] else np.zeros((rows.shape[0], 1))
        m = np.where(np.isfinite(m), m, 0.0)
        terms = np.where(live & np.isfinite(rows), np.abs(brows) * np.exp(rows - m), 0)
        big = np.log(terms.sum(-1)) + m[:, 0]
    negative = (live & (brows < 0)).any(-1)
    stable = ~negative | np.isnan(raw) | (raw == np.inf) | (raw >= big - 1.0)
    n = max(rows.shape[-1], 1)
    what = f"logsumexp [{dtype}]"
    got = t.to_numpy(lse).reshape(-1)
    assert got.shape == ref.shape, f"{what}: {got.shape} values for {ref.shape} rows"
    bound = log_bound(np.abs(ref) + np.where(np.isfinite(big), np.abs(big), 0), n, dtype)
    assert_within(got[stable], fit_range(ref, dtype)[stable], bound[stable], what)
    if sign is not None:
        assert_within(t.to_numpy(sign).reshape(-1)[stable], ref_sign[stable], 0.0,
                      what + " sign")


def _check_cross_entropy(t: Target, backend: str, ex: dict[str, Any]) -> None:
    dtype, axis, where = ex["dtype"], ex["axis"], ex["where"]
    xt, x = _represented(t, ex["x"], dtype, ex["view"])
    wt = None if where is None else t.asarray(where, None)
    rows, _ = _rows(_masked(x, where), axis)
    r, c = rows.shape
    if ex["index"] is not None:
        target_t = t.asarray(ex["index"], None)
        idx = ex["index"].reshape(-1)  # the rows' order: the kept axes, in order
        valid = idx != ex["ignore_index"] if ex["ignore_index"] is not None else np.ones(r, bool)
        y = np.zeros((r, c))
        y[np.arange(r)[valid], idx[valid]] = 1.0
        count = int(valid.sum())
    else:
        target_t, probs = _represented(t, ex["probs"], dtype, "contiguous")
        y = _rows(probs, axis)[0]
        valid = np.ones(r, bool)
        count = r
    loss, grad = sk.cross_entropy(xt, target_t, axis=axis, reduction=ex["reduction"],
                                  ignore_index=ex["ignore_index"],
                                  label_smoothing=ex["label_smoothing"], where=wt,
                                  return_grad=True, backend=backend)
    lp = _ref_log_softmax_ext(rows, "zero")
    included = rows > -np.inf  # NaN and +inf rows are NaN whatever this says
    eps = ex["label_smoothing"]
    if eps:
        k = included.sum(-1, keepdims=True)
        y = (1 - eps) * y + np.where(included, eps / np.maximum(k, 1), 0.0)
    yl = y.astype(LD)
    with np.errstate(invalid="ignore"):
        losses = -np.where(y != 0, yl * lp, 0).sum(-1)
    special = (np.isnan(rows) | (rows == np.inf)).any(-1)
    losses = np.where(special, np.nan, losses)
    losses = np.where(valid, losses, 0).astype(np.float64)
    p = np.exp(lp).astype(np.float64)
    scale = 1.0 / count if ex["reduction"] == "mean" and count else 1.0
    g = np.where(included, (p - y) * scale, 0.0)
    g = np.where(special[:, None], np.nan, g)
    g = np.where(valid[:, None], g, 0.0)
    if ex["reduction"] == "mean" and not count:
        g = np.zeros_like(g)
    # magnitudes the loss is built from: y_i |log p_i| summed, plus the logits' range
    with np.errstate(invalid="ignore"):
        mag = np.where((y != 0) & np.isfinite(lp), np.abs(y) * np.abs(lp.astype(np.float64)),
                       0).sum(-1)
    finite = np.abs(rows[np.isfinite(rows)])
    mag = mag + (finite.max() if finite.size else 0.0)
    expected = {"none": losses, "sum": losses.sum(),
                "mean": losses.sum() / count if count else 0.0}[ex["reduction"]]
    if ex["reduction"] == "none":
        got_loss = t.to_numpy(loss).reshape(-1)
        lbound = log_bound(np.abs(expected) + mag, c, dtype)
    else:
        got_loss = t.to_numpy(loss)
        total = float(np.where(valid, mag, 0).sum()) * (scale if ex["reduction"] == "mean" else 1)
        lbound = log_bound(np.abs(np.asarray(expected)) + total, c + r, dtype)
    what = f"cross_entropy {ex['reduction']} [{dtype}]"
    assert_within(got_loss, fit_range(np.asarray(expected, dtype=np.float64), dtype), lbound, what)
    # the error of p (the softmax bound), scaled, and the rounding of s (p - y)
    pf = np.where(np.isfinite(p), p, 0.0)
    gbound = scale * softmax_bound(pf, rows, c, dtype) + vjp_bound(g, scale * np.abs(y), c,
                                                                   dtype)
    got_grad = _rows(t.to_numpy(grad), axis)[0]
    assert_within(got_grad, g, gbound, what + " grad")


def _vjp(log: bool) -> Callable[[Target, str, dict[str, Any]], None]:
    def check(t: Target, backend: str, ex: dict[str, Any]) -> None:
        dtype, axis, where = ex["dtype"], ex["axis"], ex["where"]
        x = _masked(ex["x"], where)
        # the forward's results on x's rows, as the backward receives them
        rows, back = _rows(x, axis)
        primal = back(ref_log_softmax(rows) if log else ref_softmax(rows))
        pt, p = _represented(t, fit_range(primal, dtype), dtype, ex["view"])
        gt, g = _represented(t, ex["cotangent"], dtype, "contiguous")
        wt = None if where is None else t.asarray(where, None)
        op = sk.log_softmax_vjp if log else sk.softmax_vjp
        got = t.to_numpy(op(pt, gt, axis=axis, where=wt, backend=backend))
        prow, _ = _rows(p, axis)
        grow, _ = _rows(g, axis)
        wrow = np.ones(prow.shape, bool) if where is None else _rows(where, axis)[0]
        part = wrow & ((prow != -np.inf) if log else (prow != 0))
        pl = prow.astype(LD)
        gz = np.where(part, grow, 0.0)
        gl = gz.astype(LD)
        with np.errstate(invalid="ignore", over="ignore"):
            if log:
                e = np.exp(np.where(part, pl, -np.inf))
                ref = np.where(part, gl - e * gl.sum(-1, keepdims=True), 0)
                pe = np.exp(np.where(part, prow, -np.inf))
                scale = (np.abs(gz) + pe * np.abs(gz).sum(-1, keepdims=True)) * (
                    1 + np.where(part & np.isfinite(prow), np.abs(prow), 0))
            else:
                pz = np.where(part, pl, 0)
                ref = np.where(part, pz * (gl - (pz * gl).sum(-1, keepdims=True)), 0)
                pa = np.abs(np.where(part, prow, 0))
                scale = pa * (np.abs(gz) + (pa * np.abs(gz)).sum(-1, keepdims=True))
        ref = ref.astype(np.float64)
        scale = np.where(np.isfinite(scale), scale, 0.0)
        n = max(prow.shape[-1], 1)
        assert_within(_rows(got, axis)[0], fit_range(ref, dtype),
                      vjp_bound(ref, scale, n, dtype), f"{op.__name__} [{dtype}]")

    return check


def _summary_definition(x: np.ndarray, where: np.ndarray | None, values: np.ndarray | None
                        ) -> tuple[Any, ...]:
    """(max, mass, numerator, sum of |terms|) of ``[R, N]`` rows, special rows included: an
    allowed NaN makes every field NaN, an allowed +inf gives (+inf, NaN, NaN)."""
    allowed = np.ones(x.shape, bool) if where is None else where
    nan = (np.isnan(x) & allowed).any(-1)
    posinf = (x == np.inf).any(-1, where=allowed) & ~nan
    special = nan | posinf
    clean = np.where(special[:, None], 0.0, x)
    m, mass, num, scale = definition(clean, where, values)
    m = np.where(nan, np.nan, np.where(posinf, np.inf, m))
    mass = np.where(special, np.nan, mass)
    if num is not None:
        assert scale is not None  # definition gives both with the values, or neither
        num = np.where(special[:, None], np.nan, num)
        scale = np.where(special[:, None], 0.0, scale)
    return m, mass, num, scale


def _compare_summary(t: Target, dtype: str, got: Any, expected: tuple[np.ndarray, ...],
                     what: str) -> None:
    m, mass, num, scale = expected
    rtol = SUMMARY_RTOL["float64" if dtype == "float64" else "float32"]
    assert_within(t.to_numpy(got.max), m, 0.0, what + " max")
    assert_within(t.to_numpy(got.mass), mass, rtol * np.nan_to_num(mass), what + " mass")
    if num is None:
        assert got.numerator is None, f"{what}: a numerator without values"
    else:
        assert_within(t.to_numpy(got.numerator), num, rtol * scale + 1e-300,
                      what + " numerator")


def _check_summary(merge: bool) -> Callable[[Target, str, dict[str, Any]], None]:
    def check(t: Target, backend: str, ex: dict[str, Any]) -> None:
        dtype, where = ex["dtype"], ex["where"]
        xt, x = _represented(t, ex["x"], dtype, ex["view"])
        vt, v = (None, None) if ex["values"] is None else _represented(t, ex["values"], dtype,
                                                                       "contiguous")
        expected = _summary_definition(x, where, v)
        if not merge:
            wt = None if where is None else t.asarray(where, None)
            got = sk.summarize(xt, where=wt, values=vt, backend=backend)
            _compare_summary(t, dtype, got, expected, f"summarize [{dtype}]")
            return
        # the parts come from the reference; the merge is the backend's
        parts = []
        for lo, hi in zip(ex["cuts"][:-1], ex["cuts"][1:], strict=True):
            part_w = None if where is None else t.asarray(np.ascontiguousarray(where[:, lo:hi]),
                                                          None)
            part_v = None if v is None else t.asarray(np.ascontiguousarray(
                ex["values"][:, lo:hi]), dtype)
            parts.append(sk.summarize(t.asarray(np.ascontiguousarray(ex["x"][:, lo:hi]), dtype),
                                      where=part_w, values=part_v, backend="reference"))
        got = sk.merge(*parts, backend=backend)
        _compare_summary(t, dtype, got, expected, f"merge of {len(parts)} parts [{dtype}]")

    return check


def _attention_args(t: Target, ex: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    causal = ex["causal"]
    common = {"window": ex["window"], "softcap": ex["softcap"], "scale": ex["scale"]}
    mask = ex["mask"]
    frontend = dict(common, causal=causal if causal else False,
                    mask=None if mask is None else t.asarray(mask, None))
    ref = dict(common, causal={True: "bottom_right"}.get(causal, causal) or None, mask=mask)
    return frontend, ref


def _check_attention(t: Target, backend: str, ex: dict[str, Any]) -> None:
    dtype = ex["dtype"]
    q, q64 = _represented(t, ex["q"], dtype, ex["view"])
    k, k64 = _represented(t, ex["k"], dtype, ex["view"])
    v, v64 = _represented(t, ex["v"], dtype, "contiguous")
    fkw, rkw = _attention_args(t, ex)
    got = sk.attention(q, k, v, return_lse=True, backend=backend, **fkw)
    check_forward(t, dtype, got, materialized.attention(q64, k64, v64, **rkw),
                  f"attention [{dtype}]")


def _check_attention_vjp(t: Target, backend: str, ex: dict[str, Any]) -> None:
    dtype = ex["dtype"]
    acc = "float64" if dtype == "float64" else "float32"
    q, q64 = _represented(t, ex["q"], dtype, ex["view"])
    k, k64 = _represented(t, ex["k"], dtype, ex["view"])
    v, v64 = _represented(t, ex["v"], dtype, "contiguous")
    dout, dout64 = _represented(t, ex["dout"], dtype, "contiguous")
    fkw, rkw = _attention_args(t, ex)
    out64, lse64 = materialized.attention(q64, k64, v64, **rkw)
    got = sk.attention_vjp(q, k, v, t.asarray(out64, dtype), t.asarray(lse64, acc), dout,
                           backend=backend, **fkw)
    expected = materialized.attention_vjp(q64, k64, v64, dout64, **rkw)
    check_grads(t, dtype, got, expected, "attention_vjp")


CHECKS: dict[str, Callable[[Target, str, dict[str, Any]], None]] = {
    "softmax": _normalizer(False),
    "log_softmax": _normalizer(True),
    "logsumexp": _check_logsumexp,
    "cross_entropy": _check_cross_entropy,
    "softmax_vjp": _vjp(False),
    "log_softmax_vjp": _vjp(True),
    "summarize": _check_summary(merge=False),
    "merge": _check_summary(merge=True),
    "attention": _check_attention,
    "attention_vjp": _check_attention_vjp,
}
