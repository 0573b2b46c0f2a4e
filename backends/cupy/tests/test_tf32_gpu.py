"""The float32 attention forward on TF32 tensor cores (kernels/attention_tf32.cu) through the
default dispatch, at ``precision="tf32"`` and ``"tf32x3"``, against the float64 definition on
fresh random inputs under the elementwise bound of spec "Precision"
(:func:`softmaxkit.testing.precision.attention_bound`), on memory that held NaN just before
the call; and the gradient of such a forward through torch autograd (its backward runs on the
exact float32 kernels).  Skipped without a CUDA device of compute capability 8.0 or more.

Run: ``python -m pytest -q backends/cupy/tests/test_tf32_gpu.py`` (``-s`` prints each case's
errors).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", autouse=True)
def _ampere_or_later() -> None:
    import cupy

    if int(cupy.cuda.Device().compute_capability) < 80:
        pytest.skip("TF32 tensor cores need compute capability 8.0 or more")


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
]
HEAD_DIMS = (32, 64, 96, 128)


def _case_id(c: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in c.items())


def _inputs(d: int, case: dict, seed: int, dv: int | None = None):
    """q, k, v (float32, CUDA, scaled so scores reach a few units) and the mask or None."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, hq, hk, lq, lk = (case[n] for n in ("b", "hq", "hk", "lq", "lk"))

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=gen) * scale

    q, k = randn(b, hq, lq, d, scale=1.5), randn(b, hk, lk, d, scale=1.5)
    v = randn(b, hk, lk, d if dv is None else dv)
    mask = None
    if case.get("mask"):
        mask = torch.rand(b, hq, lq, lk, device="cuda", generator=gen) > 0.3
        mask[:, :, 5, :] = False  # a row with no allowed key
    return q, k, v, mask


def _options(case: dict) -> dict:
    return {"causal": case.get("causal"), "window": case.get("window"),
            "softcap": case.get("softcap")}


def _poison(*shapes: tuple[int, ...]) -> None:
    """Fill the caching allocator's next float32 blocks of these shapes with NaN."""
    junk = [torch.full(shape, math.nan, device="cuda") for shape in shapes]
    del junk


def _numpy(a):
    return None if a is None else a.cpu().numpy()


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_within_the_precision_bound(precision: str, d: int, case: dict) -> None:
    _check_forward(precision, d, d, case)


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize(("d", "dv"), [(16, 16), (48, 48), (80, 80), (64, 32), (40, 112)])
@pytest.mark.parametrize("case", [CASES[1], CASES[7]], ids=_case_id)
def test_padded_head_dims_within_the_precision_bound(precision: str, d: int, dv: int,
                                                     case: dict) -> None:
    """Head dims the kernels are not built for run on zero-padded copies at the next one."""
    _check_forward(precision, d, dv, case)


def _check_forward(precision: str, d: int, dv: int, case: dict) -> None:
    from softmaxkit_cupy.configs import tf32_config, tf32_width
    from softmaxkit_cupy.interop import shared_limit

    import softmaxkit as sk
    from softmaxkit.testing import materialized as ref
    from softmaxkit.testing.precision import attention_bound

    q, k, v, mask = _inputs(d, case, seed=d * 1000 + dv + case["lq"], dv=dv)
    opts = _options(case)
    b, hq, lq = case["b"], case["hq"], case["lq"]
    _poison((b, hq, lq, dv), (b, hq, lq))
    with sk.backend_opts(trace=True) as trace:
        out, lse = sk.attention(q, k, v, mask=mask, return_lse=True, precision=precision,
                                **opts)
    torch.cuda.synchronize()
    record = trace[-1]
    assert record.backend == "cupy", record
    assert record.kernel.startswith(f"sk_attn_fwd_tf32<{tf32_width(d, dv)},"), record.kernel
    config = tf32_config(tf32_width(d, dv), mask is not None, shared_limit(q.device.index))
    assert record.kernel == config.name(precision)

    qn, kn, vn, mn = (_numpy(a) for a in (q, k, v, mask))
    want, want_lse = ref.attention(qn, kn, vn, mask=mn, **opts)
    out_bound, lse_bound = attention_bound(qn, kn, vn, precision=precision, mask=mn, **opts)
    got, got_lse = _numpy(out).astype(np.float64), _numpy(lse).astype(np.float64)
    empty = want_lse == -np.inf
    assert np.all(got_lse[empty] == -np.inf) and np.all(got[empty] == 0), "empty rows"
    assert not np.isnan(got).any() and not np.isnan(got_lse).any(), "NaN left in a result"
    err = np.abs(got - want)
    lerr = np.abs(got_lse[~empty] - want_lse[~empty])
    report = (f"{precision} D={d} Dv={dv} {_case_id(case)}: out max error {err.max():.3g} "
              f"(bound {out_bound.max():.3g}, worst error/bound "
              f"{np.max(err / np.maximum(out_bound, 1e-300)):.3g}), relative Frobenius "
              f"{ref.rel_frobenius(got, want):.3g}; lse max error "
              f"{lerr.max() if lerr.size else 0.0:.3g} (bound {lse_bound.max():.3g})")
    print(report)
    assert np.all(err <= out_bound), report
    assert np.all(lerr <= lse_bound[~empty]), report


def test_exact_float32_calls_stay_off_the_tf32_kernels() -> None:
    import softmaxkit as sk

    q, k, v, _ = _inputs(64, CASES[0], seed=1)
    with sk.backend_opts(trace=True) as trace:
        sk.attention(q, k, v)
    assert not (trace[-1].kernel or "").startswith("sk_attn_fwd_tf32"), trace[-1]


def _served_tiles() -> list:
    from dataclasses import replace

    from softmaxkit_cupy.configs import FITTING_TF32_CONFIGS, TF32_CONFIGS

    tiles = (*TF32_CONFIGS.values(), *FITTING_TF32_CONFIGS.values())
    return [replace(c, mask=masked) for c in tiles for masked in (True, False)]


@pytest.mark.parametrize("config", _served_tiles(), ids=str)
@pytest.mark.parametrize("case", [CASES[1], CASES[7], dict(b=1, hq=4, hk=4, lq=256, lk=2048)],
                         ids=_case_id)
def test_staged_tiles_within_the_bound_and_closer_than_in_place(config, case: dict) -> None:
    """The served tiles at tf32x3, which sum each key tile apart (``Tf32Config(staged=True)``),
    through the adapter on memory that held NaN: within the spec's bound against float64,
    and, on rows of 2048 keys, closer to float64 than the same tiles summing in place (the
    truncated float32 sums of the tensor cores: backends/cupy/tools/tf32_truncation.py)."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy.attention_tf32 import attention as tf32_attention

    from softmaxkit.testing import materialized as ref
    from softmaxkit.testing.precision import attention_bound

    if case.get("mask") and not config.mask:
        pytest.skip("a tile without the mask's code takes no mask")
    d = config.head_dim
    q, k, v, mask = _inputs(d, case, seed=11 * d + case["lk"])
    opts = _options(case)
    scale = d**-0.5
    window = opts["window"] or (-1, -1)

    def run(c):
        _poison((case["b"], case["hq"], case["lq"], d), (case["b"], case["hq"], case["lq"]))
        out, lse = tf32_attention(xp, q=q, k=k, v=v, scale=scale, causal=opts["causal"],
                                  window=window, mask=mask, softcap=opts["softcap"],
                                  return_lse=True, precision="tf32x3", config=c)
        torch.cuda.synchronize()
        return _numpy(out).astype(np.float64), _numpy(lse).astype(np.float64)

    qn, kn, vn, mn = (_numpy(a) for a in (q, k, v, mask))
    want, want_lse = ref.attention(qn, kn, vn, mask=mn, **opts)
    out_bound, lse_bound = attention_bound(qn, kn, vn, precision="tf32x3", mask=mn, **opts)
    got, got_lse = run(config)
    empty = want_lse == -np.inf
    assert np.all(got_lse[empty] == -np.inf) and np.all(got[empty] == 0), "empty rows"
    assert np.all(np.abs(got - want) <= out_bound), "out beyond the bound"
    assert np.all(np.abs(got_lse[~empty] - want_lse[~empty]) <= lse_bound[~empty]), "lse"
    staged = ref.rel_frobenius(got, want)
    in_place = ref.rel_frobenius(run(dataclasses.replace(config, staged=False))[0], want)
    print(f"{config} {_case_id(case)}: relative Frobenius {staged:.3g} staged, "
          f"{in_place:.3g} in place")
    if case["lk"] >= 2048:
        assert staged < in_place, (staged, in_place)


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("d", [64, 128])
def test_gradient_of_a_tf32_forward(precision: str, d: int) -> None:
    """The backward of a TF32 forward runs on the exact float32 kernels from the forward's out
    and lse: its error is the forward's, carried through ``P = exp(S - lse)`` and
    ``rowsum(dout * out)``; against the float64 gradient, relative Frobenius within float32's
    gradient tolerance (1e-4) at tf32x3 and within 3e-2 at tf32."""
    import softmaxkit as sk
    from softmaxkit.testing import materialized as ref

    case = CASES[2]
    q, k, v, _ = _inputs(d, case, seed=7 + d)
    leaves = [a.clone().requires_grad_() for a in (q, k, v)]
    out = sk.attention(*leaves, causal="bottom_right", precision=precision)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = ref.attention_vjp(*(_numpy(a) for a in (q, k, v)), _numpy(dout),
                             causal="bottom_right")
    tol = 1e-4 if precision == "tf32x3" else 3e-2
    for name, leaf, w in zip("qkv", leaves, want, strict=True):
        err = ref.rel_frobenius(_numpy(leaf.grad).astype(np.float64), w)
        print(f"{precision} D={d} d{name}: relative Frobenius {err:.3g}")
        assert err <= tol, f"{precision} D={d} d{name}: {err:.3g} > {tol}"


BACKWARD = [
    dict(b=2, hq=4, hk=4, lq=150, lk=170),
    dict(b=1, hq=8, hk=2, lq=130, lk=211, causal="bottom_right", dlse=True),  # GQA
    dict(b=1, hq=4, hk=1, lq=211, lk=100, causal="top_left"),
    dict(b=1, hq=4, hk=2, lq=190, lk=190, causal="bottom_right", window=(60, -1),
         softcap=5.0),
    dict(b=1, hq=2, hk=2, lq=100, lk=140, mask=True),
]


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize(("d", "dv"), [(32, 32), (64, 64), (96, 96), (128, 128), (48, 48),
                                       (64, 32)])
@pytest.mark.parametrize("case", BACKWARD, ids=_case_id)
def test_backward_kernel_against_float64(precision: str, d: int, dv: int, case: dict) -> None:
    """The TF32 backward (sk_attn_bwd_tf32, built on request until this passes on a device)
    through its adapter, from the float64 forward's out and lse rounded to float32, against
    the float64 gradient: relative Frobenius error of each gradient within float32's
    gradient tolerance (1e-4) at tf32x3 and 2e-2 at tf32; rows with no allowed key give
    zero gradient; on memory that held NaN."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy.attention_tf32 import attention_vjp

    from softmaxkit.testing import materialized as ref

    q, k, v, mask = _inputs(d, case, seed=d * 100 + dv + case["lq"], dv=dv)
    opts = _options(case)
    qn, kn, vn, mn = (_numpy(a) for a in (q, k, v, mask))
    out64, lse64 = ref.attention(qn, kn, vn, mask=mn, **opts)
    gen = torch.Generator(device="cuda").manual_seed(3)
    dout = torch.randn(*out64.shape, device="cuda", generator=gen)
    dlse = (torch.randn(*lse64.shape, device="cuda", generator=gen)
            if case.get("dlse") else None)
    if dlse is not None:
        dlse = torch.where(torch.from_numpy(lse64).cuda() == -math.inf, 0.0, dlse)
    want = ref.attention_vjp(qn, kn, vn, _numpy(dout), mask=mn,
                             dlse=None if dlse is None else _numpy(dlse), **opts)
    out = torch.from_numpy(out64).float().cuda()
    lse = torch.from_numpy(lse64).float().cuda()
    b, hq, hk, lq, lk = (case[n] for n in ("b", "hq", "hk", "lq", "lk"))
    _poison((b, hk, lk, max(d, dv)), (b, hk, lk, d), (b, hk, lk, dv))
    bool_mask = None if mask is None else mask.expand(b, hq, lq, lk)
    window = case.get("window") or (-1, -1)
    grads = attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, dlse=dlse,
                          scale=d ** -0.5, causal=case.get("causal"), window=window,
                          mask=bool_mask, softcap=case.get("softcap"), precision=precision)
    torch.cuda.synchronize()
    tol = 1e-4 if precision == "tf32x3" else 2e-2
    for name, got, w in zip(("dq", "dk", "dv"), grads, want, strict=True):
        got = _numpy(got).astype(np.float64)
        assert got.shape == w.shape, (name, got.shape, w.shape)
        assert not np.isnan(got).any(), f"{name}: NaN left in the result"
        err = ref.rel_frobenius(got, w)
        report = (f"{precision} D={d} Dv={dv} {_case_id(case)} {name}: relative Frobenius "
                  f"{err:.3g}, max abs error {np.abs(got - w).max():.3g}")
        print(report)
        assert err <= tol, report
    empty = lse64 == -np.inf
    if empty.any():
        assert np.all(_numpy(grads[0])[empty] == 0), "dq of a row with no allowed key"
