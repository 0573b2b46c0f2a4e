"""Packed launches: the parameter lists the adapters state match the kernels' C signatures.

A code that disagrees with its C parameter would shift every later argument in the buffer;
this reads each kernel's parameter list from its source and compares.
"""

from __future__ import annotations

import re
from importlib import resources

import pytest
from softmaxkit_cupy import attention, mask_bits, rows, varlen

_C_CODES = {"long long": "q", "int": "i", "float": "f"}


def _parameter_codes(source: str, kernel: str) -> str:
    """The struct codes of ``kernel``'s parameters in ``source`` (pointers as addresses)."""
    match = re.search(rf"\b{kernel}\(([^)]*)\)\s*{{", source)
    assert match, f"no definition of {kernel}"
    codes = ""
    for param in match.group(1).split(","):
        decl = re.sub(r"\b(const|__restrict__)\b", "", param).split()
        ctype = " ".join(decl[:-1])
        codes += "Q" if "*" in param else _C_CODES[ctype]
    return codes


def _source(name: str) -> str:
    text = resources.files("softmaxkit_cupy").joinpath("kernels", name).read_text()
    return text + "".join(resources.files("softmaxkit_cupy").joinpath("kernels", inc)
                          .read_text() for inc in re.findall(r'#include "(\w+\.cuh)"', text))


@pytest.mark.parametrize(("file", "kernels", "codes"), [
    ("rows.cu", ("sk_rows", "sk_rows_cluster", "sk_rows16", "sk_rows16_staged",
                 "sk_rows16_persist"), rows._ROW_PARAMS),
    ("rowgrads.cu", ("sk_vjp",), rows._VJP_PARAMS),
    ("rowgrads.cu", ("sk_xent",), rows._XENT_PARAMS),
    ("mask_bits.cu", ("sk_mask_bits",), mask_bits.MASK_BITS_PARAMS),
    ("attention.cu", ("sk_attn_fwd",), attention.FORWARD_PARAMS),
    ("attention_sm90.cu", ("sk_attn_fwd_sm90",), attention.FORWARD_PARAMS),
    ("attention.cu", ("sk_attn_decode",), attention.DECODE_PARAMS),
    ("attention.cu", ("sk_merge_attn",), attention._MERGE_PARAMS),
    ("attention_bwd.cu", ("sk_attn_bwd_pre",), attention.BACKWARD_PRE_PARAMS),
    ("attention_bwd.cu", ("sk_attn_bwd",), attention.BACKWARD_PARAMS),
    ("attention_bwd_sm90.cu", ("sk_attn_bwd_sm90",), attention.BACKWARD_PARAMS),
    ("attention_bwd.cu", ("sk_attn_bwd_dq",), attention.BACKWARD_DQ_PARAMS),
    ("attention.cu", ("sk_attn_fwd_varlen",), varlen.VARLEN_PARAMS),
    ("attention_sm90.cu", ("sk_attn_fwd_sm90_varlen",), varlen.VARLEN_PARAMS),
    ("attention_bwd.cu", ("sk_attn_bwd_pre_varlen",), varlen.VARLEN_PRE_PARAMS),
    ("attention_bwd.cu", ("sk_attn_bwd_varlen",), varlen.VARLEN_BACKWARD_PARAMS),
    ("attention_bwd_sm90.cu", ("sk_attn_bwd_sm90_varlen",), varlen.VARLEN_BACKWARD_PARAMS),
    ("attention_bwd.cu", ("sk_attn_bwd_dq_varlen",), varlen.VARLEN_DQ_PARAMS),
])
def test_stated_parameters_match_the_kernels(file, kernels, codes):
    source = _source(file)
    for kernel in kernels:
        assert _parameter_codes(source, kernel) == codes, kernel


@pytest.mark.parametrize(("capability", "shared"), [(80, 163 * 1024), (86, 99 * 1024),
                                                   (90, 227 * 1024)])
def test_attention_launches_pack_every_parameter(monkeypatch, capability, shared):
    """The dense forward and backward launch with as many values as their parameter lists
    state, each of which fits its type, in the order the kernels read them, on the tiles that
    fit the device's shared memory (CPU tensors stand in for CUDA ones; the launches are
    recorded, not run)."""
    import contextlib
    import struct

    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    from softmaxkit_cupy import interop

    launches = []
    monkeypatch.setattr(attention, "_kernel", lambda name: name)
    monkeypatch.setattr(attention, "_capability_of", lambda device: capability)
    monkeypatch.setattr(interop, "shared_limit", lambda device: shared)
    monkeypatch.setattr(interop, "launch_context", lambda a: contextlib.nullcontext())
    monkeypatch.setattr(interop, "launch", lambda *a: launches.append(a))
    b, hq, hk, lq, lk, d = 2, 4, 2, 100, 130, 128
    q = torch.zeros((b, hq, lq, d), dtype=torch.bfloat16)
    k, v = (torch.zeros((b, hk, lk, d), dtype=torch.bfloat16) for _ in range(2))
    out, lse = attention.attention(xp, q=q, k=k, v=v, scale=0.1, causal="bottom_right",
                                   window=(7, -1), mask=None, softcap=None, return_lse=True)
    attention.attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=out, scale=0.1,
                            causal="bottom_right", window=(7, -1), mask=None, softcap=2.0)
    expected = [attention.FORWARD_PARAMS, attention.BACKWARD_PRE_PARAMS,
                attention.BACKWARD_PARAMS, attention.BACKWARD_DQ_PARAMS]
    assert [launch[4] for launch in launches] == expected
    for name, like, _grid, _block, codes, args, *_shared in launches:
        assert like is q and len(args) == len(codes), name
        struct.Struct("@" + codes).pack(*args)  # every value fits its parameter's type
    fwd, _, main, _ = (launch[5] for launch in launches)
    # the scalars after the addresses and strides: sizes, then scale, softcap, the options
    assert [float(a) for a in fwd[18:]] == [hq, hk, lq, lk, pytest.approx(0.1), 0.0,
                                            lk - lq, 1, 7, -1]
    config = attention.backward_config_for(capability, d, False, shared)
    assert [float(a) for a in main[25:]] == [hq, hk, lq, lk,
                                             -(-lq // config.block_m) * config.block_m,
                                             pytest.approx(0.1), 2.0, lk - lq, 1, 7, -1]
    # the backward's launch: its tiles' block, grid and shared memory, within the device's
    _name, _like, grid, block, _codes, _args, bytes_ = launches[2]
    assert (block, grid[0], bytes_) == (config.threads, -(-lk // config.block_n),
                                        config.shared_bytes())
    assert bytes_ <= shared


def test_a_launch_raises_its_kernels_shared_memory_limit_once_per_device_and_size():
    """The limit is raised on the device the launch runs on, when the launch asks for more than
    the default or than what was raised there before, and never lowered; the default is
    what the kernel's static shared memory leaves of 48 KB."""
    from types import SimpleNamespace

    from softmaxkit_cupy import launches

    class Kernel:
        def __init__(self, static: int = 0) -> None:
            self.kernel = SimpleNamespace(ptr=1234)
            self.shared_size_bytes = static
            self.raised: list[int] = []

        @property
        def max_dynamic_shared_size_bytes(self) -> int:
            return self.raised[-1] if self.raised else 0

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, value: int) -> None:
            self.raised.append(value)

    kernel, small = Kernel(), Kernel(static=416)
    try:
        assert launches.function(kernel, 0, 0) == 1234
        assert launches.function(kernel, 0, 48 * 1024) == 1234 and kernel.raised == []
        launches.function(kernel, 0, 100_000)
        launches.function(kernel, 0, 100_000)
        launches.function(kernel, 0, 60_000)
        assert kernel.raised == [100_000]
        launches.function(kernel, 1, 60_000)  # another device: its own limit
        launches.function(kernel, 0, 150_000)
        assert kernel.raised == [100_000, 60_000, 150_000]
        # 416 bytes of static shared memory: 48 KB of dynamic memory no longer fit by default
        launches.function(small, 0, 48 * 1024 - 416)
        assert small.raised == []
        launches.function(small, 0, 48 * 1024)
        assert small.raised == [48 * 1024]
    finally:
        for k in (kernel, small):
            for device in (0, 1):
                launches._functions.pop((id(k), device), None)


def test_rows_ready_keeps_aligned_rows_and_copies_the_others():
    """The adapters' operands: a contiguous tensor with 16-byte rows is used as it is; a
    transposed one and a view starting off a 16-byte boundary are copied into 16-byte aligned
    rows with unit stride, holding the same values."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp

    base = torch.arange(2 * 3 * 40 * 64, dtype=torch.float32).reshape(2, 3, 40, 64)
    a = base.to(torch.bfloat16)
    assert attention._rows_ready(xp, a) is a
    for view in (a.transpose(2, 3), a[..., 1:57]):
        got = attention._rows_ready(xp, view)
        assert got is not view and torch.equal(got, view)
        assert got.stride(-1) == 1 and got.data_ptr() % 16 == 0
        assert all((s * got.element_size()) % 16 == 0 for s in got.stride()[:-1])


def test_every_attention_kernel_is_found_in_its_source_and_module() -> None:
    """Each declared attention kernel and each alternative is looked up in the source and
    a module that declare it (so it is built with its module); any other configuration
    asked for explicitly is in none (built alone)."""
    from softmaxkit_cupy.configs import (
        BackwardConfig,
        all_modules,
        alternative_names,
        backward_alternative_names,
        decode_alternative_names,
    )

    sources = {"attention.cu", "attention_bwd.cu", "attention_sm90.cu", "attention_bwd_sm90.cu"}
    declared = [(f, n) for f, names in all_modules() if f in sources for n in names]
    alternatives = [("attention.cu", n) for n in (*alternative_names(),
                                                  *decode_alternative_names())]
    alternatives += [("attention_bwd.cu", n) for n in backward_alternative_names()]
    for filename, name in declared + alternatives:
        found, modules = attention._modules(name)
        assert found == filename and any(name in m for m in modules), name
    other = BackwardConfig(32, warps=2, block_m=16).name("bfloat16")
    found, modules = attention._modules(other)
    assert found == "attention_bwd.cu" and not any(other in m for m in modules)
