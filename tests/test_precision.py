"""Attention's ``precision=``: validation in every frontend, exact computation on the CPU
backends, the registry's precisions (serves entries, dispatch keys, the kernels' argument),
and the TF32 rounding, split and error bound of spec "Precision" against float64 emulations."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

import softmaxkit as sk
from softmaxkit import registry
from softmaxkit.registry import Backend, NoBackendError
from softmaxkit.testing import materialized as ref
from softmaxkit.testing import precision as prec
from softmaxkit.testing.attention_cases import ATTENTION_TOLERANCES

CALLS: list[str] = []


def recording_attention(xp, *, precision, **args):
    """A kernel of a backend that declares precisions: it records the precision it got."""
    CALLS.append(precision)
    return ref_attention(xp, **args)


def plain_attention(xp, **args):
    """A kernel of a backend that declares none: called without ``precision``."""
    CALLS.append("plain")
    return ref_attention(xp, **args)


def emulated_tf32_attention(xp, *, q, k, v, scale, causal, window, mask, softcap, return_lse,
                            precision):
    """A kernel of a backend that computes the reduced precisions as declared (in float64
    emulation), for the kit's precision case."""
    out, lse = prec.emulated_attention(q, k, v, precision=precision, scale=scale, causal=causal,
                                       window=window if window != (-1, -1) else None,
                                       mask=mask, softcap=softcap)
    return out.astype(np.float32), (lse.astype(np.float32) if return_lse else None)


def coarse_attention(xp, *, q, k, **args):
    """One that rounds q and k to 6 significant bits: beyond every precision's bound."""
    def coarse(a):
        return (a.astype(np.float32).view(np.uint32) & np.uint32(0xFFFC0000)).view(np.float32)

    return emulated_tf32_attention(xp, q=coarse(q), k=coarse(k), **args)


def ref_attention(xp, **args):
    from softmaxkit.reference.attention import attention

    return attention(xp, **args)


def _qkv(seed: int = 0, shape=(2, 4, 9, 16), dtype=np.float32):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=shape).astype(dtype) for _ in range(3))


@pytest.fixture
def fresh(monkeypatch):
    """Fresh backends, with this module's kernels importable as ``sk_precision_fakes``."""
    fakes = types.ModuleType("sk_precision_fakes")
    fakes.recording_attention = recording_attention
    fakes.plain_attention = plain_attention
    fakes.emulated_tf32_attention = emulated_tf32_attention
    fakes.coarse_attention = coarse_attention
    monkeypatch.setitem(sys.modules, "sk_precision_fakes", fakes)
    registry.reload()
    CALLS.clear()
    yield
    registry.reload()


# --- frontends --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["bf16", "TF32", "highest", None, 3, "float64"])
def test_a_bad_precision_is_a_named_value_error_for_every_dtype(bad):
    for dtype in (np.float32, np.float64):
        q, k, v = _qkv(dtype=dtype)
        with pytest.raises(ValueError, match="precision="):
            sk.attention(q, k, v, precision=bad)
        out, lse = sk.attention(q, k, v, return_lse=True)
        with pytest.raises(ValueError, match="precision="):
            sk.attention_vjp(q, k, v, out, lse, out, precision=bad)
    q, k, v = (a[0].transpose(1, 0, 2) for a in _qkv())
    cu = np.array([0, 4, 9])
    with pytest.raises(ValueError, match="precision="):
        sk.varlen_attention(q, k, v, cu, cu, precision=bad)
    pages = np.zeros((2, 4, 8, 16), np.float32)
    with pytest.raises(ValueError, match="precision="):
        sk.paged_attention(np.zeros((1, 4, 1, 16), np.float32), pages, pages,
                           np.array([[0]], np.int32), np.array([3], np.int32), precision=bad)
    tq, tk, tv = (torch.from_numpy(a) for a in _qkv())
    with pytest.raises(ValueError, match="precision="):
        sk.attention(tq, tk, tv, precision=bad)


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_cpu_backends_compute_every_precision_exactly(precision):
    q, k, v = _qkv(1)
    for backend in (None, "reference"):
        want = sk.attention(q, k, v, causal=True, return_lse=True, backend=backend)
        got = sk.attention(q, k, v, causal=True, return_lse=True, precision=precision,
                           backend=backend)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    out, lse = want
    grads = sk.attention_vjp(q, k, v, out, lse, out, causal=True, precision=precision)
    for a, b in zip(grads, sk.attention_vjp(q, k, v, out, lse, out, causal=True), strict=True):
        np.testing.assert_array_equal(a, b)


def test_torch_autograd_carries_the_precision():
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in _qkv(2))
    out = sk.attention(q, k, v, causal=True, precision="tf32x3")
    out.sum().backward()
    want = sk.attention(*(a.detach() for a in (q, k, v)), causal=True)
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    assert all(a.grad is not None for a in (q, k, v))


# --- the registry -----------------------------------------------------------------------------


def _manifest(name: str, kernel: str, precisions: list[str] | None) -> dict:
    entry = {"ops": ["attention"], "devices": ["cpu"], "dtypes": ["float32"]}
    if precisions is not None:
        entry["precisions"] = precisions
    return {"name": name, "kernels": {"attention": kernel}, "priority": 1000,
            "serves": [entry]}


def test_a_backend_serves_the_precisions_it_declares_and_the_key_holds_them(fresh):
    registry.register(_manifest("tf32only", "sk_precision_fakes:recording_attention", ["tf32"]))
    q, k, v = _qkv(3)
    exact = sk.attention(q, k, v, backend="reference")
    for _ in range(2):  # the second round comes from the decision cache
        for precision in ("tf32", "float32", "tf32x3", "tf32"):
            with sk.backend_opts(trace=True) as trace:
                got = sk.attention(q, k, v, precision=precision)
            np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-6)
            ran = trace[-1].backend
            assert (ran == "tf32only") == (precision == "tf32"), (precision, ran)
            if precision != "tf32":
                assert "at precision" in trace[-1].declined["tf32only"]
    assert CALLS == ["tf32", "tf32"] * 2
    assert sk.backends()["tf32only"]["serves"][0]["precisions"] == ["tf32"]
    with pytest.raises(NoBackendError, match="at precision 'float32'"):
        sk.attention(q, k, v, backend="tf32only")
    assert registry.candidates("attention", "cpu", "float32", "tf32")[0][0] == "tf32only"
    assert "tf32only" not in registry.candidates("attention", "cpu", "float32")[0]


def test_a_backend_that_declares_no_precisions_serves_all_without_the_argument(fresh):
    registry.register(_manifest("exactonly", "sk_precision_fakes:plain_attention", None))
    q, k, v = _qkv(4)
    for precision in ("float32", "tf32", "tf32x3"):
        sk.attention(q, k, v, precision=precision)
    assert CALLS == ["plain"] * 3


def test_declared_precisions_are_validated():
    for bad in (["bf16"], [], "tf32"):
        with pytest.raises(ValueError, match="precisions"):
            Backend.from_manifest(_manifest("bad", "sk_precision_fakes:plain_attention", bad))


# --- TF32 rounding and the bound ---------------------------------------------------------------


def _tf32_by_arithmetic(x: np.ndarray) -> np.ndarray:
    """Round to nearest with an 11-bit significand, ties away from zero, in float64."""
    x64 = x.astype(np.float64)
    m, e = np.frexp(np.abs(x64))  # |x| = m 2^e, m in [0.5, 1)
    r = np.floor(m * 2.0**11 + 0.5) / 2.0**11
    return (np.sign(x64) * np.ldexp(r, e)).astype(np.float32)


def test_tf32_rounding_matches_round_to_nearest_ties_away():
    rng = np.random.default_rng(5)
    x = (rng.normal(size=20000) * np.exp2(rng.integers(-60, 60, 20000))).astype(np.float32)
    bits = x.view(np.uint32)
    ties = ((bits & np.uint32(0xFFFFE000)) | np.uint32(0x1000)).view(np.float32)[:2000]
    for a in (x, ties, -ties):
        got = prec.tf32(a)
        np.testing.assert_array_equal(got, _tf32_by_arithmetic(a))
        assert np.all(got.view(np.uint32) & np.uint32(0x1FFF) == 0)
        assert np.all(np.abs(got.astype(np.float64) - a) <= 2.0**-11 * np.abs(a))
    assert np.all(np.abs(prec.tf32(ties)) > np.abs(ties))  # ties go away from zero
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    np.testing.assert_array_equal(prec.tf32(special), special)


def test_split_parts_are_tf32_and_leave_a_remainder_below_2_to_minus_22():
    rng = np.random.default_rng(6)
    x = (rng.normal(size=20000) * np.exp2(rng.integers(-30, 30, 20000))).astype(np.float32)
    big, small = prec.split(x)
    for part in (big, small):
        assert np.all(part.view(np.uint32) & np.uint32(0x1FFF) == 0)
    rest = x.astype(np.float64) - big.astype(np.float64) - small.astype(np.float64)
    assert np.all(np.abs(rest) <= 2.0**-22 * np.abs(x.astype(np.float64)))


CASES = [
    dict(),
    dict(causal="bottom_right"),
    dict(causal="top_left", window=(5, 2)),
    dict(softcap=3.0),
    dict(mask=np.random.default_rng(7).random((9, 12)) < 0.6),
]


@pytest.mark.parametrize("kw", CASES, ids=["plain", "causal", "window", "softcap", "mask"])
@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
def test_the_emulated_precision_is_within_its_bound(precision, kw):
    rng = np.random.default_rng(8)
    q = (rng.normal(size=(2, 4, 9, 64)) * 2).astype(np.float32)
    k = (rng.normal(size=(2, 2, 12, 64)) * 2).astype(np.float32)
    v = rng.normal(size=(2, 2, 12, 64)).astype(np.float32)
    out, lse = ref.attention(q, k, v, **kw)
    e_out, e_lse = prec.emulated_attention(q, k, v, precision=precision, **kw)
    b_out, b_lse = prec.attention_bound(q, k, v, precision=precision, **kw)
    empty = lse == -np.inf
    assert np.array_equal(e_lse == -np.inf, empty) and np.all(e_out[empty] == 0)
    assert np.all(np.abs(e_out - out) <= b_out)
    assert np.all(np.abs(e_lse - lse)[~empty] <= b_lse[~empty])
    # the emulation does reduce the precision, and tf32x3 is within float32's table
    err = ref.rel_frobenius(e_out, out)
    out_tol = ATTENTION_TOLERANCES["float32"][0]
    assert (err > out_tol) if precision == "tf32" else (err <= out_tol), err


def test_the_bound_is_of_the_precision_s_order():
    """The score term of the bound at D = 128, unit normal inputs: about 2^-10 times the
    scaled |q| |k| for tf32; for tf32x3 the float32 sums' D 2^-23 dominates, as it does for
    float32 arithmetic."""
    q, k, v = _qkv(9, shape=(1, 2, 16, 128))
    b32 = prec.attention_bound(q, k, v, precision="tf32")
    b3 = prec.attention_bound(q, k, v, precision="tf32x3")
    ratio = float(np.median(b32[1] / b3[1]))
    assert 50 < ratio < 2 ** 11, ratio
    assert float(np.max(b32[1])) < 0.05 and float(np.max(b3[1])) < 5e-4
    assert math.isfinite(float(np.max(b32[0])))


@pytest.mark.parametrize(("kernel", "passes"), [("emulated_tf32_attention", True),
                                                ("coarse_attention", False)])
def test_the_kit_holds_a_backend_to_the_precision_bound(fresh, kernel, passes):
    from softmaxkit.testing import check_backend

    registry.register(_manifest("emulated", f"sk_precision_fakes:{kernel}", ["tf32", "tf32x3"]))
    results = [r for r in check_backend("emulated", target="numpy", ops=["attention"],
                                        dtypes=["float32"])
               if r.case == "attention_precisions"]
    assert len(results) == 1 and results[0].checks > 0
    assert (results[0].status == "passed") is passes, results[0]
