"""The float32 attention on TF32 tensor cores (kernels/attention_tf32.cu) run on the CPU
(tests/host/emulation.h: each CUDA thread a fiber, shared memory filled with NaN first;
tests/host/primitives.h: cvt.rna.tf32.f32, mma.sync m16n8k8 TF32 and ldmatrix emulated, the
warp-collective ones through a per-warp exchange in the PTX ISA's fragment layouts).

Checked here: the emulated primitives against numpy (``sk_tf32`` against a rounding by value,
the mma against a float64 product of the operands' top 19 bits, ldmatrix against the PTX
layout); every forward kernel the module declares (:func:`softmaxkit_cupy.configs.tf32_names`:
each tile with and without the mask's code, at ``precision="tf32"`` and ``"tf32x3"``),
launched as the adapter launches it into results that held NaN, against the float64
definition within the elementwise bound of spec "Precision"
(:func:`softmaxkit.testing.precision.attention_bound`, the GPU test's check,
backends/cupy/tests/test_tf32_gpu.py) over causal alignments, grouped queries, rows with no
key, windows, soft caps, boolean masks and ragged tiles; and every backward kernel
(sk_attn_bwd_tf32, :func:`softmaxkit_cupy.configs.tf32_backward_names`) through its adapter
on torch CPU tensors, against the float64 gradient within that test's tolerances.

The emulated mma sums in double and rounds once toward zero, where the device truncates its
float32 sums step by step: the results are held to the bounds the device's are held to, but
are not the device's bit for bit; what the device adds (its sums' rounding, timing, its own
orderings) is the GPU test's.

Run: ``python -m pytest -q backends/cupy/tests/test_tf32_host.py``.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
from host_attention import (
    BACKWARD_CASES,
    CASES,
    address,
    case_id,
    cotangents,
    inputs,
    launch_forward,
    move_to_host,
    options,
    rounded_by_value,
    toward_zero,
)
from softmaxkit_cupy.attention import FORWARD_PARAMS
from softmaxkit_cupy.configs import (
    TF32_PRECISIONS,
    Tf32BackwardConfig,
    Tf32Config,
    tf32_backward_names,
    tf32_backward_pre_names,
    tf32_names,
)

from softmaxkit.testing import materialized as ref
from softmaxkit.testing.precision import attention_bound

PRECISION_OF = {code: name for name, code in TF32_PRECISIONS.items()}
"""The precision of each PRECISION template argument of the kernels."""

# --- the primitives ---------------------------------------------------------------------------

SNIPPET = r"""
__global__ void sk_check_tf32(const float* x, unsigned* y, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = sk_tf32(x[i]);
}
// One warp: d = a b + c, a [16 x 8], b [8 x 8], c, d [16 x 8] row-major, given to the mma in
// the fragments of the PTX ISA's m16n8k8 .tf32 layout (the raw float bits as operands).
__global__ void sk_check_mma(const float* a, const float* b, const float* c, float* d) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const unsigned af[4] = {__float_as_uint(a[g * 8 + t]), __float_as_uint(a[(g + 8) * 8 + t]),
                            __float_as_uint(a[g * 8 + t + 4]),
                            __float_as_uint(a[(g + 8) * 8 + t + 4])};
    float cf[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                   c[(g + 8) * 8 + 2 * t + 1]};
    sk_mma_tf32(cf, af, __float_as_uint(b[t * 8 + g]), __float_as_uint(b[(t + 4) * 8 + g]));
    d[g * 8 + 2 * t] = cf[0];
    d[g * 8 + 2 * t + 1] = cf[1];
    d[(g + 8) * 8 + 2 * t] = cf[2];
    d[(g + 8) * 8 + 2 * t + 1] = cf[3];
}
// One warp: the 32 rows (8 16-bit elements each) of four 8 x 8 matrices src[(8 i + r) 8 + c]
// placed at 16-byte rows place[8 i + r] of shared memory; lane l gives the address of row
// l % 8 of matrix l / 8 and writes what ldmatrix gives it to out[4 l .. 4 l + 3].
__global__ void sk_check_ldmatrix(const unsigned short* src, const int* place, unsigned* out,
                                  int trans) {
    const int lane = threadIdx.x % 32;
    unsigned short* rows = reinterpret_cast<unsigned short*>(sk_smem);
    std::memcpy(rows + 8 * place[lane], src + 8 * lane, 16);
    __syncwarp();
    unsigned r[4];
    if (trans) {
        sk_ldmatrix_x4_trans(r, rows + 8 * place[lane]);
    } else {
        sk_ldmatrix_x4(r, rows + 8 * place[lane]);
    }
    for (int i = 0; i < 4; ++i) out[4 * lane + i] = r[i];
}
extern "C" void check_tf32(const float* x, unsigned* y, int n) {
    sk_host_launch({1, 1, 1}, 64, 0, [&] { sk_check_tf32(x, y, n); });
}
extern "C" void check_mma(const float* a, const float* b, const float* c, float* d) {
    sk_host_launch({1, 1, 1}, 32, 0, [&] { sk_check_mma(a, b, c, d); });
}
extern "C" void check_ldmatrix(const unsigned short* src, const int* place, unsigned* out,
                               int trans) {
    sk_host_launch({1, 1, 1}, 32, 1024, [&] { sk_check_ldmatrix(src, place, out, trans); });
}
"""


@pytest.fixture(scope="module")
def primitives(host_snippet):
    """The checks of the emulated primitives (:data:`SNIPPET`), built once for the host."""
    return host_snippet(SNIPPET)


def _tf32_by_value(x: np.ndarray) -> np.ndarray:
    """The bits of ``x`` (float32) rounded to TF32 by value (ties away from zero); inf and NaN
    unchanged."""
    out = x.copy()
    finite = np.isfinite(x)
    out[finite] = rounded_by_value(x[finite], 10, ties_away=True)
    return out.view(np.uint32)


def _floats(bits: list[int] | np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def test_tf32_rounds_to_nearest_ties_away(primitives) -> None:
    """``sk_tf32`` (cvt.rna.tf32.f32) against a rounding by value: random bit patterns of
    every binade, subnormals included; exact ties (ties to even would differ on half of
    them); values that round up into the next binade; the largest float32 and TF32 values;
    signed zeros, infinities and quiet NaNs."""
    rng = np.random.default_rng(5)
    patterns = rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
    patterns = patterns[(patterns & 0x7F800000) != 0x7F800000]  # finite
    ties = (patterns & np.uint32(0xFFFFE000)) | np.uint32(0x1000)
    ulp = 2.0**-10
    edges = np.array([
        0.0, -0.0, 1.0, -1.0, 1 + ulp / 2, -(1 + ulp / 2), 1 + 3 * ulp / 2, 1 + ulp / 2 - 2**-23,
        2 - 2**-23, 2 - ulp / 2, -(2 - ulp / 2), 2 - ulp / 2 - 2**-23, 0.5 - 2**-25,
        np.finfo(np.float32).max, -np.finfo(np.float32).max, (2 - ulp) * 2.0**127,
        (2 - ulp / 2) * 2.0**127, (2 - ulp / 2) * 2.0**127 - 2.0**104,
        2.0**-149, 2.0**-137, 2.0**-137 - 2.0**-149, 3 * 2.0**-137, 2.0**-126 - 2.0**-149,
        np.finfo(np.float32).tiny, np.inf, -np.inf,
    ], dtype=np.float32)
    nans = _floats([0x7FC00000, 0xFFC00000, 0x7FFFE000])
    x = np.concatenate([_floats(patterns), _floats(ties), edges, nans])
    y = _sk_tf32(primitives, x)
    assert np.all(y & 0x1FFF == 0), "low 13 bits left"
    want = _tf32_by_value(x)
    finite = np.isfinite(x)
    wrong = np.flatnonzero((y != want) & finite)
    assert wrong.size == 0, [(f"{x[i]!r} {x.view(np.uint32)[i]:#010x}", f"{y[i]:#010x}",
                              f"{want[i]:#010x}") for i in wrong[:8]]
    assert np.array_equal(y[np.isinf(x)], x[np.isinf(x)].view(np.uint32))
    assert np.array_equal(y[np.isnan(x)], nans.view(np.uint32))  # quiet NaNs stay as they are
    spots = {  # a few of the edges by hand
        1 + ulp / 2: 1 + ulp, -(1 + ulp / 2): -(1 + ulp), 1 + 3 * ulp / 2: 1 + 2 * ulp,
        2 - ulp / 2: 2.0, np.finfo(np.float32).max: np.inf, (2 - ulp) * 2.0**127:
        (2 - ulp) * 2.0**127, (2 - ulp / 2) * 2.0**127: np.inf, 2.0**-137: 2.0**-136,
        2.0**-126 - 2.0**-149: 2.0**-126, 2.0**-149: 0.0,
    }
    got = _sk_tf32(primitives, np.array(list(spots), np.float32)).view(np.float32)
    assert got.tolist() == list(spots.values())


def _sk_tf32(primitives, x: np.ndarray) -> np.ndarray:
    """``sk_tf32`` of every element of ``x`` (float32), as bits."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.zeros(x.shape, dtype=np.uint32)
    primitives.check_tf32(address(x), address(y), ctypes.c_int(x.size))
    return y


def _mma(primitives, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    a, b, c = (np.ascontiguousarray(m, dtype=np.float32) for m in (a, b, c))
    d = np.full((16, 8), np.nan, dtype=np.float32)
    primitives.check_mma(*(address(m) for m in (a, b, c, d)))
    return d


def _top19(m: np.ndarray) -> np.ndarray:
    """What the tensor core reads of a TF32 operand: the top 19 bits, as float64."""
    bits = np.ascontiguousarray(m, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return bits.view(np.float32).astype(np.float64)


def test_mma_is_the_product_of_the_fragments(primitives) -> None:
    """``sk_mma_tf32`` given the PTX ISA's m16n8k8 fragments of A, B and C returns D = A B +
    C in its accumulator layout: on small integers with noise in the low 13 bits of every A
    and B operand (ignored: D is exact), on normal random values (D is the float64 product of
    the operands' top 19 bits plus C, rounded toward zero to float32), and with infinities
    and NaN (D is NaN or infinite where the float64 product is)."""
    rng = np.random.default_rng(11)

    def noisy(shape: tuple[int, int]) -> np.ndarray:
        m = rng.integers(-8, 9, shape).astype(np.float32)
        return (m.view(np.uint32) | rng.integers(0, 0x2000, shape).astype(np.uint32)).view(
            np.float32)

    a, b = noisy((16, 8)), noisy((16, 8))[:8]
    c = rng.integers(-50, 51, (16, 8)).astype(np.float32)
    want = _top19(a) @ _top19(b) + c
    assert np.array_equal(_mma(primitives, a, b, c), want)

    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (8, 8), (16, 8)))
    exact = _top19(a) @ _top19(b) + c.astype(np.float64)
    assert np.array_equal(_mma(primitives, a, b, c), toward_zero(exact))

    a[3, 5], b[2, 6], c[9, 1] = np.inf, -np.inf, np.nan
    b[5, 0] = 0.0  # inf * 0
    with np.errstate(invalid="ignore"):
        exact = _top19(a) @ _top19(b) + c.astype(np.float64)
    got = _mma(primitives, a, b, c)
    assert np.array_equal(np.isnan(got), np.isnan(exact))
    assert np.array_equal(np.isinf(got), np.isinf(exact))
    assert np.isnan(exact).any() and np.isinf(exact).any()


@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
def test_ldmatrix_layout(primitives, trans: bool) -> None:
    """``sk_ldmatrix_x4`` and ``_trans`` (ldmatrix.m8n8.x4(.trans).b16) from rows scattered in
    shared memory: lane l gets in r[i] elements 2 (l % 4), 2 (l % 4) + 1 of row l / 4 of
    matrix i (low half first), or with .trans elements l / 4 of rows 2 (l % 4), 2 (l % 4) + 1."""
    rng = np.random.default_rng(3)
    src = rng.integers(0, 2**16, (4, 8, 8)).astype(np.uint16)
    place = rng.permutation(64)[:32].astype(np.int32)
    out = np.zeros((32, 4), dtype=np.uint32)
    primitives.check_ldmatrix(address(src), address(place), address(out),
                              ctypes.c_int(int(trans)))
    lane = np.arange(32)[:, None]
    i = np.arange(4)[None, :]
    if trans:
        low, high = src[i, 2 * (lane % 4), lane // 4], src[i, 2 * (lane % 4) + 1, lane // 4]
    else:
        low, high = src[i, lane // 4, 2 * (lane % 4)], src[i, lane // 4, 2 * (lane % 4) + 1]
    assert np.array_equal(out, low.astype(np.uint32) | high.astype(np.uint32) << 16)


# --- the forward ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernels(host_kernels):
    """Every declared forward kernel, built once for the host."""
    return host_kernels("attention_tf32.cu", tf32_names(), FORWARD_PARAMS)


def run(kernels: dict, config: Tf32Config, precision: str, q: np.ndarray, k: np.ndarray,
        v: np.ndarray, **kw) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of the kernel of ``config`` at ``precision``
    (:func:`host_attention.launch_forward`)."""
    return launch_forward(kernels, config.name(precision), config, q, k, v, **kw)


_FORWARD_NAME = re.compile(
    r"sk_attn_fwd_tf32<(\d+), (\d+), (\d+), (\d+), (true|false), (\d+), (true|false)>")


def forward_tile(name: str) -> tuple[Tf32Config, str]:
    """The tile and precision of the forward kernel ``name`` (a name expression of
    :func:`tf32_names`), which :meth:`Tf32Config.name` gives back."""
    d, warps, bn, mt, mask, code, stage = _FORWARD_NAME.fullmatch(name).groups()
    config = Tf32Config(int(d), warps=int(warps), block_n=int(bn), m_tiles=int(mt),
                        mask=mask == "true", staged=stage == "true")
    precision = PRECISION_OF[int(code)]
    assert config.name(precision) == name, name
    return config, precision


def _tile_id(name: str) -> str:
    return "-".join(re.findall(r"\w+", name[name.index("<"):]))


def _forward_cases() -> list[tuple[str, dict]]:
    """(kernel, case) for every forward kernel :func:`tf32_names` declares: at head dim 64
    every case, those with a mask on the tiles built with the mask's code and the others on
    those built without; at the other head dims rows with no key and a window with causal
    and soft cap on the tiles without the mask's code, a mask on those with it."""
    pairs = []
    for name in tf32_names():
        config, _ = forward_tile(name)
        if config.head_dim == 64:
            chosen = [c for c in CASES if bool(c.get("mask")) == config.mask]
        else:
            chosen = [CASES[7]] if config.mask else [CASES[3], CASES[6]]
        pairs += [(name, c) for c in chosen]
    return pairs


FORWARD_CASES = _forward_cases()


@pytest.mark.parametrize(("name", "case"), FORWARD_CASES,
                         ids=[f"{_tile_id(n)}-{case_id(c)}" for n, c in FORWARD_CASES])
def test_forward_within_the_precision_bound(kernels, name: str, case: dict) -> None:
    """The forward kernel ``name`` against the float64 definition: every element of out and
    lse within the bound of spec "Precision" at its precision, rows with no allowed key
    (0, -inf), no NaN left."""
    config, precision = forward_tile(name)
    d = config.head_dim
    q, k, v, mask = inputs(d, d, case, seed=d * 100 + case["lq"] + case["lk"])
    opts = options(case)
    out, lse = run(kernels, config, precision, q, k, v, mask=mask, **opts)
    want, want_lse = ref.attention(q, k, v, mask=mask, **opts)
    out_bound, lse_bound = attention_bound(q, k, v, precision=precision, mask=mask, **opts)
    empty = want_lse == -np.inf
    assert np.all(lse[empty] == -np.inf) and np.all(out[empty] == 0), "empty rows"
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "NaN left"
    err = np.abs(out.astype(np.float64) - want)
    lerr = np.abs(lse[~empty].astype(np.float64) - want_lse[~empty])
    what = (f"{name}: out max error {err.max():.3g}, worst error/bound "
            f"{np.max(err / np.maximum(out_bound, 1e-300)):.3g}; lse max error "
            f"{lerr.max() if lerr.size else 0.0:.3g}")
    assert np.all(err <= out_bound), what
    assert np.all(lerr <= lse_bound[~empty]), what


# --- the backward -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backward_kernels(host_kernels):
    """Every declared backward kernel and its row preprocessing, built once for the host."""
    from softmaxkit_cupy.attention import BACKWARD_PARAMS, BACKWARD_PRE_PARAMS

    codes = {**dict.fromkeys(tf32_backward_names(), BACKWARD_PARAMS),
             **dict.fromkeys(tf32_backward_pre_names(), BACKWARD_PRE_PARAMS)}
    return host_kernels("attention_tf32.cu", list(codes), codes)


@pytest.fixture
def host_launches(backward_kernels, host_kernels, monkeypatch):
    """The TF32 adapter's device boundary moved to the host: ``_kernel`` names the host build
    of the backward (the mask's packing kernel, kernels/mask_bits.cu, built on first use),
    ``interop.launch`` runs it, and ``interop.empty`` gives NaN-filled float memory; the
    module."""
    from softmaxkit_cupy import attention_tf32

    move_to_host(monkeypatch, attention_tf32, dict(backward_kernels), host_kernels)
    return attention_tf32


_BACKWARD_NAME = re.compile(r"sk_attn_bwd_tf32<(\d+), (\d+), (\d+), (true|false), (\d+)>")


def backward_tile(name: str) -> tuple[Tf32BackwardConfig, str]:
    """The tile and precision of the backward kernel ``name`` (a name expression of
    :func:`tf32_backward_names`), which :meth:`Tf32BackwardConfig.name` gives back."""
    d, warps, bm, mask, code = _BACKWARD_NAME.fullmatch(name).groups()
    config = Tf32BackwardConfig(int(d), warps=int(warps), block_m=int(bm), mask=mask == "true")
    precision = PRECISION_OF[int(code)]
    assert config.name(precision) == name, name
    return config, precision


def _backward_cases() -> list[tuple[str, int, dict]]:
    """(kernel, head dim of the inputs, case) for every backward kernel
    :func:`tf32_backward_names` declares: at head dim 64 every case (the mask's on the tiles
    with the mask's code, the others on those without) and rows with no key at head dim 48
    (zero-padded to 64 by the adapter); at the other head dims grouped queries with an lse
    cotangent, or a mask."""
    pairs = []
    for name in tf32_backward_names():
        config, _ = backward_tile(name)
        d = config.head_dim
        if d == 64:
            pairs += [(name, d, c) for c in BACKWARD_CASES if bool(c.get("mask")) == config.mask]
            if not config.mask:
                pairs.append((name, 48, BACKWARD_CASES[2]))
        else:
            pairs.append((name, d, BACKWARD_CASES[5] if config.mask else BACKWARD_CASES[1]))
    return pairs


BACKWARD_RUNS = _backward_cases()


@pytest.mark.parametrize(("name", "d", "case"), BACKWARD_RUNS,
                         ids=[f"{_tile_id(n)}-d{d}-{case_id(c)}" for n, d, c in BACKWARD_RUNS])
def test_backward_against_float64(host_launches, name: str, d: int, case: dict) -> None:
    """The backward kernel ``name`` through its adapter (``attention_vjp`` given its tile) on
    torch CPU tensors, from the float64 forward's out and lse rounded to float32, against the
    float64 gradient, as backends/cupy/tests/test_tf32_gpu.py checks it on a device: relative
    Frobenius error of each gradient within 1e-4 at tf32x3 and 2e-2 at tf32, no NaN left (dk
    and dv made in NaN-filled memory), zero dq on rows with no allowed key."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp

    config, precision = backward_tile(name)
    q, k, v, mask = inputs(d, d, case, seed=d * 101 + case["lq"])
    opts = options(case)
    out64, lse64 = ref.attention(q, k, v, mask=mask, **opts)
    dout, dlse = cotangents(out64, lse64, case)
    want = ref.attention_vjp(q, k, v, dout, dlse=dlse, mask=mask, **opts)
    grads = host_launches.attention_vjp(
        xp, q=torch.from_numpy(q), k=torch.from_numpy(k), v=torch.from_numpy(v),
        out=torch.from_numpy(out64.astype(np.float32)),
        lse=torch.from_numpy(lse64.astype(np.float32)), dout=torch.from_numpy(dout),
        dlse=None if dlse is None else torch.from_numpy(dlse), scale=d ** -0.5,
        causal=opts.get("causal"), window=opts.get("window", (-1, -1)),
        mask=None if mask is None else torch.from_numpy(mask), softcap=opts.get("softcap"),
        precision=precision, config=config)
    tol = 1e-4 if precision == "tf32x3" else 2e-2
    for what, got, w in zip(("dq", "dk", "dv"), grads, want, strict=True):
        got = got.numpy().astype(np.float64)
        assert got.shape == w.shape, (what, got.shape, w.shape)
        assert not np.isnan(got).any(), f"{name} {what}: NaN left in the result"
        err = ref.rel_frobenius(got, w)
        assert err <= tol, f"{name} {case_id(case)} {what}: {err:.3g} > {tol}"
    empty = lse64 == -np.inf
    if empty.any():
        assert np.all(grads[0].numpy()[empty] == 0), "dq of a row with no allowed key"
