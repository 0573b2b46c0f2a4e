"""numba-cpu attention and its gradient against the float64 materialized definition.

The kernels' tiles are shrunk (``TILE_Q`` / ``TILE_K``) so that shapes of a few hundred keys
cross many tile boundaries: online rescaling across key tiles, causal and window bands cut by
tiles, tiles skipped entirely, the GQA sums of dK and dV over several query tiles.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
import softmaxkit_numba_cpu.attention

import softmaxkit as sk
from softmaxkit.testing import materialized as ref

NAME = "numba-cpu"
BOUNDS = {"float32": (1e-5, 1e-5, 1e-4), "float64": (1e-12, 1e-12, 1e-10)}
"""dtype -> bounds on (out, lse, gradients): spec/semantics.md, "Attention tolerances"."""


def _causal(causal):
    return {False: None, True: "bottom_right"}.get(causal, causal)


def _inputs(dtype, seed, b, hq, hk, lq, lk, d=16, dv=8):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, hq, lq, d)).astype(dtype)
    k = rng.normal(size=(b, hk, lk, d)).astype(dtype)
    v = rng.normal(size=(b, hk, lk, dv)).astype(dtype)
    dout = rng.normal(size=(b, hq, lq, dv)).astype(dtype)
    return q, k, v, dout


def _masks(b, hq, lq, lk):
    rng = np.random.default_rng(7)
    full = rng.random((b, hq, lq, lk)) < 0.4
    full[0, 1, 3] = False  # a row with no allowed key
    shared = np.broadcast_to(rng.random((lq, lk)) < 0.6, (b, hq, lq, lk))  # stride-0 view
    padding = np.ones((b, 1, 1, lk), dtype=bool)
    padding[:, :, :, lk // 3: lk // 2] = False  # a key-padding mask, broadcast over heads
    return {"full": full, "shared": shared, "padding": padding}


# (Hq, Hk, Lq, Lk, options): every option the reference supports, with Lq < Lk and Lq > Lk
SETTINGS = [
    (2, 2, 70, 150, {}),
    (4, 2, 150, 70, {"causal": True}),
    (2, 1, 70, 150, {"causal": True}),
    (2, 2, 150, 70, {"causal": "top_left"}),
    (3, 1, 100, 100, {"causal": True, "window": (20, -1)}),
    (2, 2, 90, 130, {"window": (7, 3)}),
    (2, 2, 130, 90, {"window": (-1, 2)}),
    (2, 2, 60, 60, {"window": (0, 0), "causal": "top_left"}),
    (2, 2, 70, 150, {"softcap": 2.0, "scale": 1.0}),
    (4, 2, 70, 150, {"mask": "full"}),
    (4, 2, 70, 150, {"mask": "shared", "causal": True}),
    (4, 2, 150, 70, {"mask": "padding", "window": (30, 5)}),
]


def _options(hq, lq, lk, options):
    kw = dict(options)
    if "mask" in kw:
        kw["mask"] = _masks(2, hq, lq, lk)[kw["mask"]]
    return kw


def _reference_kw(kw):
    return dict(kw, causal=_causal(kw.get("causal", False)))


def _ids(setting):
    hq, hk, lq, lk, options = setting
    return f"Hq{hq}-Hk{hk}-Lq{lq}-Lk{lk}-" + "-".join(f"{k}={v}" for k, v in options.items())


def _check_forward(got, expected, dtype):
    out_tol, lse_tol, _ = BOUNDS[dtype]
    out, lse = got
    e_out, e_lse = expected
    empty = e_lse == -np.inf
    assert np.all(lse[empty] == -np.inf) and np.all(out[empty] == 0)
    assert np.all(np.isfinite(lse[~empty]))
    assert ref.rel_frobenius(out, e_out) <= out_tol
    assert np.max(np.abs(lse[~empty] - e_lse[~empty]), initial=0.0) <= lse_tol


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
def test_forward_across_tiles(small_tiles, setting, dtype):
    hq, hk, lq, lk, options = setting
    q, k, v, _ = _inputs(dtype, lq + lk, 2, hq, hk, lq, lk)
    kw = _options(hq, lq, lk, options)
    with sk.backend_opts(trace=True) as trace:
        got = sk.attention(q, k, v, return_lse=True, **kw)
    assert trace[-1].backend == NAME
    _check_forward(got, ref.attention(q, k, v, **_reference_kw(kw)), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("setting", SETTINGS, ids=_ids)
def test_backward_across_tiles(small_tiles, setting, dtype):
    hq, hk, lq, lk, options = setting
    q, k, v, dout = _inputs(dtype, lq * lk, 2, hq, hk, lq, lk)
    kw = _options(hq, lq, lk, options)
    out, lse = sk.attention(q, k, v, return_lse=True, backend=NAME, **kw)
    with sk.backend_opts(trace=True) as trace:
        got = sk.attention_vjp(q, k, v, out, lse, dout, **kw)
    assert trace[-1].backend == NAME
    expected = ref.attention_vjp(q, k, v, dout, **_reference_kw(kw))
    for name, g, e, a in zip("qkv", got, expected, (q, k, v), strict=True):
        assert g.shape == a.shape and g.dtype == a.dtype, f"d{name}"
        err = ref.rel_frobenius(g, e)
        assert err <= BOUNDS[dtype][2], f"d{name}: relative error {err:.3g}"
    if "mask" in options and options["mask"] == "full":
        # the row with no allowed key: exactly zero gradient for its query
        assert np.all(got[0][0, 1, 3] == 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("options", [
    {}, {"causal": True}, {"window": (9, 40)}, {"softcap": 3.0}, {"mask": "full"},
], ids=str)
def test_register_blocked_products(small_tiles, options, dtype):
    # float32 runs the microkernels: blocks of 6 query rows (here 16-row tiles leave 4 over),
    # panels of 16 keys (150 keys leave a partial panel), 16 value columns (Dv = 32)
    q, k, v, dout = _inputs(dtype, 9, 2, 2, 1, 70, 150, d=24, dv=32)
    kw = _options(2, 70, 150, options)
    got = sk.attention(q, k, v, return_lse=True, backend=NAME, **kw)
    _check_forward(got, ref.attention(q, k, v, **_reference_kw(kw)), dtype)
    # a NaN query row and a +inf score: those rows NaN, the others exact
    q[0, 1, 5, 0] = np.nan
    k[1, 0, 7] = 0
    k[1, 0, 7, 0] = np.inf
    q[1, :, :, 0] = np.abs(q[1, :, :, 0]) + 0.5
    out, lse = sk.attention(q, k, v, return_lse=True, backend=NAME)
    assert np.all(np.isnan(out[0, 1, 5])) and np.isnan(lse[0, 1, 5])
    assert np.all(np.isnan(out[1])) and np.all(np.isnan(lse[1]))
    e_out, e_lse = ref.attention(q[:1], k[:1], v[:1])
    keep = np.ones(70, dtype=bool)
    keep[5] = False
    assert ref.rel_frobenius(out[0, 1, keep], e_out[0, 1, keep]) <= BOUNDS[dtype][0]
    assert ref.rel_frobenius(out[0, 0], e_out[0, 0]) <= BOUNDS[dtype][0]


def test_empty_keys_and_empty_rows_are_exact():
    q, k, v, dout = _inputs("float32", 1, 1, 2, 2, 5, 0)
    out, lse = sk.attention(q, k, v, return_lse=True, backend=NAME)
    assert out.shape == (1, 2, 5, 8) and np.all(out == 0) and np.all(lse == -np.inf)
    dq, dk, dv = sk.attention_vjp(q, k, v, out, lse, dout, backend=NAME)
    assert np.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape
    # causal with Lq > Lk: the first Lq - Lk rows see no key (bottom-right alignment)
    q, k, v, dout = _inputs("float32", 2, 1, 2, 2, 9, 4)
    out, lse = sk.attention(q, k, v, causal=True, return_lse=True, backend=NAME)
    assert np.all(out[:, :, :5] == 0) and np.all(lse[:, :, :5] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, 5:]))
    dq, _, _ = sk.attention_vjp(q, k, v, out, lse, dout, causal=True, backend=NAME)
    assert np.all(dq[:, :, :5] == 0) and np.any(dq[:, :, 5:] != 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("d", "dv"), [(0, 16), (16, 0), (0, 0)])
def test_zero_head_dims(d, dv, dtype):
    q, k, v, dout = _inputs(dtype, 10, 1, 2, 1, 20, 30, d=d, dv=dv)
    out, lse = sk.attention(q, k, v, causal=True, scale=1.0, return_lse=True, backend=NAME)
    _check_forward((out, lse), ref.attention(q, k, v, causal="bottom_right", scale=1.0), dtype)
    grads = sk.attention_vjp(q, k, v, out, lse, dout, causal=True, scale=1.0, backend=NAME)
    expected = ref.attention_vjp(q, k, v, dout, causal="bottom_right", scale=1.0)
    for g, e in zip(grads, expected, strict=True):
        assert g.shape == e.shape and ref.rel_frobenius(g, e) <= BOUNDS[dtype][2]


def test_nonfinite_scores_poison_only_their_rows():
    q, k, v, _ = _inputs("float32", 3, 1, 1, 1, 8, 8)
    q[0, 0, 2, 0] = np.nan  # row 2: every score NaN
    k[0, 0, 6] = 0
    k[0, 0, 6, 0] = np.inf
    q[0, 0, 6:, 0] = 1.0  # key 6: a +inf score for the rows that see it
    out, lse = sk.attention(q, k, v, causal=True, return_lse=True, backend=NAME)
    e_out, e_lse = ref.attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], causal="top_left")
    rows_ok = [0, 1, 3, 4, 5]  # causal: rows 0-5 never see key 6
    assert np.all(np.isnan(out[0, 0, 2])) and np.isnan(lse[0, 0, 2])
    assert np.all(np.isnan(out[0, 0, 6:])) and np.all(np.isnan(lse[0, 0, 6:]))
    assert ref.rel_frobenius(out[0, 0, rows_ok], e_out[0, 0, rows_ok]) <= 1e-5
    assert np.max(np.abs(lse[0, 0, rows_ok] - e_lse[0, 0, rows_ok])) <= 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_threads_share_tiles_deterministically(causal, monkeypatch):
    # the same tiles are computed the same way whichever thread takes them
    monkeypatch.setattr(softmaxkit_numba_cpu.attention, "PARALLEL_MIN_SCORES", 0)
    q, k, v, dout = _inputs("float32", 4, 1, 4, 2, 300, 300, d=32, dv=32)
    threads = numba.get_num_threads()
    results = {}
    try:
        for n in sorted({1, threads}):
            numba.set_num_threads(n)
            out, lse = sk.attention(q, k, v, causal=causal, return_lse=True, backend=NAME)
            grads = sk.attention_vjp(q, k, v, out, lse, dout, causal=causal, backend=NAME)
            results[n] = (out, lse, *grads)
    finally:
        numba.set_num_threads(threads)
    e_out, e_lse = ref.attention(q, k, v, causal=_causal(causal))
    _check_forward(results[1][:2], (e_out, e_lse), "float32")
    one, many = results[1], results[threads]
    for i in (0, 1, 3, 4):  # out, lse, dk, dv: each tile is one task's work
        np.testing.assert_array_equal(one[i], many[i])
    # dq adds the threads' partial sums at the end: equal up to the order of those additions
    np.testing.assert_allclose(one[2], many[2], rtol=1e-5, atol=1e-6)


def test_blas_threads_restored():
    from threadpoolctl import threadpool_info

    def blas_threads():
        return {i["filepath"]: i["num_threads"] for i in threadpool_info()
                if i["user_api"] == "blas"}

    q, k, v, _ = _inputs("float32", 5, 1, 2, 2, 64, 64)
    sk.attention(q, k, v, backend=NAME)  # loads SciPy's BLAS
    before = blas_threads()
    sk.attention(q, k, v, causal=True, backend=NAME)
    assert blas_threads() == before


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_torch_tensors_across_tiles(small_tiles, dtype):
    torch = pytest.importorskip("torch")
    q, k, v, dout = (torch.from_numpy(a).to(getattr(torch, dtype))
                     for a in _inputs("float32", 6, 1, 2, 1, 40, 90))
    q64, k64, v64, do64 = (a.double().numpy() for a in (q, k, v, dout))
    out, lse = sk.attention(q, k, v, causal=True, window=(50, -1), return_lse=True, backend=NAME)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    e_out, e_lse = ref.attention(q64, k64, v64, causal="bottom_right", window=(50, -1))
    out_tol, lse_tol, grad_tol = {"float16": (4e-3, 2e-3, 2e-2),
                                  "bfloat16": (3e-2, 2e-3, 1e-1)}[dtype]
    assert ref.rel_frobenius(out.double().numpy(), e_out) <= out_tol
    assert np.max(np.abs(lse.numpy() - e_lse)) <= lse_tol
    grads = sk.attention_vjp(q, k, v, out, lse, dout, causal=True, window=(50, -1),
                             backend=NAME)
    expected = ref.attention_vjp(q64, k64, v64, do64, causal="bottom_right", window=(50, -1))
    for g, e, a in zip(grads, expected, (q, k, v), strict=True):
        assert g.dtype == a.dtype
        assert ref.rel_frobenius(g.double().numpy(), e) <= grad_tol


def test_default_tiles_long_keys_float64():
    # default tiles: several key tiles per query tile, and a tile cut by the causal diagonal
    q, k, v, dout = _inputs("float64", 8, 1, 2, 1, 200, 1100)
    out, lse = sk.attention(q, k, v, causal=True, scale=0.5, return_lse=True, backend=NAME)
    _check_forward((out, lse), ref.attention(q, k, v, causal="bottom_right", scale=0.5),
                   "float64")
    grads = sk.attention_vjp(q, k, v, out, lse, dout, causal=True, scale=0.5, backend=NAME)
    expected = ref.attention_vjp(q, k, v, dout, causal="bottom_right", scale=0.5)
    for g, e in zip(grads, expected, strict=True):
        assert ref.rel_frobenius(g, e) <= 1e-10
    assert math.isfinite(float(lse.max()))
