"""The 16-bit (bfloat16, float16) attention on mma.sync tensor cores (kernels/attention.cu,
kernels/attention_bwd.cu) run on the CPU (tests/host/emulation.h: each CUDA thread a fiber,
shared memory filled with NaN first; tests/host/primitives.h: mma.sync m16n8k16 with
bfloat16 and float16 operands and ldmatrix emulated, the warp's lanes exchanging their
operands in the PTX ISA's fragment layouts; tests/host/cuda_bf16.h and cuda_fp16.h: the
16-bit types and their conversions).

Checked here: the emulated primitives against numpy (the conversions to and from 16 bits
against numpy's float16 and a rounding by value, the mma against a float64 product of its
operands given in the PTX layout); the declared forward tiles (``sk_attn_fwd``,
:data:`~softmaxkit_cupy.configs.ATTENTION_CONFIGS` and
:data:`~softmaxkit_cupy.configs.UNMASKED_CONFIGS`) in both dtypes, launched as the adapter
launches them into results that held NaN, against the float64 definition on the represented
inputs within the tolerances of the GPU test (the conformance kit, backends/cupy/tests/
test_gpu.py: :data:`softmaxkit.testing.attention_cases.ATTENTION_TOLERANCES`), over causal
alignments, grouped queries, rows with no key, windows, soft caps, boolean masks and ragged
tiles; the forward and the packed variable-length forward (``sk_attn_fwd_varlen``) through
their adapters on torch CPU tensors; split-KV decoding, dense (``sk_attn_decode``, through
``attention``) and paged (``sk_attn_decode_paged``, through ``paged_attention``, pages at
shuffled places of a pool whose unused slots hold NaN), each with two splits merged by
``sk_merge_attn``, and a long chunked prefill on the dense kernels over the gathered pages;
``merge_attention`` (``sk_merge_attn``) of 16-bit and float32 partial states against the
float64 merge; the backward (``sk_attn_bwd_pre``, ``sk_attn_bwd``, ``sk_attn_bwd_dq``) and
the packed variable-length backward (``sk_attn_bwd_pre_varlen``, ``sk_attn_bwd_varlen``,
``sk_attn_bwd_dq_varlen``) through their adapters on torch CPU tensors, against the float64
gradients within the kit's tolerances.  The adapters see a device of compute capability 8.0
with 163 KB of shared memory a block and 108 multiprocessors (an A100), so they pick the
mma.sync kernels and split-KV decoding splits as it would there; the Hopper kernels (sm_90a
wgmma) run on the host in tests/test_sm90_host.py.

The emulated mma sums in double and rounds once toward zero, where the device truncates its
float32 sums step by step: the results are held to the tolerances the device's are held to,
but are not the device's bit for bit; what the device adds (its sums' rounding, timing, its
own orderings) is the GPU test's.

Run: ``python -m pytest -q backends/cupy/tests/test_attention_host.py``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from host_attention import (
    BACKWARD_CASES,
    CASES,
    address,
    bits16,
    case_id,
    cotangents,
    inputs,
    launch_forward,
    move_to_host,
    options,
    represented,
    rounded_by_value,
    toward_zero,
    widen16,
)
from softmaxkit_cupy.attention import (
    BACKWARD_DQ_PARAMS,
    BACKWARD_PARAMS,
    BACKWARD_PRE_PARAMS,
    FORWARD_PARAMS,
)
from softmaxkit_cupy.configs import (
    ATTENTION_CONFIGS,
    ATTENTION_DTYPES,
    BACKWARD_CONFIGS,
    UNMASKED_CONFIGS,
    AttentionConfig,
    backward_dq_name,
    backward_pre_name,
    varlen_config,
)
from softmaxkit_cupy.varlen import VARLEN_PARAMS

from softmaxkit.testing import materialized as ref
from softmaxkit.testing.attention_cases import ATTENTION_TOLERANCES

A100 = (80, 163 * 1024)
"""The device the adapters see: compute capability 8.0 (the mma.sync kernels), and the shared
memory a block may take there."""

A100_MULTIPROCESSORS = 108
"""The A100's multiprocessors, from which the split-KV decode chooses its splits."""

# --- the primitives ---------------------------------------------------------------------------

SNIPPET = r"""
// One warp: d = a b + c, a [16 x 16] and b [16 x 8] row-major 16-bit bits, c, d [16 x 8]
// row-major float, given to SkMma<T>::run in the fragments of the PTX ISA's m16n8k16 layout
// (each register two elements, the first in its low half).
template <typename T>
__global__ void sk_check_mma(const unsigned short* a, const unsigned short* b, const float* c,
                             float* d) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    auto pair = [](const unsigned short* m, int lo, int hi) {
        return static_cast<unsigned>(m[lo]) | static_cast<unsigned>(m[hi]) << 16;
    };
    const unsigned af[4] = {pair(a, g * 16 + 2 * t, g * 16 + 2 * t + 1),
                            pair(a, (g + 8) * 16 + 2 * t, (g + 8) * 16 + 2 * t + 1),
                            pair(a, g * 16 + 2 * t + 8, g * 16 + 2 * t + 9),
                            pair(a, (g + 8) * 16 + 2 * t + 8, (g + 8) * 16 + 2 * t + 9)};
    const unsigned b0 = pair(b, 2 * t * 8 + g, (2 * t + 1) * 8 + g);
    const unsigned b1 = pair(b, (2 * t + 8) * 8 + g, (2 * t + 9) * 8 + g);
    float cf[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                   c[(g + 8) * 8 + 2 * t + 1]};
    SkMma<T>::run(cf, af, b0, b1);
    d[g * 8 + 2 * t] = cf[0];
    d[g * 8 + 2 * t + 1] = cf[1];
    d[(g + 8) * 8 + 2 * t] = cf[2];
    d[(g + 8) * 8 + 2 * t + 1] = cf[3];
}
extern "C" void check_mma_bf16(const unsigned short* a, const unsigned short* b, const float* c,
                               float* d) {
    sk_host_launch({1, 1, 1}, 32, 0, [&] { sk_check_mma<__nv_bfloat16>(a, b, c, d); });
}
extern "C" void check_mma_f16(const unsigned short* a, const unsigned short* b, const float* c,
                              float* d) {
    sk_host_launch({1, 1, 1}, 32, 0, [&] { sk_check_mma<__half>(a, b, c, d); });
}
// The conversions of cuda_bf16.h and cuda_fp16.h, and SkMma<T>::pack, element by element.
extern "C" void check_round(const float* x, unsigned short* bf, unsigned short* hf, int n) {
    for (int i = 0; i < n; ++i) {
        bf[i] = __float2bfloat16_rn(x[i]).x;
        hf[i] = __float2half_rn(x[i]).x;
    }
}
extern "C" void check_widen(const unsigned short* bits, float* bf, float* hf, int n) {
    for (int i = 0; i < n; ++i) {
        bf[i] = __bfloat162float(__nv_bfloat16{bits[i]});
        hf[i] = __half2float(__half{bits[i]});
    }
}
extern "C" void check_pack(const float* lo, const float* hi, unsigned* bf, unsigned* hf, int n) {
    for (int i = 0; i < n; ++i) {
        bf[i] = SkMma<__nv_bfloat16>::pack(lo[i], hi[i]);
        hf[i] = SkMma<__half>::pack(lo[i], hi[i]);
    }
}
"""


@pytest.fixture(scope="module")
def primitives(host_snippet):
    """The checks of the emulated primitives (:data:`SNIPPET`), built once for the host."""
    return host_snippet(SNIPPET)


def _bf16_by_value(x: np.ndarray) -> np.ndarray:
    """The bits of ``x`` (finite float32) rounded to bfloat16 by value (ties to even)."""
    return (rounded_by_value(x, 7, ties_away=False).view(np.uint32) >> 16).astype(np.uint16)


def test_conversions(primitives) -> None:
    """cuda_bf16.h's and cuda_fp16.h's conversions: every 16-bit pattern widened exactly (the
    bfloat16 bits as a float32's top half, float16 as numpy's float16, NaN payloads
    included); float32 rounded to bfloat16 against a rounding by value and to float16 against
    numpy's cast (to nearest, ties to even; random bit patterns of every binade, subnormals,
    exact ties, the overflow edges; NaN to a NaN); and ``SkMma<T>::pack``, its first value in
    the low half."""
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    bf, hf = (np.zeros(every.shape, np.float32) for _ in range(2))
    primitives.check_widen(address(every), address(bf), address(hf), ctypes.c_int(every.size))
    assert np.array_equal(bf.view(np.uint32), every.astype(np.uint32) << 16)
    assert np.array_equal(hf.view(np.uint32), every.view(np.float16).astype(np.float32)
                          .view(np.uint32))

    rng = np.random.default_rng(5)
    patterns = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    patterns = patterns[(patterns & 0x7F800000) != 0x7F800000]  # finite
    small = ((rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
              & np.uint32(0x807FFFFF))
             | rng.integers(100, 116, 4000).astype(np.uint32) << 23)  # float16's subnormals
    ties = np.concatenate([(patterns & np.uint32(0xFFFF0000)) | np.uint32(0x8000),
                           (patterns & np.uint32(0xFFFFE000)) | np.uint32(0x1000)])
    edges = np.array([0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, -65520.0, 2.0**-24,
                      2.0**-25, 2.0**-25 * 1.0001, 3 * 2.0**-25, 2.0**-14, 2.0**-14 - 2.0**-25,
                      np.finfo(np.float32).max, -np.finfo(np.float32).max,
                      np.finfo(np.float32).tiny, 2.0**-149, np.inf, -np.inf], np.float32)
    x = np.concatenate([patterns.view(np.float32), small.view(np.float32),
                        ties.view(np.float32), edges])
    x = np.concatenate([x, np.float32([np.nan])])
    b16, h16 = (np.zeros(x.shape, np.uint16) for _ in range(2))
    primitives.check_round(address(x), address(b16), address(h16), ctypes.c_int(x.size))
    finite = np.isfinite(x)
    with np.errstate(over="ignore"):
        want_h = x.astype(np.float16).view(np.uint16)
    wrong = np.flatnonzero((h16 != want_h) & ~np.isnan(x))
    assert wrong.size == 0, [(repr(x[i]), hex(h16[i]), hex(want_h[i])) for i in wrong[:8]]
    wrong = np.flatnonzero((b16 != _bf16_by_value(np.where(finite, x, 0))) & finite)
    assert wrong.size == 0, [(repr(x[i]), hex(b16[i])) for i in wrong[:8]]
    assert np.array_equal(b16[np.isinf(x)], (x[np.isinf(x)].view(np.uint32) >> 16)
                          .astype(np.uint16))
    assert np.isnan(widen16(b16[np.isnan(x)], "bfloat16")).all()
    assert np.isnan(widen16(h16[np.isnan(x)], "float16")).all()
    assert np.array_equal(b16[finite], bits16(x[finite], "bfloat16"))  # host_attention's too

    lo, hi = x[:1000], x[1000:2000]
    pb, ph = (np.zeros(lo.shape, np.uint32) for _ in range(2))
    primitives.check_pack(address(lo), address(hi), address(pb), address(ph),
                          ctypes.c_int(lo.size))
    assert np.array_equal(pb, b16[:1000].astype(np.uint32)
                          | b16[1000:2000].astype(np.uint32) << 16)
    assert np.array_equal(ph, h16[:1000].astype(np.uint32)
                          | h16[1000:2000].astype(np.uint32) << 16)


def _mma(primitives, dtype: str, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``SkMma<T>::run`` of a [16 x 16], b [16 x 8] (float values rounded to ``dtype``) and c
    [16 x 8] (float32), through :data:`SNIPPET`'s PTX-layout fragments."""
    a16, b16 = bits16(a, dtype), bits16(b, dtype)
    c = np.ascontiguousarray(c, dtype=np.float32)
    d = np.full((16, 8), np.nan, dtype=np.float32)
    run = primitives.check_mma_bf16 if dtype == "bfloat16" else primitives.check_mma_f16
    run(*(address(m) for m in (a16, b16, c, d)))
    return d


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_mma_is_the_product_of_the_fragments(primitives, dtype: str) -> None:
    """``SkMma<T>::run`` given the PTX ISA's m16n8k16 fragments of A, B and C returns D = A B
    + C in its accumulator layout: on distinct small integers (every element of A and B a
    different weight, so a misplaced one shows; D is exact), on normal random values (D is the
    float64 product of the 16-bit operands plus C, rounded toward zero to float32: their
    products and the sums of 16 of them are exact in float64 here), and with infinities and
    NaN (D is NaN or infinite where the float64 product is)."""
    rng = np.random.default_rng(13)
    a = rng.permutation(256).reshape(16, 16).astype(np.float32) - 128
    b = rng.permutation(128).reshape(16, 8).astype(np.float32) / 8 - 8
    c = rng.integers(-50, 51, (16, 8)).astype(np.float32)
    assert np.array_equal(represented(a, dtype), a) and np.array_equal(represented(b, dtype), b)
    want = a.astype(np.float64) @ b + c
    assert np.array_equal(_mma(primitives, dtype, a, b, c), want)

    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((16, 16), (16, 8), (16, 8)))
    a, b = represented(a, dtype), represented(b, dtype)
    exact = a.astype(np.float64) @ b + c.astype(np.float64)
    assert np.array_equal(_mma(primitives, dtype, a, b, c), toward_zero(exact))

    a[3, 5], b[2, 6], c[9, 1] = np.inf, -np.inf, np.nan
    b[5, 0] = 0.0  # inf * 0
    with np.errstate(invalid="ignore"):
        exact = a.astype(np.float64) @ b + c.astype(np.float64)
    got = _mma(primitives, dtype, a, b, c)
    assert np.array_equal(np.isnan(got), np.isnan(exact))
    assert np.array_equal(np.isinf(got), np.isinf(exact))
    assert np.isnan(exact).any() and np.isinf(exact).any()


# --- the forward ------------------------------------------------------------------------------

FORWARD_TILES = tuple(dict.fromkeys([*ATTENTION_CONFIGS.values(), *UNMASKED_CONFIGS.values()]))
"""Every declared forward tile (with and without the mask's code)."""


VARLEN_DIMS = (64, 96, 128)
"""Head dims of the packed variable-length forward run here."""


@pytest.fixture(scope="module")
def kernels(host_kernels):
    """Every declared forward tile, and the packed forward's tiles at :data:`VARLEN_DIMS`, in
    both dtypes, built once for the host."""
    codes = {c.name(t): FORWARD_PARAMS for c in FORWARD_TILES for t in ATTENTION_DTYPES}
    codes |= {varlen_config(d).varlen_name(t): VARLEN_PARAMS for d in VARLEN_DIMS
              for t in ATTENTION_DTYPES}
    return host_kernels("attention.cu", list(codes), codes)


def _forward_cases() -> list[tuple[AttentionConfig, str, dict]]:
    """(tile, dtype, case): at head dim 64 (one tile, with the mask's code) every case of
    :data:`host_attention.CASES` (causal alignments, grouped queries, rows with no key,
    windows, a soft cap, masks, a single query row), the dtypes in turn; at every other head
    dim a mask on the tile with the mask's code, and rows with no key and a window with causal
    and soft cap on the tile without it, the dtypes in turn."""
    pairs = []
    for i, c in enumerate((CASES[1], CASES[4], CASES[2], CASES[3], CASES[6], CASES[7],
                           CASES[8], CASES[5], CASES[0])):
        pairs.append((ATTENTION_CONFIGS[64], ATTENTION_DTYPES[i % 2], c))
    turn = 0
    for config in FORWARD_TILES:
        if config.head_dim == 64:
            continue
        chosen = [CASES[7]] if config.mask else [CASES[3], CASES[6]]
        for c in chosen:
            pairs.append((config, ATTENTION_DTYPES[turn % 2], c))
            turn += 1
    return pairs


FORWARD_CASES = _forward_cases()


def _tile_id(config: AttentionConfig) -> str:
    return (f"d{config.head_dim}-w{config.warps}-n{config.block_n}-m{config.m_tiles}"
            f"{'-mask' if config.mask else ''}")


@pytest.mark.parametrize(("config", "dtype", "case"), FORWARD_CASES,
                         ids=[f"{_tile_id(t)}-{d}-{case_id(c)}" for t, d, c in FORWARD_CASES])
def test_forward_within_tolerances(kernels, config: AttentionConfig, dtype: str,
                                   case: dict) -> None:
    """The forward tile ``config`` in ``dtype`` against the float64 definition on the
    represented inputs: relative Frobenius error of out and the largest error of lse within
    the kit's tolerances, rows with no allowed key (0, -inf), no NaN left."""
    d = config.head_dim
    q, k, v, mask = inputs(d, d, case, seed=d * 100 + case["lq"] + case["lk"])
    q, k, v = (represented(a, dtype) for a in (q, k, v))
    opts = options(case)
    out, lse = launch_forward(kernels, config.name(dtype), config, q, k, v, mask=mask,
                              dtype=dtype, **opts)
    want, want_lse = ref.attention(q, k, v, mask=mask, **opts)
    _check_forward(dtype, out, lse, want, want_lse, config.name(dtype))


def _check_forward(dtype: str, out, lse, want: np.ndarray, want_lse: np.ndarray,
                   what: str) -> None:
    """The kit's checks of a forward (``check_forward``), and no NaN left."""
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    empty = want_lse == -np.inf
    assert np.all(lse[empty] == -np.inf) and np.all(out[empty] == 0), f"{what}: empty rows"
    assert not np.isnan(out).any() and np.isfinite(lse[~empty]).all(), f"{what}: NaN left"
    out_tol, lse_tol, _ = ATTENTION_TOLERANCES[dtype]
    err = ref.rel_frobenius(out, want)
    lerr = np.abs(lse[~empty] - want_lse[~empty])
    lerr = float(lerr.max()) if lerr.size else 0.0
    message = f"{what}: out relative Frobenius {err:.3g}, lse max error {lerr:.3g}"
    assert err <= out_tol and lerr <= lse_tol, message


# --- through the adapters -------------------------------------------------------------------


@pytest.fixture(scope="module")
def backward_kernels(host_kernels):
    """Every declared backward tile, and the row preprocessing and dQ conversion of each head
    dim, in both dtypes, built once for the host."""
    codes = {}
    for d in sorted(BACKWARD_CONFIGS):
        for t in ATTENTION_DTYPES:
            codes[BACKWARD_CONFIGS[d].name(t)] = BACKWARD_PARAMS
            codes[backward_pre_name(t, d)] = BACKWARD_PRE_PARAMS
            codes[backward_dq_name(t, d)] = BACKWARD_DQ_PARAMS
    return host_kernels("attention_bwd.cu", list(codes), codes)


def _adapters_on_host(monkeypatch, built: dict, host_kernels):
    """The 16-bit adapters' device boundary moved to the host (:func:`host_attention.
    move_to_host`: the host builds ``built``, the mask's packing kernel built on first use),
    on a device they take for an A100 (:data:`A100`, :data:`A100_MULTIPROCESSORS`),
    ``interop.empty`` giving NaN-filled float memory; the module
    ``softmaxkit_cupy.attention`` (the packed and paged adapters launch through its
    ``_kernel``, ``split_decode`` and ``_merge``)."""
    from softmaxkit_cupy import attention, interop, varlen

    move_to_host(monkeypatch, attention, built, host_kernels)
    monkeypatch.setattr(varlen, "_kernel", attention._kernel)  # imported from attention
    capability, shared = A100
    for module in (attention, varlen):
        monkeypatch.setattr(module, "_capability_of", lambda device: capability)
    monkeypatch.setattr(attention, "_multiprocessors_of", lambda device: A100_MULTIPROCESSORS)
    monkeypatch.setattr(interop, "shared_limit", lambda device: shared)
    return attention


@pytest.fixture
def host_launches(kernels, backward_kernels, host_kernels, monkeypatch):
    """:func:`_adapters_on_host` with the dense and packed forward's tiles and the dense
    backward's kernels; the module ``softmaxkit_cupy.attention``."""
    return _adapters_on_host(monkeypatch, {**kernels, **backward_kernels}, host_kernels)


def _torch(a: np.ndarray, dtype: str):
    """``a`` (values ``dtype`` holds, or booleans) as a torch CPU tensor of ``dtype``."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).to(getattr(torch, dtype))


ADAPTER_CASES = [("bfloat16", 64, 64, CASES[7]), ("float16", 40, 40, CASES[2]),
                 ("bfloat16", 128, 96, CASES[6]), ("float16", 96, 96, CASES[3])]
"""(dtype, D, Dv, case): a mask at a built head dim, grouped queries zero-padded from 40 to
64, a window with causal and soft cap at D != Dv (run at 128 on the tile without the mask's
code), rows with no key."""


@pytest.mark.parametrize(("dtype", "d", "dv", "case"), ADAPTER_CASES,
                         ids=[f"{t}-{d}-{dv}-{case_id(c)}" for t, d, dv, c in ADAPTER_CASES])
def test_forward_through_the_adapter(host_launches, dtype: str, d: int, dv: int,
                                     case: dict) -> None:
    """The adapter's padding, mask packing (kernels/mask_bits.cu, on the host too) and launch
    (``attention``) on torch CPU tensors, q a view with strides of its own, within the kit's
    tolerances of the float64 definition."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp

    q, k, v, mask = inputs(d, dv, case, seed=d + dv)
    q, k, v = (represented(a, dtype) for a in (q, k, v))
    opts = options(case)
    tq = _torch(np.concatenate([q, q], axis=-1), dtype)[..., :d]  # rows 16-byte aligned
    assert not tq.is_contiguous()
    out, lse = host_launches.attention(
        xp, q=tq, k=_torch(k, dtype), v=_torch(v, dtype), scale=d ** -0.5,
        causal=opts.get("causal"), window=opts.get("window", (-1, -1)),
        mask=None if mask is None else torch.from_numpy(mask), softcap=opts.get("softcap"),
        return_lse=True)
    assert out.dtype == getattr(torch, dtype) and lse.dtype == torch.float32
    want, want_lse = ref.attention(q, k, v, mask=mask, **opts)
    assert tuple(out.shape) == want.shape and tuple(lse.shape) == want_lse.shape
    _check_forward(dtype, out.float().numpy(), lse.numpy(), want, want_lse,
                   f"attention {dtype} D={d} Dv={dv}")


VARLEN_CASES = [
    ("bfloat16", 64, [(70, 100), (0, 30), (33, 33), (90, 20)], {}),
    ("float16", 64, [(40, 60), (100, 50), (1, 80)], dict(causal="bottom_right")),
    ("bfloat16", 96, [(60, 45), (20, 90)], dict(causal="top_left")),
    ("float16", 128, [(80, 80), (35, 130)], dict(causal="bottom_right", window=(30, 5),
                                                  softcap=5.0)),
]
"""(dtype, head dim, per-sequence (Lq, Lk), options): ragged sequences (one without
queries) in one launch, causal in both alignments (rows with no key among them), a window
with a soft cap."""


@pytest.mark.parametrize(("dtype", "d", "lengths", "opts"), VARLEN_CASES,
                         ids=[f"{t}-d{d}-{len(s)}seqs-{case_id(o) or 'plain'}"
                              for t, d, s, o in VARLEN_CASES])
def test_varlen_forward_through_the_adapter(host_launches, dtype: str, d: int,
                                            lengths: list[tuple[int, int]],
                                            opts: dict) -> None:
    """The packed variable-length forward (sk_attn_fwd_varlen, through
    ``softmaxkit_cupy.varlen.varlen_attention``) on torch CPU tensors
    (:func:`varlen_forward_against_float64`)."""
    varlen_forward_against_float64(dtype, d, lengths, opts)


def varlen_forward_against_float64(dtype: str, d: int, lengths: list[tuple[int, int]],
                                   opts: dict, config=None) -> None:
    """``softmaxkit_cupy.varlen.varlen_attention`` (on the host) of ragged sequences of
    ``lengths`` at head dim ``d``, on the tiles ``config`` (None: the adapter's choice), grouped
    queries (Hq 4, Hk 2): each sequence's rows within the kit's tolerances of the float64
    definition on the sequence alone, its causal diagonal and window aligned to its own
    lengths."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import varlen

    hq, hk = 4, 2
    rng = np.random.default_rng(d + len(lengths))
    tq, tk = (sum(n[i] for n in lengths) for i in (0, 1))
    q = represented((rng.standard_normal((tq, hq, d)) * 1.5).astype(np.float32), dtype)
    k = represented((rng.standard_normal((tk, hk, d)) * 1.5).astype(np.float32), dtype)
    v = represented(rng.standard_normal((tk, hk, d)).astype(np.float32), dtype)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum([n[i] for n in lengths])]) for i in (0, 1))
    out, lse = varlen.varlen_attention(
        xp, q=_torch(q, dtype), k=_torch(k, dtype), v=_torch(v, dtype),
        cu_seqlens_q=torch.from_numpy(cu_q), cu_seqlens_k=torch.from_numpy(cu_k),
        scale=d ** -0.5, causal=opts.get("causal"), window=opts.get("window", (-1, -1)),
        softcap=opts.get("softcap"), return_lse=True, config=config)
    assert out.dtype == getattr(torch, dtype) and tuple(out.shape) == (tq, hq, d)
    out, lse = out.float().numpy(), lse.numpy()
    for b in range(len(lengths)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b] == cu_q[b + 1]:
            continue
        want, want_lse = ref.attention(*(np.moveaxis(a[None], 2, 1) for a in (
            q[rows], k[keys], v[keys])), **opts)
        _check_forward(dtype, np.moveaxis(out[rows], 1, 0)[None],
                       np.moveaxis(lse[rows], 1, 0)[None], want, want_lse,
                       f"varlen {dtype} d={d} sequence {b}")


def _backward_cases() -> list[tuple[str, int, dict]]:
    """(dtype, head dim, case): at 64 every case, the dtypes in turn; at every other built
    head dim, and at 48 (zero-padded to 64 by the adapter), one case, the dtypes in turn,
    above 128 (eight warps, two on each 16 keys) on half the rows and keys."""
    pairs = [(ATTENTION_DTYPES[i % 2], 64, c) for i, c in enumerate(BACKWARD_CASES)]
    others = [d for d in sorted(BACKWARD_CONFIGS) if d != 64] + [48]
    for i, d in enumerate(others):
        case = BACKWARD_CASES[(i + 1) % len(BACKWARD_CASES)]
        if d > 128:
            case = dict(case, lq=case["lq"] // 2, lk=case["lk"] // 2)
        pairs.append((ATTENTION_DTYPES[i % 2], d, case))
    return pairs


BACKWARD_RUNS = _backward_cases()



def _check_gradients(dtype: str, grads, want, label: str) -> list[np.ndarray]:
    """dq, dk, dv (torch tensors of ``dtype``) within the 16-bit gradient tolerance of the
    float64 ``want`` in relative Frobenius norm, with no NaN left; as float64 arrays."""
    tol = ATTENTION_TOLERANCES[dtype][2]
    got = []
    for what, g, w in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert str(g.dtype) == f"torch.{dtype}", (what, g.dtype)
        g = g.float().numpy().astype(np.float64)
        assert g.shape == w.shape, (what, g.shape, w.shape)
        assert not np.isnan(g).any(), f"{label} {what}: NaN left in the result"
        err = ref.rel_frobenius(g, w)
        assert err <= tol, f"{label} {what}: {err:.3g} > {tol}"
        got.append(g)
    return got

@pytest.mark.parametrize(("dtype", "d", "case"), BACKWARD_RUNS,
                         ids=[f"{t}-d{d}-{case_id(c)}" for t, d, c in BACKWARD_RUNS])
def test_backward_against_float64(host_launches, dtype: str, d: int, case: dict) -> None:
    """The backward through its adapter (``attention_vjp``: sk_attn_bwd_pre, the tile of
    :data:`~softmaxkit_cupy.configs.BACKWARD_CONFIGS`, sk_attn_bwd_dq) on torch CPU tensors,
    from the float64 forward's out rounded to ``dtype`` and lse in float32 (as the kit's
    ``attention_vjp`` case gives them), against the float64 gradient on the represented
    inputs (:func:`backward_against_float64`)."""
    backward_against_float64(host_launches, dtype, d, case, seed=d * 101 + case["lq"])


def test_a_kind_of_call_runs_its_kept_launches_again(host_launches) -> None:
    """A later call of one kind (shapes, strides, dtype, options; no mask) runs the launches
    the first call kept (:mod:`softmaxkit_cupy.kept`) on its own fresh arrays, forward and
    backward, each result within the kit's tolerances of float64; a call of another kind
    keeps launches of its own."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy import kept

    case = dict(b=1, hq=4, hk=2, lq=70, lk=90, causal="bottom_right")
    firsts = None
    for seed in (1, 2, 3):
        q, k, v, _ = inputs(64, 64, case, seed=seed)
        q, k, v = (represented(a, "bfloat16") for a in (q, k, v))
        out, lse = host_launches.attention(
            xp, q=_torch(q, "bfloat16"), k=_torch(k, "bfloat16"), v=_torch(v, "bfloat16"),
            scale=0.125, causal="bottom_right", window=(-1, -1), mask=None, softcap=None,
            return_lse=True)
        want, want_lse = ref.attention(q, k, v, causal="bottom_right")
        _check_forward("bfloat16", out.float().numpy(), lse.numpy(), want, want_lse,
                       f"kept forward, call {seed}")
        backward_against_float64(host_launches, "bfloat16", 64, case, seed=seed)
        if firsts is None:
            firsts = dict(kept._store)
            assert {key[0] for key in firsts} == {"attention", "attention_vjp"}
        else:  # the same launches, none made again
            assert kept._store.keys() == firsts.keys()
            assert all(kept._store[key] is firsts[key] for key in firsts)
    backward_against_float64(host_launches, "bfloat16", 64, dict(case, lq=71), seed=4)
    assert len(kept._store) == len(firsts) + 1


def backward_against_float64(adapter, dtype: str, d: int, case: dict, seed: int,
                             config=None) -> None:
    """``adapter.attention_vjp`` (a module on the host, :func:`_adapters_on_host` or
    :func:`host_attention.move_to_host`) of ``case`` at head dim ``d`` on torch CPU tensors,
    on the tiles ``config`` (None: the adapter's choice), from the float64 forward's out
    rounded to ``dtype`` and lse in float32, against the float64 gradient on the represented
    inputs: relative Frobenius error of each gradient within the kit's tolerance, no NaN left
    (dq, dk, dv, lse2 and delta made in NaN-filled memory), zero dq on rows with no allowed
    key."""
    pytest.importorskip("torch")
    import array_api_compat.torch as xp

    q, k, v, mask = inputs(d, d, case, seed=seed)
    q, k, v = (represented(a, dtype) for a in (q, k, v))
    opts = options(case)
    out64, lse64 = ref.attention(q, k, v, mask=mask, **opts)
    dout, dlse = cotangents(out64, lse64, case)
    dout = represented(dout, dtype)
    want = ref.attention_vjp(q, k, v, dout, dlse=dlse, mask=mask, **opts)
    grads = adapter.attention_vjp(
        xp, q=_torch(q, dtype), k=_torch(k, dtype), v=_torch(v, dtype),
        out=_torch(represented(out64.astype(np.float32), dtype), dtype),
        lse=_torch(lse64.astype(np.float32), "float32"), dout=_torch(dout, dtype),
        dlse=None if dlse is None else _torch(dlse, "float32"), scale=d ** -0.5,
        causal=opts.get("causal"), window=opts.get("window", (-1, -1)),
        mask=None if mask is None else _torch(mask, "bool"), softcap=opts.get("softcap"),
        config=config)
    label = f"{dtype} d={d} {case_id(case)}" + ("" if config is None else f" {config}")
    _check_gradients(dtype, grads, want, label)
    empty = lse64 == -np.inf
    if empty.any():
        assert np.all(grads[0].float().numpy()[empty] == 0), "dq of a row with no allowed key"


# --- split-KV decoding, paged attention, merges and the packed backward ------------------

DECODE_CASES = [
    ("bfloat16", 64, dict(b=2, hq=4, hk=1, lq=4, lk=600, causal="bottom_right", mask=True)),
    ("float16", 128, dict(b=1, hq=2, hk=1, lq=3, lk=530, causal="bottom_right",
                          window=(300, -1), softcap=5.0)),
    ("bfloat16", 64, dict(b=1, hq=4, hk=2, lq=2, lk=520, causal="top_left")),
]
"""(dtype, head dim, case) of dense split-KV decoding (sk_attn_decode: at most 16 query rows
per key head, at least 256 keys), two splits each: grouped queries with a mask (a row with
no allowed key) and bottom-right causal, a window with a soft cap, top-left causal (the
second split's keys excluded for every row: an empty partial state)."""

PAGE_SIZE = 16
"""The page size of the paged cases."""

PAGED_CASES = [
    ("bfloat16", 64, 4, 2, 1, [600, 0, 37, 16], {}, "int32"),
    ("float16", 64, 4, 2, 1, [5, 600, 0, 31], dict(causal="bottom_right"), "int64"),
    ("float16", 128, 4, 1, 3, [2, 560, 45, 0], dict(causal="bottom_right"), "int32"),
    ("bfloat16", 128, 2, 1, 4, [20, 700], dict(causal="bottom_right", window=(520, -1),
                                               softcap=5.0), "int32"),
    ("bfloat16", 64, 4, 1, 5, [3, 70, 0, 41], dict(causal="bottom_right"), "int32"),
]
"""(dtype, head dim, Hq, Hk, Lq, seqlens, options, the metadata's dtype): decoding (Lq = 1)
with and without causal, grouped queries, chunked prefill (Lq > 1, bottom-right causal; a
sequence shorter than Lq has rows with no key) up to 12 query rows per key head, a sliding
window with a soft cap (the kernel starts the sequence at the first query's window); a
sequence with no key in most; in the first four (sk_attn_decode_paged) one sequence long
enough to take two splits of the split-KV decode, merged by sk_merge_attn.  The last has 20
query rows per key head, more than the decode kernel holds: the dense kernels on the pages
gathered, each sequence's length and alignment a mask (the adapter's ``_prefill``)."""


@pytest.fixture(scope="module")
def decode_kernels(host_kernels):
    """The dense and paged decode kernels the cases run (:data:`DECODE_CASES`,
    :data:`PAGED_CASES`), the merges of their float32 partials, and the merges of
    ``merge_attention`` in every dtype, built once for the host."""
    from softmaxkit_cupy.attention import _MERGE_PARAMS, DECODE_PARAMS
    from softmaxkit_cupy.configs import MERGE_DTYPES, decode_config, decode_holds, merge_name
    from softmaxkit_cupy.paged import _PAGED_PARAMS

    codes = {decode_config(d, A100[1]).name(t): DECODE_PARAMS for t, d, _ in DECODE_CASES}
    codes |= {decode_config(d, A100[1]).name(t, paged=True): _PAGED_PARAMS
              for t, d, hq, hk, lq, *_ in PAGED_CASES if decode_holds(hq, hk, lq)}
    codes |= {merge_name("float32", t): _MERGE_PARAMS for t in ATTENTION_DTYPES}
    codes |= {merge_name(t, t): _MERGE_PARAMS for t in MERGE_DTYPES}
    return host_kernels("attention.cu", list(codes), codes)


@pytest.fixture
def decode_launches(decode_kernels, kernels, host_kernels, monkeypatch):
    """:func:`_adapters_on_host` with the decode kernels, the merges and the dense forward's
    tiles (a long chunked prefill runs on them); a list that gathers the split-KV decode
    launches, ``(grid, keys per split)`` each."""
    from softmaxkit_cupy import interop
    from softmaxkit_cupy.attention import DECODE_PARAMS
    from softmaxkit_cupy.paged import _PAGED_PARAMS

    _adapters_on_host(monkeypatch, {**kernels, **decode_kernels}, host_kernels)
    chunk_at = {DECODE_PARAMS: 22, _PAGED_PARAMS: 23}  # the position of `chunk`
    decodes = []
    launch = interop.launch

    def recorded(kernel, like, grid, block, codes, args, shared=0) -> None:
        if codes in chunk_at:
            decodes.append((grid, args[chunk_at[codes]]))
        launch(kernel, like, grid, block, codes, args, shared)

    monkeypatch.setattr(interop, "launch", recorded)
    return decodes


@pytest.mark.parametrize(("dtype", "d", "case"), DECODE_CASES,
                         ids=[f"{t}-d{d}-{case_id(c)}" for t, d, c in DECODE_CASES])
def test_decode_through_the_adapter(decode_launches, dtype: str, d: int, case: dict) -> None:
    """Dense split-KV decoding (``attention`` with few query rows per key head and at least
    256 keys: sk_attn_decode on a (splits, Hk, B) grid, then sk_merge_attn of the float32
    partials) on torch CPU tensors, against the float64 definition on the represented
    inputs: the kit's tolerances, rows with no allowed key (0, -inf), no NaN left; the keys
    span two splits."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import attention

    q, k, v, mask = inputs(d, d, case, seed=d + case["lk"])
    q, k, v = (represented(a, dtype) for a in (q, k, v))
    opts = options(case)
    out, lse = attention.attention(
        xp, q=_torch(q, dtype), k=_torch(k, dtype), v=_torch(v, dtype), scale=d ** -0.5,
        causal=opts.get("causal"), window=opts.get("window", (-1, -1)),
        mask=None if mask is None else torch.from_numpy(mask), softcap=opts.get("softcap"),
        return_lse=True)
    ((splits, heads, batch), chunk), = decode_launches
    assert (heads, batch) == (case["hk"], case["b"]) and splits > 1 and case["lk"] > chunk
    assert out.dtype == getattr(torch, dtype) and lse.dtype == torch.float32
    want, want_lse = ref.attention(q, k, v, mask=mask, **opts)
    assert tuple(out.shape) == want.shape and tuple(lse.shape) == want_lse.shape
    _check_forward(dtype, out.float().numpy(), lse.numpy(), want, want_lse,
                   f"decode {dtype} d={d} {case_id(case)}")


@pytest.mark.parametrize(("dtype", "d", "hq", "hk", "lq", "seqlens", "opts", "index"),
                         PAGED_CASES,
                         ids=[f"{t}-d{d}-hq{hq}-hk{hk}-lq{lq}-{case_id(o) or 'plain'}-{i}"
                              for t, d, hq, hk, lq, _, o, i in PAGED_CASES])
def test_paged_attention_through_the_adapter(decode_launches, dtype: str, d: int, hq: int,
                                             hk: int, lq: int, seqlens: list[int],
                                             opts: dict, index: str) -> None:
    """Paged attention (``softmaxkit_cupy.paged.paged_attention``: sk_attn_decode_paged on a
    (splits, Hk, B) grid, then sk_merge_attn of the float32 partials; more query rows per
    key head than it holds, the dense kernels on the gathered pages) on torch CPU tensors,
    pages of 16 at shuffled places of the pool (the kit's ``make_cache``: NaN in the slots
    past each sequence's end and in the unused pages, -1 or an index past the pool in the
    unused table entries), against the float64 definition on each sequence's gathered
    represented keys and values: the kit's tolerances, rows with no allowed key (0, -inf),
    no NaN left; on the decode kernel, the longest sequence's keys span two splits."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import paged
    from softmaxkit_cupy.configs import decode_holds

    from softmaxkit.testing.paged_cases import make_cache, paged_definition

    rng = np.random.default_rng(d + lq + sum(seqlens))
    k64, v64, table, lens = make_cache(rng, seqlens, PAGE_SIZE, hk, d, d)
    q = represented((rng.standard_normal((len(seqlens), hq, lq, d)) * 1.5).astype(np.float32),
                    dtype)
    kp, vp = (represented((a * s).astype(np.float32), dtype) for a, s in ((k64, 1.5), (v64, 1)))
    out, lse = paged.paged_attention(
        xp, q=_torch(q, dtype), k_pages=_torch(kp, dtype), v_pages=_torch(vp, dtype),
        block_table=torch.from_numpy(table.astype(index)),
        seqlens=torch.from_numpy(lens.astype(index)), scale=d ** -0.5,
        causal=opts.get("causal"), window=opts.get("window", (-1, -1)),
        softcap=opts.get("softcap"), return_lse=True)
    if decode_holds(hq, hk, lq):
        ((splits, heads, batch), chunk), = decode_launches
        assert (heads, batch) == (hk, len(seqlens)) and splits > 1
        left = opts.get("window", (-1, -1))[0]
        longest = max(n - max(0, n - lq - left) if left >= 0 else n for n in seqlens)
        assert longest > chunk, (longest, chunk)  # its keys reach a second split
    else:
        assert not decode_launches
    assert out.dtype == getattr(torch, dtype) and lse.dtype == torch.float32
    want, want_lse = paged_definition(q, kp, vp, table, lens, opts.get("causal"),
                                      scale=d ** -0.5, window=opts.get("window"),
                                      softcap=opts.get("softcap"))
    assert tuple(out.shape) == want.shape and tuple(lse.shape) == want_lse.shape
    _check_forward(dtype, out.float().numpy(), lse.numpy(), want, want_lse,
                   f"paged {dtype} d={d} seqlens={seqlens}")


MERGE_CASES = [("bfloat16", 5), ("float16", 37), ("float32", 37), ("float32", 5)]
"""(dtype, parts): a few parts, and more than a warp's 32 lanes."""


@pytest.mark.parametrize(("dtype", "parts"), MERGE_CASES,
                         ids=[f"{t}-{s}parts" for t, s in MERGE_CASES])
def test_merge_attention_through_the_adapter(decode_launches, dtype: str,
                                             parts: int) -> None:
    """``merge_attention`` (sk_merge_attn, through ``softmaxkit_cupy.attention.
    merge_attention``) on torch CPU tensors: the float64 partial states of attention over
    ``parts`` chunks of the keys (one chunk empty), their outs rounded to ``dtype`` and their
    lses to float32, against the float64 merge of those represented states (the kit's
    tolerances; 42 rows, Dv 40); an empty part's out is NaN and never read, a row whose parts
    are all empty gives (0, -inf), a NaN lse makes its row NaN."""
    pytest.importorskip("torch")
    import array_api_compat.torch as xp

    rng = np.random.default_rng(parts)
    b, h, lq, lk, dv = 2, 3, 7, 150, 40
    q, k = ((rng.standard_normal((b, h, n, 32)) * 1.5).astype(np.float32) for n in (lq, lk))
    v = rng.standard_normal((b, h, lk, dv)).astype(np.float32)
    bounds = np.linspace(0, lk, parts, dtype=int)
    bounds = np.concatenate([bounds[:2], bounds[1:]])  # chunk 1 empty
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        o, s = ref.attention(q, k[..., lo:hi, :], v[..., lo:hi, :])
        outs.append(o.reshape(-1, dv))
        lses.append(s.reshape(-1))
    outs, lses = np.stack(outs).astype(np.float32), np.stack(lses).astype(np.float32)
    rows = outs.shape[1]
    lses[:, 3] = -np.inf  # every part empty
    lses[2:, 10] = -np.inf  # the first two parts only (the second is the empty chunk)
    lses[parts - 1, 20] = np.nan  # a NaN part
    lses[[0, 1], 30] = np.nan, -np.inf  # a NaN part beside an empty one
    outs[lses == -np.inf] = np.nan  # an empty part's out is never read
    if dtype != "float32":
        outs = represented(outs, dtype)
    from softmaxkit_cupy import attention

    out, lse = attention.merge_attention(xp, outs=_torch(outs, dtype),
                                         lses=_torch(lses, "float32"))
    assert str(out.dtype) == f"torch.{dtype}" and str(lse.dtype) == "torch.float32"
    out, lse = out.float().numpy(), lse.numpy()
    assert out.shape == (rows, dv) and lse.shape == (rows,)
    nan_rows = np.isnan(lses).any(axis=0)
    assert np.isnan(out[nan_rows]).all() and np.isnan(lse[nan_rows]).all(), "NaN rows"
    want, want_lse = ref.merge_states(outs[:, ~nan_rows], lses[:, ~nan_rows])
    assert want_lse[3] == -np.inf
    _check_forward(dtype, out[~nan_rows], lse[~nan_rows], want, want_lse,
                   f"merge {dtype} of {parts} parts")


VARLEN_BACKWARD_CASES = [
    ("bfloat16", 64, [(50, 70), (0, 30), (33, 33), (20, 0), (70, 45)], {}, True),
    ("float16", 128, [(40, 60), (70, 35), (0, 20), (1, 80)],
     dict(causal="bottom_right", window=(30, -1), softcap=5.0), False),
]
"""(dtype, head dim, per-sequence (Lq, Lk), options, with an lse cotangent): ragged
sequences (one without queries in both, one without keys in the first), the lse in the loss;
bottom-right causal (rows with no key) with a window and a soft cap."""


@pytest.fixture(scope="module")
def varlen_backward_kernels(host_kernels):
    """The packed backward's kernels (sk_attn_bwd_pre_varlen, sk_attn_bwd_varlen,
    sk_attn_bwd_dq_varlen) at the dtypes and head dims of :data:`VARLEN_BACKWARD_CASES`,
    built once for the host."""
    from softmaxkit_cupy.configs import (
        backward_config,
        backward_dq_varlen_name,
        backward_pre_varlen_name,
    )
    from softmaxkit_cupy.varlen import (
        VARLEN_BACKWARD_PARAMS,
        VARLEN_DQ_PARAMS,
        VARLEN_PRE_PARAMS,
    )

    codes = {}
    for t, d, *_ in VARLEN_BACKWARD_CASES:
        codes[backward_config(d, A100[1]).varlen_name(t)] = VARLEN_BACKWARD_PARAMS
        codes[backward_pre_varlen_name(t, d)] = VARLEN_PRE_PARAMS
        codes[backward_dq_varlen_name(t, d)] = VARLEN_DQ_PARAMS
    return host_kernels("attention_bwd.cu", list(codes), codes)


@pytest.mark.parametrize(("dtype", "d", "lengths", "opts", "with_dlse"),
                         VARLEN_BACKWARD_CASES,
                         ids=[f"{t}-d{d}-{len(s)}seqs-{case_id(o) or 'plain'}"
                              f"{'-dlse' if w else ''}"
                              for t, d, s, o, w in VARLEN_BACKWARD_CASES])
def test_varlen_backward_through_the_adapter(varlen_backward_kernels, host_kernels,
                                             monkeypatch, dtype: str, d: int,
                                             lengths: list[tuple[int, int]], opts: dict,
                                             with_dlse: bool) -> None:
    """The packed backward (``softmaxkit_cupy.varlen.varlen_attention_vjp``:
    sk_attn_bwd_pre_varlen, sk_attn_bwd_varlen, sk_attn_bwd_dq_varlen) on torch CPU tensors,
    grouped queries (Hq 4, Hk 2), from the float64 forward's out rounded to ``dtype`` and lse
    in float32, against the float64 gradients of attention on each sequence alone: the
    kit's tolerance on each gradient packed and on each sequence with queries and keys, no
    NaN left (dq, dk, dv, lse2 and delta made in NaN-filled memory), zero dk and dv on the
    keys of a sequence without queries, zero dq on rows with no allowed key."""
    _adapters_on_host(monkeypatch, dict(varlen_backward_kernels), host_kernels)
    varlen_backward_against_float64(dtype, d, lengths, opts, with_dlse)


def varlen_backward_against_float64(dtype: str, d: int, lengths: list[tuple[int, int]],
                                    opts: dict, with_dlse: bool, config=None) -> None:
    """``softmaxkit_cupy.varlen.varlen_attention_vjp`` (its kernels moved to the host) of
    ragged sequences of ``lengths`` at head dim ``d``, grouped queries (Hq 4, Hk 2), on the
    tiles ``config`` (None: the adapter's choice), against the float64 gradients of attention
    on each sequence alone (:func:`test_varlen_backward_through_the_adapter`'s checks)."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import varlen

    from softmaxkit.testing.varlen_cases import packed_reference, packed_vjp_reference

    hq, hk = 4, 2
    rng = np.random.default_rng(d + len(lengths))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum([n[i] for n in lengths])]) for i in (0, 1))
    q = represented((rng.standard_normal((cu_q[-1], hq, d)) * 1.5).astype(np.float32), dtype)
    k = represented((rng.standard_normal((cu_k[-1], hk, d)) * 1.5).astype(np.float32), dtype)
    v = represented(rng.standard_normal((cu_k[-1], hk, d)).astype(np.float32), dtype)
    kw = dict(scale=d ** -0.5, **opts)
    out64, lse64 = packed_reference(q, k, v, cu_q, cu_k, **kw)
    dout = represented(rng.standard_normal(out64.shape).astype(np.float32), dtype)
    dlse = None
    if with_dlse:  # 0 on the rows with no allowed key, as the frontend hands it
        dlse = np.where(lse64 == -np.inf, 0.0, rng.standard_normal(lse64.shape))
        dlse = dlse.astype(np.float32)
    grads = varlen.varlen_attention_vjp(
        xp, q=_torch(q, dtype), k=_torch(k, dtype), v=_torch(v, dtype),
        out=_torch(represented(out64.astype(np.float32), dtype), dtype),
        lse=_torch(lse64.astype(np.float32), "float32"), dout=_torch(dout, dtype),
        cu_seqlens_q=torch.from_numpy(cu_q), cu_seqlens_k=torch.from_numpy(cu_k),
        scale=d ** -0.5, causal=opts.get("causal"), window=opts.get("window", (-1, -1)),
        softcap=opts.get("softcap"), dlse=None if dlse is None else _torch(dlse, "float32"),
        config=config)
    want = packed_vjp_reference(q, k, v, dout, cu_q, cu_k, dlse, **kw)
    dq, dk, dv = _check_gradients(dtype, grads, want, f"varlen {dtype} d={d}")
    for b in range(len(lengths)):
        (q0, q1), (k0, k1) = (cu_q[b], cu_q[b + 1]), (cu_k[b], cu_k[b + 1])
        if q0 == q1:
            assert np.all(dk[k0:k1] == 0) and np.all(dv[k0:k1] == 0), (
                f"sequence {b}: keys of a sequence without queries have a gradient")
        elif k0 < k1:
            for what, g, w in zip(("dq", "dk", "dv"), (dq[q0:q1], dk[k0:k1], dv[k0:k1]),
                                  (want[0][q0:q1], want[1][k0:k1], want[2][k0:k1]),
                                  strict=True):
                err, tol = ref.rel_frobenius(g, w), ATTENTION_TOLERANCES[dtype][2]
                assert err <= tol, f"varlen {dtype} d={d} sequence {b} {what}: {err:.3g}"
    assert np.all(dq[lse64 == -np.inf] == 0), "dq of a row with no allowed key"
