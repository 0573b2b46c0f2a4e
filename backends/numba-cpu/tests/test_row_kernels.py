"""The row kernels' blocks, streaming stores and thread shares, against float64 references.

The kernels read a row in blocks (:data:`~softmaxkit_numba_cpu.lanes.BLOCK` elements), keep
each block's maximum and lifted sum and combine them; large results are written with
aligned non-temporal stores between scalar heads and tails, smaller ones plainly. These
tests put block boundaries, alignments, special values and thread shares where those
mechanisms could go wrong, and check every result against float64 numpy within the spec's
bounds.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import softmaxkit_numba_cpu.row_kernels as k
from numba import njit
from softmaxkit_numba_cpu.adapters import storage
from softmaxkit_numba_cpu.lanes import BLOCK, max_of

from softmaxkit.testing.tolerance import TOLERANCES, assert_within, log_bound, softmax_bound

NO_MASK = np.ones((1, 1), dtype=bool)
DTYPES = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
          "float16": np.float16}


@njit(cache=True)
def _max_of(x, j0, n):
    return max_of(x, j0, n)


def _ref(x64):
    """float64 softmax, log_softmax and logsumexp of rows with at least one finite logit."""
    m = np.max(x64, axis=-1, keepdims=True)
    e = np.exp(x64 - m)
    s = e.sum(axis=-1, keepdims=True)
    lse = m + np.log(s)
    return e / s, x64 - lse, lse[..., 0]


def _run(x, threads, where=None):
    """softmax, log_softmax and logsumexp of 2-D ``x`` (any dtype) through the kernels."""
    x2 = storage(x)
    if where is None:
        w, wstep, has_where = NO_MASK, 0, False
    else:
        w, wstep, has_where = where, 1, True
    p, lp = np.empty_like(x), np.empty_like(x)
    acc = np.float64 if x.dtype == np.float64 else np.float32
    lse, sign = np.empty(x.shape[0], dtype=acc), np.empty(x.shape[0], dtype=acc)
    if threads:
        k.softmax_par(x2, w, wstep, has_where, False, storage(p), threads)
        k.log_softmax_par(x2, w, wstep, has_where, False, storage(lp), threads)
        k.logsumexp_par(x2, w, wstep, has_where, lse, sign, threads)
    else:
        k.softmax_ser(x2, w, wstep, has_where, False, storage(p))
        k.log_softmax_ser(x2, w, wstep, has_where, False, storage(lp))
        k.logsumexp_ser(x2, w, wstep, has_where, lse, sign)
    return [a.astype(np.float64) for a in (p, lp, lse)]


def _check(x, got, dtype, x64=None):
    x64 = x.astype(np.float64) if x64 is None else x64
    n = x.shape[-1]
    p, lp, lse = _ref(x64)
    assert_within(got[0], p, softmax_bound(p, x64, n, dtype), f"softmax {dtype}")
    assert_within(got[1], lp, log_bound(lp, n, dtype), f"log_softmax {dtype}")
    assert_within(got[2], lse, log_bound(lse, n, "float32" if dtype != "float64" else dtype),
                  f"logsumexp {dtype}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_row_lengths_around_blocks(dtype, n):
    rng = np.random.default_rng(n)
    x = rng.normal(scale=4.0, size=(3, n)).astype(DTYPES[dtype])
    # the threaded driver runs the same row code; in float64 it is left out to save compiling
    for threads in (0,) if dtype == "float64" else (0, 2):
        _check(x, _run(x, threads), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_far_below_the_row_maximum(dtype):
    # block maxima 0, -40, -90, -120 and -300 below the row's: their scale factors
    # exp(m_b - M) / S reach below the float32 range, and results become subnormal or 0
    rng = np.random.default_rng(7)
    offsets = np.array([-40.0, 0.0, -90.0, -120.0, -300.0])
    x = rng.normal(size=(2, 5 * BLOCK)) + np.repeat(offsets, BLOCK)[None, :]
    x = x.astype(DTYPES[dtype])
    for threads in (0, 2):
        got = _run(x, threads)
        _check(x, got, dtype)
        assert np.all(got[0][:, 4 * BLOCK:] == 0)  # exp(-300) is below every float32


def test_special_values_in_any_block():
    n = 3 * BLOCK
    x = np.random.default_rng(8).normal(size=(6, n)).astype(np.float32)
    x[0, 2 * BLOCK + 5] = np.nan  # NaN in a block with a finite maximum
    x[1, BLOCK:2 * BLOCK] = -np.inf  # a whole block excluded
    x[2, BLOCK:2 * BLOCK] = -np.inf
    x[2, BLOCK + 3] = np.nan  # NaN in a block whose maximum is -inf
    x[3, n - 1] = np.inf  # +inf in the last block
    x[4, :] = -np.inf  # nothing allowed
    for threads in (0, 2):
        p, lp, lse = _run(x, threads)
        assert np.all(np.isnan(p[[0, 2, 3]])) and np.all(np.isnan(lse[[0, 2]]))
        assert lse[3] == np.inf and np.isnan(lp[3, n - 1]) and np.all(lp[3, :-1] == -np.inf)
        assert np.all(np.isnan(lp[[0, 2]]))
        assert np.all(p[4] == 0) and np.all(lp[4] == -np.inf) and lse[4] == -np.inf
        assert np.all(p[1, BLOCK:2 * BLOCK] == 0) and np.all(lp[1, BLOCK:2 * BLOCK] == -np.inf)
        _check(x[[1, 5]], [p[[1, 5]], lp[[1, 5]], lse[[1, 5]]], "float32")


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_special_short_rows_between_ordinary_ones(dtype):
    # unmasked rows of at most BLOCK elements take a short path that leaves any row whose
    # maximum or sum is not finite to the general row code and carries on after it
    n = 37
    x = np.random.default_rng(12).normal(scale=3.0, size=(9, n))
    x[1, 5] = np.nan  # NaN among finite logits: a NaN sum
    x[3, 30] = np.inf
    x[4, :] = -np.inf  # nothing allowed
    x[5, :] = np.nan  # NaN only: the maximum is -inf
    x[6, :10] = -np.inf  # some excluded: an ordinary row
    x[7, :] = -40.0
    x[7, 2] = 0.0  # one dominant term: logsumexp's second pass
    x = x.astype(DTYPES[dtype])
    normal = [0, 2, 6, 7, 8]
    for threads in (0, 2):
        p, lp, lse = _run(x, threads)
        assert np.all(np.isnan(p[[1, 3, 5]])) and np.all(np.isnan(lp[[1, 5]]))
        assert np.all(np.isnan(lse[[1, 5]])) and lse[3] == np.inf
        assert np.isnan(lp[3, 30]) and np.all(lp[3, np.arange(n) != 30] == -np.inf)
        assert np.all(p[4] == 0) and np.all(lp[4] == -np.inf) and lse[4] == -np.inf
        assert np.all(p[6, :10] == 0) and np.all(lp[6, :10] == -np.inf)
        _check(x[normal], [p[normal], lp[normal], lse[normal]], dtype)
    # logsumexp keeps the rest of the dominated row: log(1 + 36 e^-40), not 0
    assert lse[7] == pytest.approx(np.log1p(36 * np.exp(-40.0)), rel=1e-5, abs=0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_maximum_on_vectors_and_tail(dtype):
    # max_of takes whole groups of vectors, then a scalar tail: every length up to three
    # groups and every offset of a row within the array, with NaN (ignored) and -inf
    rng = np.random.default_rng(13)
    for n in [*range(0, 100), 1024, 2048]:
        for j0 in (0, 3):
            x = rng.normal(scale=5.0, size=n + 8).astype(DTYPES[dtype])
            row = x[j0:j0 + n]
            cases = [row.copy()]
            if n:
                nan = row.copy()
                nan[rng.integers(0, n, 1 + n // 10)] = np.nan
                low = np.full(n, -np.inf)
                low[rng.integers(0, n)] = np.nan
                top = row.copy()
                top[rng.integers(0, n)] = np.inf
                cases += [nan, low, top]
            for case in cases:
                x[j0:j0 + n] = case
                finite = case[~np.isnan(case)]
                want = finite.max() if finite.size else -np.inf
                assert _max_of(x, j0, n) == want, (n, j0, case)


def test_mask_across_blocks():
    rng = np.random.default_rng(9)
    x = rng.normal(scale=3.0, size=(4, 2 * BLOCK + 3)).astype(np.float32)
    where = rng.random(x.shape) > 0.5
    where[1, :BLOCK] = False  # a block with nothing allowed
    x64 = np.where(where, x.astype(np.float64), -np.inf)
    for threads in (0, 2):
        got = _run(x, threads, where)
        _check(x, got, "float32", x64)
        assert np.all(got[0][~where] == 0) and np.all(got[1][~where] == -np.inf)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shift", [0, 1, 3, 5, 7])
@pytest.mark.parametrize("streamed", [False, True])
def test_streamed_rows_at_every_alignment(dtype, shift, streamed):
    # outputs that start 0..7 elements past an aligned address, rows not a multiple of 8:
    # the scalar head and tail around the streamed part, and nothing outside is touched;
    # outputs below STREAM_FROM bytes are stored plainly
    rng = np.random.default_rng(shift)
    n = 203
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    r = k.STREAM_FROM // (n * itemsize) + 1 if streamed else 5
    x = rng.normal(scale=2.0, size=(r, n)).astype(DTYPES[dtype])
    x2 = storage(x)
    for threads in (0, 2):
        for which in ("softmax", "log_softmax"):
            buffer = np.full(r * n + 16, 7, dtype=x2.dtype)
            out = buffer[shift:shift + r * n].reshape(r, n)
            if which == "softmax" and threads:
                k.softmax_par(x2, NO_MASK, 0, False, False, out, threads)
            elif which == "softmax":
                k.softmax_ser(x2, NO_MASK, 0, False, False, out)
            elif threads:
                k.log_softmax_par(x2, NO_MASK, 0, False, False, out, threads)
            else:
                k.log_softmax_ser(x2, NO_MASK, 0, False, False, out)
            assert np.all(buffer[:shift] == 7) and np.all(buffer[shift + r * n:] == 7)
            got = out.view(x.dtype).astype(np.float64)
            x64 = x.astype(np.float64)
            p, lp, _ = _ref(x64)
            if which == "softmax":
                assert_within(got, p, softmax_bound(p, x64, n, dtype), "softmax")
            else:
                assert_within(got, lp, log_bound(lp, n, dtype), "log_softmax")


def test_short_rows_of_an_input_beyond_the_caches():
    # softmax and log_softmax short rows of an input of STREAM_FROM bytes or more take their
    # maximum with maxnum_of, the others with vector_max: both give the same values, special
    # rows included
    n = 300
    r = k.STREAM_FROM // (n * 4) + 1
    x = np.random.default_rng(14).normal(scale=4.0, size=(r, n)).astype(np.float32)
    x[1, 7] = np.nan
    x[2, :] = -np.inf
    x[3, 5] = np.inf
    small = x[:40].copy()
    for threads in (0, 2):
        big = _run(x, threads)
        few = _run(small, threads)
        for a, b in zip(big, few, strict=True):
            assert np.array_equal(a[:40], b, equal_nan=True)
        normal = np.r_[0, 4:r]
        _check(x[normal], [a[normal] for a in big], "float32")


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("rows", [37, 301])
def test_thread_shares_give_the_one_thread_result(threads, rows):
    # every row is computed the same way whichever share of rows it falls in; 301 rows of
    # 300 float32 make 6 batches, so up to 6 workers take them
    x = np.random.default_rng(10).normal(scale=5.0, size=(rows, 300)).astype(np.float32)
    serial = _run(x, 0)
    _check(x, serial, "float32")
    for a, b in zip(serial, _run(x, threads), strict=True):
        assert np.array_equal(a, b)


def test_every_row_kernel_can_be_cached():
    # a kernel that embeds a run-time address (a large global array, a function pointer)
    # cannot be cached by Numba, which then warns and recompiles it in every process
    x = np.random.default_rng(11).normal(size=(4, 9)).astype(np.float32)
    _run(x, 0)
    _run(x, 2)
    compiled = 0
    for name in dir(k):
        dispatcher = getattr(k, name)
        for cres in getattr(dispatcher, "overloads", {}).values():
            compiled += 1
            assert not cres.library.has_dynamic_globals, name
    assert compiled >= 6


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_with_class_indices(dtype, eps):
    """The class-index rows without a mask (the common training call, vectorized loops) and
    the rows the general loop keeps (a target whose logit is -inf, an ignored row, a NaN
    row), against the reference on the same values in float64."""
    import softmaxkit as sk

    rng = np.random.default_rng(7)
    n = 3 * BLOCK + 5
    x = (rng.standard_normal((7, n)) * 4).astype(DTYPES[dtype])
    x[1, ::5] = -np.inf           # excluded classes: gradient 0, not counted in smoothing
    x[2, 11] = -np.inf            # ... the target among them: infinite loss
    x[4, 3] = np.nan
    target = rng.integers(0, n, 7)
    target[1] = 1
    target[2] = 11
    target[5] = -100              # ignored: loss 0, gradient 0
    x64 = x.astype(np.float64)
    got = sk.cross_entropy(x, target, label_smoothing=eps, reduction="none",
                           ignore_index=-100, return_grad=True, backend="numba-cpu")
    want = sk.cross_entropy(x64, target, label_smoothing=eps, reduction="none",
                            ignore_index=-100, return_grad=True, backend="reference")
    # the loss is returned in the input's dtype: its bound includes that rounding
    loss, lref = np.asarray(got[0], np.float64), want[0]
    assert_within(loss, lref, log_bound(np.abs(lref), n, dtype), f"loss {dtype} eps={eps}")
    # gradient p - y (scale 1): the softmax's bound, and y's rounding to the dtype
    finite = np.where(np.isnan(x64), -np.inf, x64)
    e = np.exp(finite - finite.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    bound = softmax_bound(p, finite, n, dtype) + TOLERANCES[dtype][0] * np.abs(want[1] - p)
    assert_within(np.asarray(got[1], np.float64), want[1], np.nan_to_num(bound),
                  f"gradient {dtype} eps={eps}")
    assert np.all(np.asarray(got[1], np.float64)[1, ::5] == 0)
