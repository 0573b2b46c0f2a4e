"""Conformance cases for packed variable-length attention and its gradient.

Each case packs a few sequences of different lengths (no queries, no keys, more queries than
keys and the reverse among them), runs ``varlen_attention`` on the backend under test and
checks the packed result twice: against the float64 materialized definition evaluated on each
unpacked sequence (:mod:`softmaxkit.testing.materialized`), under the bounds of
spec/semantics.md, "Attention", and against the library's dense ``attention`` called on each
unpacked sequence in the case's dtype, which must agree within the same bounds and give the
same empty rows.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import softmaxkit as sk

from ..dtypes import accumulator_name
from . import materialized as ref
from .attention_cases import _causal_kw, check_against_dense, check_forward, check_grads
from .kit import Target, case

LENGTHS: tuple[tuple[int, ...], tuple[int, ...]] = ((3, 0, 6, 1, 4, 9), (5, 2, 3, 0, 4, 12))
"""Query and key lengths of the packed sequences: sequence 1 has keys but no queries,
sequence 3 a query but no keys (out 0, lse -inf), sequence 2 more queries than keys (its
first rows see no key under bottom-right causal alignment)."""


TILED_LENGTHS: tuple[tuple[int, ...], tuple[int, ...]] = (
    (130, 0, 67, 1, 200, 33, 64), (150, 40, 67, 0, 129, 300, 64))
"""Lengths spanning several tiles of a tiled kernel (16 to 128 rows or keys): a sequence with
keys but no queries, one with a query but no keys, more queries than keys and far fewer, and
lengths on both sides of the tile boundaries (64, 128) beside the ones on them."""


def _cu(lengths: tuple[int, ...]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)])


def packed_arrays(
    seed: int, lens_q: tuple[int, ...], lens_k: tuple[int, ...], hq: int, hk: int, d: int,
    dv: int, dtype: Any = np.float64, index_dtype: Any = np.int64, scale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Packed numpy ``(q, k, v, cu_seqlens_q, cu_seqlens_k)`` for sequences of ``lens_q``
    queries and ``lens_k`` keys: normal values of standard deviation ``scale`` in ``dtype``,
    cumulative lengths in ``index_dtype``."""
    rng = np.random.default_rng(seed)
    cu_q, cu_k = _cu(lens_q).astype(index_dtype), _cu(lens_k).astype(index_dtype)
    shapes = ((cu_q[-1], hq, d), (cu_k[-1], hk, d), (cu_k[-1], hk, dv))
    q, k, v = (rng.normal(scale=scale, size=s).astype(dtype) for s in shapes)
    return q, k, v, cu_q, cu_k


def _spans(cu_q: np.ndarray, cu_k: np.ndarray) -> list[tuple[int, int, int, int]]:
    return [(int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1]))
            for b in range(len(cu_q) - 1)]


def _heads_first(a: np.ndarray) -> np.ndarray:
    return a.transpose(1, 0, 2)


def _inputs(t: Target, dtype: str, seed: int, hq: int, hk: int, d: int, dv: int,
            scale: float = 1.0, lengths: tuple[tuple[int, ...], tuple[int, ...]] = LENGTHS,
            ) -> tuple[list[Any], list[np.ndarray], np.ndarray, np.ndarray]:
    """Packed (q, k, v) on the target, their represented float64 values, and cu_seqlens."""
    *arrays, cu_q, cu_k = packed_arrays(seed, *lengths, hq, hk, d, dv, scale=scale)
    on_target = [t.asarray(a, dtype) for a in arrays]
    return on_target, [t.to_numpy(a) for a in on_target], cu_q, cu_k


def _metadata(t: Target, cu_q: np.ndarray, cu_k: np.ndarray, kind: str) -> tuple[Any, Any]:
    return t.asarray(cu_q.astype(kind), None), t.asarray(cu_k.astype(kind), None)


def packed_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_q: np.ndarray, cu_k: np.ndarray,
    **kw: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """(out [Tq, Hq, Dv], lse [Tq, Hq]) in float64: the definition on each sequence, packed."""
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = np.full(q.shape[:2], -np.inf)
    for q0, q1, k0, k1 in _spans(cu_q, cu_k):
        o, s = ref.attention(_heads_first(q[q0:q1]), _heads_first(k[k0:k1]),
                             _heads_first(v[k0:k1]), **kw)
        out[q0:q1], lse[q0:q1] = _heads_first(o), s.T
    return out, lse


def packed_vjp_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, cu_q: np.ndarray,
    cu_k: np.ndarray, dlse: np.ndarray | None = None, **kw: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv) in float64: the definition's gradients on each sequence, packed (the keys
    of a sequence without queries get zeros); ``dlse`` [Tq, Hq] the lse's cotangent, NaN
    read as 0."""
    expected = [np.zeros(a.shape) for a in (q, k, v)]
    for q0, q1, k0, k1 in _spans(cu_q, cu_k):
        grads = ref.attention_vjp(_heads_first(q[q0:q1]), _heads_first(k[k0:k1]),
                                  _heads_first(v[k0:k1]), _heads_first(dout[q0:q1]),
                                  dlse=None if dlse is None else np.nan_to_num(dlse[q0:q1]).T,
                                  **kw)
        for e, g, (lo, hi) in zip(expected, grads, ((q0, q1), (k0, k1), (k0, k1)),
                                  strict=True):
            e[lo:hi] = _heads_first(g)
    return expected[0], expected[1], expected[2]


def _dense_on_target(
    t: Target, dtype: str, q: Any, k: Any, v: Any, cu_q: np.ndarray, cu_k: np.ndarray,
    **kw: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """The library's dense attention on each unpacked sequence (default dispatch), packed."""
    xp = t.xp
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = np.full(tuple(q.shape[:2]), -np.inf)

    def heads_first(a: Any, lo: int, hi: int) -> Any:
        return xp.permute_dims(a[lo:hi, ...], (1, 0, 2))

    for q0, q1, k0, k1 in _spans(cu_q, cu_k):
        if q1 == q0:
            continue
        o, s = sk.attention(heads_first(q, q0, q1), heads_first(k, k0, k1),
                            heads_first(v, k0, k1), return_lse=True, **kw)
        out[q0:q1], lse[q0:q1] = _heads_first(t.to_numpy(o)), t.to_numpy(s).T
    return out, lse


def _forward(t: Target, dtype: str, backend: str, seed: int, heads: tuple[int, int],
             dims: tuple[int, int], what: str, kind: str = "int64", scale: Any = None,
             score_scale: float = 1.0,
             lengths: tuple[tuple[int, ...], tuple[int, ...]] = LENGTHS, **kw: Any) -> None:
    (q, k, v), (q64, k64, v64), cu_q, cu_k = _inputs(t, dtype, seed, *heads, *dims,
                                                      scale=score_scale, lengths=lengths)
    mq, mk = _metadata(t, cu_q, cu_k, kind)
    got = sk.varlen_attention(q, k, v, mq, mk, return_lse=True, scale=scale, backend=backend,
                              **kw)
    rkw = dict(kw, causal=_causal_kw(kw.get("causal", False)))
    expected = packed_reference(q64, k64, v64, cu_q, cu_k, scale=scale, **rkw)
    check_forward(t, dtype, got, expected, what)
    if lengths is not LENGTHS:
        # each sequence on its own: an error confined to one short sequence is not hidden in
        # the norm of the whole packed batch
        out, lse = t.to_numpy(got[0]), t.to_numpy(got[1])
        for b, (q0, q1, _, _) in enumerate(_spans(cu_q, cu_k)):
            if q1 > q0:
                check_forward(t, dtype, (t.asarray(out[q0:q1], None),
                                         t.asarray(lse[q0:q1], None)),
                              (expected[0][q0:q1], expected[1][q0:q1]), f"{what}, sequence {b}")
    dense = _dense_on_target(t, dtype, q, k, v, cu_q, cu_k, scale=scale, **kw)
    check_against_dense(t, dtype, got, dense, what + " vs dense attention")


@case("varlen_attention")
def case_varlen_attention_causal_alignments(t: Target, dtype: str, backend: str) -> None:
    d, dv = t.head_dims[0]
    for causal in (False, True, "top_left"):
        _forward(t, dtype, backend, 40, (2, 2), (d, dv), f"varlen_attention causal={causal!r}",
                 causal=causal)
    _forward(t, dtype, backend, 41, (2, 2), (d, dv), "varlen_attention int32 cu_seqlens",
             kind="int32", causal=True)


@case("varlen_attention")
def case_varlen_attention_grouped_query(t: Target, dtype: str, backend: str) -> None:
    d, dv = t.head_dims[0]
    for hq, hk in ((4, 2), (3, 1)):
        _forward(t, dtype, backend, 42 + hq, (hq, hk), (d, dv),
                 f"varlen_attention Hq={hq} Hk={hk}", causal=True)


@case("varlen_attention")
def case_varlen_attention_window_softcap(t: Target, dtype: str, backend: str) -> None:
    d, dv = next(((d, dv) for d, dv in t.head_dims if d == dv), t.head_dims[0])
    for window, causal in (((2, 1), False), ((1, -1), True), ((2, 2), "top_left")):
        _forward(t, dtype, backend, 44, (2, 2), (d, dv),
                 f"varlen_attention window={window} causal={causal!r}", window=window,
                 causal=causal)
    # scores of standard deviation about 4, so the cap bends some of them
    _forward(t, dtype, backend, 45, (2, 2), (d, dv), "varlen_attention softcap=5",
             softcap=5.0, scale=4.0 / math.sqrt(d), causal=True)


def _square_pairs(t: Target) -> list[tuple[int, int]]:
    """The target's (D, Dv) pairs with D == Dv (its first pair when none has)."""
    return [(d, dv) for d, dv in t.head_dims if d == dv] or [t.head_dims[0]]


TILED_SETTINGS: tuple[tuple[tuple[int, int], dict[str, Any]], ...] = (
    ((4, 2), {}),
    ((4, 2), {"causal": True}),
    ((4, 2), {"causal": True}),
    ((4, 4), {"causal": "top_left"}),
    ((6, 2), {"causal": True, "window": (50, 0)}),
    ((4, 1), {"window": (70, 20), "softcap": 5.0}),
)
"""(Hq, Hk) and options of the tiled-lengths cases: grouped-query heads, both causal
alignments, a window, and a softcap on scores of standard deviation about 4."""


def _tiled(t: Target) -> list[tuple[int, tuple[int, int], tuple[int, int], dict[str, Any]]]:
    """(index, heads, (D, Dv), options) of the tiled-lengths cases: setting i at the i-th
    square pair of the target, cyclically, so with two pairs each sees bottom-right causal
    grouped-query heads (the settings' order sees to it) and the cost stays that of one sweep."""
    pairs = _square_pairs(t)
    runs = []
    for i, (heads, kw) in enumerate(TILED_SETTINGS):
        d, dv = pairs[i % len(pairs)]
        if "softcap" in kw:
            kw = dict(kw, scale=4.0 / math.sqrt(d))
        runs.append((i, heads, (d, dv), kw))
    return runs


@case("varlen_attention")
def case_varlen_attention_tiled_lengths(t: Target, dtype: str, backend: str) -> None:
    for i, heads, dims, kw in _tiled(t):
        _forward(t, dtype, backend, 70 + i, heads, dims,
                 f"varlen_attention tiled lengths D={dims[0]} Hq, Hk={heads} {kw}",
                 lengths=TILED_LENGTHS, **kw)


@case("varlen_attention")
def case_varlen_attention_lse_base_2(t: Target, dtype: str, backend: str) -> None:
    d, dv = t.head_dims[0]
    (q, k, v), (q64, k64, v64), cu_q, cu_k = _inputs(t, dtype, 46, 2, 2, d, dv)
    mq, mk = _metadata(t, cu_q, cu_k, "int64")
    out, lse2 = sk.varlen_attention(q, k, v, mq, mk, causal=True, return_lse=True, lse_base=2,
                                    backend=backend)
    e_out, e_lse = packed_reference(q64, k64, v64, cu_q, cu_k, causal="bottom_right")
    lse_e = t.asarray(t.to_numpy(lse2) * math.log(2.0), None)
    check_forward(t, dtype, (out, lse_e), (e_out, e_lse), "varlen_attention lse_base=2")
    plain = sk.varlen_attention(q, k, v, mq, mk, causal=True, backend=backend)
    assert np.array_equal(t.to_numpy(plain), t.to_numpy(out)), (
        "varlen_attention: out differs between return_lse=False and True")


def _vjp(t: Target, dtype: str, backend: str, seed: int, heads: tuple[int, int],
         dims: tuple[int, int], name: str,
         lengths: tuple[tuple[int, ...], tuple[int, ...]] = LENGTHS, with_dlse: bool = False,
         **kw: Any) -> None:
    """One gradient check: against the float64 definition on each sequence, the keys of the
    sequence with no queries (the second) get zero gradients, empty rows a zero dq; with
    ``with_dlse`` a loss that uses the lse too (its cotangent NaN on the rows with no key,
    which never read it)."""
    hq, hk = heads
    d, dv = dims
    acc = accumulator_name(dtype)
    (q, k, v), (q64, k64, v64), cu_q, cu_k = _inputs(t, dtype, seed, hq, hk, d, dv,
                                                      lengths=lengths)
    rng = np.random.default_rng(seed + 10)
    dout = t.asarray(rng.normal(size=(int(cu_q[-1]), hq, dv)), dtype)
    dout64 = t.to_numpy(dout)
    base = kw.pop("lse_base", "e")
    per_base = 1.0 if base == "e" else math.log(2.0)  # lse_2 = lse / ln 2, dlse_2 = dlse ln 2
    rkw = dict(kw, causal=_causal_kw(kw.get("causal", False)))
    # the forward's (out, lse) come from the float64 definition, so a backend that serves
    # only the gradient is checked too
    out64, lse64 = packed_reference(q64, k64, v64, cu_q, cu_k, **rkw)
    mq, mk = _metadata(t, cu_q, cu_k, "int64")
    dlse64 = None
    if with_dlse:
        dlse64 = rng.normal(size=lse64.shape)
        dlse64[lse64 == -np.inf] = np.nan
        kw = dict(kw, dlse=t.asarray(dlse64 * per_base, acc))
    got = sk.varlen_attention_vjp(q, k, v, t.asarray(out64, dtype),
                                  t.asarray(lse64 / per_base, acc), dout, mq, mk,
                                  lse_base=base, backend=backend, **kw)
    expected = packed_vjp_reference(q64, k64, v64, dout64, cu_q, cu_k, dlse64, **rkw)
    what = f"varlen_attention_vjp {name}"
    check_grads(t, dtype, got, tuple(expected), what)
    dq, dk, dvv = (t.to_numpy(g) for g in got)
    if lengths is not LENGTHS:
        # each sequence on its own (its queries' dq, its keys' dk and dv) where it has any
        for b, (q0, q1, k0, k1) in enumerate(_spans(cu_q, cu_k)):
            if q1 > q0 and k1 > k0:
                check_grads(t, dtype, tuple(t.asarray(a, None) for a in
                                            (dq[q0:q1], dk[k0:k1], dvv[k0:k1])),
                            (expected[0][q0:q1], expected[1][k0:k1], expected[2][k0:k1]),
                            f"{what}, sequence {b}")
    k0, k1 = int(cu_k[1]), int(cu_k[2])  # the keys of the sequence with no queries
    assert np.all(dk[k0:k1] == 0) and np.all(dvv[k0:k1] == 0), (
        f"{what}: keys of a sequence with no queries have a gradient")
    empty = lse64 == -np.inf
    assert np.all(dq[empty] == 0), f"{what}: a row with no allowed key has nonzero dq"


@case("varlen_attention_vjp")
def case_varlen_attention_vjp(t: Target, dtype: str, backend: str) -> None:
    d, dv = t.head_dims[0]
    settings: tuple[tuple[dict[str, Any], str], ...] = (
        ({}, "plain"),
        ({"causal": True}, "causal (empty rows)"),
        ({"causal": "top_left", "window": (2, 1)}, "top_left window"),
        ({"softcap": 4.0, "scale": 4.0 / math.sqrt(d)}, "softcap"),
        ({"causal": True, "with_dlse": True}, "causal, the lse in the loss"),
        ({"lse_base": 2, "with_dlse": True}, "the lse in base 2 in the loss"),
    )
    for i, (kw, name) in enumerate(settings):
        _vjp(t, dtype, backend, 50 + i, (4, 2), (d, dv), name, **kw)


@case("varlen_attention_vjp")
def case_varlen_attention_vjp_tiled_lengths(t: Target, dtype: str, backend: str) -> None:
    for i, heads, dims, kw in _tiled(t):
        _vjp(t, dtype, backend, 80 + i, heads, dims,
             f"tiled lengths D={dims[0]} Hq, Hk={heads} {kw}", lengths=TILED_LENGTHS, **kw)
