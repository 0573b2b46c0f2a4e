"""The Hopper attention kernels (kernels/attention_sm90.cu, attention_bwd_sm90.cu: sm_90a
wgmma) run on the CPU (tests/host/primitives.h: wgmma.mma_async computed when issued, its
shared-memory operands read through their matrix descriptors and swizzles, its register
operand from the warp's fragments; the rest as in tests/test_attention_host.py).

Checked here: every declared Hopper backward tile and every one built on request only
(``configs.SM90_BACKWARD_CONFIGS``, ``SM90_BACKWARD_ALTERNATIVES``, the 64-byte rows of the
tiles at 32, 96 and 192 among them), through the adapter's ``attention_vjp`` with
``config=`` on torch CPU tensors, against the float64 gradients within the kit's
tolerances: causal alignments, grouped queries with an lse cotangent, rows with no key, a
window with a soft cap, a boolean mask; the packed backward on the same tiles
(``varlen_attention_vjp``: ragged sequences, one without queries and one without keys); a
call zero-padded to its tiles; and every Hopper forward tile, declared and alternative
(``SM90_CONFIGS``, ``SM90_ALTERNATIVES``), through ``attention``, and each declared one
through the packed ``varlen_attention``.  The tiles the device runs
and its tests check (tests/test_sm90_bwd_gpu.py, test_sm90_gpu.py), on panels of 64 columns
and of 32, check the emulation's reading of the descriptors and both swizzles; the same
reading then checks a tile before any device has run it.  The inline PTX of the products,
which the emulation replaces, is read apart: each binds its accumulators and inputs in order.
What the emulation cannot show is the GPU test's: timing, the hardware's own reading of a
descriptor where it would differ from the PTX ISA's, and orders of the threads between
barriers the emulation does not take.

Run: ``python -m pytest -q backends/cupy/tests/test_sm90_host.py``.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

import pytest
from host_attention import (
    BACKWARD_CASES,
    CASES,
    case_id,
    inputs,
    options,
    represented,
)
from softmaxkit_cupy.attention import (
    BACKWARD_DQ_PARAMS,
    BACKWARD_PARAMS,
    BACKWARD_PRE_PARAMS,
    FORWARD_PARAMS,
)
from softmaxkit_cupy.configs import (
    ATTENTION_DTYPES,
    SM90_ALTERNATIVES,
    SM90_BACKWARD_ALTERNATIVES,
    SM90_BACKWARD_CONFIGS,
    SM90_CONFIGS,
    backward_dq_name,
    backward_pre_name,
)

from softmaxkit.testing import materialized as ref

TILES = [*SM90_BACKWARD_CONFIGS.values(), *SM90_BACKWARD_ALTERNATIVES]
"""The Hopper backward tiles: declared, then built on request only."""

RUNS = [(tile, ATTENTION_DTYPES[i % 2], BACKWARD_CASES[i % len(BACKWARD_CASES)])
        for i, tile in enumerate(TILES)] + [
    (SM90_BACKWARD_ALTERNATIVES[0], "float16", c) for c in BACKWARD_CASES[1:]]
"""(tile, dtype, case): each tile on one case, the dtypes and cases in turn; the first
alternative (32, two warpgroups) on every case (a mask among them)."""


PADDED = (SM90_BACKWARD_CONFIGS[96], "bfloat16")
"""The tile and dtype of a call zero-padded to its tiles (head dim 80 on the tiles of 96)."""


@pytest.fixture(scope="module")
def sm90_kernels(host_kernels):
    """The runs' Hopper backward kernels (masked builds where a case has a mask) and the row
    preprocessing and dQ conversion of their head dims, built once for the host."""
    codes = {}
    for tile, dtype, case in RUNS:
        built = dataclasses.replace(tile, mask=bool(case.get("mask")))
        codes[built.name(dtype)] = BACKWARD_PARAMS
    codes[PADDED[0].name(PADDED[1])] = BACKWARD_PARAMS
    bwd = host_kernels("attention_bwd_sm90.cu", list(codes), codes)
    rows = {}
    for tile in TILES:
        for t in ATTENTION_DTYPES:
            rows[backward_pre_name(t, tile.head_dim)] = BACKWARD_PRE_PARAMS
            rows[backward_dq_name(t, tile.head_dim)] = BACKWARD_DQ_PARAMS
    return {**bwd, **host_kernels("attention_bwd.cu", list(rows), rows)}


@pytest.mark.parametrize(("tile", "dtype", "case"), RUNS,
                         ids=[f"{t.head_dim}-{t.warpgroups}wg-{d}-{case_id(c)}"
                              for t, d, c in RUNS])
def test_hopper_backward_against_float64(sm90_kernels, host_kernels, monkeypatch, tile,
                                         dtype: str, case: dict) -> None:
    """The Hopper backward tile through the adapter (``attention_vjp`` with ``config=``:
    sk_attn_bwd_pre, the tile, sk_attn_bwd_dq) against the float64 gradient
    (``test_attention_host.backward_against_float64``: each gradient within the kit's
    tolerance, no NaN left, zero dq on rows with no allowed key)."""
    from host_attention import move_to_host
    from softmaxkit_cupy import attention
    from test_attention_host import backward_against_float64

    move_to_host(monkeypatch, attention, sm90_kernels, host_kernels)
    d = tile.head_dim
    backward_against_float64(attention, dtype, d, case, seed=d * 7 + case["lq"],
                             config=dataclasses.replace(tile, mask=bool(case.get("mask"))))


def test_config_pads_a_call_to_its_tiles(sm90_kernels, host_kernels, monkeypatch) -> None:
    """A call below its tiles' head dim (80 on the tiles of 96) runs zero-padded to it and
    gives the gradients of its own width (``head_dims.config_width``)."""
    from host_attention import move_to_host
    from softmaxkit_cupy import attention, head_dims
    from test_attention_host import backward_against_float64

    tile, dtype = PADDED
    move_to_host(monkeypatch, attention, sm90_kernels, host_kernels)
    backward_against_float64(attention, dtype, 80, BACKWARD_CASES[0], seed=80, config=tile)
    assert head_dims.config_width(tile, 80, 80) == 96
    assert head_dims.config_width(tile, 96, 96) is None
    with pytest.raises(ValueError, match="cannot run D=128"):
        head_dims.config_width(tile, 128, 128)


VARLEN_TILES = [SM90_BACKWARD_CONFIGS[64], *SM90_BACKWARD_ALTERNATIVES]
"""The packed backward's Hopper tiles run here: a declared one, and every alternative."""


@pytest.fixture(scope="module")
def sm90_varlen_kernels(host_kernels):
    """The packed Hopper backward of :data:`VARLEN_TILES` in bfloat16, with the packed row
    preprocessing and dQ conversion of their head dims, built once for the host."""
    from softmaxkit_cupy.configs import backward_dq_varlen_name, backward_pre_varlen_name
    from softmaxkit_cupy.varlen import VARLEN_BACKWARD_PARAMS, VARLEN_DQ_PARAMS, VARLEN_PRE_PARAMS

    codes = {t.varlen_name("bfloat16"): VARLEN_BACKWARD_PARAMS for t in VARLEN_TILES}
    rows = {}
    for t in VARLEN_TILES:
        rows[backward_pre_varlen_name("bfloat16", t.head_dim)] = VARLEN_PRE_PARAMS
        rows[backward_dq_varlen_name("bfloat16", t.head_dim)] = VARLEN_DQ_PARAMS
    return {**host_kernels("attention_bwd_sm90.cu", list(codes), codes),
            **host_kernels("attention_bwd.cu", list(rows), rows)}


@pytest.mark.parametrize("tile", VARLEN_TILES, ids=lambda t: f"{t.head_dim}-{t.warpgroups}wg")
def test_hopper_varlen_backward_against_float64(sm90_varlen_kernels, host_kernels,
                                                monkeypatch, tile) -> None:
    """The packed Hopper backward tile through ``varlen_attention_vjp`` with ``config=``:
    ragged sequences (one without queries, one without keys) with an lse cotangent, against
    the float64 gradients of each sequence (``test_attention_host.
    varlen_backward_against_float64``)."""
    from test_attention_host import _adapters_on_host, varlen_backward_against_float64

    _adapters_on_host(monkeypatch, dict(sm90_varlen_kernels), host_kernels)
    varlen_backward_against_float64(
        "bfloat16", tile.head_dim, [(50, 70), (0, 30), (33, 33), (20, 0), (70, 45)],
        dict(causal="bottom_right"), True, config=tile)


FORWARD_TILES = [*SM90_CONFIGS.values(), *SM90_ALTERNATIVES]
"""The Hopper forward tiles: declared, then built on request only."""

FORWARD_RUNS = [(tile, ATTENTION_DTYPES[i % 2], c)
                for i, tile in enumerate(FORWARD_TILES)
                for c in CASES[i % 3::3] if not c.get("mask")]
"""(tile, dtype, case): each tile on every third unmasked case, the dtypes in turn."""


@pytest.fixture(scope="module")
def sm90_forward_kernels(host_kernels):
    """The runs' Hopper forward kernels, built once for the host."""
    codes = {tile.name(dtype): FORWARD_PARAMS for tile, dtype, _ in FORWARD_RUNS}
    return host_kernels("attention_sm90.cu", list(codes), codes)


@pytest.mark.parametrize(("tile", "dtype", "case"), FORWARD_RUNS,
                         ids=[f"{t.head_dim}-{t.block_n}-{d}-{case_id(c)}"
                              for t, d, c in FORWARD_RUNS])
def test_hopper_forward_against_float64(sm90_forward_kernels, host_kernels, monkeypatch, tile,
                                        dtype: str, case: dict) -> None:
    """The Hopper forward tile through the adapter (``attention`` with ``config=``) into
    results that held NaN, within the kit's tolerances of the float64 definition on the
    represented inputs."""
    pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from host_attention import move_to_host
    from softmaxkit_cupy import attention
    from test_attention_host import _check_forward, _torch

    move_to_host(monkeypatch, attention, sm90_forward_kernels, host_kernels)
    d = tile.head_dim
    q, k, v, _ = inputs(d, d, case, seed=d * 5 + case["lq"])
    q, k, v = (represented(a, dtype) for a in (q, k, v))
    opts = options(case)
    out, lse = attention.attention(
        xp, q=_torch(q, dtype), k=_torch(k, dtype), v=_torch(v, dtype), scale=d ** -0.5,
        causal=opts.get("causal"), window=opts.get("window", (-1, -1)), mask=None,
        softcap=opts.get("softcap"), return_lse=True, config=tile)
    want, want_lse = ref.attention(q, k, v, **opts)
    _check_forward(dtype, out.float().numpy(), lse.numpy(), want, want_lse,
                   f"{dtype} tile {tile} {case_id(case)}")


VARLEN_FORWARD_RUNS = [
    (tile, ATTENTION_DTYPES[i % 2], lengths, opts)
    for i, tile in enumerate(SM90_CONFIGS.values())
    for lengths, opts in [[([(70, 100), (0, 30), (33, 33), (90, 20)], {}),
                           ([(40, 60), (100, 50), (1, 80)], dict(causal="bottom_right")),
                           ([(80, 80), (35, 130)], dict(causal="top_left", window=(30, 5),
                                                         softcap=5.0))][i % 3]]]
"""(tile, dtype, per-sequence (Lq, Lk), options): each declared Hopper forward tile on ragged
sequences, the dtypes and options in turn."""


@pytest.fixture(scope="module")
def sm90_varlen_forward_kernels(host_kernels):
    """The runs' packed Hopper forward kernels, built once for the host."""
    from softmaxkit_cupy.varlen import VARLEN_PARAMS

    codes = {tile.varlen_name(dtype): VARLEN_PARAMS for tile, dtype, _, _ in VARLEN_FORWARD_RUNS}
    return host_kernels("attention_sm90.cu", list(codes), codes)


@pytest.mark.parametrize(("tile", "dtype", "lengths", "opts"), VARLEN_FORWARD_RUNS,
                         ids=[f"{t.head_dim}-{t.block_n}-{d}-{len(s)}seqs-{case_id(o) or 'plain'}"
                              for t, d, s, o in VARLEN_FORWARD_RUNS])
def test_hopper_varlen_forward_against_float64(sm90_varlen_forward_kernels, host_kernels,
                                               monkeypatch, tile, dtype: str, lengths,
                                               opts: dict) -> None:
    """The packed Hopper forward tile through ``varlen_attention`` with ``config=``: each
    sequence's rows within the kit's tolerances of the float64 definition on the sequence
    alone (``test_attention_host.varlen_forward_against_float64``)."""
    from test_attention_host import _adapters_on_host, varlen_forward_against_float64

    _adapters_on_host(monkeypatch, dict(sm90_varlen_forward_kernels), host_kernels)
    varlen_forward_against_float64(dtype, tile.head_dim, lengths, opts, config=tile)


# a product of kernels/wgmma.cuh, preprocessed: name, accumulators, input type, asm body
_PRODUCT = re.compile(r"static __device__ __forceinline__ void (\w+)\(float \(&d\)\[(\d+)\],"
                      r".*?(sk_bf16|__half)\) \{\s*asm volatile\((.*?)\);", re.S)


def test_wgmma_products_bind_their_operands_in_order() -> None:
    """The inline PTX of each warpgroup product (kernels/wgmma.cuh), which the emulation
    replaces and so cannot check: m64nNk16 of the overload's input type into N / 2
    accumulators, its list %0 .. %(N / 2 - 1) bound to d[0] .. d[N / 2 - 1] in order, then
    the inputs in order (A's registers or descriptor, B's descriptor), the predicate from the
    last (acc), and the immediates of its operand layout."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    from softmaxkit_cupy.compiler import KERNELS

    text = re.sub(r"^#(include|pragma).*$", "", (KERNELS / "wgmma.cuh").read_text(),
                  flags=re.M)
    done = subprocess.run([gxx, "-E", "-P", "-x", "c++", "-"], input=text,
                          capture_output=True, text=True, check=True)
    tails = {"ss": "1, 1, 0, 0", "rs": "1, 1, 1", "sst": "1, 1, 1, 1"}
    inputs = {"ss": ["a", "b", "acc"], "sst": ["a", "b", "acc"],
              "rs": ["a[0]", "a[1]", "a[2]", "a[3]", "b", "acc"]}
    products = _PRODUCT.findall(done.stdout)
    assert len(products) == done.stdout.count("wgmma.mma_async"), "each product read"
    found = set()
    for kind, count, tag, body in products:
        ptx, constraints = body.split(":", 1)
        ptx = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', ptx))
        r = int(count)
        kinds = "bf16" if tag == "sk_bf16" else "f16"
        head = f"wgmma.mma_async.sync.aligned.m64n{2 * r}k16.f32.{kinds}.{kinds} "
        assert head in ptx, (kind, r, tag)
        operands = [int(x) for x in re.findall(r"%(\d+)", ptx.split(head)[1])]
        n_in = len(inputs[kind])
        assert operands == list(range(r + n_in - 1)), (kind, r, tag)
        assert f"setp.ne.b32 p, %{r + n_in - 1}, 0;" in ptx, (kind, r, tag)
        assert ptx.endswith(f"p, {tails[kind]};\\n}}\\n"), (kind, r, tag)
        outs = re.findall(r'"\+f"\s*\(\s*d\s*\[([^\]]*)\]\s*\)', constraints)
        assert [sum(int(x) for x in i.split("+")) for i in outs] == list(range(r)), (
            kind, r, tag)
        ins = re.findall(r'"[rl]"\s*\(([^)]*)\)', constraints)
        assert [i.replace(" ", "") for i in ins] == inputs[kind], (kind, r, tag)
        found.add((kind, 2 * r, tag))
    assert {("rs", 192, "sk_bf16"), ("rs", 192, "__half")} <= found
