"""Conformance cases for the row operations (softmax, log_softmax, logsumexp, cross_entropy,
softmax_vjp, log_softmax_vjp): the golden vectors of spec/vectors/ (mpmath), in the dtypes
that represent their inputs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import softmaxkit as sk

from . import vectors
from .kit import Target, case
from .row_checks import (
    check_dtype,
    masked,
    run_parts,
)
from .row_references import (
    _rows,
)
from .tolerance import (
    assert_within,
    log_bound,
    softmax_bound,
    vjp_bound,
)


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
        check_dtype(out, dtype, what)
        expected = vectors.array(v["expected"], v["shape"])
        got = t.to_numpy(out)
        rows, _ = _rows(masked(x, where), axis)
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
        check_dtype(lse, dtype, what)
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
        check_dtype(loss, dtype, what)
        check_dtype(grad, dtype, what)
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

    run_parts({op: part(op) for op in ("softmax_vjp", "log_softmax_vjp")})


def _check_vjp_vector(t: Target, dtype: str, backend: str, v: dict[str, Any]) -> None:
    what = f"{v['op']} vector {v['name']} [{dtype}]"
    fn = getattr(sk, v["op"])
    primal = vectors.array(v["primal"], v["shape"])
    cot = vectors.array(v["cotangent"], v["shape"])
    where = vectors.array(v["where"], v["shape"])
    out = fn(t.asarray(primal, dtype), t.asarray(cot, dtype), axis=v["axis"],
             where=None if where is None else t.asarray(where, None), backend=backend)
    check_dtype(out, dtype, what)
    expected = vectors.array(v["expected"], v["shape"])
    scale = np.abs(cot) + np.abs(cot).sum(-1, keepdims=True)
    if v["op"] == "log_softmax_vjp":
        scale = scale * (1 + np.where(np.isfinite(primal), np.abs(primal), 0))
    assert_within(t.to_numpy(out), expected,
                  vjp_bound(expected, scale, v["shape"][-1], dtype), what)
