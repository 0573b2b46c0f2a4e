"""The Dask backend's task graphs: one read of each input chunk for logsumexp and two for
softmax and log_softmax, a size proportional to the number of chunks, and no task that takes
more than one chunk of a row (the merge tree moves only per-row summaries)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
from dask.core import get_dependencies  # noqa: E402

import softmaxkit as sk  # noqa: E402
from softmaxkit.chunked.rows import SPLIT_EVERY  # noqa: E402

READS = {"logsumexp": 1, "softmax": 2, "log_softmax": 2}


def _graph(op: str, chunks: int, rows: int = 4, width: int = 8):
    x = da.from_array(np.zeros((rows, chunks * width)), chunks=(rows, width), name="input")
    out = getattr(sk, op)(x, axis=-1)
    graph = dict(out.__dask_graph__())
    return graph, {key: get_dependencies(graph, key) for key in graph}


def _is_input(key) -> bool:
    return isinstance(key, tuple) and key[0] == "input"


@pytest.mark.parametrize("op", sorted(READS))
def test_each_input_chunk_is_read_as_often_as_claimed(op):
    graph, deps = _graph(op, chunks=64)
    readers = Counter(d for ds in deps.values() for d in ds if _is_input(d))
    assert len(readers) == 64
    assert set(readers.values()) == {READS[op]}


@pytest.mark.parametrize("op", sorted(READS))
def test_no_task_gathers_a_row(op):
    graph, deps = _graph(op, chunks=64)
    for key, ds in deps.items():
        assert sum(_is_input(d) for d in ds) <= 1, f"{key} reads several chunks of a row"
        assert len(ds) <= SPLIT_EVERY, f"{key} takes {len(ds)} inputs"


@pytest.mark.parametrize("op", sorted(READS))
def test_graph_size_is_proportional_to_the_chunks(op):
    sizes = {n: len(_graph(op, chunks=n)[0]) for n in (16, 256)}
    # tasks per chunk: the chunk itself, the tasks reading it, the tree's first step and its
    # share of the tree above; then a few fixed ones
    per_chunk = 1 + READS[op] + 1 + 1 / (SPLIT_EVERY - 1) + 0.01
    for n, size in sizes.items():
        assert size <= per_chunk * n + 8, (n, size)
    assert sizes[256] / sizes[16] == pytest.approx(16, rel=0.1)
