"""The attention kernels at head dimensions they are not built for, on a CUDA device (skipped
without one).

``backend="cupy"`` runs these calls on zero-padded copies (``softmaxkit_cupy/head_dims.py``):
value dimensions other than the key dimension (multi-head latent attention's D = 192, Dv = 128
and the reverse) and head dimensions between the built ones (40 at 64, 112 at 128).  Dense,
packed variable-length and paged attention, forward and backward where there is one, are
checked in bfloat16 on random data against the float64 definition on the represented inputs,
under the kit's attention tolerances (spec "Attention tolerances").  The caching allocator's
next blocks are filled with NaN first (the API takes no output arrays), so a result or work
array a kernel fails to write shows up as NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)

PAIRS = [(192, 128), (128, 192), (40, 40), (112, 112)]
"""(D, Dv): run at P = 192, 192, 64 and 128."""

DTYPE = "bfloat16"


@pytest.fixture(scope="module")
def t():
    pytest.importorskip("torch")
    from softmaxkit.testing.kit import target

    return target("torch-cuda")


def _poison(*shapes: tuple[tuple[int, ...], str]) -> None:
    """Fill the caching allocator's next blocks of these shapes and dtypes with NaN."""
    import torch

    junk = [torch.full(shape, math.nan, dtype=getattr(torch, dtype), device="cuda")
            for shape, dtype in shapes]
    del junk


def _poison_like(rows: int, d: int, dv: int) -> None:
    """NaN in blocks the size of a call's padded results and work arrays: ``rows`` query rows,
    the output at D, Dv and the width they run at, float32 rows and dq sums."""
    from softmaxkit_cupy.head_dims import served_head_dim, value_blocks

    # a value dim above 256 runs in blocks, each at the width its block is served at
    blocks = value_blocks(d, dv) or [(0, dv)]
    width = max(served_head_dim(d, stop - start) for start, stop in blocks)
    _poison(*(((rows, n), DTYPE) for n in (d, dv, width)),
            ((rows,), "float32"), ((rows + 8 * 128, width), "float32"))


def _causal(kw: dict) -> dict:
    """The options in the float64 definition's spelling."""
    return dict(kw, causal={False: None, True: "bottom_right"}.get(kw.get("causal", False),
                                                                   kw.get("causal")))


DENSE = [
    # (B, Hq, Hk, Lq, Lk, options): tiles with grouped heads and ragged edges, a boolean mask
    # with softcap, a window, and split-KV decoding ((Hq / Hk) * Lq <= 16, Lk >= 256)
    (1, 4, 2, 150, 201, {"causal": True}),
    (1, 2, 2, 70, 130, {"mask": True, "softcap": 3.0}),
    (1, 2, 1, 100, 300, {"causal": "top_left", "window": (40, 10)}),
    (2, 8, 2, 1, 700, {}),
    (1, 4, 1, 3, 500, {"causal": True, "mask": True}),
]


def _mask(b: int, hq: int, lq: int, lk: int) -> np.ndarray:
    mask = np.random.default_rng(7).random((b, hq, lq, lk)) < 0.5
    mask[:, :, min(3, lq - 1)] = False  # a query row with no allowed key
    return mask


WIDE_VALUES = [(64, 320), (256, 257)]
"""(D, Dv) with Dv above 256: blocks of value columns, a call each (257: an lse cotangent's
widened value column at Dv = 256)."""


@pytest.mark.parametrize(("d", "dv"), PAIRS + WIDE_VALUES)
@pytest.mark.parametrize("case", DENSE, ids=str)
def test_dense_forward_and_backward(t, d, dv, case) -> None:
    import softmaxkit as sk
    from softmaxkit.dtypes import accumulator_name
    from softmaxkit.testing import materialized as ref
    from softmaxkit.testing.attention_cases import check_forward, check_grads

    b, hq, hk, lq, lk, kw = case
    rng = np.random.default_rng(d * 1000 + dv + lq)
    shapes = ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, dv), (b, hq, lq, dv))
    q, k, v, dout = (t.asarray(rng.normal(size=s), DTYPE) for s in shapes)
    q64, k64, v64, dout64 = (t.to_numpy(a) for a in (q, k, v, dout))
    mask = _mask(b, hq, lq, lk) if kw.get("mask") else None
    opts = dict(kw, mask=None if mask is None else t.asarray(mask, None))
    rkw = dict(_causal(kw), mask=mask)
    what = f"attention D={d} Dv={dv} {case}"

    _poison_like(b * hq * lq, d, dv)
    got = sk.attention(q, k, v, return_lse=True, backend="cupy", **opts)
    assert tuple(got[0].shape) == (b, hq, lq, dv)
    expected = ref.attention(q64, k64, v64, **rkw)
    check_forward(t, DTYPE, got, expected, what)

    # the backward from the float64 definition's (out, lse), as the kit does
    out, lse = t.asarray(expected[0], DTYPE), t.asarray(expected[1], accumulator_name(DTYPE))
    _poison_like(b * hq * lq, d, dv)
    grads = sk.attention_vjp(q, k, v, out, lse, dout, backend="cupy", **opts)
    check_grads(t, DTYPE, grads, ref.attention_vjp(q64, k64, v64, dout64, **rkw),
                f"{what} backward")
    if mask is not None:  # the row with no allowed key
        assert np.all(t.to_numpy(grads[0])[:, :, min(3, lq - 1)] == 0), what


LENGTHS = ((70, 0, 130, 1, 64), (130, 9, 64, 0, 200))
"""Query and key lengths of the packed batch: ragged tiles, a sequence without queries and
one without keys."""


@pytest.mark.parametrize(("d", "dv"), PAIRS + WIDE_VALUES)
@pytest.mark.parametrize("kw", [{"causal": True}, {"window": (30, 5), "softcap": 4.0}],
                         ids=str)
def test_varlen_forward_and_backward(t, d, dv, kw) -> None:
    import softmaxkit as sk
    from softmaxkit.dtypes import accumulator_name
    from softmaxkit.testing.attention_cases import check_forward, check_grads
    from softmaxkit.testing.varlen_cases import (
        packed_arrays,
        packed_reference,
        packed_vjp_reference,
    )

    hq, hk = 4, 2
    arrays = packed_arrays(d + dv, *LENGTHS, hq, hk, d, dv)
    q, k, v = (t.asarray(a, DTYPE) for a in arrays[:3])
    q64, k64, v64 = (t.to_numpy(a) for a in (q, k, v))
    cu_q, cu_k = arrays[3:]
    mq, mk = t.asarray(cu_q, None), t.asarray(cu_k, None)
    rkw = _causal(kw)
    what = f"varlen_attention D={d} Dv={dv} {kw}"

    _poison_like(q.shape[0] * hq, d, dv)
    got = sk.varlen_attention(q, k, v, mq, mk, return_lse=True, backend="cupy", **kw)
    assert tuple(got[0].shape) == (q.shape[0], hq, dv)
    expected = packed_reference(q64, k64, v64, cu_q, cu_k, **rkw)
    check_forward(t, DTYPE, got, expected, what)

    dout = t.asarray(np.random.default_rng(3).normal(size=(q.shape[0], hq, dv)), DTYPE)
    dout64 = t.to_numpy(dout)
    out, lse = t.asarray(expected[0], DTYPE), t.asarray(expected[1], accumulator_name(DTYPE))
    _poison_like(q.shape[0] * hq, d, dv)
    grads = sk.varlen_attention_vjp(q, k, v, out, lse, dout, mq, mk, backend="cupy", **kw)
    want = packed_vjp_reference(q64, k64, v64, dout64, cu_q, cu_k, **rkw)
    check_grads(t, DTYPE, grads, want, f"{what} backward")
    k0, k1 = int(cu_k[1]), int(cu_k[2])  # the keys of the sequence without queries
    assert np.all(t.to_numpy(grads[1])[k0:k1] == 0) and np.all(t.to_numpy(grads[2])[k0:k1] == 0)


PAGED = [
    # (seqlens, page size, Hq, Hk, Lq, options): decoding, a chunked prefill of 16 rows per
    # key head, one of 36 (beyond the decode kernel: the dense kernels on the gathered pages),
    # a sliding window over a long cache; an empty sequence in each
    ([700, 0, 33], 16, 8, 2, 1, {}),
    ([300, 5, 0], 16, 8, 2, 4, {"causal": True}),
    ([300, 5, 0], 16, 8, 2, 9, {"causal": True}),
    ([1500, 0, 260], 64, 4, 1, 2, {"causal": True, "window": (200, -1), "softcap": 5.0}),
]


@pytest.mark.parametrize(("d", "dv"), PAIRS)
@pytest.mark.parametrize("case", PAGED, ids=str)
def test_paged_attention(t, d, dv, case) -> None:
    import softmaxkit as sk
    from softmaxkit.testing.attention_cases import check_forward
    from softmaxkit.testing.paged_cases import make_cache, paged_definition

    seqlens, page_size, hq, hk, lq, kw = case
    rng = np.random.default_rng(d + 3 * dv + lq)
    # NaN in every slot no sequence uses: the kernel must not read them
    k64, v64, table, lens = make_cache(rng, seqlens, page_size, hk, d, dv)
    b = len(seqlens)
    q, kp, vp = (t.asarray(a, DTYPE) for a in (rng.normal(size=(b, hq, lq, d)), k64, v64))
    q64, k64, v64 = (t.to_numpy(a) for a in (q, kp, vp))
    what = f"paged_attention D={d} Dv={dv} {case}"
    _poison_like(b * hq * lq, d, dv)
    got = sk.paged_attention(q, kp, vp, t.asarray(table, None), t.asarray(lens, None),
                             return_lse=True, backend="cupy", **kw)
    assert tuple(got[0].shape) == (b, hq, lq, dv)
    check_forward(t, DTYPE, got, paged_definition(q64, k64, v64, table, lens, **kw), what)


SM86_SHARED = 99 * 1024
"""The shared memory a block may take on compute capability 8.6, 8.9 and 12.0."""

FITTING_DIMS = [96, 128, 160, 192, 256]
"""The head dimensions whose default forward, decode or backward tiles exceed 99 KB."""


@pytest.fixture
def small_device(monkeypatch):
    """The device at hand taken for one of compute capability 8.6 with 99 KB of shared memory
    a block: the mma.sync kernels on the tiles that fit there (configs.FITTING_*) run on it."""
    from softmaxkit_cupy import interop

    monkeypatch.setattr(interop, "capability", lambda device: 86)
    monkeypatch.setattr(interop, "shared_limit", lambda device: SM86_SHARED)


@pytest.mark.parametrize("d", FITTING_DIMS)
def test_a_small_device_runs_the_fitting_tiles(small_device, t, d) -> None:
    """The kernels a call runs on such a device are the fitting ones (traced), not declined."""
    from softmaxkit_cupy.configs import attention_config, backward_config

    import softmaxkit as sk

    rng = np.random.default_rng(d)
    q, k, v = (t.asarray(rng.normal(size=(1, 4, 130, d)), DTYPE) for _ in range(3))
    with sk.backend_opts(trace=True) as trace:
        out, lse = sk.attention(q, k, v, return_lse=True, backend="cupy")
        sk.attention_vjp(q, k, v, out, lse, out, backend="cupy")
    kernels = [r.kernel for r in trace]
    assert kernels[0] == attention_config(d, False, SM86_SHARED).name(DTYPE), kernels
    assert backward_config(d, SM86_SHARED).name(DTYPE) in kernels[1:], kernels


@pytest.mark.parametrize("d", FITTING_DIMS)
@pytest.mark.parametrize("case", DENSE, ids=str)
def test_dense_on_the_fitting_tiles(small_device, t, d, case) -> None:
    test_dense_forward_and_backward(t, d, d, case)


@pytest.mark.parametrize("d", FITTING_DIMS)
@pytest.mark.parametrize("kw", [{"causal": True}, {"window": (30, 5), "softcap": 4.0}],
                         ids=str)
def test_varlen_on_the_fitting_tiles(small_device, t, d, kw) -> None:
    test_varlen_forward_and_backward(t, d, d, kw)


@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("case", PAGED, ids=str)
def test_paged_on_the_fitting_tiles(small_device, t, d, case) -> None:
    test_paged_attention(t, d, d, case)
