"""Conformance cases for attention, attention_vjp and the merges of partial attention states.

Every case builds inputs in numpy, rounds them to the case's dtype on the target, and compares
the backend's result with the float64 materialized definition
(:mod:`softmaxkit.testing.materialized`) evaluated on the represented inputs, under the bounds
of spec/semantics.md, "Attention".  Shapes are small so the cases also run under slow
simulators.  Head dimensions come from the target (:attr:`~softmaxkit.testing.Target.head_dims`,
chosen with ``cases(..., head_dims=...)``), so a backend that serves only some head dimensions
runs every case at those.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import softmaxkit as sk

from ..dtypes import accumulator_name
from . import materialized as ref
from .kit import Target, case

ATTENTION_TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float64": (1e-12, 1e-12, 1e-10),
    "float32": (1e-5, 1e-5, 1e-4),
    "float16": (4e-3, 2e-3, 2e-2),
    "bfloat16": (3e-2, 2e-3, 1e-1),
}
"""dtype -> (relative Frobenius error of out, absolute error of lse, relative Frobenius error of
each gradient), against float64 on the represented inputs (spec "Attention tolerances")."""


def _inputs(
    t: Target, dtype: str, seed: int, q_shape: tuple[int, ...], k_shape: tuple[int, ...],
    dv: int | None = None, scale: float = 1.0,
) -> tuple[Any, Any, Any, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    v_shape = k_shape[:-1] + (dv if dv is not None else k_shape[-1],)
    arrays = [rng.normal(scale=scale, size=s) for s in (q_shape, k_shape, v_shape)]
    on_target = [t.asarray(a, dtype) for a in arrays]
    represented = [t.to_numpy(a) for a in on_target]
    return (*on_target, *represented)


def check_forward(
    t: Target, dtype: str, got: tuple[Any, Any], expected: tuple[np.ndarray, np.ndarray],
    what: str,
) -> None:
    """Compare (out, lse) with the float64 reference: bounds, exact zeros and -inf when empty."""
    out_tol, lse_tol, _ = ATTENTION_TOLERANCES[dtype]
    out, lse = t.to_numpy(got[0]), t.to_numpy(got[1])
    e_out, e_lse = expected
    assert out.shape == e_out.shape, f"{what}: out shape {out.shape} != {e_out.shape}"
    assert lse.shape == e_lse.shape, f"{what}: lse shape {lse.shape} != {e_lse.shape}"
    empty = e_lse == -np.inf
    assert np.all(lse[empty] == -np.inf), f"{what}: lse of a row with no allowed key is not -inf"
    assert np.all(out[empty] == 0), f"{what}: out of a row with no allowed key is not 0"
    assert np.all(np.isfinite(lse[~empty])), f"{what}: non-finite lse on a row with keys"
    err = ref.rel_frobenius(out, e_out)
    assert err <= out_tol, f"{what} [{dtype}]: out relative Frobenius error {err:.3g} > {out_tol}"
    if np.any(~empty):
        lerr = float(np.max(np.abs(lse[~empty] - e_lse[~empty])))
        assert lerr <= lse_tol, f"{what} [{dtype}]: lse error {lerr:.3g} > {lse_tol}"


def check_against_dense(
    t: Target, dtype: str, got: tuple[Any, Any], dense: tuple[np.ndarray, np.ndarray],
    what: str,
) -> None:
    """Compare (out, lse) with ``softmaxkit.attention`` on the same sequences in ``dtype``:
    the same rows with no allowed key, (0, -inf) in both, and the rest within twice the
    bounds (each result is within the bounds of the float64 definition)."""
    out_tol, lse_tol, _ = ATTENTION_TOLERANCES[dtype]
    out, lse = t.to_numpy(got[0]), t.to_numpy(got[1])
    d_out, d_lse = dense
    empty = d_lse == -np.inf
    assert np.array_equal(lse == -np.inf, empty), (
        f"{what}: rows with no allowed key differ from dense attention's")
    assert np.all(out[empty] == 0), f"{what}: out of a row with no allowed key is not 0"
    err = ref.rel_frobenius(out, d_out)
    assert err <= 2 * out_tol, f"{what} [{dtype}]: out differs from dense attention by {err:.3g}"
    if np.any(~empty):
        lerr = float(np.max(np.abs(lse[~empty] - d_lse[~empty])))
        assert lerr <= 2 * lse_tol, (
            f"{what} [{dtype}]: lse differs from dense attention by {lerr:.3g}")

def _pair(t: Target) -> tuple[int, int]:
    """(D, Dv) for a case with a value dimension of its own: the target's first pair."""
    return t.head_dims[0]


def _square(t: Target) -> tuple[int, int]:
    """(D, Dv) for the other cases: the target's first pair with D == Dv, else its first."""
    return next(((d, dv) for d, dv in t.head_dims if d == dv), t.head_dims[0])


def _causal_kw(causal: Any) -> str | None:
    return {False: None, True: "bottom_right"}.get(causal, causal)


def _forward(
    t: Target, dtype: str, backend: str, seed: int, q_shape: tuple[int, ...],
    k_shape: tuple[int, ...], *, dv: int | None = None, mask: np.ndarray | None = None,
    causal: Any = False, window: Any = None, softcap: Any = None, scale: Any = None,
    what: str = "attention",
) -> None:
    q, k, v, q64, k64, v64 = _inputs(t, dtype, seed, q_shape, k_shape, dv)
    m = None if mask is None else t.asarray(mask, None)
    got = sk.attention(q, k, v, mask=m, causal=causal, window=window, softcap=softcap,
                       scale=scale, return_lse=True, backend=backend)
    expected = ref.attention(q64, k64, v64, mask=mask, causal=_causal_kw(causal),
                             window=window, softcap=softcap, scale=scale)
    check_forward(t, dtype, got, expected, what)


@case("attention")
def case_attention_random_shapes(t: Target, dtype: str, backend: str) -> None:
    rng = np.random.default_rng(10)
    for trial in range(3):
        b, h = int(rng.integers(1, 3)), int(rng.integers(1, 3))
        lq, lk = int(rng.integers(1, 20)), int(rng.integers(1, 40))
        d, dv = t.head_dims[int(rng.integers(len(t.head_dims)))]
        _forward(t, dtype, backend, trial, (b, h, lq, d), (b, h, lk, d), dv=dv,
                 what=f"attention B={b} H={h} Lq={lq} Lk={lk} D={d} Dv={dv}")


@case("attention")
def case_attention_causal_alignments(t: Target, dtype: str, backend: str) -> None:
    # Lq > Lk with bottom-right alignment leaves the first Lq - Lk query rows empty
    d, dv = _square(t)
    for lq, lk in ((5, 9), (9, 5), (7, 7)):
        for causal in (True, "bottom_right", "top_left"):
            _forward(t, dtype, backend, lq * 31 + lk, (1, 2, lq, d), (1, 2, lk, d), dv=dv,
                     causal=causal, what=f"attention causal={causal!r} Lq={lq} Lk={lk}")


@case("attention")
def case_attention_grouped_query(t: Target, dtype: str, backend: str) -> None:
    d, dv = _pair(t)
    for hq, hk in ((4, 2), (6, 1), (3, 3)):
        _forward(t, dtype, backend, hq * 7 + hk, (2, hq, 6, d), (2, hk, 11, d), dv=dv,
                 causal=True, what=f"attention Hq={hq} Hk={hk}")


@case("attention")
def case_attention_masks(t: Target, dtype: str, backend: str) -> None:
    rng = np.random.default_rng(3)
    lq, lk = 6, 13
    full = rng.random((2, 2, lq, lk)) < 0.6
    full[0, 1, 2, :] = False  # a fully masked row
    shared = rng.random((lq, lk)) < 0.5  # broadcast over batch and heads
    shared[4] = False
    per_head = rng.random((2, 1, lk)) < 0.7  # [H, 1, Lk]: a key-padding mask per head
    d, dv = _square(t)
    for name, mask in (("full", full), ("shared", shared), ("per_head", per_head)):
        _forward(t, dtype, backend, 5, (2, 2, lq, d), (2, 2, lk, d), dv=dv, mask=mask,
                 what=f"attention mask={name}")
        _forward(t, dtype, backend, 6, (2, 2, lq, d), (2, 2, lk, d), dv=dv, mask=mask,
                 causal=True, window=(4, -1), what=f"attention mask={name} + causal + window")


@case("attention")
def case_attention_windows(t: Target, dtype: str, backend: str) -> None:
    d, dv = _square(t)
    for window in ((2, 1), (3, -1), (-1, 0), (0, 0), (-1, 2)):
        for lq, lk in ((8, 12), (12, 8)):
            _forward(t, dtype, backend, 11, (1, 2, lq, d), (1, 2, lk, d), dv=dv, window=window,
                     what=f"attention window={window} Lq={lq} Lk={lk}")
        _forward(t, dtype, backend, 12, (1, 2, 10, d), (1, 2, 10, d), dv=dv, window=(2, 2),
                 causal="top_left", what="attention window=(2, 2) causal=top_left")


@case("attention")
def case_attention_softcap(t: Target, dtype: str, backend: str) -> None:
    d, dv = _square(t)
    # scores of standard deviation about 4 at every D, so both caps bend some of them
    for softcap in (5.0, 30.0):
        _forward(t, dtype, backend, 13, (1, 2, 7, d), (1, 2, 9, d), dv=dv, softcap=softcap,
                 scale=4.0 / math.sqrt(d), causal=True, what=f"attention softcap={softcap}")


@case("attention", dtypes=("float32",))
def case_attention_precisions(t: Target, dtype: str, backend: str) -> None:
    """``precision="tf32x3"`` and ``"tf32"`` on float32 inputs: each result within the
    elementwise bound of spec "Precision" (:func:`.precision.attention_bound`) against the
    float64 definition, rows with no allowed key exact; a backend computing exactly meets it
    too (it may compute more precisely than asked)."""
    from .precision import attention_bound
    from .tolerance import assert_within

    d, dv = _square(t)
    rng = np.random.default_rng(21)
    mask = rng.random((9, 14)) < 0.6
    mask[3] = False  # a row with no allowed key
    options: tuple[dict[str, Any], ...] = (
        dict(), dict(causal="bottom_right"), dict(causal="top_left", window=(4, -1)),
        dict(mask=mask), dict(softcap=5.0, scale=3.0 / math.sqrt(d)))
    for precision in ("tf32x3", "tf32"):
        for seed, kw in enumerate(options):
            q, k, v, q64, k64, v64 = _inputs(t, dtype, 40 + seed, (2, 4, 9, d), (2, 2, 14, d),
                                             dv)
            m = None if kw.get("mask") is None else t.asarray(kw["mask"], None)
            got = sk.attention(q, k, v, **{**kw, "mask": m}, return_lse=True,
                               precision=precision, backend=backend)
            out, lse = ref.attention(q64, k64, v64, **kw)
            out_bound, lse_bound = attention_bound(q64, k64, v64, precision=precision, **kw)
            what = f"attention precision={precision!r} {sorted(kw)}"
            assert_within(t.to_numpy(got[0]), out, out_bound, what + " out")
            assert_within(t.to_numpy(got[1]), lse, lse_bound, what + " lse")


@case("attention")
def case_attention_head_dims(t: Target, dtype: str, backend: str) -> None:
    for d, dv in t.head_dims:
        _forward(t, dtype, backend, d, (1, 1, 4, d), (1, 1, 6, d), dv=dv,
                 what=f"attention D={d} Dv={dv}")


@case("attention")
def case_attention_long_rows(t: Target, dtype: str, backend: str) -> None:
    d, dv = _square(t)
    _forward(t, dtype, backend, 14, (1, 1, 3, d), (1, 1, 300, d), dv=dv,
             what="attention Lk=300")
    _forward(t, dtype, backend, 15, (1, 1, 3, d), (1, 1, 300, d), dv=dv, causal=True,
             window=(130, -1), what="attention Lk=300 causal window")


@case("attention")
def case_attention_broadcast_and_empty(t: Target, dtype: str, backend: str) -> None:
    d, dv = _square(t)
    q, k, v, q64, k64, v64 = _inputs(t, dtype, 16, (2, 3, 2, 5, d), (1, 2, 7, d), dv)
    got = sk.attention(q, k, v, return_lse=True, backend=backend)
    expected = ref.attention(q64, np.broadcast_to(k64, (2, 3, 2, 7, d)),
                             np.broadcast_to(v64, (2, 3, 2, 7, dv)))
    check_forward(t, dtype, got, expected, "attention with broadcast leading dims")
    for lq, lk in ((4, 0), (0, 4)):
        q, k, v, q64, k64, v64 = _inputs(t, dtype, 17, (1, 2, lq, d), (1, 2, lk, d), dv)
        got = sk.attention(q, k, v, return_lse=True, backend=backend)
        check_forward(t, dtype, got, ref.attention(q64, k64, v64), f"attention Lq={lq} Lk={lk}")


@case("attention")
def case_attention_lse_base_2(t: Target, dtype: str, backend: str) -> None:
    d, dv = _square(t)
    q, k, v, q64, k64, v64 = _inputs(t, dtype, 18, (1, 2, 5, d), (1, 2, 9, d), dv)
    out, lse2 = sk.attention(q, k, v, return_lse=True, lse_base=2, causal=True,
                             backend=backend)
    e_out, e_lse = ref.attention(q64, k64, v64, causal="bottom_right")
    lse2 = t.to_numpy(lse2)
    check_forward(t, dtype, (out, t.asarray(lse2 * math.log(2.0), None)),
                  (e_out, e_lse), "attention lse_base=2")
    fin = np.isfinite(e_lse)
    assert np.allclose(lse2[fin], e_lse[fin] / math.log(2.0), rtol=0,
                       atol=ATTENTION_TOLERANCES[dtype][1] / math.log(2.0))


def check_grads(
    t: Target, dtype: str, got: tuple[Any, ...], expected: tuple[np.ndarray, ...], what: str
) -> None:
    """Assert that ``got`` = (dq, dk, dv) match ``expected`` in shape and within the dtype's
    relative Frobenius tolerance."""
    tol = ATTENTION_TOLERANCES[dtype][2]
    for name, g, e in zip(("dq", "dk", "dv"), got, expected, strict=True):
        g = t.to_numpy(g)
        assert g.shape == e.shape, f"{what}: {name} shape {g.shape} != {e.shape}"
        err = ref.rel_frobenius(g, e)
        assert err <= tol, f"{what} [{dtype}]: {name} relative Frobenius error {err:.3g} > {tol}"


@case("attention_vjp")
def case_attention_vjp(t: Target, dtype: str, backend: str) -> None:
    rng = np.random.default_rng(20)
    d, dv = _pair(t)
    mask = rng.random((6, 11)) < 0.7
    mask[1] = False
    settings: tuple[tuple[dict[str, Any], str], ...] = (
        ({}, "plain"),
        ({"causal": True}, "causal"),
        ({"causal": "top_left", "window": (2, 1)}, "top_left window"),
        ({"mask": mask, "causal": True}, "mask + causal (empty rows)"),
        ({"softcap": 4.0, "scale": 4.0 / math.sqrt(d)}, "softcap"),  # as in the forward case
    )
    for i, (kw, name) in enumerate(settings):
        q, k, v, q64, k64, v64 = _inputs(t, dtype, 21 + i, (2, 4, 6, d), (2, 2, 11, d), dv=dv)
        dout64 = rng.normal(size=(2, 4, 6, dv))
        dout = t.asarray(dout64, dtype)
        dout64 = t.to_numpy(dout)
        tkw = dict(kw)
        if "mask" in tkw:
            tkw["mask"] = t.asarray(tkw["mask"], None)
        rkw = dict(kw, causal=_causal_kw(kw.get("causal", False)))
        # the forward's (out, lse) come from the float64 definition, so a backend that serves
        # only the gradient is checked too
        out64, lse64 = ref.attention(q64, k64, v64, **rkw)
        out, lse = t.asarray(out64, dtype), t.asarray(lse64, accumulator_name(dtype))
        got = sk.attention_vjp(q, k, v, out, lse, dout, backend=backend, **tkw)
        expected = ref.attention_vjp(q64, k64, v64, dout64, **rkw)
        check_grads(t, dtype, got, expected, f"attention_vjp {name}")
        if "mask" in kw:
            dq = t.to_numpy(got[0])
            assert np.all(dq[:, :, 1] == 0), "attention_vjp: a row with no key has nonzero dq"
        if name in ("plain", "mask + causal (empty rows)"):
            # a loss that uses the lse too: its cotangent, in base e and in base 2
            dlse64 = rng.normal(size=(2, 4, 6))
            if "mask" in kw:
                dlse64[:, :, 1] = np.nan  # a row with no key: its dlse is never read
            for base, factor in (("e", 1.0), (2, math.log(2.0))):
                dlse = t.asarray(dlse64 * factor, accumulator_name(dtype))
                lse_b = lse if base == "e" else t.asarray(lse64 / math.log(2.0),
                                                          accumulator_name(dtype))
                got = sk.attention_vjp(q, k, v, out, lse_b, dout, dlse=dlse, lse_base=base,
                                       backend=backend, **tkw)
                expected = ref.attention_vjp(q64, k64, v64, dout64,
                                             dlse=np.nan_to_num(dlse64), **rkw)
                check_grads(t, dtype, got, expected, f"attention_vjp {name} with dlse {base}")


@case("merge_attention")
def case_merge_attention_states_split_kv(t: Target, dtype: str, backend: str) -> None:
    # merges take any value dimension, so these sizes do not follow the head dims
    _, _, _, q64, k64, v64 = _inputs(t, dtype, 30, (2, 2, 5, 16), (2, 2, 23, 16), dv=8)
    expected = ref.attention(q64, k64, v64)
    bounds = (0, 7, 7, 15, 23)  # one empty chunk
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        o, s = ref.attention(q64, k64[..., lo:hi, :], v64[..., lo:hi, :])
        outs.append(t.asarray(o, dtype))
        lses.append(t.asarray(s, accumulator_name(dtype)))
    # the partial outputs are rounded to the dtype once before the merge; the bounds allow it
    got = sk.merge_attention_states(outs, lses, backend=backend)
    check_forward(t, dtype, got, expected, "merge_attention_states over key chunks")


@case("merge_attention")
def case_merge_attention_conventions(t: Target, dtype: str, backend: str) -> None:
    rng = np.random.default_rng(31)
    out_a64, out_b64 = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 4))
    lse_a64 = rng.normal(scale=3.0, size=(2, 3))
    lse_b64 = rng.normal(scale=3.0, size=(2, 3))
    lse_a64[0, 0] = lse_b64[0, 0] = -np.inf  # both empty -> (0, -inf)
    lse_b64[1, 2] = -np.inf  # one empty -> the other unchanged
    out_a, out_b = t.asarray(out_a64, dtype), t.asarray(out_b64, dtype)
    out_a64, out_b64 = t.to_numpy(out_a), t.to_numpy(out_b)
    acc = accumulator_name(dtype)
    la, lb = t.asarray(lse_a64, acc), t.asarray(lse_b64, acc)
    lse_a64, lse_b64 = t.to_numpy(la), t.to_numpy(lb)
    expected = ref.merge_states(np.stack([out_a64, out_b64]), np.stack([lse_a64, lse_b64]))
    got = sk.merge_attention(out_a, la, out_b, lb, backend=backend)
    check_forward(t, dtype, got, expected, "merge_attention")
    # FlashAttention 2 marks empty rows with lse = +inf (and may leave garbage in out)
    fa_a = np.where(lse_a64 == -np.inf, np.inf, lse_a64)
    fa_b = np.where(lse_b64 == -np.inf, np.inf, lse_b64)
    garbage_b = np.where((lse_b64 == -np.inf)[..., None], np.nan, out_b64)
    got = sk.merge_attention(out_a, t.asarray(fa_a, acc), t.asarray(garbage_b, dtype),
                             t.asarray(fa_b, acc), empty_lse=math.inf, backend=backend)
    check_forward(t, dtype, got, expected, "merge_attention empty_lse=+inf")
    # FlashInfer's base-2 log-sum-exp
    got_out, got_lse2 = sk.merge_attention(
        out_a, t.asarray(lse_a64 / math.log(2.0), acc), out_b,
        t.asarray(lse_b64 / math.log(2.0), acc), lse_base=2, backend=backend)
    lse_e = t.asarray(t.to_numpy(got_lse2) * math.log(2.0), None)
    check_forward(t, dtype, (got_out, lse_e), expected, "merge_attention lse_base=2")


@case("merge_attention")
def case_merge_attention_nan_part(t: Target, dtype: str, backend: str) -> None:
    rng = np.random.default_rng(33)
    outs64 = rng.normal(size=(3, 4, 5))
    lses64 = rng.normal(scale=2.0, size=(3, 4))
    lses64[1, 0] = np.nan  # a NaN part: the row is NaN, never read as empty
    lses64[:, 2] = -np.inf
    lses64[0, 2] = np.nan  # NaN beside empty parts
    acc = accumulator_name(dtype)
    outs, lses = t.asarray(outs64, dtype), t.asarray(lses64, acc)
    out, lse = (t.to_numpy(a) for a in sk.merge_attention_states(outs, lses, backend=backend))
    for row in (0, 2):
        assert np.all(np.isnan(out[row])) and np.isnan(lse[row]), (
            f"merge_attention_states: a NaN lse in row {row} gave out={out[row]}, "
            f"lse={lse[row]}; expected NaN")
    keep = [1, 3]
    expected = ref.merge_states(t.to_numpy(outs)[:, keep], t.to_numpy(lses)[:, keep])
    out_tol, lse_tol, _ = ATTENTION_TOLERANCES[dtype]
    err = ref.rel_frobenius(out[keep], expected[0])
    lerr = float(np.max(np.abs(lse[keep] - expected[1])))
    assert err <= out_tol and lerr <= lse_tol, (
        f"merge_attention_states [{dtype}]: rows beside a NaN row off by {err:.3g} (out), "
        f"{lerr:.3g} (lse)")


@case("merge_attention_vjp")
def case_merge_attention_vjp(t: Target, dtype: str, backend: str) -> None:
    rng = np.random.default_rng(32)
    outs64 = rng.normal(size=(3, 4, 5))
    lses64 = rng.normal(scale=2.0, size=(3, 4))
    lses64[1, 0] = -np.inf
    lses64[:, 3] = -np.inf
    dout64, dlse64 = rng.normal(size=(4, 5)), rng.normal(size=(4,))
    acc = accumulator_name(dtype)
    outs, lses = t.asarray(outs64, dtype), t.asarray(lses64, acc)
    dout, dlse = t.asarray(dout64, dtype), t.asarray(dlse64, acc)
    outs64, lses64, dout64, dlse64 = map(t.to_numpy, (outs, lses, dout, dlse))
    douts, dlses = sk.merge_attention_vjp(outs, lses, dout, dlse, backend=backend)
    douts, dlses = t.to_numpy(douts), t.to_numpy(dlses)
    # float64 analytic gradient of the definition
    out, lse = ref.merge_states(outs64, lses64)
    empty = lses64 == -np.inf
    a = np.where(empty, 0.0, np.exp(np.where(empty, 0.0, lses64 - np.where(
        np.isfinite(lse), lse, 0.0))))
    e_douts = a[..., None] * dout64
    inner = np.where(empty, 0.0, np.sum(dout64 * (outs64 - out), axis=-1)) + dlse64
    e_dlses = a * inner
    tol = ATTENTION_TOLERANCES[dtype][2]
    for name, g, e in (("douts", douts, e_douts), ("dlses", dlses, e_dlses)):
        err = ref.rel_frobenius(g, e)
        assert err <= tol, f"merge_attention_vjp [{dtype}]: {name} error {err:.3g} > {tol}"
    assert np.all(douts[:, 3] == 0) and np.all(dlses[:, 3] == 0), (
        "merge_attention_vjp: rows with every part empty must have zero gradient"
    )
    assert np.all(douts[1, 0] == 0) and dlses[1, 0] == 0, (
        "merge_attention_vjp: an empty part must have zero gradient"
    )


@case("merge_attention_vjp")
def case_merge_attention_vjp_special_values(t: Target, dtype: str, backend: str) -> None:
    """Fresh parts wider than a block of threads, with a NaN part, an empty part holding
    garbage, a row whose parts are all empty and a row dominated by one part; with and
    without ``dlse``."""
    rng = np.random.default_rng(34)
    n_parts, n_rows, dv = 4, 6, 160
    outs64 = rng.normal(size=(n_parts, n_rows, dv))
    lses64 = rng.normal(scale=2.0, size=(n_parts, n_rows))
    lses64[2, 1] = -np.inf
    outs64[2, 1, ::2], outs64[2, 1, 1::2] = np.nan, np.inf  # never read: the part is empty
    lses64[:, 2] = -np.inf
    lses64[0, 3] = np.nan  # the row's gradients are NaN
    lses64[1, 4] += 30.0  # the other parts' weights are tiny
    outs64[:, 5] = outs64[0, 5] + 1e-2 * outs64[:, 5]  # parts close to the merged out
    acc = accumulator_name(dtype)
    outs, lses = t.asarray(outs64, dtype), t.asarray(lses64, acc)
    dout = t.asarray(rng.normal(size=(n_rows, dv)), dtype)
    dlse = t.asarray(rng.normal(size=(n_rows,)), acc)
    outs64, lses64, dout64, dlse64 = map(t.to_numpy, (outs, lses, dout, dlse))
    keep = [0, 1, 2, 4, 5]
    out, lse = ref.merge_states(outs64[:, keep], lses64[:, keep])
    empty = lses64[:, keep] == -np.inf
    a = np.where(empty, 0.0, np.exp(np.where(empty, 0.0, lses64[:, keep] - np.where(
        np.isfinite(lse), lse, 0.0))))
    present = np.where(empty[..., None], 0.0, outs64[:, keep])
    inner = np.where(empty, 0.0, np.sum(dout64[keep] * (present - out), axis=-1))
    tol = ATTENTION_TOLERANCES[dtype][2]
    for with_dlse in (True, False):
        douts, dlses = sk.merge_attention_vjp(outs, lses, dout, dlse if with_dlse else None,
                                              backend=backend)
        douts, dlses = t.to_numpy(douts), t.to_numpy(dlses)
        what = f"merge_attention_vjp [{dtype}] {'with' if with_dlse else 'without'} dlse"
        e_dlses = a * (inner + (dlse64[keep] if with_dlse else 0.0))
        for name, g, e in (("douts", douts[:, keep], a[..., None] * dout64[keep]),
                           ("dlses", dlses[:, keep], e_dlses)):
            err = ref.rel_frobenius(g, e)
            assert err <= tol, f"{what}: {name} error {err:.3g} > {tol}"
        # the nearly equal parts' lse gradients are small differences: held on their own
        err = ref.rel_frobenius(dlses[:, 5], e_dlses[:, 4])
        assert err <= tol, f"{what}: dlses of parts close to out, error {err:.3g} > {tol}"
        assert np.all(np.isnan(douts[:, 3])) and np.all(np.isnan(dlses[:, 3])), (
            f"{what}: a NaN lse must make its row's gradients NaN")
        assert np.all(douts[:, 2] == 0) and np.all(dlses[:, 2] == 0), (
            f"{what}: rows with every part empty must have zero gradient")
        assert np.all(douts[2, 1] == 0) and dlses[2, 1] == 0, (
            f"{what}: an empty part must have zero gradient, whatever its out holds")
