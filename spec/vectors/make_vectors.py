"""Make the golden vectors of spec/semantics.md in 50-digit arithmetic (mpmath).

Run from the repository root::

    python spec/vectors/make_vectors.py

Each operation gets one JSON file beside this script.  Every number is a string: float64
inputs in Python's shortest round-trip form, expected results rounded to 25 significant
digits, and ``"inf"``, ``"-inf"``, ``"nan"`` for the special values.  Arrays are stored flat
with their shape.  ``dtypes`` lists the floating dtypes that represent every input exactly;
a case is checked in those dtypes only, under the error bounds of the spec.

The edge-case rules here are written out independently of softmaxkit (which this script does
not import): they are the spec's, in mpmath.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import ml_dtypes
import mpmath as mp
import numpy as np

mp.mp.dps = 50
HERE = Path(__file__).resolve().parent
INF, NAN = math.inf, math.nan
DTYPES = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float64": np.float64,
}


# ---------------------------------------------------------------- encoding


def enc(value: float | mp.mpf) -> str:
    """A number as a string: special values by name, others exactly enough to round-trip."""
    if isinstance(value, mp.mpf):
        if mp.isnan(value):
            return "nan"
        if mp.isinf(value):
            return "inf" if value > 0 else "-inf"
        return mp.nstr(value, 25, min_fixed=-1, max_fixed=1)
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def flat(values: np.ndarray) -> list[str]:
    return [enc(v) for v in np.asarray(values, dtype=object).ravel().tolist()]


def exact_dtypes(*arrays: np.ndarray | None) -> list[str]:
    """The dtypes that represent every value of ``arrays`` exactly."""
    out = []
    for name, dtype in DTYPES.items():
        ok = True
        for a in arrays:
            if a is None:
                continue
            a = np.asarray(a, dtype=np.float64)
            with np.errstate(over="ignore"):
                back = a.astype(dtype).astype(np.float64)
            ok &= bool(np.array_equal(back, a, equal_nan=True))
        if ok:
            out.append(name)
    return out


# ---------------------------------------------------------------- row semantics in mpmath


def classify(row: Sequence[float]) -> str:
    """'nan', 'posinf', 'empty' or 'regular' for the allowed values of a row."""
    if any(math.isnan(v) for v in row):
        return "nan"
    if any(v == INF for v in row):
        return "posinf"
    if all(v == -INF for v in row):
        return "empty"
    return "regular"


def mp_lse(row: Sequence[float], weights: Sequence[float] | None = None) -> tuple[mp.mpf, int]:
    """(log |sum w exp(x)|, sign) over finite-max rows; empty sums give (-inf, 0)."""
    if weights is None:
        weights = [1.0] * len(row)
    pairs = zip(row, weights, strict=True)
    total = mp.fsum(mp.mpf(w) * mp.exp(mp.mpf(v)) for v, w in pairs if v != -INF)
    if total == 0:
        return mp.mpf("-inf"), 0
    return mp.log(abs(total)), (1 if total > 0 else -1)


def mp_softmax_row(row: list[float], allowed: list[bool], masked: str) -> list:
    vals = [v if a else -INF for v, a in zip(row, allowed, strict=True)]
    kind = classify(vals)
    if kind in ("nan", "posinf"):
        return [mp.nan] * len(row)
    if kind == "empty":
        return [mp.nan if masked == "nan" else mp.mpf(0)] * len(row)
    lse, _ = mp_lse(vals)
    return [mp.exp(mp.mpf(v) - lse) if v != -INF else mp.mpf(0) for v in vals]


def mp_log_softmax_row(row: list[float], allowed: list[bool], masked: str) -> list:
    vals = [v if a else -INF for v, a in zip(row, allowed, strict=True)]
    kind = classify(vals)
    if kind == "nan":
        return [mp.nan] * len(row)
    if kind == "posinf":
        return [mp.nan if v == INF else mp.mpf("-inf") for v in vals]
    if kind == "empty":
        return [mp.nan if masked == "nan" else mp.mpf("-inf")] * len(row)
    lse, _ = mp_lse(vals)
    return [mp.mpf(v) - lse if v != -INF else mp.mpf("-inf") for v in vals]


def mp_logsumexp_row(row: list[float], weights: list[float], allowed: list[bool]) -> tuple:
    pairs = [(v, w) for v, w, a in zip(row, weights, allowed, strict=True) if a and w != 0]
    if any(math.isnan(v) or math.isnan(w) for v, w in pairs):
        return mp.nan, mp.nan
    at_inf = [w for v, w in pairs if v == INF]
    if at_inf:
        if any(w > 0 for w in at_inf) and any(w < 0 for w in at_inf):
            return mp.nan, mp.nan
        return mp.inf, (1 if at_inf[0] > 0 else -1)
    if not pairs:
        return mp.mpf("-inf"), 0
    return mp_lse([v for v, _ in pairs], [w for _, w in pairs])


# ---------------------------------------------------------------- layout helpers


def as_rows(x: np.ndarray, axis: int | tuple[int, ...] | None) -> tuple[np.ndarray, Callable]:
    """View ``x`` as rows along ``axis`` (moved last, merged), with the inverse for results."""
    axes = tuple(range(x.ndim)) if axis is None else (
        tuple(a % x.ndim for a in axis) if isinstance(axis, tuple) else (axis % x.ndim,)
    )
    kept = tuple(i for i in range(x.ndim) if i not in axes)
    perm = kept + axes
    moved = np.transpose(x, perm)
    batch = moved.shape[: len(kept)]
    rows = moved.reshape(batch + (math.prod(moved.shape[len(kept):]),))

    def back(r: np.ndarray) -> np.ndarray:
        r = np.asarray(r, dtype=object).reshape(moved.shape)
        return np.transpose(r, np.argsort(perm))

    return rows, back


def apply_rows(fn: Callable, x: np.ndarray, allowed: np.ndarray, axis, *extra) -> np.ndarray:
    rows, back = as_rows(x, axis)
    arows, _ = as_rows(allowed, axis)
    out = np.empty(rows.shape, dtype=object)
    for idx in np.ndindex(rows.shape[:-1]):
        out[idx + (slice(None),)] = fn(rows[idx].tolist(), arows[idx].tolist(), *extra)
    return back(out)


# ---------------------------------------------------------------- the cases


def softmax_cases(log: bool) -> list[dict]:
    fn = mp_log_softmax_row if log else mp_softmax_row
    cases: list[dict] = []

    def add(name: str, x, axis=-1, where=None, masked="zero", note: str = "") -> None:
        x = np.asarray(x, dtype=np.float64)
        allowed = np.ones(x.shape, bool) if where is None else np.broadcast_to(where, x.shape)
        if masked == "raise":
            expected = None
        else:
            expected = apply_rows(fn, x, allowed, axis, masked)
        cases.append({
            "name": name, "note": note, "shape": list(x.shape), "x": flat(x),
            "axis": list(axis) if isinstance(axis, tuple) else axis,
            "where": None if where is None else [bool(v) for v in allowed.ravel()],
            "masked": masked,
            "expected": None if expected is None else flat(expected),
            "dtypes": exact_dtypes(x),
        })

    add("seed_fp16_example", [20.0, 18.0, 17.0, -5.0],
        note="naive float16 overflows (exp(20) > 65504); stable: p ~ [0.84380, 0.11420, "
             "0.04201, 1.17e-11]")
    for z in (0.5, 2.5, -3.0, 0.0, 10.0, -30.0):
        add(f"two_logit_sigmoid_{z:g}", [0.0, z],
            note=f"[0, z] gives p = [1 - sigmoid(z), sigmoid(z)]; z = {z:g}")
    add("uniform_row", [3.0] * 7)
    add("single_position", [42.0])
    add("scalar_input", 5.0, axis=None, note="a 0-d input is a row of one")
    add("large_logits_float64", [1000.0, 999.0, -1000.0, 0.0])
    add("large_logits", [1000.0, 992.0, 960.0, -64.0])
    add("tiny_gaps", [1.0, 1.0 + 2.0**-20, 1.0 - 2.0**-20])
    add("two_rows_axis_last", [[1.0, 2.0, 3.0], [-1.0, 0.0, 8.0]], axis=-1)
    add("two_rows_axis_0", [[1.0, 2.0, 3.0], [-1.0, 0.0, 8.0]], axis=0)
    add("axis_none", [[1.0, 2.0, 3.0], [-1.0, 0.0, 8.0]], axis=None)
    add("axis_tuple", np.arange(24.0).reshape(2, 3, 4) / 4.0, axis=(0, 2))
    k = np.arange(-80, 81, dtype=np.float64)
    row = ((k * 37) % 161 - 80) / 8.0  # a permutation of k / 8: exact in every dtype
    add("long_row", row)
    add("minus_inf_logit", [-INF, 1.0, 2.0], note="-inf excludes the position (p = 0)")
    add("where_excludes", [1.0, 2.0, 3.0, 4.0], where=[True, False, True, False])
    add("where_broadcast", [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], where=[[True], [False]],
        note="second row fully masked by a broadcast mask")
    for masked in ("zero", "nan"):
        add(f"fully_masked_{masked}", [[1.0, 2.0], [5.0, 6.0]],
            where=[[False, False], [True, True]], masked=masked)
        add(f"all_minus_inf_{masked}", [[-INF, -INF, -INF], [0.0, 1.0, 2.0]], masked=masked)
    add("fully_masked_raise", [[1.0, 2.0]], where=[[False, False]], masked="raise",
        note="masked='raise' raises EmptyRowError")
    add("plus_inf", [[INF, 1.0, 2.0], [0.0, 1.0, 2.0]])
    add("two_plus_inf", [INF, INF, 1.0])
    add("plus_and_minus_inf", [INF, -INF])
    add("nan", [[math.nan, 1.0, 2.0], [0.0, 1.0, 2.0]])
    add("nan_masked_out", [math.nan, 1.0, 2.0], where=[False, True, True],
        note="an excluded NaN is never read")
    add("nan_and_plus_inf", [math.nan, INF])
    add("empty_axis", np.zeros((2, 0)), axis=-1, note="empty rows: an empty result")
    add("zero_rows", np.zeros((0, 3)), axis=-1, note="no rows: an empty result")
    return cases


def logsumexp_cases() -> list[dict]:
    cases: list[dict] = []

    def add(name, a, axis=-1, b=None, where=None, keepdims=False, return_sign=False,
            note: str = "") -> None:
        a = np.asarray(a, dtype=np.float64)
        bb = None if b is None else np.asarray(b, dtype=np.float64)
        shape = a.shape if bb is None else np.broadcast_shapes(a.shape, bb.shape)
        a_full = np.broadcast_to(a, shape)
        b_full = np.ones(shape) if bb is None else np.broadcast_to(bb, shape)
        allowed = np.ones(shape, bool) if where is None else np.broadcast_to(where, shape)
        rows, _ = as_rows(a_full, axis)
        brows, _ = as_rows(b_full, axis)
        arows, _ = as_rows(allowed, axis)
        lse = np.empty(rows.shape[:-1], dtype=object)
        sign = np.empty(rows.shape[:-1], dtype=object)
        for idx in np.ndindex(rows.shape[:-1]):
            v, s = mp_logsumexp_row(rows[idx].tolist(), brows[idx].tolist(),
                                    arows[idx].tolist())
            if not return_sign and (s == -1 or (isinstance(s, mp.mpf) and mp.isnan(s))):
                v = mp.nan
            lse[idx], sign[idx] = v, (s if isinstance(s, mp.mpf) else mp.mpf(s))
        axes = tuple(range(len(shape))) if axis is None else (
            axis if isinstance(axis, tuple) else (axis,))
        out_shape = tuple(
            (1 if (i in axes or i - len(shape) in axes) else n)
            for i, n in enumerate(shape)
            if keepdims or not (i in axes or i - len(shape) in axes)
        )
        cases.append({
            "name": name, "note": note, "shape": list(a.shape), "a": flat(a),
            "b_shape": None if bb is None else list(bb.shape),
            "b": None if bb is None else flat(bb),
            "axis": list(axis) if isinstance(axis, tuple) else axis,
            "where": None if where is None else [bool(v) for v in allowed.ravel()],
            "keepdims": keepdims, "return_sign": return_sign,
            "expected_shape": list(out_shape), "expected": flat(lse),
            "sign": flat(sign) if return_sign else None,
            "dtypes": exact_dtypes(a, bb),
        })

    add("seed_fp16_example", [20.0, 18.0, 17.0, -5.0])
    add("two_logit", [0.0, 2.5])
    add("large", [1000.0, 1000.0], note="log(2) + 1000, no overflow")
    add("large_negative", [-1000.0, -1000.0, -1001.0])
    add("axis_none", [[1.0, 2.0], [3.0, 4.0]], axis=None)
    add("axis_tuple_keepdims", np.arange(24.0).reshape(2, 3, 4) / 2.0, axis=(0, 2),
        keepdims=True)
    add("axis_0", [[1.0, 2.0], [3.0, -INF]], axis=0)
    add("scalar", 3.0, axis=None)
    add("weights", [0.0, 1.0, 2.0, 3.0], b=[3.0, 2.0, 1.0, 0.5])
    add("weights_broadcast", [[0.0, 1.0], [2.0, 3.0]], b=[2.0, 0.5])
    add("negative_sum_sign", [1.0, 2.0], b=[1.0, -1.0], return_sign=True)
    add("negative_sum_nan", [1.0, 2.0], b=[1.0, -1.0],
        note="a negative sum is NaN without return_sign")
    add("cancelling_weights", [1.0, 1.0], b=[1.0, -1.0], return_sign=True,
        note="an exact zero sum: -inf with sign 0")
    add("zero_weight_excludes_inf", [INF, 1.0], b=[0.0, 1.0])
    add("zero_weight_excludes_nan", [math.nan, 1.0], b=[0.0, 1.0])
    add("nan_weight", [1.0, 2.0], b=[math.nan, 1.0], return_sign=True)
    add("nan_weight_on_minus_inf", [-INF, 2.0], b=[math.nan, 1.0],
        note="NaN * exp(-inf) is NaN: a NaN weight is never excluded by its logit")
    add("nan_weight_on_minus_inf_row", [-INF, -INF], b=[math.nan, 1.0],
        note="a row of -inf logits is not empty when one of its weights is NaN")
    add("inf_opposite_weights", [INF, INF], b=[1.0, -1.0], return_sign=True,
        note="+inf minus +inf: NaN")
    add("inf_negative_weight", [INF, 1.0], b=[-1.0, 1.0], return_sign=True)
    add("inf_negative_weight_nan", [INF, 1.0], b=[-1.0, 1.0])
    add("minus_inf_row", [[-INF, -INF], [0.0, 0.0]], return_sign=True)
    add("plus_inf", [INF, 1.0, -INF])
    add("nan", [math.nan, INF])
    add("where_excludes", [1.0, 50.0, 2.0], where=[True, False, True])
    add("where_all_false", [[1.0, 2.0]], where=[[False, False]], return_sign=True)
    add("empty_axis", np.zeros((3, 0)), axis=-1, return_sign=True,
        note="an empty sum: -inf with sign 0")
    add("zero_rows", np.zeros((0, 4)), axis=-1)
    return cases


def cross_entropy_cases() -> list[dict]:
    cases: list[dict] = []

    def add(name, logits, target, kind, *, where=None, ignore_index=None,
            label_smoothing=0.0, reduction="mean", note: str = "") -> None:
        x = np.asarray(logits, dtype=np.float64)
        rows, classes = x.shape
        allowed = np.ones(x.shape, bool) if where is None else np.broadcast_to(where, x.shape)
        losses, grads, counted = [], [], 0
        for r in range(rows):
            pairs = zip(x[r].tolist(), allowed[r].tolist(), strict=True)
            row = [v if a else -INF for v, a in pairs]
            if kind == "index":
                t = int(target[r])
                if ignore_index is not None and t == ignore_index:
                    losses.append(mp.mpf(0))
                    grads.append([mp.mpf(0)] * classes)
                    continue
                y = [mp.mpf(1 if c == t else 0) for c in range(classes)]
            else:
                y = [mp.mpf(v) for v in np.asarray(target, dtype=np.float64)[r].tolist()]
            counted += 1
            kind_row = classify(row)
            included = [v != -INF for v in row] if kind_row in ("regular", "empty") \
                else [True] * classes
            if label_smoothing:
                n_inc = sum(included)
                eps = mp.mpf(label_smoothing)
                y = [(1 - eps) * yi + (eps / n_inc if inc and n_inc else 0)
                     for yi, inc in zip(y, included, strict=True)]
            if kind_row in ("nan", "posinf"):
                losses.append(mp.nan)
                grads.append([mp.nan] * classes)
                continue
            lse = mp_lse(row)[0] if kind_row == "regular" else None
            logp = [mp.mpf(v) - lse if inc and lse is not None else mp.mpf("-inf")
                    for v, inc in zip(row, included, strict=True)]
            loss = mp.mpf(0)
            for yi, lp in zip(y, logp, strict=True):
                if yi != 0:
                    loss -= yi * lp
            losses.append(loss)
            grads.append([mp.exp(lp) - yi if inc else mp.mpf(0)
                          for lp, yi, inc in zip(logp, y, included, strict=True)])
        scale = mp.mpf(1) / counted if reduction == "mean" and counted else mp.mpf(1)
        grads = [[g * scale for g in row] for row in grads]
        if reduction == "none":
            loss_out, loss_shape = losses, [rows]
        else:
            total = mp.fsum(losses)
            loss_out, loss_shape = [total * scale], []
        tgt = np.asarray(target)
        cases.append({
            "name": name, "note": note, "shape": list(x.shape), "logits": flat(x),
            "target_kind": kind,
            "target": [int(v) for v in tgt.ravel()] if kind == "index" else flat(tgt),
            "target_shape": list(tgt.shape),
            "where": None if where is None else [bool(v) for v in allowed.ravel()],
            "ignore_index": ignore_index, "label_smoothing": label_smoothing,
            "reduction": reduction,
            "loss_shape": loss_shape, "loss": flat(np.array(loss_out, dtype=object)),
            "grad": flat(np.array(grads, dtype=object)),
            "dtypes": exact_dtypes(x, None if kind == "index" else tgt),
        })

    x = [[2.0, 0.0, -1.0], [0.5, 1.5, -2.0], [-3.0, 4.0, 0.25]]
    add("index_mean", x, [0, 2, 1], "index")
    add("index_sum", x, [0, 2, 1], "index", reduction="sum")
    add("index_none", x, [0, 2, 1], "index", reduction="none")
    add("seed_fp16_example", [[20.0, 18.0, 17.0, -5.0]], [3], "index", reduction="none",
        note="a confidently wrong prediction: a large finite loss, not inf")
    add("probability_targets", x, [[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.125, 0.375, 0.5]],
        "probs", reduction="none")
    add("label_smoothing", x, [0, 2, 1], "index", label_smoothing=0.25)
    add("ignore_index", x, [0, -100, 1], "index", ignore_index=-100)
    add("all_ignored_mean", x, [-1, -1, -1], "index", ignore_index=-1,
        note="mean over zero counted rows: loss 0, gradient 0")
    add("where_excludes", x, [0, 1, 1], "index",
        where=[[True, True, False], [True, True, True], [False, True, True]])
    add("target_on_excluded_class", x, [2, 0, 1], "index", reduction="none",
        where=[[True, True, False], [True, True, True], [True, True, True]],
        note="target on an excluded class: +inf loss, gradient 0 there")
    add("target_on_minus_inf_logit", [[-INF, 0.0, 1.0]], [0], "index", reduction="none")
    add("smoothing_with_mask", x, [0, 2, 1], "index", label_smoothing=0.5,
        where=[[True, True, False], [True, True, True], [True, False, True]],
        reduction="none")
    add("nan_logit", [[math.nan, 0.0], [1.0, 2.0]], [0, 1], "index", reduction="none")
    add("large_logits", [[1000.0, 0.0, -1000.0]], [1], "index", reduction="none")
    return cases


def vjp_cases() -> list[dict]:
    cases: list[dict] = []

    def add(op, name, primal, cotangent, where=None, note: str = "") -> None:
        pr = np.asarray(primal, dtype=np.float64)
        ct = np.asarray(cotangent, dtype=np.float64)
        allowed = np.ones(pr.shape, bool) if where is None else np.broadcast_to(where, pr.shape)
        out = np.empty(pr.shape, dtype=object)
        for idx in np.ndindex(pr.shape[:-1]):
            row, g, a = pr[idx].tolist(), ct[idx].tolist(), allowed[idx].tolist()
            if op == "softmax_vjp":
                part = [ai and v != 0 for v, ai in zip(row, a, strict=True)]
                terms = zip(row, g, part, strict=True)
                dot = mp.fsum(mp.mpf(v) * mp.mpf(gi) for v, gi, pa in terms if pa)
                out[idx] = [mp.mpf(v) * (mp.mpf(gi) - dot) if pa else mp.mpf(0)
                            for v, gi, pa in zip(row, g, part, strict=True)]
            else:
                part = [ai and v != -INF for v, ai in zip(row, a, strict=True)]
                total = mp.fsum(mp.mpf(gi) for gi, pa in zip(g, part, strict=True) if pa)
                out[idx] = [mp.mpf(gi) - mp.exp(mp.mpf(v)) * total if pa else mp.mpf(0)
                            for v, gi, pa in zip(row, g, part, strict=True)]
        cases.append({
            "op": op, "name": name, "note": note, "shape": list(pr.shape),
            "primal": flat(pr), "cotangent": flat(ct),
            "where": None if where is None else [bool(v) for v in allowed.ravel()],
            "axis": -1, "expected": flat(out), "dtypes": exact_dtypes(pr, ct),
        })

    p = [[0.5, 0.25, 0.125, 0.125], [0.0, 0.75, 0.25, 0.0]]
    g = [[1.0, -2.0, 0.5, 3.0], [4.0, 1.0, -1.0, 2.0]]
    add("softmax_vjp", "dyadic", p, g)
    add("softmax_vjp", "masked", p, g, where=[[True, True, True, True], [False] * 4],
        note="a fully masked row has gradient 0")
    lp = np.log(np.asarray(p))  # -inf where p = 0 (log(0) here is the spec's -inf)
    add("log_softmax_vjp", "from_dyadic", lp, g,
        note="positions with log p = -inf take no part")
    add("log_softmax_vjp", "masked", lp, g, where=[[True, False, True, True], [True] * 4])
    return cases


def build() -> dict[str, dict]:
    """Every vector file's content, by file name."""
    with np.errstate(divide="ignore"):
        files = {
            "softmax.json": ("softmax", softmax_cases(log=False)),
            "log_softmax.json": ("log_softmax", softmax_cases(log=True)),
            "logsumexp.json": ("logsumexp", logsumexp_cases()),
            "cross_entropy.json": ("cross_entropy", cross_entropy_cases()),
            "vjp.json": ("softmax_vjp, log_softmax_vjp", vjp_cases()),
        }
    return {
        filename: {
            "ops": ops,
            "generator": "spec/vectors/make_vectors.py (mpmath, 50 digits)",
            "cases": cases,
        }
        for filename, (ops, cases) in files.items()
    }


def main() -> None:
    for filename, doc in build().items():
        (HERE / filename).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"{filename}: {len(doc['cases'])} cases")


if __name__ == "__main__":
    main()
