"""Kernel configurations: every row length gets the smallest configuration that holds it."""

from __future__ import annotations

import re

import pytest
from softmaxkit_cupy.compiler import source
from softmaxkit_cupy.configs import (
    NON_PORTABLE_CLUSTER,
    ROW16_CONFIGS,
    ROW_ALTERNATIVES,
    ROW_CONFIGS,
    all_modules,
    max_row_length,
    row_alternative_names,
    row_config,
    row_configs,
    row_lean,
    row_modules,
)


@pytest.mark.parametrize("clusters", [True, False])
@pytest.mark.parametrize(("itemsize", "lean"), [(2, False), (2, True), (4, False)])
def test_row_config_is_the_smallest_that_holds_the_row(itemsize: int, lean: bool,
                                                       clusters: bool) -> None:
    usable = row_configs(lean, clusters)
    capacities = [c.capacity(itemsize) for c in usable]
    assert capacities == sorted(capacities)
    longest = max_row_length(itemsize, lean, clusters)
    lengths = sorted({1, 2, 7, 8, 9, 127, 128, 129, 4095, 4096, 4097, 32768, 65537,
                      longest} | set(capacities) | {c + 1 for c in capacities})
    for n in lengths:
        config = row_config(n, itemsize, lean, clusters)
        if n > longest:
            assert config is None
            continue
        assert config is not None and config.capacity(itemsize) >= n
        assert config.lean == lean
        assert clusters or config.cluster == 1  # no cluster where the device has none
        smaller = [c for c in usable if c.capacity(itemsize) < config.capacity(itemsize)]
        assert all(c.capacity(itemsize) < n for c in smaller)


def test_devices_without_clusters_hold_rows_of_one_block() -> None:
    """Below compute capability 9.0 every row is one block's: the general kernels hold 32768
    float32 (65536 16-bit) elements, the lean 16-bit ones 32768, in 64 KB of shared memory
    (the opt-in limit of every device from 8.0 is above it); each module builds both sets."""
    assert (max_row_length(4, clusters=False), max_row_length(2, clusters=False)) == (
        32768, 65536)
    assert max_row_length(2, lean=True, clusters=False) == 32768
    assert all(c.cluster == 1 and c.threads <= 1024 and c.shared_bytes() <= 64 * 1024
               for lean in (False, True) for c in row_configs(lean, clusters=False))
    # with clusters nothing changes
    assert row_configs(False) == ROW_CONFIGS and row_configs(True) == ROW16_CONFIGS
    for op, din, dout, names in row_modules():
        lean = row_lean(op, din, dout)
        wanted = {c.name(op, din, dout) for c in (*row_configs(lean),
                                                 *row_configs(lean, clusters=False))}
        assert set(names) == wanted


def test_lean_configurations_serve_16_bit_softmax_only() -> None:
    assert row_lean("softmax", "bfloat16", "bfloat16")
    assert row_lean("log_softmax", "float16", "float16")
    assert not row_lean("logsumexp", "bfloat16", "bfloat16")
    assert not row_lean("softmax", "float32", "float32")
    assert not row_lean("softmax", "bfloat16", "float32")
    for op, din, dout, names in row_modules():
        assert all(n.startswith("sk_rows16") == row_lean(op, din, dout) for n in names)
    with pytest.raises(ValueError):
        ROW16_CONFIGS[0].name("logsumexp", "bfloat16", "bfloat16")
    # the lean list holds rows as long as the general one
    assert ROW16_CONFIGS[-1].capacity(2) == max_row_length(2)
    # the benchmark shapes: 16 threads per 128-element row, 256 x 2 loads per 4096, staged
    # 32 KB blocks in 2-block clusters at 32768 and 64 KB blocks in 16-block clusters at 524288
    assert row_config(128, 2, lean=True) == ROW16_CONFIGS[2]
    assert (row_config(4096, 2, lean=True).threads, row_config(4096, 2, lean=True).k) == (256, 2)
    long = row_config(32768, 2, lean=True)
    assert long.staged and long.cluster == 2 and long.shared_bytes() == 32 * 1024
    longest = row_config(524288, 2, lean=True)
    assert longest.staged and longest.cluster == 16 and longest.shared_bytes() == 64 * 1024
    assert longest.persistent and longest.name("softmax", "bfloat16", "bfloat16").startswith(
        "sk_rows16_persist<")


def test_configurations_are_well_formed() -> None:
    for c in ROW_CONFIGS + ROW16_CONFIGS + ROW_ALTERNATIVES:
        assert c.threads % 32 == 0 and c.threads <= 1024
        assert c.group <= 32 or c.group == c.threads  # packed rows stay inside one warp
        assert c.threads % c.group == 0 and c.cluster in (1, 2, 4, 8, 16)
        assert c.cluster <= NON_PORTABLE_CLUSTER or (c.lean and c.staged)
        assert c.cluster == 1 or c.group == c.threads
        assert not c.persistent or c.staged
        assert c.policy in (0, 1, 2) and (c.policy == 0 or c.cluster > 1)
        assert not c.staged or (c.lean and c.group == c.threads
                                and c.shared_bytes() <= 227 * 1024 and c.k % c.groups == 0
                                and c.groups <= 8)


def test_alternative_module_holds_every_applicable_configuration() -> None:
    names = row_alternative_names("softmax", "bfloat16", "bfloat16")
    assert len(set(names)) == len(names)
    assert all(c.name("softmax", "bfloat16", "bfloat16") in names
               for c in ROW_CONFIGS + ROW16_CONFIGS + ROW_ALTERNATIVES)
    assert not any("sk_rows16" in n for n in row_alternative_names("logsumexp", "float16",
                                                                     "float16"))


def test_every_module_names_distinct_kernels_defined_in_its_source() -> None:
    for filename, names in all_modules():
        assert len(set(names)) == len(names)
        text = source(filename)
        for name in names:
            assert re.search(rf"\b{name.split('<')[0]}\s*\(", text), name


def test_source_inlines_local_includes_once() -> None:
    text = source("attention.cu")
    assert '#include "' not in text
    assert text.count("void sk_merge(") == 1


def test_attention_configurations_cover_every_head_dim_within_the_h200s_limits() -> None:
    from softmaxkit_cupy.configs import (
        ATTENTION_ALTERNATIVES,
        ATTENTION_CONFIGS,
        ATTENTION_HEAD_DIMS,
        BACKWARD_ALTERNATIVES,
        BACKWARD_CONFIGS,
        UNMASKED_CONFIGS,
        attention_config,
        backward_config,
        backward_pre_group,
        decode_config,
    )

    assert {32, 64, 80, 96, 128, 160, 192, 256} <= set(ATTENTION_HEAD_DIMS)
    assert set(ATTENTION_CONFIGS) == set(BACKWARD_CONFIGS) == set(ATTENTION_HEAD_DIMS)
    limit = 227 * 1024  # dynamic shared memory per block on the H200
    for d in ATTENTION_HEAD_DIMS:
        # 16-byte rows of the swizzle (mma.cuh): 1, 2 or 4 chunks, or 8 k + 0, 2 or 4
        chunks = d // 8
        assert d % 16 == 0 and (chunks in (2, 4) or chunks % 8 in (0, 2, 4))
        for masked in (True, False):
            c = attention_config(d, masked)
            assert c.head_dim == d and (c.mask or not masked)
            assert c.shared_bytes() <= limit and c.threads <= 1024 and c.block_n % 16 == 0
        b = backward_config(d)
        assert b.head_dim == d and b.shared_bytes() <= limit and b.block_n % 16 == 0
        assert b.warps % b.split == 0 and (d // 8 // b.split) % 2 == 0
        # the dQ product's warp layout (kernels/attention_bwd.cu): whole m16 rows, columns
        # in 16-wide passes
        wm = b.block_m // 16
        assert b.warps % wm == 0 and (d // (b.warps // wm)) % 16 == 0
        dc = decode_config(d)
        assert dc.head_dim == d and dc.shared_bytes() <= limit and dc.resident() >= 1
        group = backward_pre_group(d)
        assert group & (group - 1) == 0 and d // 8 <= group <= 32
    # the head dimensions 64 and 128 keep their tiles (their kernels' code is unchanged)
    assert ATTENTION_CONFIGS[64].name("bfloat16") == "sk_attn_fwd<sk_bf16, 64, 4, 64, 2, true>"
    assert ATTENTION_CONFIGS[128].name("float16") == "sk_attn_fwd<__half, 128, 4, 32, 2, true>"
    assert UNMASKED_CONFIGS[128].block_n == 64
    assert BACKWARD_CONFIGS[64].block_n == 64 and BACKWARD_CONFIGS[128].block_n == 128
    # the widest rows: one m16 tile per warp, dK and dV split over two warps per 16 keys
    assert attention_config(256).m_tiles == 1 and backward_config(256).split == 2
    for c in (*ATTENTION_ALTERNATIVES, *BACKWARD_ALTERNATIVES):
        assert c.head_dim in ATTENTION_HEAD_DIMS and c.shared_bytes() <= limit


def test_hopper_forward_serves_capability_9_0_only_within_the_h200s_limits() -> None:
    from softmaxkit_cupy.attention import forward_config
    from softmaxkit_cupy.configs import (
        ATTENTION_HEAD_DIMS,
        SM90_ALTERNATIVES,
        SM90_CONFIGS,
        SM90_MASKED_CONFIGS,
        SM90_SOURCES,
        AttentionConfig,
        Sm90Config,
        attention_config,
        sm90_names,
    )

    assert set(SM90_CONFIGS) == {32, 64, 96, 128, 192, 256}
    assert set(SM90_MASKED_CONFIGS) <= set(SM90_CONFIGS)
    assert set(SM90_CONFIGS) <= set(ATTENTION_HEAD_DIMS)
    for configs, masked in ((SM90_CONFIGS, False), (SM90_MASKED_CONFIGS, True)):
        for d, c in configs.items():
            # whole panels: of 64 columns (the 128-byte swizzle) or of 32 (the 64-byte one)
            assert c.head_dim == d and c.mask == masked and d % 32 == 0
            assert c.block_n % 64 == 0 and c.block_n in (64, 128, 256)
            assert c.shared_bytes() <= 227 * 1024 and c.threads == 128 * c.warpgroups
            assert c.name("bfloat16") in sm90_names()
    for c in SM90_ALTERNATIVES:  # built on request only, beside the declared tiles
        assert c.head_dim in ATTENTION_HEAD_DIMS and c.head_dim % 32 == 0
        assert c.block_n % 64 == 0 and c.shared_bytes() <= 227 * 1024
        assert c.name("bfloat16") not in sm90_names()
    assert SM90_CONFIGS[128].name("bfloat16") == "sk_attn_fwd_sm90<sk_bf16, 128, 128, 2, false>"
    assert {filename for filename, _ in all_modules()} >= SM90_SOURCES
    for d in ATTENTION_HEAD_DIMS:
        for masked in (False, True):
            hopper = forward_config(90, d, masked)
            built = (SM90_MASKED_CONFIGS if masked else SM90_CONFIGS).get(d)
            assert hopper == (built or attention_config(d, masked))
            assert isinstance(hopper, Sm90Config) == (built is not None)
            for other in (80, 86, 89, 100, 120):
                assert forward_config(other, d, masked) == attention_config(d, masked)
                assert isinstance(forward_config(other, d, masked), AttentionConfig)


def test_hopper_backward_serves_capability_9_0_only_within_the_h200s_limits() -> None:
    from softmaxkit_cupy.attention import backward_config_for
    from softmaxkit_cupy.configs import (
        ATTENTION_HEAD_DIMS,
        SM90_BACKWARD_CONFIGS,
        SM90_BACKWARD_MASKED_CONFIGS,
        SM90_SOURCES,
        BackwardConfig,
        Sm90BackwardConfig,
        backward_config,
        sm90_backward_names,
    )

    assert (set(SM90_BACKWARD_CONFIGS) == set(SM90_BACKWARD_MASKED_CONFIGS)
            == {32, 64, 96, 128, 192, 256})
    assert "attention_bwd_sm90.cu" in SM90_SOURCES
    assert ("attention_bwd_sm90.cu", list(sm90_backward_names())) in all_modules()
    for configs, masked in ((SM90_BACKWARD_CONFIGS, False), (SM90_BACKWARD_MASKED_CONFIGS, True)):
        for d, c in configs.items():
            assert c.head_dim == d and c.mask == masked
            if d <= 128:  # 64 keys a warpgroup
                assert c.block_n == 64 * c.warpgroups
            else:  # one tile of 64 keys, its columns split between the warpgroups
                assert c.block_n == 64
            assert c.block_m == 64 and c.threads == 128 * c.warpgroups
            assert c.shared_bytes() <= 227 * 1024
            assert c.name("bfloat16") in sm90_backward_names()
    # the packed variable-length kernels on Hopper: the dense tiles, a module each of their own
    from softmaxkit_cupy.configs import (
        SM90_CONFIGS,
        SM90_VARLEN_BACKWARD_CONFIGS,
        sm90_varlen_backward_names,
        sm90_varlen_names,
    )

    assert SM90_VARLEN_BACKWARD_CONFIGS == SM90_BACKWARD_CONFIGS
    assert ("attention_sm90.cu", list(sm90_varlen_names())) in all_modules()
    assert ("attention_bwd_sm90.cu", list(sm90_varlen_backward_names())) in all_modules()
    assert (SM90_VARLEN_BACKWARD_CONFIGS[128].varlen_name("bfloat16")
            == "sk_attn_bwd_sm90_varlen<sk_bf16, 128, 2>")
    assert "sk_attn_bwd_sm90_varlen<sk_bf16, 128, 2>" in sm90_varlen_backward_names()
    assert (SM90_CONFIGS[256].varlen_name("float16")
            == "sk_attn_fwd_sm90_varlen<__half, 256, 64, 2>")
    assert "sk_attn_fwd_sm90_varlen<__half, 256, 64, 2>" in sm90_varlen_names()
    assert (SM90_BACKWARD_CONFIGS[128].name("bfloat16")
            == "sk_attn_bwd_sm90<sk_bf16, 128, 2, false>")
    assert (SM90_BACKWARD_MASKED_CONFIGS[64].name("float16")
            == "sk_attn_bwd_sm90<__half, 64, 2, true>")
    for d in ATTENTION_HEAD_DIMS:
        for masked in (False, True):
            hopper = backward_config_for(90, d, masked)
            built = (SM90_BACKWARD_MASKED_CONFIGS if masked else SM90_BACKWARD_CONFIGS).get(d)
            assert hopper == (built or backward_config(d))
            assert isinstance(hopper, Sm90BackwardConfig) == (built is not None)
            for other in (80, 86, 89, 100, 120):
                assert backward_config_for(other, d, masked) == backward_config(d)
                assert isinstance(backward_config_for(other, d, masked), BackwardConfig)
