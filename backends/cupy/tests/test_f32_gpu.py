"""The exact float32 attention forward on CUDA cores (kernels/attention_f32.cu) through its
adapter: against the float64 definition on fresh random inputs, on memory that held NaN just
before the call, within the float32 row of spec "Attention tolerances" and, elementwise,
within the bound of spec "Precision" at ``"tf32x3"`` (float32 products are more exact than
its split ones, and the sums are the same float32 sums); every declared tile and every
alternative, every forward feature, head dimensions built and padded.  The backward
(sk_attn_bwd_f32) through its adapter, each gradient against float64.  Through the default
dispatch, float32 calls reach them once they are served (``configs.F32_SERVED``), numba-cuda's
exact kernels before.
Skipped without a CUDA device of compute capability 8.0 or more.

Run: ``python -m pytest -q backends/cupy/tests/test_f32_gpu.py`` (``-s`` prints each case's
errors).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", autouse=True)
def _ampere_or_later() -> None:
    import cupy

    if int(cupy.cuda.Device().compute_capability) < 80:
        pytest.skip("the cupy kernels need compute capability 8.0 or more")


CASES = [
    dict(b=2, hq=4, hk=4, lq=257, lk=300),
    dict(b=1, hq=4, hk=4, lq=300, lk=300, causal="bottom_right"),
    dict(b=1, hq=8, hk=2, lq=200, lk=333, causal="bottom_right"),  # GQA
    dict(b=1, hq=4, hk=2, lq=333, lk=150, causal="bottom_right"),  # rows with no key
    dict(b=1, hq=4, hk=1, lq=333, lk=150, causal="top_left"),
    dict(b=1, hq=4, hk=2, lq=300, lk=400, window=(70, 20)),
    dict(b=1, hq=4, hk=2, lq=260, lk=260, causal="bottom_right", window=(90, -1),
         softcap=5.0),
    dict(b=1, hq=4, hk=2, lq=200, lk=250, causal="bottom_right", mask=True),
    dict(b=1, hq=2, hk=2, lq=130, lk=170, mask=True),
    dict(b=1, hq=2, hk=2, lq=1, lk=1000),  # one query row: a block of padding rows
]


def _case_id(c: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in c.items())


def _inputs(d: int, dv: int, case: dict, seed: int):
    """q, k, v (float32, CUDA, scaled so scores reach a few units) and the mask or None."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, hq, hk, lq, lk = (case[n] for n in ("b", "hq", "hk", "lq", "lk"))

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=gen) * scale

    q, k, v = randn(b, hq, lq, d, scale=1.5), randn(b, hk, lk, d, scale=1.5), randn(b, hk, lk, dv)
    mask = None
    if case.get("mask"):
        mask = torch.rand(b, hq, lq, lk, device="cuda", generator=gen) > 0.3
        mask[:, :, min(5, lq - 1), :] = False  # a row with no allowed key
    return q, k, v, mask


def _options(case: dict) -> dict:
    return {"causal": case.get("causal"), "window": case.get("window"),
            "softcap": case.get("softcap")}


def _numpy(a):
    return None if a is None else a.cpu().numpy()


def _check_gradients(got, want, what: str) -> None:
    """(dq, dk, dv) against float64 ``want``: each within the float32 row of the tolerances
    (spec "Gradients")."""
    from softmaxkit.testing import materialized as ref
    from softmaxkit.testing.attention_cases import ATTENTION_TOLERANCES

    tol = ATTENTION_TOLERANCES["float32"][2]
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        err = ref.rel_frobenius(_numpy(g).astype(np.float64), w)
        print(f"{what} {name}: {err:.3g}")
        assert err <= tol, f"{what} {name}: relative Frobenius {err:.3g}"


def _check(got: tuple, q, k, v, mask, case: dict, what: str) -> None:
    """``got`` = (out, lse) against float64: the tolerance table and the elementwise bound."""
    from softmaxkit.testing import materialized as ref
    from softmaxkit.testing.attention_cases import ATTENTION_TOLERANCES
    from softmaxkit.testing.precision import attention_bound

    opts = _options(case)
    qn, kn, vn, mn = (_numpy(a) for a in (q, k, v, mask))
    want, want_lse = ref.attention(qn, kn, vn, mask=mn, **opts)
    out_bound, lse_bound = attention_bound(qn, kn, vn, precision="tf32x3", mask=mn, **opts)
    out, lse = (_numpy(a).astype(np.float64) for a in got)
    empty = want_lse == -np.inf
    assert np.all(lse[empty] == -np.inf) and np.all(out[empty] == 0), f"{what}: empty rows"
    assert not np.isnan(out).any() and not np.isnan(lse).any(), f"{what}: NaN left"
    err, lerr = np.abs(out - want), np.abs(lse[~empty] - want_lse[~empty])
    rel = ref.rel_frobenius(out, want)
    out_tol, lse_tol, _ = ATTENTION_TOLERANCES["float32"]
    report = (f"{what}: out relative Frobenius {rel:.3g}, max error {err.max():.3g} (worst "
              f"error/bound {np.max(err / np.maximum(out_bound, 1e-300)):.3g}); lse max error "
              f"{lerr.max() if lerr.size else 0.0:.3g}")
    print(report)
    assert rel <= out_tol and (lerr.size == 0 or lerr.max() <= lse_tol), report
    assert np.all(err <= out_bound) and np.all(lerr <= lse_bound[~empty]), report


def _forward(d: int, dv: int, case: dict, config=None):
    """(out, lse) of the adapter on fresh inputs, into memory that held NaN; the inputs."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy.attention_f32 import attention

    q, k, v, mask = _inputs(d, dv, case, seed=d * 1000 + dv + case["lq"])
    b, hq, lq = case["b"], case["hq"], case["lq"]
    junk = [torch.full(s, math.nan, device="cuda") for s in ((b, hq, lq, dv), (b, hq, lq))]
    del junk  # the results' memory held NaN
    opts = _options(case)
    got = attention(xp, q=q, k=k, v=v, scale=d ** -0.5, causal=opts["causal"],
                    window=opts["window"] or (-1, -1), mask=mask, softcap=opts["softcap"],
                    return_lse=True, config=config)
    torch.cuda.synchronize()
    return got, (q, k, v, mask)


def _cotangents(out, lse, seed: int, operands: tuple):
    """(dout, dlse): fresh normal cotangents of ``out`` and ``lse`` (0 on the rows with no
    allowed key, as the frontend hands it); then memory of the ``operands``' sizes filled
    with NaN and released, which the gradients' buffers take next."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dout = torch.randn(out.shape, device="cuda", generator=gen)
    dlse = torch.where(lse == -math.inf, 0.0, torch.randn(lse.shape, device="cuda",
                                                          generator=gen))
    junk = [torch.full(a.shape, math.nan, device="cuda") for a in operands]
    del junk
    return dout, dlse


def _shared_limit() -> int:
    """The shared memory a block may take on the current device."""
    import cupy
    from softmaxkit_cupy.interop import shared_limit

    return shared_limit(cupy.cuda.runtime.getDevice())


def _fits(config) -> bool:
    return config.shared_bytes() <= _shared_limit()


@pytest.mark.parametrize(("d", "dv"), [(32, 32), (64, 64), (80, 96), (96, 96), (128, 128),
                                       (160, 160), (192, 128), (192, 192), (256, 256)])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_within_float32_bounds(d: int, dv: int, case: dict) -> None:
    from softmaxkit_cupy.configs import f32_config

    if not _fits(f32_config(d, dv, True)):
        pytest.skip("the tiles do not fit this device's shared memory")
    got, arrays = _forward(d, dv, case)
    _check(got, *arrays, case, f"D={d} Dv={dv} {_case_id(case)}")


@pytest.mark.parametrize(("d", "dv"), [(16, 16), (48, 48), (80, 80), (64, 32), (40, 112),
                                       (136, 136), (170, 100), (248, 248)])
@pytest.mark.parametrize("case", [CASES[1], CASES[7]], ids=_case_id)
def test_padded_head_dims_within_float32_bounds(d: int, dv: int, case: dict) -> None:
    """Head dims the kernels are not built for run on zero-padded copies of a built pair."""
    from softmaxkit_cupy.configs import f32_config, f32_shape

    if not _fits(f32_config(*f32_shape(d, dv), True)):
        pytest.skip("the tiles do not fit this device's shared memory")
    got, arrays = _forward(d, dv, case)
    _check(got, *arrays, case, f"D={d} Dv={dv} {_case_id(case)}")


def _other_tiles() -> list:
    from softmaxkit_cupy.configs import F32_ALTERNATIVES, FITTING_F32_CONFIGS

    return [*FITTING_F32_CONFIGS.values(), *F32_ALTERNATIVES]


@pytest.mark.parametrize("config", _other_tiles(), ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]], ids=_case_id)
def test_fitting_and_alternative_tiles_within_float32_bounds(config, case: dict) -> None:
    if not _fits(config):
        pytest.skip("the tiles do not fit this device's shared memory")
    got, arrays = _forward(config.head_dim, config.value_dim, case, config=config)
    _check(got, *arrays, case, f"{config} {_case_id(case)}")


def test_default_dispatch_of_float32_calls() -> None:
    """Served: the default float32 call runs here on the declared tile; not yet: on
    numba-cuda's exact kernels (or whatever leads them), never on the TF32 kernels."""
    from softmaxkit_cupy.configs import F32_SERVED, f32_config

    import softmaxkit as sk

    case = CASES[1]
    q, k, v, _ = _inputs(64, 64, case, seed=3)
    with sk.backend_opts(trace=True) as trace:
        out, lse = sk.attention(q, k, v, return_lse=True, **_options(case))
    record = trace[-1]
    if F32_SERVED:
        assert record.backend == "cupy" and record.kernel == f32_config(64, 64, False).name()
    else:
        assert record.backend != "cupy", record
    _check((out, lse), q, k, v, None, case, f"default dispatch on {record.backend}")


def test_long_rows_and_non_finite_inputs() -> None:
    """Rows of 4096 keys stay within the bounds; a NaN in q makes its row NaN, an infinite
    key the rows whose score with it is +inf or NaN, as in the float64 definition."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy.attention_f32 import attention

    from softmaxkit.testing import materialized as ref

    case = dict(b=1, hq=2, hk=2, lq=64, lk=4096)
    got, arrays = _forward(64, 64, case)
    _check(got, *arrays, case, "L4096")
    q, k, v, _ = _inputs(64, 64, dict(b=1, hq=1, hk=1, lq=70, lk=90), seed=7)
    q[0, 0, 3, 5] = math.nan
    k[0, 0, 40, 0] = math.inf
    out, lse = attention(xp, q=q, k=k, v=v, scale=0.125, causal="bottom_right",
                         window=(-1, -1), mask=None, softcap=None, return_lse=True)
    out, lse = _numpy(out), _numpy(lse)
    with np.errstate(invalid="ignore"):
        want, want_lse = ref.attention(_numpy(q), _numpy(k), _numpy(v), causal="bottom_right")
    nan_rows = np.isnan(want_lse[0, 0])
    assert nan_rows[3] and nan_rows.sum() > 1 and not nan_rows.all()
    assert np.array_equal(np.isnan(lse[0, 0]), nan_rows)
    assert np.isnan(out[0, 0, nan_rows]).all() and np.isfinite(out[0, 0, ~nan_rows]).all()


@pytest.mark.parametrize("precision", ["float32", "tf32"])
def test_gradient_through_autograd_is_exact(precision: str) -> None:
    """Through the default dispatch and autograd (these kernels once served, forward and
    backward; numba-cuda's before), at each precision of the forward: the backward on
    sk_attn_bwd_f32 whatever the precision, its gradients within the float32 row of the
    tolerances of exact arithmetic on the forward's own out and lse, and at "float32" of the
    definition too (a "tf32" forward's error passes into its gradient, spec "Precision")."""
    from softmaxkit_cupy.configs import F32_SERVED, f32_backward_config

    import softmaxkit as sk
    from softmaxkit.testing import materialized as ref

    case = dict(b=1, hq=4, hk=2, lq=150, lk=170, causal="bottom_right")
    q, k, v, _ = _inputs(64, 64, case, seed=11)
    q, k, v = (a.requires_grad_() for a in (q, k, v))
    with sk.backend_opts(trace=True) as trace:
        out, lse = sk.attention(q, k, v, causal="bottom_right", precision=precision,
                                return_lse=True)
        dout = torch.randn_like(out)
        out.backward(dout)
    backward = [r for r in trace if r.op == "attention_vjp"]
    assert backward, [r.op for r in trace]
    if F32_SERVED:
        assert backward[-1].backend == "cupy"
        assert backward[-1].kernel == f32_backward_config(64, 64, False).name()
    grads = (q.grad, k.grad, v.grad)
    qn, kn, vn, on, ln = (_numpy(a.detach()) for a in (q, k, v, out, lse))
    own = ref.attention_vjp(qn, kn, vn, _numpy(dout), causal="bottom_right", out=on, lse=ln)
    _check_gradients(grads, own, f"autograd at {precision}, on its forward's out and lse")
    if precision == "float32":
        want = ref.attention_vjp(qn, kn, vn, _numpy(dout), causal="bottom_right")
        _check_gradients(grads, want, "autograd at float32")


def test_wider_gradients_stay_exact_elsewhere() -> None:
    """A float32 gradient wider than the backward's tiles (D = 264) is declined with the
    reason and computed exactly by the next backend."""
    import softmaxkit as sk
    from softmaxkit.testing import materialized as ref

    case = dict(b=1, hq=2, hk=2, lq=40, lk=50)
    q, k, v, _ = _inputs(264, 264, case, seed=5)
    out, lse = sk.attention(q, k, v, return_lse=True)
    dout = torch.randn_like(out)
    with sk.backend_opts(trace=True) as trace:
        grads = sk.attention_vjp(q, k, v, out, lse, dout)
    assert trace[-1].backend != "cupy" and "up to 256" in trace[-1].declined["cupy"]
    want = ref.attention_vjp(*(_numpy(a) for a in (q, k, v)), _numpy(dout))
    _check_gradients(grads, want, f"D=264 on {trace[-1].backend}")


@pytest.mark.parametrize(("d", "dv"), [(32, 32), (64, 64), (96, 96), (128, 128), (160, 160),
                                       (192, 128), (192, 192), (256, 256), (48, 80),
                                       (144, 152)])
@pytest.mark.parametrize("case", CASES[:9], ids=_case_id)
def test_backward_within_float32_bounds(d: int, dv: int, case: dict) -> None:
    """The backward's adapter (sk_attn_bwd_f32) from the forward's out and lse, with an lse
    cotangent, its results on memory that held NaN: each gradient within the float32 row of
    the tolerances against float64 (spec "Gradients")."""
    from softmaxkit_cupy.configs import f32_backward_config, f32_backward_shape

    if not _fits(f32_backward_config(*f32_backward_shape(d, dv), True)):
        pytest.skip("the tiles do not fit this device's shared memory")
    _check_backward(d, dv, case)


def _backward_alternatives() -> list:
    from softmaxkit_cupy.configs import F32_BACKWARD_ALTERNATIVES

    return list(F32_BACKWARD_ALTERNATIVES)


@pytest.mark.parametrize("config", _backward_alternatives(), ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]], ids=_case_id)
def test_backward_alternatives_within_float32_bounds(config, case: dict) -> None:
    """The backward's other tiles (``configs.F32_BACKWARD_ALTERNATIVES``), as
    tools/f32_backward_timing.py runs them, within the same bounds."""
    if not _fits(config):
        pytest.skip("the tiles do not fit this device's shared memory")
    _check_backward(config.head_dim, config.value_dim, case, config)


def _check_backward(d: int, dv: int, case: dict, config=None) -> None:
    """The float32 adapter's gradients of ``case`` (on the tiles ``config``, None: the
    declared ones) against float64, their memory poisoned first."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy.attention_f32 import attention_vjp

    from softmaxkit.testing import materialized as ref

    (out, lse), (q, k, v, mask) = _forward(d, dv, case)
    dout, dlse = _cotangents(out, lse, seed=d, operands=(q, k, v))
    opts = _options(case)
    got = attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, dlse=dlse,
                        scale=d ** -0.5, causal=opts["causal"],
                        window=opts["window"] or (-1, -1), mask=mask, softcap=opts["softcap"],
                        config=config)
    torch.cuda.synchronize()
    want = ref.attention_vjp(*(_numpy(a) for a in (q, k, v, dout)), dlse=_numpy(dlse),
                             mask=_numpy(mask), **opts)
    _check_gradients(got, want, f"D={d} Dv={dv} {_case_id(case)} {config or ''}")


VARLEN = [
    # (query lengths, key lengths, options): ragged tiles, a sequence without queries and one
    # without keys, both causal alignments, a window with softcap
    ((70, 0, 300, 1, 129), (130, 9, 64, 0, 700), {}),
    ((70, 0, 300, 1, 129), (130, 9, 64, 0, 700), {"causal": "bottom_right"}),
    ((300, 5, 257), (300, 40, 200), {"causal": "top_left"}),
    ((400, 64), (900, 64), {"window": (100, 20), "softcap": 8.0}),
]


@pytest.mark.parametrize(("d", "dv"), [(64, 64), (80, 80), (128, 128), (160, 160),
                                       (192, 128), (256, 256)])
@pytest.mark.parametrize(("lens_q", "lens_k", "kw"), VARLEN, ids=str)
def test_varlen_through_the_default_dispatch(d: int, dv: int, lens_q, lens_k, kw) -> None:
    """Packed float32 sequences through ``sk.varlen_attention`` and
    ``sk.varlen_attention_vjp`` (with an lse cotangent) run on the exact packed kernels (named
    in the trace), their results on memory that held NaN: out, lse and each gradient against
    the float64 definition on each sequence alone, within the float32 row of spec "Attention
    tolerances"; out 0 and lse -inf on rows with no allowed key."""
    from softmaxkit_cupy.configs import (
        f32_backward_config,
        f32_backward_shape,
        f32_config,
        f32_shape,
    )

    import softmaxkit as sk
    from softmaxkit.testing import materialized as ref
    from softmaxkit.testing.attention_cases import ATTENTION_TOLERANCES
    from softmaxkit.testing.varlen_cases import (
        packed_arrays,
        packed_reference,
        packed_vjp_reference,
    )

    forward = f32_config(*f32_shape(d, dv), False)
    backward = f32_backward_config(*f32_backward_shape(d, dv), False)
    if not (_fits(forward) and _fits(backward)):
        pytest.skip("the tiles do not fit this device's shared memory")
    hq, hk = 4, 2
    q, k, v, cu_q, cu_k = packed_arrays(d + dv, lens_q, lens_k, hq, hk, d, dv,
                                        dtype=np.float32, scale=1.5)
    tq, tk, tv, mq, mk = (torch.as_tensor(a, device="cuda") for a in (q, k, v, cu_q, cu_k))
    causal, window, softcap = kw.get("causal"), kw.get("window"), kw.get("softcap")
    opts = dict(scale=d ** -0.5, causal=causal or False, window=window, softcap=softcap)
    junk = [torch.full((q.shape[0], hq, dv), math.nan, device="cuda"),
            torch.full((q.shape[0], hq), math.nan, device="cuda")]
    del junk  # the results' memory held NaN
    with sk.backend_opts(trace=True) as trace:
        out, lse = sk.varlen_attention(tq, tk, tv, mq, mk, return_lse=True, **opts)
    torch.cuda.synchronize()
    assert trace[-1].backend == "cupy" and trace[-1].kernel == forward.varlen_name()
    rkw = dict(scale=d ** -0.5, causal=causal, window=window or (-1, -1), softcap=softcap)
    want, want_lse = packed_reference(q, k, v, cu_q, cu_k, **rkw)
    got, got_lse = _numpy(out).astype(np.float64), _numpy(lse).astype(np.float64)
    empty = np.isneginf(want_lse)
    assert not np.isnan(got).any() and not np.isnan(got_lse).any()
    assert np.array_equal(np.isneginf(got_lse), empty) and np.all(got[empty] == 0)
    out_tol, lse_tol, _ = ATTENTION_TOLERANCES["float32"]
    assert ref.rel_frobenius(got, want) <= out_tol
    assert np.abs(got_lse[~empty] - want_lse[~empty]).max() <= lse_tol

    dout, dlse = _cotangents(out, lse, seed=d, operands=(tq, tk, tv))
    with sk.backend_opts(trace=True) as trace:
        grads = sk.varlen_attention_vjp(tq, tk, tv, out, lse, dout, mq, mk, dlse=dlse, **opts)
    torch.cuda.synchronize()
    assert trace[-1].backend == "cupy" and trace[-1].kernel == backward.varlen_name()
    wants = packed_vjp_reference(q, k, v, _numpy(dout), cu_q, cu_k, _numpy(dlse), **rkw)
    _check_gradients(grads, wants, f"varlen D={d} Dv={dv} {kw}")


DECODE = [
    dict(b=2, hq=8, hk=2, lq=1, lk=3000),
    dict(b=1, hq=4, hk=1, lq=3, lk=2600, causal="bottom_right", window=(900, -1), softcap=5.0),
    dict(b=2, hq=4, hk=2, lq=2, lk=1500, causal="bottom_right", mask=True),
    dict(b=1, hq=16, hk=1, lq=1, lk=1000),
]
"""Decoding shapes: grouped queries, a chunked prefill under a window and a soft cap, a mask
with a row of no allowed key, 16 rows a key head; each several splits long."""


@pytest.mark.parametrize("d", [32, 64, 80, 128, 160, 256])
@pytest.mark.parametrize("case", DECODE, ids=_case_id)
def test_decode_within_float32_bounds(d: int, case: dict) -> None:
    """Float32 decoding through the default dispatch runs on the split-KV decode kernel
    (sk_attn_decode_f32, named in the trace) where the device holds its tiles, and on the
    exact forward where not; on memory that held NaN, out and lse are within the float32
    bounds of the float64 definition (:func:`_check`)."""
    from softmaxkit_cupy.configs import f32_decode_config

    import softmaxkit as sk

    q, k, v, mask = _inputs(d, d, case, seed=d * 1000 + case["lq"])
    junk = torch.full((70 * q.numel() + 4096,), math.nan, device="cuda")
    del junk  # the memory of the partial states (up to 64 splits) and results held NaN
    opts = _options(case)
    with sk.backend_opts(trace=True) as trace:
        got = sk.attention(q, k, v, mask=mask, causal=opts["causal"] or False,
                           window=opts["window"], softcap=opts["softcap"], return_lse=True)
    torch.cuda.synchronize()
    tiles = f32_decode_config(d, d, _shared_limit())
    want = tiles.name() if tiles is not None else None
    assert trace[-1].backend == "cupy" and (want is None or trace[-1].kernel == want), trace[-1]
    _check(got, q, k, v, mask, case, f"decode D={d} {_case_id(case)} on {trace[-1].kernel}")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_paged_decode_within_float32_bounds(d: int) -> None:
    """Paged float32 decoding through the default dispatch (sk_attn_decode_f32_paged where
    the device holds its tiles) over pages of 16 at shuffled places of a pool whose unused
    slots hold NaN, one sequence empty and one with a sliding window's worth of keys: out
    and lse against the float64 definition on each sequence's keys."""
    from softmaxkit_cupy.configs import f32_decode_config

    import softmaxkit as sk
    from softmaxkit.testing import materialized as ref
    from softmaxkit.testing.attention_cases import ATTENTION_TOLERANCES
    from softmaxkit.testing.paged_cases import make_cache, paged_definition

    rng = np.random.default_rng(d)
    k, v, table, lens = make_cache(rng, [3000, 0, 517, 40], 16, 2, d, d)
    q = rng.standard_normal((4, 8, 1, d))
    tiles = f32_decode_config(d, d, _shared_limit())
    for window in ((-1, -1), (700, -1)):
        args = [torch.as_tensor(a, device="cuda") for a in (q, k, v)]
        tq, tk, tv = (a.float() for a in args)
        with sk.backend_opts(trace=True) as trace:
            out, lse = sk.paged_attention(
                tq, tk, tv, torch.as_tensor(table, device="cuda"),
                torch.as_tensor(lens, device="cuda"), causal=True, window=window,
                return_lse=True)
        torch.cuda.synchronize()
        assert trace[-1].backend == "cupy"
        assert tiles is None or trace[-1].kernel == tiles.name("float32", paged=True), trace[-1]
        want, want_lse = paged_definition(*(_numpy(a).astype(np.float64) for a in (tq, tk, tv)),
                                          table, lens, True, scale=d ** -0.5, window=window)[:2]
        got, got_lse = _numpy(out).astype(np.float64), _numpy(lse).astype(np.float64)
        empty = want_lse == -np.inf
        assert np.all(got[empty] == 0) and np.all(got_lse[empty] == -np.inf)
        out_tol, lse_tol, _ = ATTENTION_TOLERANCES["float32"]
        assert ref.rel_frobenius(got, want) <= out_tol, window
        assert np.abs(got_lse[~empty] - want_lse[~empty]).max() <= lse_tol, window
