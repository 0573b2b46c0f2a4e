"""Result memory: cache-line alignment, and reuse of released buffers that is never visible.

A reused buffer must never belong to a result that is still reachable, through the result
itself, a view of it or a torch tensor sharing it; every value is checked against float64.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import softmaxkit_numba_cpu.buffers as buffers
import torch

import softmaxkit as sk
from softmaxkit.testing.tolerance import assert_within, softmax_bound

NAME = "numba-cpu"
SHAPE = (1024, 1024)  # 4 MiB of float32: at REUSE_FROM


def _softmax64(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _check(got, x):
    x64 = np.asarray(x, dtype=np.float64)
    p = _softmax64(x64)
    assert_within(np.asarray(got, dtype=np.float64), p, softmax_bound(p, x64, x.shape[-1],
                                                                      "float32"), "softmax")


@pytest.fixture
def reuse(monkeypatch):
    monkeypatch.setattr(buffers, "REUSE", True)
    buffers.release()
    yield
    buffers.release()


def _inputs(k):
    rng = np.random.default_rng(k)
    return [rng.normal(scale=3.0, size=SHAPE).astype(np.float32) for _ in range(3)]


def test_large_results_start_on_a_cache_line(reuse):
    assert SHAPE[0] * SHAPE[1] * 4 >= buffers.REUSE_FROM
    assert SHAPE[0] * SHAPE[1] * 4 >= buffers.ALIGN_FROM
    for shape in [(1024, 1025), SHAPE]:  # ALIGN_FROM and up: aligned, with or without reuse
        a = buffers.result_array(shape, np.float32)
        assert a.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous
        assert a.ctypes.data % 64 == 0 and a.flags.writeable
    for shape in [(3, 5), (64, 257)]:
        small = buffers.result_array(shape, np.float16)
        assert small.shape == shape and small.dtype == np.float16


def test_large_results_start_on_a_cache_line_without_reuse(monkeypatch):
    monkeypatch.setattr(buffers, "REUSE", False)
    a = buffers.result_array(SHAPE, np.float32)
    assert a.shape == SHAPE and a.flags.c_contiguous and a.ctypes.data % 64 == 0


def test_released_buffers_are_reused_and_live_ones_never(reuse):
    x1, x2, x3 = _inputs(0)
    p1 = sk.softmax(x1, axis=-1, backend=NAME)
    address = p1.ctypes.data
    view = p1[3:]  # keeps p1's memory in use after p1 itself is gone
    del p1
    gc.collect()
    p2 = sk.softmax(x2, axis=-1, backend=NAME)
    assert p2.ctypes.data != address
    _check(view, x1[3:])
    del view
    gc.collect()
    p3 = sk.softmax(x3, axis=-1, backend=NAME)  # now p1's buffer is free again
    assert p3.ctypes.data == address
    _check(p2, x2)
    _check(p3, x3)


def test_torch_results_keep_their_buffer(reuse):
    x1, x2, _ = _inputs(1)
    t1 = sk.softmax(torch.from_numpy(x1), axis=-1, backend=NAME)
    t2 = sk.log_softmax(torch.from_numpy(x2), axis=-1, backend=NAME)
    gc.collect()
    t3 = sk.softmax(torch.from_numpy(x2), axis=-1, backend=NAME)
    assert len({t.data_ptr() for t in (t1, t2, t3)}) == 3
    _check(t1.numpy(), x1)
    _check(t3.numpy(), x2)


def test_reuse_off_and_release(reuse, monkeypatch):
    x1, x2, _ = _inputs(2)
    p = sk.softmax(x1, axis=-1, backend=NAME)
    del p
    gc.collect()
    assert len(buffers._kept) == 1
    buffers.release()
    assert not buffers._kept
    monkeypatch.setattr(buffers, "REUSE", False)
    p = sk.softmax(x2, axis=-1, backend=NAME)
    assert p.ctypes.data % 64 == 0
    _check(p, x2)
    del p
    gc.collect()
    assert not buffers._kept
