"""Head dimensions the attention kernels are not built for, served on zero-padded copies.

No GPU is needed: the padding is checked with the reference backend in float64 (attention of
the padded arrays, sliced, equals attention of the arrays as given, for every operation the
padding serves), the adapters' padding and slicing with the reference standing in for the
kernel they would launch (CPU tensors), the calls without work at padded head dimensions
against the reference, and the manifest's reasons.  ``test_head_dims_gpu.py`` runs the
kernels themselves.
"""

from __future__ import annotations

import array_api_compat.numpy as xp
import numpy as np
import pytest
from softmaxkit_cupy import head_dims
from softmaxkit_cupy import manifest as mf
from softmaxkit_cupy.configs import (
    ATTENTION_HEAD_DIMS,
    SM90_BACKWARD_CONFIGS,
    SM90_BACKWARD_MASKED_CONFIGS,
    SM90_CONFIGS,
    SM90_MASKED_CONFIGS,
    SM90_VARLEN_BACKWARD_CONFIGS,
)

import softmaxkit as sk
from softmaxkit.ops import Call
from softmaxkit.reference import attention as dense_ref
from softmaxkit.reference import paged as paged_ref
from softmaxkit.reference import varlen as varlen_ref
from softmaxkit.testing.paged_cases import make_cache

PAIRS = [(192, 128), (128, 192), (40, 40), (8, 8), (72, 64)]
"""(D, Dv): multi-head latent attention's shapes both ways (P = 192), a head dimension between
built ones (P = 64) and one below them all (P = 32), and D != Dv with D not built (P = 80)."""

OPTIONS = [
    ({}, "plain"),
    ({"causal": "bottom_right"}, "causal"),
    ({"causal": "top_left", "window": (2, 1)}, "top_left window"),
    ({"window": (-1, 0), "softcap": 3.0}, "right window softcap"),
]
"""Options of the dense and packed cases (a boolean mask is added to the dense ones)."""

CLOSE = {"rtol": 1e-12, "atol": 1e-13}
"""float64 on both sides: only the summation order of the extra +0 products may differ."""


def _settings(kw: dict) -> dict:
    return {"causal": kw.get("causal"), "window": kw.get("window", (-1, -1)),
            "softcap": kw.get("softcap")}


def _pad_all(width: int, *arrays: np.ndarray) -> list[np.ndarray]:
    return [head_dims.pad(xp, a, width) for a in arrays]


# ---- the policy ---------------------------------------------------------------------------

@pytest.mark.parametrize(("d", "dv", "width"), [
    (1, 1, 32), (8, 8, 32), (16, 16, 32), (32, 32, 32), (33, 33, 64), (40, 40, 64),
    (48, 48, 64), (64, 64, 64), (72, 64, 80), (64, 72, 80), (80, 80, 80), (81, 1, 96),
    (112, 112, 128), (128, 64, 128), (129, 129, 160), (192, 128, 192), (128, 192, 192),
    (200, 200, 256), (256, 256, 256), (1, 256, 256),
    (257, 257, None), (264, 264, None), (128, 300, None), (257, 1, None), (0, 64, None),
    (64, 0, None),
])
def test_served_head_dim_table(d, dv, width) -> None:
    assert head_dims.served_head_dim(d, dv) == width


def test_served_head_dim_is_the_smallest_built_one_that_holds_both() -> None:
    built = sorted(ATTENTION_HEAD_DIMS)
    for d in range(1, 257):
        for dv in range(1, 257):
            width = head_dims.served_head_dim(d, dv)
            assert width in built and width >= max(d, dv), (d, dv, width)
            assert all(p < max(d, dv) for p in built if p < width), (d, dv, width)


def test_pad_width_is_none_exactly_at_the_built_head_dims() -> None:
    for d in ATTENTION_HEAD_DIMS:
        assert head_dims.pad_width(d, d) is None
    assert head_dims.pad_width(40, 40) == 64
    assert head_dims.pad_width(192, 128) == head_dims.pad_width(128, 192) == 192
    assert head_dims.pad_width(64, 32) == 64  # D built, Dv differs: v padded
    with pytest.raises(ValueError, match="D=264, Dv=264"):
        head_dims.pad_width(264, 264)


def test_head_dim_reason_names_both_dimensions() -> None:
    assert head_dims.head_dim_reason(192, 128) is None
    reason = head_dims.head_dim_reason(128, 300)
    assert reason is not None and "D=128" in reason and "Dv=300" in reason and "256" in reason


# ---- the padding helpers ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_pad_appends_positive_zeros_in_a_contiguous_aligned_copy(dtype) -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2, 3, 5, 40)).astype(dtype)
    a[0, 0, 0, :3] = [np.inf, -np.inf, np.nan]
    view = np.swapaxes(a, 1, 2)  # not contiguous: the copy is
    for src in (a, view):
        padded = head_dims.pad(xp, src, 64)
        assert padded.shape == src.shape[:-1] + (64,) and padded.dtype == src.dtype
        assert padded.flags.c_contiguous and not np.shares_memory(padded, src)
        assert padded.strides[-2] % 16 == 0 and padded.ctypes.data % 16 == 0
        np.testing.assert_array_equal(padded[..., :40], src)
        assert np.all(padded[..., 40:] == 0) and not np.any(np.signbit(padded[..., 40:]))
    assert head_dims.pad(xp, a, 40) is a  # already that wide: no copy
    with pytest.raises(ValueError, match="cannot pad"):
        head_dims.pad(xp, a, 32)


def test_narrow_is_a_view_and_undoes_pad() -> None:
    a = np.arange(2 * 3 * 40, dtype=np.float64).reshape(2, 3, 40)
    padded = head_dims.pad(xp, a, 64)
    back = head_dims.narrow(padded, 40)
    assert np.shares_memory(back, padded)
    np.testing.assert_array_equal(back, a)
    assert head_dims.narrow(a, 40) is a


def test_pad_keeps_torch_tensors_dtype_and_device() -> None:
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xpt

    a = torch.randn(2, 7, 3, 40).to(torch.bfloat16).transpose(1, 2)
    padded = head_dims.pad(xpt, a, 64)
    assert padded.dtype == torch.bfloat16 and padded.device == a.device
    assert padded.is_contiguous() and tuple(padded.shape) == (2, 3, 7, 64)
    assert torch.equal(padded[..., :40], a) and not bool(padded[..., 40:].any())
    assert head_dims.pad(xpt, a, 40) is a


# ---- the padded operations equal the unpadded ones (reference backend, float64) -----------

def _dense(seed: int, d: int, dv: int, hq: int = 4, hk: int = 2, lq: int = 6, lk: int = 11):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(2, hq, lq, d)), rng.normal(size=(2, hk, lk, d)),
            rng.normal(size=(2, hk, lk, dv)))


def _mask(lq: int = 6, lk: int = 11, hq: int = 4) -> np.ndarray:
    mask = np.random.default_rng(9).random((2, hq, lq, lk)) < 0.6
    mask[1, 2, 3] = False  # a row with no allowed key
    return mask


@pytest.mark.parametrize(("d", "dv"), PAIRS)
@pytest.mark.parametrize(("kw", "name"), [*OPTIONS, ({"mask": True, "causal": "bottom_right"},
                                                      "mask")])
def test_padded_attention_and_gradient_equal_the_unpadded(d, dv, kw, name) -> None:
    q, k, v = _dense(d + dv, d, dv)
    opts = dict(_settings(kw), scale=d ** -0.5, mask=_mask() if kw.get("mask") else None)
    out, lse = _padded_equals_unpadded(dense_ref.attention, dense_ref.attention_vjp,
                                       (q, k, v), opts, seed=1)
    if kw.get("mask"):
        assert lse[1, 2, 3] == -np.inf and np.all(out[1, 2, 3] == 0)


def _padded_equals_unpadded(forward, vjp, qkv, opts, seed):
    """``forward`` and ``vjp`` (reference kernels) on q, k, v and, for the gradient, out and
    dout zero-padded to the served head dimension, sliced, equal them on the arrays as given;
    the padded columns of every result are 0.  Returns the unpadded ``(out, lse)``."""
    q, k, v = qkv
    d, dv = q.shape[-1], v.shape[-1]
    width = head_dims.served_head_dim(d, dv)
    out, lse = forward(xp, q=q, k=k, v=v, return_lse=True, **opts)
    pq, pk, pv = _pad_all(width, q, k, v)
    p_out, p_lse = forward(xp, q=pq, k=pk, v=pv, return_lse=True, **opts)
    assert p_out.shape[-1] == width and np.all(p_out[..., dv:] == 0)
    np.testing.assert_allclose(head_dims.narrow(p_out, dv), out, **CLOSE)
    np.testing.assert_allclose(p_lse, lse, **CLOSE)

    dout = np.random.default_rng(seed).normal(size=out.shape)
    grads = vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, **opts)
    p_grads = vjp(xp, q=pq, k=pk, v=pv, out=head_dims.pad(xp, out, width), lse=lse,
                  dout=head_dims.pad(xp, dout, width), **opts)
    for gname, g, pg, n in zip(("dq", "dk", "dv"), grads, p_grads, (d, d, dv), strict=True):
        assert pg.shape[-1] == width and np.all(pg[..., n:] == 0), gname
        np.testing.assert_allclose(head_dims.narrow(pg, n), g, err_msg=gname, **CLOSE)
    return out, lse


def _packed(seed: int, d: int, dv: int, hq: int = 4, hk: int = 2):
    lens_q, lens_k = (3, 0, 7, 1), (5, 4, 9, 0)  # a sequence without queries, one without keys
    rng = np.random.default_rng(seed)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int64) for n in (lens_q, lens_k))
    return (rng.normal(size=(int(cu_q[-1]), hq, d)), rng.normal(size=(int(cu_k[-1]), hk, d)),
            rng.normal(size=(int(cu_k[-1]), hk, dv)), cu_q, cu_k)


@pytest.mark.parametrize(("d", "dv"), PAIRS)
@pytest.mark.parametrize(("kw", "name"), OPTIONS)
def test_padded_varlen_attention_and_gradient_equal_the_unpadded(d, dv, kw, name) -> None:
    q, k, v, cu_q, cu_k = _packed(d * 3 + dv, d, dv)
    opts = dict(_settings(kw), scale=d ** -0.5, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    _padded_equals_unpadded(varlen_ref.varlen_attention, varlen_ref.varlen_attention_vjp,
                            (q, k, v), opts, seed=2)


def _paged(seed: int, d: int, dv: int, lq: int):
    rng = np.random.default_rng(seed)
    # NaN in the slots no sequence uses; an empty sequence; a spare table column
    k_pages, v_pages, table, lens = make_cache(rng, [5, 0, 13], 4, 2, d, dv)
    return rng.normal(size=(3, 4, lq, d)), k_pages, v_pages, table, lens


@pytest.mark.parametrize(("d", "dv"), PAIRS)
@pytest.mark.parametrize(("kw", "lq"), [({}, 1), ({"causal": "bottom_right"}, 3),
                                        ({"causal": "bottom_right", "window": (4, -1)}, 2),
                                        ({"softcap": 2.0}, 1)])
def test_padded_paged_attention_equals_the_unpadded(d, dv, kw, lq) -> None:
    q, k_pages, v_pages, table, lens = _paged(d + 7 * dv, d, dv, lq)
    width = head_dims.served_head_dim(d, dv)
    opts = dict(_settings(kw), scale=d ** -0.5, block_table=table, seqlens=lens)
    out, lse = paged_ref.paged_attention(xp, q=q, k_pages=k_pages, v_pages=v_pages,
                                         return_lse=True, **opts)
    pq, pk, pv = _pad_all(width, q, k_pages, v_pages)
    p_out, p_lse = paged_ref.paged_attention(xp, q=pq, k_pages=pk, v_pages=pv,
                                             return_lse=True, **opts)
    assert np.all(np.isfinite(out)) and np.any(lse == -np.inf)  # the empty sequence's rows
    assert p_out.shape[-1] == width and np.all(p_out[..., dv:] == 0)
    np.testing.assert_allclose(head_dims.narrow(p_out, dv), out, **CLOSE)
    np.testing.assert_allclose(p_lse, lse, **CLOSE)


# ---- the adapters pad, pass the scale as given and slice, with the reference as the kernel --

@pytest.fixture
def torch_xp():
    pytest.importorskip("torch")
    import array_api_compat.torch

    return array_api_compat.torch


def _torch(*arrays: np.ndarray):
    import torch

    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def _stand_in(monkeypatch, module, name: str, reference, seen: list) -> None:
    """Replace ``module.name`` (the adapter's launch at a built head dimension) by the
    reference, recording the arguments it is given."""

    def run(xp, config=None, keep=None, **kw):  # keep: the dense adapter's kept launches
        seen.append(kw)
        return reference(xp, **kw)

    monkeypatch.setattr(module, name, run)


def _assert_padded(seen: dict, names: tuple[str, ...], width: int) -> None:
    for name in names:
        a = seen[name]
        # rows as the kernels read them (out may be a wider forward's output, sliced)
        assert a.shape[-1] == width and a.stride(-1) == 1, (name, tuple(a.shape))
        assert (a.stride(-2) * a.element_size()) % 16 == 0, name


CAPABILITIES = [80, 90]
"""Compute capabilities the dense adapter is run as on (its device query stood in for): the
mma.sync kernels alone, and beside them the Hopper forward, which takes its own widths."""


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize(("d", "dv"), [*PAIRS, (64, 64), (96, 96)])
def test_dense_adapter_pads_and_slices(monkeypatch, torch_xp, d, dv, capability) -> None:
    from softmaxkit_cupy import attention as adapter

    monkeypatch.setattr(adapter, "_capability_of", lambda device: capability)
    seen: list = []
    _stand_in(monkeypatch, adapter, "_attention", dense_ref.attention, seen)
    _stand_in(monkeypatch, adapter, "_attention_vjp", dense_ref.attention_vjp, seen)
    q, k, v = _dense(d, d, dv)
    mask = _mask()
    scale = 0.3  # not d ** -0.5, nor the padded width's: the adapter passes it as given
    opts = {"scale": scale, "causal": "bottom_right", "window": (3, -1), "mask": mask,
            "softcap": 4.0}
    out, lse = dense_ref.attention(xp, q=q, k=k, v=v, return_lse=True, **opts)
    dout = np.random.default_rng(3).normal(size=out.shape)
    tq, tk, tv, tmask, tdout = _torch(q, k, v, mask, dout)
    got_out, got_lse = adapter.attention(torch_xp, q=tq, k=tk, v=tv, return_lse=True,
                                         **dict(opts, mask=tmask))
    np.testing.assert_allclose(got_out.numpy(), out, **CLOSE)
    np.testing.assert_allclose(got_lse.numpy(), lse, **CLOSE)
    grads = dense_ref.attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, **opts)
    got = adapter.attention_vjp(torch_xp, q=tq, k=tk, v=tv, out=got_out, lse=got_lse,
                                dout=tdout, **dict(opts, mask=tmask))
    for name, g, e in zip(("dq", "dk", "dv"), got, grads, strict=True):
        assert tuple(g.shape) == e.shape, name
        np.testing.assert_allclose(g.numpy(), e, err_msg=name, **CLOSE)
    forward, backward = seen
    assert forward["scale"] == backward["scale"] == scale
    width = head_dims.served_head_dim(d, dv)
    # on Hopper: at the Hopper kernels' next width if any (a masked forward: up to 128)
    hopper = capability == 90
    forward_width = (hopper and head_dims.sm90_width(d, dv, SM90_MASKED_CONFIGS)) or width
    backward_width = (hopper and head_dims.sm90_width(
        d, dv, SM90_BACKWARD_MASKED_CONFIGS, head_dims.SM90_BACKWARD_PADDED_FROM)) or width
    if d == dv == forward_width:  # built: the caller's arrays, no copy
        assert forward["q"] is tq and forward["k"] is tk and forward["v"] is tv
    else:
        _assert_padded(forward, ("q", "k", "v"), forward_width)
    if d == dv == backward_width:
        assert backward["q"] is tq and backward["dout"] is tdout
    else:
        _assert_padded(backward, ("q", "k", "v", "out", "dout"), backward_width)


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize(("d", "dv"), [*PAIRS, (96, 96)])
def test_varlen_adapter_pads_and_slices(monkeypatch, torch_xp, d, dv, capability) -> None:
    from softmaxkit_cupy import attention as dense
    from softmaxkit_cupy import varlen as adapter

    monkeypatch.setattr(dense, "_capability_of", lambda device: capability)
    seen: list = []
    _stand_in(monkeypatch, adapter, "_varlen_attention", varlen_ref.varlen_attention, seen)
    _stand_in(monkeypatch, adapter, "_varlen_attention_vjp", varlen_ref.varlen_attention_vjp,
              seen)
    q, k, v, cu_q, cu_k = _packed(d, d, dv)
    opts = {"scale": 0.2, "causal": "bottom_right", "window": (-1, -1), "softcap": None}
    out, lse = varlen_ref.varlen_attention(xp, q=q, k=k, v=v, cu_seqlens_q=cu_q,
                                           cu_seqlens_k=cu_k, return_lse=True, **opts)
    tq, tk, tv, tcu_q, tcu_k = _torch(q, k, v, cu_q, cu_k)
    got_out, got_lse = adapter.varlen_attention(torch_xp, q=tq, k=tk, v=tv, cu_seqlens_q=tcu_q,
                                                cu_seqlens_k=tcu_k, return_lse=True, **opts)
    np.testing.assert_allclose(got_out.numpy(), out, **CLOSE)
    np.testing.assert_allclose(got_lse.numpy(), lse, **CLOSE)
    dout = np.random.default_rng(4).normal(size=out.shape)
    grads = varlen_ref.varlen_attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout,
                                            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **opts)
    got = adapter.varlen_attention_vjp(torch_xp, q=tq, k=tk, v=tv, out=got_out, lse=got_lse,
                                       dout=_torch(dout)[0], cu_seqlens_q=tcu_q,
                                       cu_seqlens_k=tcu_k, **opts)
    for name, g, e in zip(("dq", "dk", "dv"), got, grads, strict=True):
        assert tuple(g.shape) == e.shape, name
        np.testing.assert_allclose(g.numpy(), e, err_msg=name, **CLOSE)
    width = head_dims.served_head_dim(d, dv)
    # on Hopper: at the Hopper kernels' next width if any
    hopper = capability == 90
    forward_width = (hopper and head_dims.sm90_width(d, dv, SM90_CONFIGS)) or width
    backward_width = (hopper and head_dims.sm90_width(
        d, dv, SM90_VARLEN_BACKWARD_CONFIGS, head_dims.SM90_BACKWARD_PADDED_FROM)) or width
    forward, backward = seen
    assert forward["scale"] == backward["scale"] == 0.2
    if d == dv == forward_width:
        assert forward["q"] is tq
    else:
        _assert_padded(forward, ("q", "k", "v"), forward_width)
    if d == dv == backward_width:
        assert backward["q"] is tq
    else:
        _assert_padded(backward, ("q", "k", "v", "out", "dout"), backward_width)


@pytest.mark.parametrize(("d", "dv"), [*PAIRS, (128, 128)])
def test_paged_adapter_pads_the_pools_and_slices(monkeypatch, torch_xp, d, dv) -> None:
    from softmaxkit_cupy import paged as adapter

    seen: list = []
    _stand_in(monkeypatch, adapter, "_paged_attention", paged_ref.paged_attention, seen)
    q, k_pages, v_pages, table, lens = _paged(d, d, dv, 2)
    opts = {"scale": 0.7, "causal": "bottom_right", "window": (-1, -1), "softcap": None}
    out, lse = paged_ref.paged_attention(xp, q=q, k_pages=k_pages, v_pages=v_pages,
                                         block_table=table, seqlens=lens, return_lse=True,
                                         **opts)
    tq, tk, tv, ttable, tlens = _torch(q, k_pages, v_pages, table, lens)
    got_out, got_lse = adapter.paged_attention(torch_xp, q=tq, k_pages=tk, v_pages=tv,
                                               block_table=ttable, seqlens=tlens,
                                               return_lse=True, **opts)
    np.testing.assert_allclose(got_out.numpy(), out, **CLOSE)
    np.testing.assert_allclose(got_lse.numpy(), lse, **CLOSE)
    (call,) = seen
    assert call["scale"] == 0.7
    width = head_dims.served_head_dim(d, dv)
    if d == dv == width:
        assert call["k_pages"] is tk and call["v_pages"] is tv and call["q"] is tq
    else:
        _assert_padded(call, ("q", "k_pages", "v_pages"), width)


# ---- calls without work at padded head dimensions: no launch, shapes at D and Dv -----------

def _numpy(a):
    import torch

    return a.to(torch.float64).numpy()


@pytest.mark.parametrize(("d", "dv"), [(192, 128), (40, 40), (128, 192)])
@pytest.mark.parametrize(("lq", "lk"), [(0, 5), (3, 0), (0, 0)])
def test_dense_calls_without_work_at_padded_dims(torch_xp, d, dv, lq, lk) -> None:
    import torch
    from softmaxkit_cupy import attention as adapter

    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=s) for s in ((1, 4, lq, d), (1, 2, lk, d), (1, 2, lk, dv))]
    q, k, v = (torch.from_numpy(a).to(torch.bfloat16) for a in arrays)
    opts = {"scale": 0.125, "causal": None, "window": (-1, -1), "mask": None, "softcap": None}
    out, lse = adapter.attention(torch_xp, q=q, k=k, v=v, return_lse=True, **opts)
    e_out, e_lse = sk.attention(*map(_numpy, (q, k, v)), scale=0.125, return_lse=True,
                                backend="reference")
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == e_out.shape == (1, 4, lq, dv)
    np.testing.assert_array_equal(_numpy(out), e_out)
    np.testing.assert_array_equal(lse.numpy(), e_lse)
    dout = torch.ones_like(out)
    grads = adapter.attention_vjp(torch_xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout,
                                  **opts)
    for g, a in zip(grads, (q, k, v), strict=True):
        assert g.shape == a.shape and g.dtype == a.dtype and not bool(g.any())


@pytest.mark.parametrize(("d", "dv"), [(192, 128), (40, 40), (128, 192)])
@pytest.mark.parametrize(("lens_q", "lens_k"), [((0, 0), (5, 3)), ((4, 2), (0, 0))])
def test_varlen_calls_without_work_at_padded_dims(torch_xp, d, dv, lens_q, lens_k) -> None:
    import torch
    from softmaxkit_cupy import varlen as adapter

    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int64)
                  for n in (lens_q, lens_k))
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = (torch.randn(s).to(torch.bfloat16) for s in ((tq, 4, d), (tk, 2, d), (tk, 2, dv)))
    opts = {"scale": 0.125, "causal": "bottom_right", "window": (-1, -1), "softcap": None}
    out, lse = adapter.varlen_attention(torch_xp, q=q, k=k, v=v, cu_seqlens_q=cu_q,
                                        cu_seqlens_k=cu_k, return_lse=True, **opts)
    e_out, e_lse = sk.varlen_attention(*map(_numpy, (q, k, v)), cu_q.numpy(), cu_k.numpy(),
                                       causal=True, scale=0.125, return_lse=True,
                                       backend="reference")
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == e_out.shape == (tq, 4, dv)
    np.testing.assert_array_equal(_numpy(out), e_out)
    np.testing.assert_array_equal(lse.numpy(), e_lse)
    grads = adapter.varlen_attention_vjp(torch_xp, q=q, k=k, v=v, out=out, lse=lse,
                                         dout=torch.ones_like(out), cu_seqlens_q=cu_q,
                                         cu_seqlens_k=cu_k, **opts)
    for g, a in zip(grads, (q, k, v), strict=True):
        assert g.shape == a.shape and g.dtype == a.dtype and not bool(g.any())


@pytest.mark.parametrize(("d", "dv"), [(192, 128), (40, 40), (128, 192)])
@pytest.mark.parametrize(("lq", "max_pages"), [(0, 3), (2, 0)])
def test_paged_calls_without_work_at_padded_dims(torch_xp, d, dv, lq, max_pages) -> None:
    import torch
    from softmaxkit_cupy import paged as adapter

    q = torch.randn((2, 4, lq, d)).to(torch.bfloat16)
    k_pages, v_pages = (torch.randn((5, 2, 4, n)).to(torch.bfloat16) for n in (d, dv))
    table = torch.zeros((2, max_pages), dtype=torch.int32)
    lens = torch.zeros((2,), dtype=torch.int32)
    out, lse = adapter.paged_attention(torch_xp, q=q, k_pages=k_pages, v_pages=v_pages,
                                       block_table=table, seqlens=lens, scale=0.125,
                                       causal="bottom_right", window=(-1, -1), softcap=None,
                                       return_lse=True)
    e_out, e_lse = sk.paged_attention(*map(_numpy, (q, k_pages, v_pages)), table.numpy(),
                                      lens.numpy(), causal=True, scale=0.125, return_lse=True,
                                      backend="reference")
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == e_out.shape == (2, 4, lq, dv)
    np.testing.assert_array_equal(_numpy(out), e_out)
    np.testing.assert_array_equal(lse.numpy(), e_lse)


# ---- the manifest serves them -------------------------------------------------------------

def _arrays(torch, shapes, dtype=None):
    return [torch.zeros(s, dtype=dtype or torch.bfloat16) for s in shapes]


def _calls(torch, d: int, dv: int) -> dict[str, Call]:
    """One call of each padded operation at (d, dv), CPU tensors standing in for CUDA ones."""
    q, k, v = _arrays(torch, ((1, 4, 8, d), (1, 2, 9, d), (1, 2, 9, dv)))
    out, dout = _arrays(torch, ((1, 4, 8, dv),) * 2)
    lse = torch.zeros((1, 4, 8))
    pq, pk, pv = _arrays(torch, ((2, 4, 1, d), (5, 2, 4, d), (5, 2, 4, dv)))
    cq, ck, cv = _arrays(torch, ((7, 4, d), (9, 2, d), (9, 2, dv)))
    c_out, c_dout = _arrays(torch, ((7, 4, dv),) * 2)
    cu_q, cu_k = torch.tensor([0, 3, 7]), torch.tensor([0, 4, 9])
    packed = {"q": cq, "k": ck, "v": cv, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    args = {
        "attention": {"q": q, "k": k, "v": v, "mask": None},
        "attention_vjp": {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout,
                          "mask": None},
        "varlen_attention": packed,
        "varlen_attention_vjp": dict(packed, out=c_out, dout=c_dout,
                                     lse=torch.zeros((7, 4))),
        "paged_attention": {"q": pq, "k_pages": pk, "v_pages": pv,
                            "block_table": torch.zeros((2, 3), dtype=torch.int32),
                            "seqlens": torch.tensor([3, 9], dtype=torch.int32)},
    }
    return {op: Call(op, None, "cuda", "bfloat16", a) for op, a in args.items()}


@pytest.mark.parametrize(("d", "dv"), [*PAIRS, (112, 112), (1, 1), (256, 256), (256, 1)])
def test_can_run_accepts_every_head_dim_up_to_256(monkeypatch, d, dv) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(mf, "_library", lambda a: "torch")
    for op, call in _calls(torch, d, dv).items():
        assert mf.can_run(call) is True, (op, mf.can_run(call))


@pytest.mark.parametrize(("d", "dv"), [(264, 264), (128, 300), (257, 64)])
def test_can_run_declines_head_dims_above_256_naming_them(monkeypatch, d, dv) -> None:
    """D above 256 is declined everywhere; Dv above 256 only by paged attention (the dense and
    packed operations run it in blocks of value columns)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(mf, "_library", lambda a: "torch")
    for op, call in _calls(torch, d, dv).items():
        verdict = mf.can_run(call)
        if d <= 256 and op != "paged_attention":
            assert verdict is True, (op, verdict)
            continue
        assert isinstance(verdict, str) and f"D={d}" in verdict and f"Dv={dv}" in verdict, (
            op, verdict)


@pytest.mark.parametrize(("d", "dv", "blocks"), [
    (64, 256, None), (64, 257, [(0, 129), (129, 257)]), (256, 512, [(0, 256), (256, 512)]),
    (8, 600, [(0, 200), (200, 400), (400, 600)]), (257, 300, None), (0, 300, None),
])
def test_value_blocks(d, dv, blocks) -> None:
    assert head_dims.value_blocks(d, dv) == blocks


@pytest.mark.parametrize(("d", "dv"), [(64, 300), (256, 257), (40, 520)])
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_dense_adapter_runs_value_dims_above_256_in_blocks(monkeypatch, torch_xp, d, dv,
                                                           capability) -> None:
    """Forward and gradient at Dv > 256: a kernel call per block of value columns (the
    reference standing in for the kernels), each at a built head dimension, results equal
    the reference's on the whole call (float64)."""
    import torch
    from softmaxkit_cupy import attention as adapter

    monkeypatch.setattr(adapter, "_capability_of", lambda device: capability)
    seen: list = []
    _stand_in(monkeypatch, adapter, "_attention", dense_ref.attention, seen)
    _stand_in(monkeypatch, adapter, "_attention_vjp", dense_ref.attention_vjp, seen)
    rng = np.random.default_rng(dv)
    q, k, v = (rng.normal(size=s) for s in ((1, 4, 9, d), (1, 2, 11, d), (1, 2, 11, dv)))
    opts = {"scale": 0.3, "causal": "bottom_right", "window": (-1, -1), "mask": None,
            "softcap": 7.0}
    out, lse = dense_ref.attention(xp, q=q, k=k, v=v, return_lse=True, **opts)
    dout = rng.normal(size=out.shape)
    grads = dense_ref.attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout, **opts)
    tq, tk, tv, tout, tlse, tdout = _torch(q, k, v, out, lse, dout)
    got_out, got_lse = adapter.attention(torch_xp, q=tq, k=tk, v=tv, return_lse=True, **opts)
    np.testing.assert_allclose(got_out.numpy(), out, **CLOSE)
    np.testing.assert_allclose(got_lse.numpy(), lse, **CLOSE)
    got = adapter.attention_vjp(torch_xp, q=tq, k=tk, v=tv, out=tout, lse=tlse, dout=tdout,
                                **opts)
    for g, w in zip(got, grads, strict=True):
        assert g.dtype == torch.float64 and tuple(g.shape) == w.shape
        np.testing.assert_allclose(g.numpy(), w, **CLOSE)
    blocks = head_dims.value_blocks(d, dv)
    assert len(seen) == 2 * len(blocks)
    assert all(call["v"].shape[-1] in ATTENTION_HEAD_DIMS for call in seen)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_varlen_adapter_runs_value_dims_above_256_in_blocks(monkeypatch, torch_xp,
                                                            capability) -> None:
    from softmaxkit_cupy import attention as dense
    from softmaxkit_cupy import varlen as adapter

    monkeypatch.setattr(dense, "_capability_of", lambda device: capability)
    seen: list = []
    _stand_in(monkeypatch, adapter, "_varlen_attention", varlen_ref.varlen_attention, seen)
    _stand_in(monkeypatch, adapter, "_varlen_attention_vjp", varlen_ref.varlen_attention_vjp,
              seen)
    rng = np.random.default_rng(5)
    cu_q, cu_k = np.array([0, 3, 3, 10]), np.array([0, 4, 9, 9])
    q, k, v = (rng.normal(size=s) for s in ((10, 4, 64), (9, 2, 64), (9, 2, 300)))
    opts = {"scale": 0.4, "causal": "bottom_right", "window": (-1, -1), "softcap": None}
    meta = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    out, lse = varlen_ref.varlen_attention(xp, q=q, k=k, v=v, return_lse=True, **meta, **opts)
    dout = rng.normal(size=out.shape)
    grads = varlen_ref.varlen_attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout,
                                            **meta, **opts)
    tq, tk, tv, tout, tlse, tdout, tcq, tck = _torch(q, k, v, out, lse, dout, cu_q, cu_k)
    tmeta = {"cu_seqlens_q": tcq, "cu_seqlens_k": tck}
    got_out, got_lse = adapter.varlen_attention(torch_xp, q=tq, k=tk, v=tv, return_lse=True,
                                                **tmeta, **opts)
    np.testing.assert_allclose(got_out.numpy(), out, **CLOSE)
    np.testing.assert_allclose(got_lse.numpy(), lse, **CLOSE)
    got = adapter.varlen_attention_vjp(torch_xp, q=tq, k=tk, v=tv, out=tout, lse=tlse,
                                       dout=tdout, **tmeta, **opts)
    for g, w in zip(got, grads, strict=True):
        np.testing.assert_allclose(g.numpy(), w, **CLOSE)
    assert len(seen) == 4  # two blocks, forward and gradient


def test_kit_attention_cases_at_padded_head_dims_are_accepted(monkeypatch) -> None:
    """``can_run`` accepts every dense, packed and paged attention case of the kit in the
    kernels' dtypes at (D, Dv) = (192, 128) and (40, 40) (the kit's cases with a value
    dimension of their own take the first pair, the others the first with D = Dv): CPU
    tensors stand in for CUDA ones and the reference computes, so this checks the reasons,
    not the kernels."""
    pytest.importorskip("torch")
    from softmaxkit_cupy.configs import ATTENTION_DTYPES

    from softmaxkit import registry
    from softmaxkit.testing import check_backend

    modules = {"attention": "attention", "attention_vjp": "attention",
               "varlen_attention": "varlen", "varlen_attention_vjp": "varlen",
               "paged_attention": "paged"}
    monkeypatch.setattr(mf, "_library", lambda a: "torch")
    registry.register({
        "name": "cupy-padded-reasons",
        "serves": [{"ops": list(modules), "devices": ["cpu"]}],
        "kernels": {op: f"softmaxkit.reference.{m}:{op}" for op, m in modules.items()},
        "can_run": "softmaxkit_cupy.manifest:can_run",
    })
    try:
        results = check_backend("cupy-padded-reasons", target="torch-cpu", ops=tuple(modules),
                                dtypes=ATTENTION_DTYPES, head_dims=[(192, 128), (40, 40)])
    finally:
        registry.unregister("cupy-padded-reasons")
    assert {op for r in results for op in r.ops} == set(modules)
    left = [f"{r.case}[{r.dtype}]: {r.status} {r.message}" for r in results
            if r.status != "passed"]
    assert not left, "\n".join(left)


@pytest.mark.parametrize(("d", "dv", "plain", "masked", "backward"), [
    (16, 24, 32, 32, 32),         # Hopper tiles at 32 (panels of 32 columns)
    (32, 32, 32, 32, 32),
    (40, 40, 64, 64, 64),         # mma.sync would pad to 64 too
    (80, 80, None, None, None),   # mma.sync at 80
    (96, 96, 96, 96, 96),         # Hopper tiles at 96
    (112, 112, 128, 128, 128),
    (160, 160, 192, None, 192),   # no masked Hopper forward above 128; padded to 192
    (192, 128, 192, None, 192),
    (256, 256, 256, None, 256),
])
def test_sm90_width_pads_where_the_hopper_kernels_are_faster(d, dv, plain, masked,
                                                             backward) -> None:
    assert head_dims.sm90_width(d, dv, SM90_CONFIGS) == plain
    assert head_dims.sm90_width(d, dv, SM90_MASKED_CONFIGS) == masked
    for built in (SM90_BACKWARD_CONFIGS, SM90_BACKWARD_MASKED_CONFIGS):
        assert head_dims.sm90_width(d, dv, built, head_dims.SM90_BACKWARD_PADDED_FROM) == backward
    # the packed backward, on the same tiles
    packed = head_dims.sm90_width(d, dv, SM90_VARLEN_BACKWARD_CONFIGS,
                                  head_dims.SM90_BACKWARD_PADDED_FROM)
    assert packed == backward
