"""The exact float32 attention forward and backward (kernels/attention_f32.cu) run on the CPU
(tests/host/emulation.h: each CUDA thread a fiber, shared memory filled with NaN first):
every declared tile against the float64 definition, within the float32 row of spec
"Attention tolerances" and, elementwise, the bound of spec "Precision" at ``"tf32x3"`` (the
GPU test's checks, backends/cupy/tests/test_f32_gpu.py), over causal alignments, grouped
queries, windows, soft caps, boolean masks, rows with no key, ragged tiles, and non-finite
inputs; and the adapters (``softmaxkit_cupy.attention_f32``), forward and backward, on
torch CPU tensors, their launches (the mask's packing, kernels/mask_bits.cu, too) run on the
host, so that what they pack is what the kernels read.  cp.async poisons its destination
when issued and lands at the wait (tests/host/primitives.h), so a missing wait or barrier
shows as NaN; what the device adds (timing, the device's own orderings) is that test's."""

from __future__ import annotations

import math

import numpy as np
import pytest
from host_attention import CASES, case_id, inputs, launch_forward, move_to_host, options
from softmaxkit_cupy.attention import BACKWARD_PARAMS, BACKWARD_PRE_PARAMS, FORWARD_PARAMS
from softmaxkit_cupy.configs import (
    F32_ALTERNATIVES,
    F32_BACKWARD_ALTERNATIVES,
    F32_CONFIGS,
    FITTING_F32_CONFIGS,
    F32Config,
    f32_alternative_names,
    f32_backward_names,
    f32_backward_pre_names,
    f32_config,
    f32_names,
)

from softmaxkit.testing import materialized as ref
from softmaxkit.testing.attention_cases import ATTENTION_TOLERANCES
from softmaxkit.testing.precision import attention_bound

SM90_SHARED = 227 * 1024
"""The shared memory a block may take on a device of compute capability 9.0."""


@pytest.fixture(scope="module")
def kernels(host_kernels):
    """Every declared tile and every alternative, built once for the host."""
    backward = {c.name() for c in F32_BACKWARD_ALTERNATIVES}
    codes = {n: BACKWARD_PARAMS if n in backward else FORWARD_PARAMS
             for n in (*f32_names(), *f32_alternative_names())}
    return host_kernels("attention_f32.cu", list(codes), codes)


def run(kernels: dict, config: F32Config, q: np.ndarray, k: np.ndarray, v: np.ndarray,
        **kw) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of the kernel of ``config`` (:func:`host_attention.launch_forward`)."""
    return launch_forward(kernels, config.name(), config, q, k, v, **kw)


def _cases_of(pairs: list[tuple[int, int, dict]]) -> dict:
    """``parametrize`` arguments for (d, dv, case) triples, with readable ids."""
    return dict(argvalues=pairs, ids=[f"{d}-{dv}-{case_id(c)}" for d, dv, c in pairs])


FEATURES = (CASES[2], CASES[6], CASES[7])
"""Grouped queries with causal rows of no key; window, causal and soft cap; a mask."""
FORWARD_CASES = [(d, dv, c) for d, dv in ((64, 64), (128, 128)) for c in CASES] + [
    (d, dv, c) for d, dv in sorted(F32_CONFIGS) if d not in (64, 128) for c in FEATURES]
"""Every case at the two common head dims, and the features at the other built pairs."""


@pytest.mark.parametrize(("d", "dv", "case"), **_cases_of(FORWARD_CASES))
def test_every_tile_within_float32_bounds(kernels, d: int, dv: int, case: dict) -> None:
    masked = bool(case.get("mask"))
    for config in {f32_config(d, dv, True), f32_config(d, dv, masked)}:
        _check(kernels, config, case)


LONG = dict(b=2, hq=2, hk=1, lq=300, lk=270, causal="bottom_right", mask=True)
"""Several blocks of rows and tiles of keys, past the diagonal, under a mask: the 128-row
tiles' longest-first order over three row blocks, two heads and two batches."""
OTHER_RUNS = [(c, case) for c in (*FITTING_F32_CONFIGS.values(), *F32_ALTERNATIVES)
              for case in (CASES[3], CASES[6]) if c.mask or not case.get("mask")]
OTHER_RUNS += [(c, LONG) for c in (f32_config(128, 128, True), *F32_ALTERNATIVES) if c.mask]


@pytest.mark.parametrize(("config", "case"), OTHER_RUNS,
                         ids=[f"{c}-{case_id(case)}" for c, case in OTHER_RUNS])
def test_fitting_alternative_and_long_within_float32_bounds(kernels, config: F32Config,
                                                            case: dict) -> None:
    _check(kernels, config, case)


def _check(kernels: dict, config: F32Config, case: dict) -> None:
    d, dv = config.head_dim, config.value_dim
    q, k, v, mask = inputs(d, dv, case, seed=d * 100 + dv + case["lq"])
    opts = options(case)
    out, lse = run(kernels, config, q, k, v, mask=mask, **opts)
    want, want_lse = ref.attention(q, k, v, mask=mask, **opts)
    out_bound, lse_bound = attention_bound(q, k, v, precision="tf32x3", mask=mask, **opts)
    empty = want_lse == -np.inf
    assert np.all(lse[empty] == -np.inf) and np.all(out[empty] == 0), "empty rows"
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "NaN left"
    got, got_lse = out.astype(np.float64), lse.astype(np.float64)
    err, lerr = np.abs(got - want), np.abs(got_lse[~empty] - want_lse[~empty])
    out_tol, lse_tol, _ = ATTENTION_TOLERANCES["float32"]
    what = f"{config}: relative Frobenius {ref.rel_frobenius(got, want):.3g}"
    assert ref.rel_frobenius(got, want) <= out_tol, what
    assert lerr.size == 0 or lerr.max() <= lse_tol, what
    assert np.all(err <= out_bound) and np.all(lerr <= lse_bound[~empty]), what


def test_non_finite_inputs(kernels) -> None:
    """A NaN in q makes its row NaN (out and lse); an infinite key makes NaN the rows whose
    score with it is +inf or NaN, as in the float64 definition, and the others stay finite
    and within the bounds (spec "Attention": non-finite inputs are not sanitized)."""
    case = dict(b=1, hq=1, hk=1, lq=70, lk=90)
    q, k, v, _ = inputs(64, 64, case, seed=7)
    q[0, 0, 3, 5] = math.nan
    k[0, 0, 40, 0] = math.inf
    out, lse = run(kernels, f32_config(64, 64, False), q, k, v, causal="bottom_right")
    with np.errstate(invalid="ignore"):
        want, want_lse = ref.attention(q, k, v, causal="bottom_right")
    nan_rows = np.isnan(want_lse[0, 0])
    assert nan_rows[3] and nan_rows.sum() > 1 and not nan_rows.all()
    assert np.array_equal(np.isnan(lse[0, 0]), nan_rows)
    assert np.isnan(out[0, 0, nan_rows]).all()
    assert np.isfinite(out[0, 0, ~nan_rows]).all()
    finite = ~nan_rows
    assert np.abs(out[0, 0, finite] - want[0, 0, finite]).max() <= 1e-5
    assert np.abs(lse[0, 0, finite] - want_lse[0, 0, finite]).max() <= 1e-5


@pytest.fixture(scope="module")
def backward_kernels(host_kernels):
    """Every declared backward tile and the row preprocessing, built once for the host."""
    codes = {**dict.fromkeys(f32_backward_names(), BACKWARD_PARAMS),
             **dict.fromkeys(f32_backward_pre_names(), BACKWARD_PRE_PARAMS)}
    return host_kernels("attention_f32.cu", list(codes), codes)


@pytest.fixture
def host_launches(kernels, backward_kernels, host_kernels, monkeypatch):
    """The adapters' device boundary moved to the host: ``_kernel`` names the host build and
    ``interop.launch`` runs it (the mask's packing kernel built on first use); the module."""
    from softmaxkit_cupy import attention_f32, interop

    move_to_host(monkeypatch, attention_f32, {**kernels, **backward_kernels}, host_kernels)
    monkeypatch.setattr(interop, "shared_limit", lambda device: SM90_SHARED)
    return attention_f32


@pytest.mark.parametrize(("d", "dv", "case"), **_cases_of([
    (64, 64, CASES[7]), (80, 80, CASES[6]), (40, 112, CASES[2]), (192, 128, CASES[7])]))
def test_adapter_on_the_host(host_launches, d: int, dv: int, case: dict) -> None:
    """The adapter's padding, packing and launch, on torch CPU tensors (a view of q with
    strides of its own too), within the float32 bounds."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp

    q, k, v, mask = inputs(d, dv, case, seed=d + dv)
    opts = options(case)
    wide = torch.from_numpy(np.concatenate([q, q], axis=-1))
    tq = wide[..., :d]  # rows 16-byte aligned, strides not C order
    tk, tv = torch.from_numpy(k), torch.from_numpy(v)
    tm = None if mask is None else torch.from_numpy(mask)
    out, lse = host_launches.attention(xp, q=tq, k=tk, v=tv, scale=d ** -0.5,
                                       causal=opts.get("causal"),
                                       window=opts.get("window", (-1, -1)), mask=tm,
                                       softcap=opts.get("softcap"), return_lse=True)
    want, want_lse = ref.attention(q, k, v, mask=mask, **opts)
    got, got_lse = out.numpy().astype(np.float64), lse.numpy().astype(np.float64)
    empty = want_lse == -np.inf
    assert out.shape == want.shape and np.all(got[empty] == 0)
    assert np.all(got_lse[empty] == -np.inf)
    out_tol, lse_tol, _ = ATTENTION_TOLERANCES["float32"]
    assert ref.rel_frobenius(got, want) <= out_tol
    assert np.abs(got_lse[~empty] - want_lse[~empty]).max() <= lse_tol


def test_wide_calls_at_a_reduced_precision_run_exactly(host_launches) -> None:
    """Wider than the TF32 kernels (D = 160), a call at "tf32" or "tf32x3" runs on the exact
    kernels (which meet every precision's bound), giving the bits of a "float32" call."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import attention as entry

    q, k, v, _ = inputs(160, 160, CASES[0], seed=11)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    got = {p: entry.attention(xp, q=tq, k=tk, v=tv, scale=160 ** -0.5, causal="bottom_right",
                              window=(-1, -1), mask=None, softcap=None, return_lse=True,
                              precision=p) for p in ("float32", "tf32", "tf32x3")}
    want, want_lse = ref.attention(q, k, v, causal="bottom_right")
    out_tol, lse_tol, _ = ATTENTION_TOLERANCES["float32"]
    assert ref.rel_frobenius(got["float32"][0].numpy().astype(np.float64), want) <= out_tol
    assert np.abs(got["float32"][1].numpy() - want_lse).max() <= lse_tol
    for p in ("tf32", "tf32x3"):
        assert all(torch.equal(a, b) for a, b in zip(got[p], got["float32"], strict=True)), p


@pytest.mark.parametrize(("d", "dv"), [(64, 64), (192, 128)])
def test_a_kind_of_call_runs_its_kept_launches_again(host_launches, d: int, dv: int) -> None:
    """A later float32 call of one kind (shapes, strides, options; no mask) runs the launches
    the first call kept (:mod:`softmaxkit_cupy.kept`) on its own fresh arrays, forward and
    backward, each result within the float32 tolerances of float64; a call of another kind
    keeps launches of its own."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import attention as entry
    from softmaxkit_cupy import kept

    case = dict(b=1, hq=4, hk=2, lq=70, lk=90, causal="bottom_right")
    out_tol, lse_tol, grad_tol = ATTENTION_TOLERANCES["float32"]
    firsts = None
    for seed in (1, 2, 3, 4):
        if seed == 4:
            case = dict(case, lq=71)
        q, k, v, _ = inputs(d, dv, case, seed=seed)
        kw = dict(scale=d ** -0.5, causal="bottom_right", window=(-1, -1), mask=None,
                  softcap=None)
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        out, lse = entry.attention(xp, q=tq, k=tk, v=tv, return_lse=True, **kw)
        want, want_lse = ref.attention(q, k, v, causal="bottom_right")
        assert ref.rel_frobenius(out.numpy().astype(np.float64), want) <= out_tol
        assert np.abs(lse.numpy() - want_lse).max() <= lse_tol
        dout = np.random.default_rng(seed).standard_normal(out.shape).astype(np.float32)
        got = entry.attention_vjp(xp, q=tq, k=tk, v=tv, out=out, lse=lse,
                                  dout=torch.from_numpy(dout), **kw)
        grads = ref.attention_vjp(q, k, v, dout, causal="bottom_right")
        for name, g, w in zip(("dq", "dk", "dv"), got, grads, strict=True):
            err = ref.rel_frobenius(g.numpy().astype(np.float64), w)
            assert err <= grad_tol, f"call {seed}, {name}: relative Frobenius {err:.3g}"
        if firsts is None:
            firsts = dict(kept._store)
            assert {key[0] for key in firsts} == {"attention", "attention_vjp"}
        elif seed < 4:  # the same launches, none made again
            assert kept._store.keys() == firsts.keys()
            assert all(kept._store[key] is firsts[key] for key in firsts)
    assert len(kept._store) == len(firsts) + 2


BACKWARD_RUNS = [(64, 64, c) for c in CASES[:8]] + [(128, 128, c) for c in FEATURES] + [
    (256, 256, c) for c in FEATURES] + [(d, dv, CASES[7]) for d, dv in (
        (32, 32), (96, 96), (160, 160), (192, 128), (192, 192), (48, 80), (144, 152))]
"""Every feature at 64, the features at 128 and 256 (the other query tiles, two keys a lane
above 128), a mask at the other built head dims and at padded pairs."""


@pytest.mark.parametrize(("d", "dv", "case"), **_cases_of(BACKWARD_RUNS))
def test_backward_on_the_host(host_launches, d: int, dv: int, case: dict) -> None:
    """The backward's adapter and kernel (sk_attn_bwd_f32) on torch CPU tensors, from the
    forward's out and lse, with an lse cotangent, called as the manifest calls them
    (``softmaxkit_cupy.attention``; the gradient at a reduced precision, which the exact
    kernel serves too): each gradient within the float32 row of the tolerances against
    float64 (spec "Gradients")."""
    from softmaxkit_cupy import attention as entry

    _check_backward(lambda **kw: entry.attention_vjp(
        precision="tf32" if d == 64 else "float32", **kw), d, dv, case)


@pytest.mark.parametrize("config", F32_BACKWARD_ALTERNATIVES, ids=str)
@pytest.mark.parametrize("case", [CASES[2], CASES[6]], ids=case_id)
def test_backward_alternatives_on_the_host(host_launches, config, case: dict) -> None:
    """The backward's other tiles (``configs.F32_BACKWARD_ALTERNATIVES``) through the adapter,
    as tools/f32_backward_timing.py calls them, within the same bounds."""
    _check_backward(lambda **kw: host_launches.attention_vjp(config=config, **kw),
                    config.head_dim, config.value_dim, case)


def _check_backward(vjp, d: int, dv: int, case: dict) -> None:
    """``vjp(xp=, q=, ...)`` of ``case`` on torch CPU tensors, from the forward's out and lse,
    with an lse cotangent: each gradient within the float32 row of the tolerances against
    float64."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import attention as entry

    q, k, v, mask = inputs(d, dv, case, seed=d + dv + 1)
    opts = options(case)
    kw = dict(scale=d ** -0.5, causal=opts.get("causal"), window=opts.get("window", (-1, -1)),
              mask=None if mask is None else torch.from_numpy(mask),
              softcap=opts.get("softcap"))
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    out, lse = entry.attention(xp, q=tq, k=tk, v=tv, return_lse=True, **kw)
    rng = np.random.default_rng(d)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    dlse[lse.numpy() == -np.inf] = 0.0
    got = vjp(xp=xp, q=tq, k=tk, v=tv, out=out, lse=lse, dout=torch.from_numpy(dout),
              dlse=torch.from_numpy(dlse), **kw)
    want = ref.attention_vjp(q, k, v, dout, dlse=dlse, mask=mask, **opts)
    tol = ATTENTION_TOLERANCES["float32"][2]
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert tuple(g.shape) == w.shape, name
        err = ref.rel_frobenius(g.numpy().astype(np.float64), w)
        assert err <= tol, f"{name}: relative Frobenius {err:.3g}"


VARLEN_RUNS = [
    (64, 64, [(70, 100), (0, 30), (33, 33), (90, 20), (20, 0)], {}),
    (64, 64, [(40, 60), (150, 130), (1, 80)], dict(causal="bottom_right")),
    (80, 80, [(60, 45), (20, 90)], dict(causal="top_left")),
    (128, 128, [(80, 80), (35, 130)], dict(causal="bottom_right", window=(30, 5),
                                            softcap=5.0)),
    (192, 128, [(50, 40), (30, 70), (0, 0)], dict(causal="bottom_right")),
]
"""(D, Dv, per-sequence (Lq, Lk), options): ragged sequences in one launch (one without
queries, one without keys, one without either), several row tiles of a sequence past the
diagonal, causal in both alignments (rows with no key among them), a window with a soft
cap, a pair zero-padded (80 to 96) and one with D != Dv."""


@pytest.fixture(scope="module")
def varlen_kernels(host_kernels):
    """The packed forward and backward kernels (sk_attn_fwd_f32_varlen, sk_attn_bwd_f32_varlen,
    sk_attn_bwd_pre_varlen<float, Dv>) at the pairs of :data:`VARLEN_RUNS`, built once for
    the host."""
    from softmaxkit_cupy.configs import (
        backward_pre_varlen_name,
        f32_backward_config,
        f32_backward_shape,
        f32_shape,
    )
    from softmaxkit_cupy.varlen import VARLEN_BACKWARD_PARAMS, VARLEN_PARAMS, VARLEN_PRE_PARAMS

    codes = {}
    for d, dv, *_ in VARLEN_RUNS:
        codes[f32_config(*f32_shape(d, dv), False, SM90_SHARED).varlen_name()] = VARLEN_PARAMS
        pair = f32_backward_shape(d, dv)
        codes[f32_backward_config(*pair, False).varlen_name()] = VARLEN_BACKWARD_PARAMS
        codes[backward_pre_varlen_name("float32", pair[1])] = VARLEN_PRE_PARAMS
    return host_kernels("attention_f32.cu", list(codes), codes)


@pytest.mark.parametrize(("d", "dv", "lengths", "opts"), VARLEN_RUNS,
                         ids=[f"{d}-{dv}-{len(s)}seqs-{case_id(o) or 'plain'}"
                              for d, dv, s, o in VARLEN_RUNS])
def test_varlen_on_the_host(varlen_kernels, host_kernels, monkeypatch, d: int, dv: int,
                            lengths: list[tuple[int, int]], opts: dict) -> None:
    """Packed float32 sequences through the adapter (``softmaxkit_cupy.varlen``: the forward,
    then the gradient from its out and lse with an lse cotangent), grouped queries (Hq 4,
    Hk 2), on torch CPU tensors into memory that held NaN, against the float64 definition on
    each sequence alone (:func:`softmaxkit.testing.varlen_cases.packed_reference`): out and
    the gradients within the float32 row of spec "Attention tolerances", the lse within its
    bound, out 0 and lse -inf on rows with no allowed key, zero gradients for the keys of a
    sequence without queries."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import attention_f32, interop, varlen

    from softmaxkit.testing.varlen_cases import packed_reference, packed_vjp_reference

    move_to_host(monkeypatch, attention_f32, dict(varlen_kernels), host_kernels)
    monkeypatch.setattr(interop, "shared_limit", lambda device: SM90_SHARED)
    hq, hk = 4, 2
    rng = np.random.default_rng(d + dv + len(lengths))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum([n[i] for n in lengths])]) for i in (0, 1))
    q = (rng.standard_normal((cu_q[-1], hq, d)) * 1.5).astype(np.float32)
    k = (rng.standard_normal((cu_k[-1], hk, d)) * 1.5).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], hk, dv)).astype(np.float32)
    kw = dict(scale=d ** -0.5, causal=opts.get("causal"), window=opts.get("window", (-1, -1)),
              softcap=opts.get("softcap"), cu_seqlens_q=torch.from_numpy(cu_q),
              cu_seqlens_k=torch.from_numpy(cu_k))
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    out, lse = varlen.varlen_attention(xp, q=tq, k=tk, v=tv, return_lse=True, **kw)
    want, want_lse = packed_reference(q, k, v, cu_q, cu_k, scale=d ** -0.5, **opts)
    _within_float32_bounds(out, lse, want, want_lse)
    empty, grad_tol = want_lse == -np.inf, ATTENTION_TOLERANCES["float32"][2]

    dout = rng.standard_normal(want.shape).astype(np.float32)
    dlse = np.where(empty, 0.0, rng.standard_normal(want_lse.shape)).astype(np.float32)
    grads = varlen.varlen_attention_vjp(xp, q=tq, k=tk, v=tv, out=out, lse=lse,
                                        dout=torch.from_numpy(dout),
                                        dlse=torch.from_numpy(dlse), **kw)
    wants = packed_vjp_reference(q, k, v, dout, cu_q, cu_k, dlse, scale=d ** -0.5, **opts)
    for name, g, w in zip(("dq", "dk", "dv"), grads, wants, strict=True):
        g = g.numpy().astype(np.float64)
        assert g.shape == w.shape and not np.isnan(g).any(), name
        err = ref.rel_frobenius(g, w)
        assert err <= grad_tol, f"{name}: relative Frobenius {err:.3g}"
    for b, (lq, _) in enumerate(lengths):
        if lq == 0:  # its keys: zero gradients
            keys = slice(cu_k[b], cu_k[b + 1])
            assert all(np.all(g.numpy()[keys] == 0) for g in grads[1:]), b


@pytest.mark.parametrize(("lq", "causal", "window"), [(4, True, (-1, -1)), (5, True, (6, -1)),
                                                      (3, False, (-1, -1))])
def test_paged_on_the_host(host_launches, lq: int, causal: bool,
                           window: tuple[int, int]) -> None:
    """float32 chunked prefill of more query rows a key head (8 heads x Lq) than the decode
    kernel holds, through the paged adapter (``softmaxkit_cupy.paged``: the pages in use
    gathered, each sequence's length and alignment a mask, the exact dense kernel on the
    host), a sequence without keys, NaN in every unused page slot: within the float32 row of
    the tolerances of the float64 definition, out 0 and lse -inf on rows with no allowed
    key."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import paged

    from softmaxkit.testing.paged_cases import make_cache, paged_definition

    rng = np.random.default_rng(lq)
    k, v, table, lens = make_cache(rng, [70, 0, 33], 16, 2, 64, 64)
    q = rng.normal(size=(3, 16, lq, 64))
    q, k, v = (a.astype(np.float32) for a in (q, k, v))
    out, lse = paged.paged_attention(
        xp, q=torch.from_numpy(q), k_pages=torch.from_numpy(k), v_pages=torch.from_numpy(v),
        block_table=torch.from_numpy(table), seqlens=torch.from_numpy(lens), scale=0.125,
        causal="bottom_right" if causal else None, window=window, softcap=None,
        return_lse=True)
    want = paged_definition(*(a.astype(np.float64) for a in (q, k, v)), table, lens,
                            causal=causal, window=window)[:2]
    _within_float32_bounds(out, lse, *want)


DECODE_RUNS = [
    (64, 64, dict(b=2, hq=8, hk=2, lq=1, lk=600)),
    (128, 128, dict(b=1, hq=4, hk=1, lq=3, lk=520, causal="bottom_right", window=(300, -1),
                    softcap=5.0)),
    (96, 96, dict(b=1, hq=4, hk=2, lq=2, lk=600, causal="bottom_right", mask=True)),
    (80, 72, dict(b=1, hq=16, hk=1, lq=1, lk=600)),
]
"""(D, Dv, case): grouped queries (4 rows a key head), a chunked prefill of 12 rows under a
window and a soft cap, a mask with a row of no allowed key, 16 rows a key head at a pair
zero-padded to 96; each long enough for two splits."""

PAGED_DECODE_RUNS = [
    (64, 4, 2, 1, [600, 0, 37, 16], {}),
    (128, 4, 1, 3, [2, 560, 45, 0], dict(causal="bottom_right")),
    (96, 2, 1, 4, [20, 700], dict(causal="bottom_right", window=(520, -1), softcap=5.0)),
]
"""(D, Hq, Hk, Lq, seqlens, options): decoding, a chunked prefill with sequences shorter than
it, and a sliding window (the kernel starting each sequence at its first query's window)."""


@pytest.fixture(scope="module")
def decode_kernels(host_kernels):
    """The float32 decode kernels (dense and paged) at the head dims of :data:`DECODE_RUNS`
    and :data:`PAGED_DECODE_RUNS` and the merge of their partial states (kernels/attention.cu),
    built once for the host."""
    from softmaxkit_cupy.attention import _MERGE_PARAMS, DECODE_PARAMS
    from softmaxkit_cupy.configs import F32_DECODE_CONFIGS, f32_decode_width, merge_name
    from softmaxkit_cupy.paged import _PAGED_PARAMS

    widths = {f32_decode_width(d, dv) for d, dv, _ in DECODE_RUNS}
    widths |= {d for d, *_ in PAGED_DECODE_RUNS}
    codes = {F32_DECODE_CONFIGS[w].name("float32", paged): (_PAGED_PARAMS if paged
                                                             else DECODE_PARAMS)
             for w in widths for paged in (False, True)}
    built = host_kernels("attention_f32.cu", list(codes), codes)
    merge = merge_name("float32", "float32")
    return built | host_kernels("attention.cu", [merge], _MERGE_PARAMS)


@pytest.fixture
def decode_launches(decode_kernels, host_kernels, monkeypatch):
    """The adapters' device boundary moved to the host with :func:`decode_kernels` (a device
    of 132 multiprocessors); a list that gathers the decode launches' grids."""
    from softmaxkit_cupy import attention, attention_f32, interop
    from softmaxkit_cupy.attention import DECODE_PARAMS
    from softmaxkit_cupy.paged import _PAGED_PARAMS

    built = dict(decode_kernels)
    for module in (attention_f32, attention):
        move_to_host(monkeypatch, module, built, host_kernels)
    monkeypatch.setattr(attention, "_multiprocessors_of", lambda device: 132)
    monkeypatch.setattr(interop, "shared_limit", lambda device: SM90_SHARED)
    grids = []
    launch = interop.launch

    def recorded(kernel, like, grid, block, codes, args, shared=0) -> None:
        if codes in (DECODE_PARAMS, _PAGED_PARAMS):
            grids.append(grid)
        launch(kernel, like, grid, block, codes, args, shared)

    monkeypatch.setattr(interop, "launch", recorded)
    return grids


def _within_float32_bounds(got, got_lse, want, want_lse) -> None:
    """out and lse (torch tensors) against float64: rows with no allowed key (0, -inf), the
    float32 row of the tolerances, no NaN."""
    got, got_lse = got.numpy().astype(np.float64), got_lse.numpy().astype(np.float64)
    empty = want_lse == -np.inf
    assert got.shape == want.shape and not np.isnan(got).any()
    assert np.all(got[empty] == 0) and np.all(got_lse[empty] == -np.inf)
    out_tol, lse_tol, _ = ATTENTION_TOLERANCES["float32"]
    assert ref.rel_frobenius(got, want) <= out_tol
    assert np.abs(got_lse[~empty] - want_lse[~empty]).max() <= lse_tol


@pytest.mark.parametrize(("d", "dv", "case"), **_cases_of(DECODE_RUNS))
def test_decode_on_the_host(decode_launches, d: int, dv: int, case: dict) -> None:
    """Dense float32 split-KV decoding (sk_attn_decode_f32 on a (splits, Hk, B) grid, then
    sk_merge_attn), the adapter's own choice for these few rows a key head, on torch CPU
    tensors into memory that held NaN: within the float32 bounds of the float64 definition."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import attention_f32

    q, k, v, mask = inputs(d, dv, case, seed=d + case["lk"])
    opts = options(case)
    out, lse = attention_f32.attention(
        xp, q=torch.from_numpy(q), k=torch.from_numpy(k), v=torch.from_numpy(v),
        scale=d ** -0.5, causal=opts.get("causal"), window=opts.get("window", (-1, -1)),
        mask=None if mask is None else torch.from_numpy(mask), softcap=opts.get("softcap"),
        return_lse=True)
    (splits, heads, batch), = decode_launches
    assert (heads, batch) == (case["hk"], case["b"]) and splits > 1
    _within_float32_bounds(out, lse, *ref.attention(q, k, v, mask=mask, **opts))


@pytest.mark.parametrize(("d", "hq", "hk", "lq", "seqlens", "opts"), PAGED_DECODE_RUNS,
                         ids=[f"d{d}-hq{hq}-hk{hk}-lq{lq}-{case_id(o) or 'plain'}"
                              for d, hq, hk, lq, _, o in PAGED_DECODE_RUNS])
def test_paged_decode_on_the_host(decode_launches, d: int, hq: int, hk: int, lq: int,
                                  seqlens: list[int], opts: dict) -> None:
    """Paged float32 split-KV decoding (sk_attn_decode_f32_paged, then sk_merge_attn), the
    adapter's own choice, pages of 16 at shuffled places of a pool whose unused slots hold
    NaN: within the float32 bounds of the float64 definition on each sequence's keys."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import paged

    from softmaxkit.testing.paged_cases import make_cache, paged_definition

    rng = np.random.default_rng(d + lq + sum(seqlens))
    k, v, table, lens = make_cache(rng, seqlens, 16, hk, d, d)
    q = rng.standard_normal((len(seqlens), hq, lq, d)) * 1.5
    q, k, v = (a.astype(np.float32) for a in (q, k * 1.5, v))
    out, lse = paged.paged_attention(
        xp, q=torch.from_numpy(q), k_pages=torch.from_numpy(k), v_pages=torch.from_numpy(v),
        block_table=torch.from_numpy(table), seqlens=torch.from_numpy(lens), scale=d ** -0.5,
        causal=opts.get("causal"), window=opts.get("window", (-1, -1)),
        softcap=opts.get("softcap"), return_lse=True)
    (splits, heads, batch), = decode_launches
    assert (heads, batch) == (hk, len(seqlens)) and splits > 1
    want = paged_definition(*(a.astype(np.float64) for a in (q, k, v)), table, lens,
                            opts.get("causal"), scale=d ** -0.5, window=opts.get("window"),
                            softcap=opts.get("softcap"))[:2]
    _within_float32_bounds(out, lse, *want)


def test_float32_decode_tiles_by_shared_memory() -> None:
    """Each head dim up to 256 decodes on the tiles of its padded width while a block of them
    fits the device's shared memory; on a device of less (99 KB a block), the wide tiles give
    way to the exact forward (None), and nothing decodes above 256."""
    from softmaxkit_cupy.configs import (
        F32_DECODE_CONFIGS,
        SM_SHARED_BYTES,
        f32_decode_config,
        f32_decode_width,
    )

    for d in range(1, 257):
        tiles = f32_decode_config(d, d, SM90_SHARED)
        assert tiles is F32_DECODE_CONFIGS[f32_decode_width(d, d)] and tiles.head_dim >= d
        assert tiles.shared_bytes() <= SM90_SHARED <= SM_SHARED_BYTES
    assert f32_decode_config(192, 128) is F32_DECODE_CONFIGS[192]
    small = 99 * 1024
    fitting = {w: f32_decode_config(w, w, small) for w in F32_DECODE_CONFIGS}
    assert fitting == {w: tiles if tiles.shared_bytes() <= small else None
                       for w, tiles in F32_DECODE_CONFIGS.items()}
    assert fitting[64] is F32_DECODE_CONFIGS[64] and fitting[256] is None
    assert f32_decode_config(264, 264) is None and f32_decode_config(64, 264) is None
