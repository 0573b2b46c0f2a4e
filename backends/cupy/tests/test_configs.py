"""Kernel configurations: every row length gets the smallest configuration that holds it."""

from __future__ import annotations

import re

import pytest
from softmaxkit_cupy.compiler import source
from softmaxkit_cupy.configs import (
    ROW_ALTERNATIVES,
    ROW_CONFIGS,
    all_modules,
    max_row_length,
    row_config,
    row_configs,
    row_modules,
    row_staged,
)


@pytest.mark.parametrize(("itemsize", "staged"), [(2, False), (2, True), (4, False)])
def test_row_config_is_the_smallest_that_holds_the_row(itemsize: int, staged: bool) -> None:
    usable = row_configs(staged)
    capacities = [c.capacity(itemsize) for c in usable]
    assert capacities == sorted(capacities)
    lengths = sorted({1, 2, 7, 8, 9, 127, 128, 129, 4095, 4096, 4097, 32768, 65537,
                      max_row_length(itemsize)} | set(capacities) | {c + 1 for c in capacities})
    for n in lengths:
        config = row_config(n, itemsize, staged)
        if n > max_row_length(itemsize):
            assert config is None
            continue
        assert config is not None and config.capacity(itemsize) >= n
        assert staged or not config.staged
        smaller = [c for c in usable if c.capacity(itemsize) < config.capacity(itemsize)]
        assert all(c.capacity(itemsize) < n for c in smaller)


def test_staged_configurations_serve_16_bit_softmax_only() -> None:
    assert row_staged("softmax", "bfloat16", "bfloat16")
    assert row_staged("log_softmax", "float16", "float16")
    assert not row_staged("logsumexp", "bfloat16", "bfloat16")
    assert not row_staged("softmax", "float32", "float32")
    for op, din, dout, names in row_modules():
        assert any("sk_rows_staged" in n for n in names) == row_staged(op, din, dout)
    # the long 16-bit rows of the benchmarks take the staged kernels
    assert row_config(32768, 2, staged=True).staged
    assert row_config(524288, 2, staged=True).staged
    assert not row_config(4096, 2, staged=True).staged


def test_configurations_are_well_formed() -> None:
    for c in ROW_CONFIGS + ROW_ALTERNATIVES:
        assert c.threads % 32 == 0 and c.threads <= 1024
        assert c.group <= 32 or c.group == c.threads  # packed rows stay inside one warp
        assert c.threads % c.group == 0 and c.cluster in (1, 2, 4, 8)
        assert c.cluster == 1 or c.group == c.threads
        assert not c.staged or (c.group == c.threads and c.shared_bytes() <= 227 * 1024)


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
