"""Paged attention's host side: the page divisor the kernel uses, the manifest's reasons, and
the calls the adapter serves without a launch.

The kernel itself needs a GPU (.gpu checks and the conformance kit there); here CPU PyTorch
tensors stand in for CUDA ones where the adapter makes a result without a launch, and the
reference backend is the oracle.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from softmaxkit_cupy import manifest as mf
from softmaxkit_cupy.configs import (
    ATTENTION_DTYPES,
    ATTENTION_HEAD_DIMS,
    all_modules,
    decode_config,
)
from softmaxkit_cupy.paged import page_divisor

import softmaxkit as sk
from softmaxkit.ops import Call


@pytest.mark.parametrize("page_size", [*range(1, 130), 1000, 4096, 12345, 2**20 + 1, 2**31 - 1])
def test_page_divisor_divides_every_31_bit_position(page_size) -> None:
    mul, shift = page_divisor(page_size)
    assert 0 < mul < 2**32 and shift < 64
    ends = np.array([0, 1, 2**23, 2**31 - 2, 2**31 - 1], dtype=np.uint64)
    near = np.arange(0, 2**31, max(1, 2**31 // 4000), dtype=np.uint64)
    p = np.unique(np.concatenate([
        ends, near, (near // page_size) * page_size,
        np.minimum((near // page_size) * page_size + page_size - 1, 2**31 - 1)]))
    # p * mul < 2**63: exact in uint64, as the kernel's 64-bit product
    got = (p * np.uint64(mul)) >> np.uint64(shift)
    np.testing.assert_array_equal(got, p // np.uint64(page_size))


def test_page_divisor_rejects_sizes_outside_31_bits() -> None:
    for bad in (0, -4, 2**31):
        with pytest.raises(ValueError, match="page_size"):
            page_divisor(bad)


def test_every_paged_kernel_is_in_a_module_the_ci_compiles() -> None:
    declared = {name for _, names in all_modules() for name in names}
    for dtype in ATTENTION_DTYPES:
        for d in ATTENTION_HEAD_DIMS:
            assert decode_config(d).name(dtype, paged=True) in declared


# (dtype, q [B, Hq, Lq, D], pools [P, Hk, S, D], Dv, table [B, max_pages], declined)
@pytest.mark.parametrize(
    ("dtype", "q", "pool", "dv", "table", "declined"),
    [
        ("bfloat16", (64, 32, 1, 128), (4096, 8, 16, 128), 128, (64, 2048), False),
        ("float16", (5, 4, 1, 64), (20, 2, 1, 64), 64, (5, 14), False),
        ("bfloat16", (3, 2, 8, 64), (9, 1, 4, 64), 64, (3, 5), False),     # 16 rows per head
        # more rows per key head than the decode kernel holds: the dense kernels' limits
        ("bfloat16", (3, 2, 9, 64), (9, 1, 4, 64), 64, (3, 5), False),     # 18 rows per head
        ("float16", (2, 32, 1, 128), (9, 1, 4, 128), 128, (2, 5), False),  # 32 heads per group
        ("bfloat16", (3, 2, 9, 264), (9, 1, 4, 264), 264, (3, 5), True),
        ("bfloat16", (70000, 2, 9, 64), (9, 1, 4, 64), 64, (70000, 5), True),
        # float32: the exact dense kernels over the gathered pages, up to 256
        ("float32", (2, 4, 1, 64), (9, 2, 4, 64), 64, (2, 5), False),
        ("float32", (2, 4, 1, 192), (9, 2, 4, 192), 128, (2, 5), False),
        ("float32", (2, 4, 1, 264), (9, 2, 4, 264), 264, (2, 5), True),
        ("float64", (2, 4, 1, 64), (9, 2, 4, 64), 64, (2, 5), True),
        *(("bfloat16", (2, 4, 1, d), (9, 2, 4, d), d, (2, 5), False)
          for d in (32, 80, 96, 160, 192, 256)),
        # head dimensions the kernel is not built for, and D != Dv: served zero-padded
        ("bfloat16", (2, 4, 1, 112), (9, 2, 4, 112), 112, (2, 5), False),
        ("bfloat16", (2, 4, 1, 128), (9, 2, 4, 128), 64, (2, 5), False),
        ("bfloat16", (2, 4, 1, 192), (9, 2, 4, 192), 128, (2, 5), False),
        ("bfloat16", (2, 4, 1, 264), (9, 2, 4, 264), 264, (2, 5), True),
        ("bfloat16", (2, 4, 1, 128), (9, 2, 4, 128), 300, (2, 5), True),
        # no query row, or no page in the table: served without a launch, at the kernel's
        # dtypes and head dimensions only
        ("bfloat16", (2, 4, 0, 64), (9, 2, 4, 64), 64, (2, 5), False),
        ("float16", (2, 64, 40, 128), (0, 2, 4, 128), 128, (2, 0), False),
        ("float16", (0, 4, 1, 64), (9, 2, 4, 64), 64, (0, 5), False),
        ("float32", (2, 4, 0, 64), (9, 2, 4, 64), 64, (2, 5), False),
        ("bfloat16", (2, 4, 1, 48), (0, 2, 4, 48), 48, (2, 0), False),
        ("bfloat16", (2, 4, 1, 264), (0, 2, 4, 264), 264, (2, 0), True),
        # launch limits: sequences on grid z, key heads on grid y, 32-bit key positions
        ("bfloat16", (70000, 2, 1, 64), (9, 2, 4, 64), 64, (70000, 5), True),
        ("bfloat16", (2, 70000, 1, 64), (9, 70000, 4, 64), 64, (2, 5), True),
        ("bfloat16", (2, 4, 1, 64), (9, 2, 16, 64), 64, (2, 2**19), True),
        ("bfloat16", (2, 4, 1, 64), (9, 2, 16, 64), 64, (2, 2**19 - 1), False),
    ],
)
def test_paged_reasons(dtype, q, pool, dv, table, declined) -> None:
    reason = mf.paged_reason(dtype, q, pool, pool[:3] + (dv,), table)
    assert (reason is not None) == declined, reason


def test_a_long_chunked_prefill_takes_the_dense_kernels_limits() -> None:
    """32 query rows per key head: beyond the decode kernel, served by the dense kernels,
    whose limits (not the decode kernel's) apply."""
    assert mf.paged_reason("bfloat16", (1, 8, 4, 64), (3, 1, 16, 64), (3, 1, 16, 64),
                           (1, 3)) is None
    reason = mf.paged_reason("bfloat16", (1, 70000, 4, 64), (3, 1, 16, 64), (3, 1, 16, 64),
                             (1, 3))
    assert reason is not None and "65535" in reason


def _paged_args(torch, dtype="bfloat16", d=64, lq=1, table_dtype=None):
    q = torch.zeros((2, 4, lq, d), dtype=getattr(torch, dtype))
    pool = torch.zeros((5, 2, 4, d), dtype=getattr(torch, dtype))
    table = torch.zeros((2, 3), dtype=table_dtype or torch.int32)
    lens = torch.tensor([3, 9], dtype=table_dtype or torch.int32)
    return {"q": q, "k_pages": pool, "v_pages": pool, "block_table": table, "seqlens": lens,
            "scale": 0.125, "causal": None, "window": (-1, -1), "softcap": None,
            "return_lse": True}


def test_can_run_paged_declines_host_arrays_mixed_libraries_and_dtypes( monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    args = _paged_args(torch)
    call = Call("paged_attention", None, "cpu", "bfloat16", args)
    assert "CUDA tensors" in mf.can_run(call)
    numpy_call = Call("paged_attention", np, "cpu", "float16",
                      {n: (a.float().numpy() if hasattr(a, "numpy") else a)
                       for n, a in args.items()})
    assert "CuPy arrays or PyTorch CUDA tensors" in mf.can_run(numpy_call)
    monkeypatch.setattr(mf, "_library",
                        lambda a: "torch" if isinstance(a, torch.Tensor) else None)
    assert mf.can_run(Call("paged_attention", None, "cuda", "bfloat16", args)) is True
    int64 = _paged_args(torch, table_dtype=torch.int64)
    assert mf.can_run(Call("paged_attention", None, "cuda", "bfloat16", int64)) is True
    mixed = dict(args, v_pages=args["v_pages"].half())
    assert "one dtype" in mf.can_run(Call("paged_attention", None, "cuda", "bfloat16", mixed))
    host_table = dict(args, block_table=args["block_table"].numpy())
    assert "one library" in mf.can_run(Call("paged_attention", None, "cuda", "bfloat16",
                                            host_table))
    long = _paged_args(torch, lq=5)  # 2 heads per group x 5 queries: 10 rows, served
    assert mf.can_run(Call("paged_attention", None, "cuda", "bfloat16", long)) is True
    longer = _paged_args(torch, lq=9)  # 18 rows: the dense kernels on the gathered pages
    assert mf.can_run(Call("paged_attention", None, "cuda", "bfloat16", longer)) is True


def test_paged_attention_is_declared_for_cuda_and_tried_before_the_reference() -> None:
    from softmaxkit_cupy.configs import F32_SERVED

    from softmaxkit import registry

    m = mf.manifest()
    entry = next(e for e in m["serves"] if "paged_attention" in e["ops"])
    f32 = ["float32"] if F32_SERVED else []
    assert entry["devices"] == ["cuda"] and entry["dtypes"] == [*ATTENTION_DTYPES, *f32]
    assert m["kernels"]["paged_attention"] == "softmaxkit_cupy.paged:paged_attention"
    registry.reload()
    try:
        for dtype in (*ATTENTION_DTYPES, *f32):
            order, _ = registry.candidates("paged_attention", "cuda", dtype)
            assert order.index("cupy") < order.index("reference"), (dtype, order)
            if "numba-cuda" in order:  # its float32 kernels are the slower ones
                assert order.index("cupy") < order.index("numba-cuda"), (dtype, order)
    finally:
        registry.reload()


def test_kit_paged_cases_at_the_kernels_head_dims_are_accepted(monkeypatch) -> None:
    """``can_run`` accepts every paged case of the kit in the kernel's dtypes at its head
    dimensions: CPU tensors stand in for CUDA ones and the reference computes, so this checks
    the reasons (the cases' decode and chunked-prefill shapes fit the kernel), not the
    kernel."""
    pytest.importorskip("torch")
    from softmaxkit import registry
    from softmaxkit.testing import check_backend

    monkeypatch.setattr(mf, "_library", lambda a: "torch")
    registry.register({
        "name": "cupy-paged-reasons",
        "serves": [{"ops": ["paged_attention"], "devices": ["cpu"]}],
        "kernels": {"paged_attention": "softmaxkit.reference.paged:paged_attention"},
        "can_run": "softmaxkit_cupy.manifest:can_run",
    })
    try:
        # each head dimension on its own: the kit runs most cases at the first one given
        results = [r for d in ATTENTION_HEAD_DIMS
                   for r in check_backend("cupy-paged-reasons", target="torch-cpu",
                                          ops=("paged_attention",), dtypes=ATTENTION_DTYPES,
                                          head_dims=[(d, d)])]
    finally:
        registry.unregister("cupy-paged-reasons")
    assert {r.case for r in results} >= {"paged_attention_decode",
                                         "paged_attention_chunked_prefill",
                                         "paged_attention_long_cache"}
    left = [f"{r.case}[{r.dtype}]: {r.status} {r.message}" for r in results
            if r.status != "passed"]
    assert not left, "\n".join(left)


# (B, Hq, Lq, D, pool [P, Hk, S], max_pages) of calls made without a launch
WITHOUT_WORK = [
    (2, 4, 1, 64, (0, 2, 4), 0),     # no page in the table: every sequence is empty
    (3, 2, 6, 128, (0, 1, 16), 0),   # ... with several queries each
    (2, 4, 0, 64, (5, 2, 4), 3),     # no query row
    (0, 4, 1, 128, (5, 2, 4), 3),    # no sequence
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", WITHOUT_WORK, ids=str)
def test_calls_without_work_match_the_reference(shape, dtype) -> None:
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import paged as adapter

    b, hq, lq, d, (pages, hk, size), max_pages = shape
    t = getattr(torch, dtype)
    q = torch.randn((b, hq, lq, d)).to(t)
    pool = torch.randn((pages, hk, size, d)).to(t)
    table = torch.zeros((b, max_pages), dtype=torch.int32)
    lens = torch.zeros((b,), dtype=torch.int32)
    out, lse = adapter.paged_attention(xp, q=q, k_pages=pool, v_pages=pool, block_table=table,
                                       seqlens=lens, scale=0.125, causal="bottom_right",
                                       window=(-1, -1), softcap=None, return_lse=True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    e_out, e_lse = sk.paged_attention(*(a.double().numpy() for a in (q, pool, pool)),
                                      table.numpy(), lens.numpy(), causal=True, scale=0.125,
                                      return_lse=True, backend="reference")
    assert tuple(out.shape) == e_out.shape and tuple(lse.shape) == e_lse.shape
    np.testing.assert_array_equal(out.double().numpy(), e_out)
    np.testing.assert_array_equal(lse.numpy(), e_lse)
    plain, none = adapter.paged_attention(xp, q=q, k_pages=pool, v_pages=pool,
                                          block_table=table, seqlens=lens, scale=0.125,
                                          causal=None, window=(-1, -1), softcap=None,
                                          return_lse=False)
    assert none is None and plain.shape == out.shape


_C_TO_NUMPY = {"long long": np.int64, "int": np.int32, "unsigned": np.uint32,
               "float": np.float32}


def _kernel_parameters(name: str) -> list[type]:
    """The numpy scalar type each parameter of ``__global__ ... name(...)`` in
    kernels/attention.cu takes (pointers as uint64), read from the source."""
    import re

    from softmaxkit_cupy.compiler import KERNELS

    text = (KERNELS / "attention.cu").read_text()
    head = re.search(rf"__global__ void __launch_bounds__\([^)]*\) {name}\(([^)]*)\)", text)
    assert head is not None, name
    types = []
    for param in head.group(1).split(","):
        words = param.replace("__restrict__", "").replace("const", "").split()
        if "*" in param:
            types.append(np.uint64)
        else:
            types.append(_C_TO_NUMPY[" ".join(words[:-1])])
    return types


def _struct_codes(kernel: str) -> str:
    """The :mod:`struct` codes of ``kernel``'s parameters, as a launch packs them."""
    code = {np.uint64: "Q", np.int64: "q", np.int32: "i", np.uint32: "I", np.float32: "f"}
    return "".join(code[t] for t in _kernel_parameters(kernel))


def test_merge_launch_packs_the_kernels_parameter_list() -> None:
    from softmaxkit_cupy.attention import _MERGE_PARAMS

    assert _MERGE_PARAMS == _struct_codes("sk_merge_attn")


# (window, keys the grid spans, (left, right) passed) with max_pages * S = 1120, Lq = 2
WINDOWS = [
    ((7, -1), 9, (7, -1)),           # a sliding window: the grid spans left + Lq keys
    ((-1, -1), 1120, (-1, -1)),      # no window: the table's capacity
    ((-1, 4), 1120, (-1, 4)),        # a right bound alone leaves every key reachable
    ((1500, 2**40), 1120, (1122, 1122)),  # bounds past capacity + Lq exclude nothing
]


@pytest.mark.parametrize("table_dtype", ["int32", "int64"])
@pytest.mark.parametrize(("window", "span", "sent"), WINDOWS)
def test_paged_launch_passes_the_kernels_parameters_in_order(monkeypatch, table_dtype, window,
                                                             span, sent) -> None:
    """The adapter's launch against the kernel's parameter list (count and scalar type of
    each), and the values that place the pools, the table and the splits; CPU tensors stand
    in for CUDA ones and the launch is recorded, not run."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import attention as launcher
    from softmaxkit_cupy import interop
    from softmaxkit_cupy import paged as adapter

    launches = []
    names = []
    # the paged adapter launches through attention.split_decode
    monkeypatch.setattr(launcher, "_kernel", lambda name: names.append(name) or name)
    monkeypatch.setattr(launcher, "_multiprocessors_of", lambda device: 132)
    monkeypatch.setattr(interop, "shared_limit", lambda device: 227 * 1024)  # the H200's
    monkeypatch.setattr(launcher, "_merge", lambda outs, lses, dtype: (
        torch.zeros(outs.shape[1:]), torch.zeros(lses.shape[1:])))
    monkeypatch.setattr(interop, "launch", lambda *a: launches.append(a))
    b, hq, hk, lq, d, size, max_pages = 3, 8, 2, 2, 128, 16, 70
    q = torch.zeros((b, hq, lq, d), dtype=torch.bfloat16)
    pools = torch.zeros((2, 400, hk, size, d), dtype=torch.bfloat16)  # k and v in one cache
    itype = getattr(torch, table_dtype)
    table = torch.zeros((b, max_pages), dtype=itype)
    lens = torch.tensor([5, 1000, 0], dtype=itype)
    adapter.paged_attention(xp, q=q, k_pages=pools[0], v_pages=pools[1], block_table=table,
                            seqlens=lens, scale=0.1, causal="bottom_right", window=window,
                            softcap=None, return_lse=True)
    (kernel, like, grid, block, codes, args, shared), = launches
    config = decode_config(d)
    assert names == [config.name("bfloat16", paged=True)] and kernel == names[0] and like is q
    assert codes == _struct_codes("sk_attn_decode_paged")  # the kernel's parameter list
    assert len(args) == len(codes)
    struct.Struct("@" + codes).pack(*args)  # every value fits its parameter's type
    splits, chunk = launcher.splits_for(b * hk, span, 132, config)
    assert grid == (splits, hk, b) and splits * chunk >= span
    assert block == config.threads and shared == config.shared_bytes()
    page = hk * size * d
    assert [int(a) for a in args[7:17]] == [hq * lq * d, lq * d, d, page, size * d, d, page,
                                            size * d, d, max_pages]
    assert int(args[1]) == pools[0].data_ptr() and int(args[2]) == pools[1].data_ptr()
    mul, shift = page_divisor(size)
    assert [int(a) for a in args[17:24]] == [size, mul, shift, hq, hk, lq, chunk]
    assert [float(a) for a in args[25:]] == [0.0, 1.0, *sent]


def _allowed(lk, lq, causal, left, right, shift=0):
    """Per query, the keys the spec allows (``shift`` moves the diagonal down by that many
    keys and the key indices up, as the kernel's ``first`` does)."""
    rows = []
    for i in range(lq):
        d = i + lk - lq
        rows.append({j + shift for j in range(lk - shift)
                     if (not causal or j <= d - shift) and (left < 0 or j >= d - shift - left)
                     and (right < 0 or j <= d - shift + right)})
    return rows


def test_window_span_and_first_key_leave_out_only_keys_no_query_sees() -> None:
    """The kernel walks keys ``[first, seqlens[b])`` with ``first = max(0, seqlens[b] - lq -
    left)`` (left >= 0), its diagonal shifted by ``first``, over splits spanning
    ``window_span``'s keys: the keys allowed are the spec's, on random sequences."""
    from softmaxkit_cupy.attention import splits_for
    from softmaxkit_cupy.paged import window_span

    rng = np.random.default_rng(5)
    for _ in range(1500):
        capacity = int(rng.choice([1, 4, 16, 64, 300, 1000]))
        lk, lq = int(rng.integers(0, capacity + 1)), int(rng.integers(1, 17))
        causal = bool(rng.random() < 0.5)
        window = (int(rng.choice([-1, 0, 1, 3, 50, 700, 2**40])),
                  int(rng.choice([-1, 0, 2, 40, 2**40])))
        left, right, span = window_span(window, lq, capacity)
        assert max(left, right) < 2**31
        first = max(0, lk - lq - left) if left >= 0 else 0
        splits, chunk = splits_for(4, span, 132, decode_config(128))
        assert lk - first <= splits * chunk  # every key the kernel must see has a split
        got = _allowed(lk, lq, causal, left, right, shift=first)
        assert got == _allowed(lk, lq, causal, *window), (lk, lq, causal, window, capacity)


def test_dense_decode_launch_packs_the_kernels_parameter_list() -> None:
    from softmaxkit_cupy.attention import DECODE_PARAMS

    assert DECODE_PARAMS == _struct_codes("sk_attn_decode")


@pytest.mark.parametrize(("causal", "window", "lq", "dims", "dtype"), [
    (True, (-1, -1), 9, (64, 64), "float64"), (False, (-1, -1), 9, (64, 64), "float64"),
    (True, (5, -1), 12, (64, 64), "float64"), (True, (-1, 2), 9, (192, 128), "float64"),
    # more queries than a sequence's keys: empty rows
    (True, (-1, -1), 20, (40, 40), "float64"),
    (True, (-1, -1), 1, (64, 64), "float32"), (False, (3, -1), 2, (192, 128), "float32"),
])
def test_a_long_chunked_prefill_runs_the_dense_kernels_on_the_gathered_pages(
        monkeypatch, causal, window, lq, dims, dtype) -> None:
    """Calls with more query rows per key head than the decode kernel holds, and float32
    calls (decoding too) on a device whose shared memory cannot hold the float32 decode
    tiles (48 KB a block here), go to the dense attention adapter (the reference's dense
    attention stands in for its kernels here) with the pages in use gathered and each
    sequence's length and alignment as a mask; the result is the float64 definition on
    NaN-poisoned pages (in float32, within its tolerances)."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as txp
    from softmaxkit_cupy import interop
    from softmaxkit_cupy import paged as adapter

    from softmaxkit.reference.attention import attention as dense
    from softmaxkit.testing.paged_cases import make_cache, paged_definition

    seen: list = []

    def stand_in(xp, **kw):
        seen.append(kw)
        return dense(xp, **kw)

    monkeypatch.setattr(adapter, "attention", stand_in)
    monkeypatch.setattr(adapter, "_paged_attention", None)  # the decode kernel must not run
    monkeypatch.setattr(interop, "shared_limit", lambda device: 48 * 1024)
    d, dv = dims
    rng = np.random.default_rng(lq)
    k, v, table, lens = make_cache(rng, [5, 0, 19], 4, 2, d, dv)
    q = rng.normal(size=(3, 4, lq, d))
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    out, lse = adapter.paged_attention(
        txp, q=torch.from_numpy(q), k_pages=torch.from_numpy(k), v_pages=torch.from_numpy(v),
        block_table=torch.from_numpy(table), seqlens=torch.from_numpy(lens), scale=d ** -0.5,
        causal="bottom_right" if causal else None, window=window, softcap=None,
        return_lse=True)
    want, want_lse = paged_definition(*(a.astype(np.float64) for a in (q, k, v)), table, lens,
                                      causal=causal, window=window)[:2]
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == "float64" else dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.numpy(), want, **tol)
    np.testing.assert_allclose(lse.numpy(), want_lse, **tol)
    (call,) = seen
    assert call["causal"] is None and call["window"] == (-1, -1)
    assert tuple(call["mask"].shape) == (3, 4, lq, int(table.shape[1]) * 4)
