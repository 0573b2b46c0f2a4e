"""Kernel configurations: every row length gets the smallest configuration that holds it."""

from __future__ import annotations

import re

import pytest
from softmaxkit_cupy.compiler import source
from softmaxkit_cupy.configs import (
    ROW_CONFIGS,
    all_modules,
    max_row_length,
    row_config,
)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_row_config_is_the_smallest_that_holds_the_row(itemsize: int) -> None:
    capacities = [c.capacity(itemsize) for c in ROW_CONFIGS]
    assert capacities == sorted(capacities)
    lengths = sorted({1, 2, 7, 8, 9, 127, 128, 129, 4095, 4096, 4097, 32768, 65537,
                      max_row_length(itemsize)} | set(capacities) | {c + 1 for c in capacities})
    for n in lengths:
        config = row_config(n, itemsize)
        if n > max_row_length(itemsize):
            assert config is None
            continue
        assert config is not None and config.capacity(itemsize) >= n
        smaller = [c for c in ROW_CONFIGS if c.capacity(itemsize) < config.capacity(itemsize)]
        assert all(c.capacity(itemsize) < n for c in smaller)


def test_configurations_are_well_formed() -> None:
    for c in ROW_CONFIGS:
        assert c.threads % 32 == 0 and c.threads <= 1024
        assert c.group <= 32 or c.group == c.threads  # packed rows stay inside one warp
        assert c.threads % c.group == 0 and c.cluster in (1, 2, 4, 8)
        assert c.cluster == 1 or c.group == c.threads


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
