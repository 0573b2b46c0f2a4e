"""numba-cpu as a plugin: discovery, default choice, what it declines, layouts, threads.

Values are checked against float64 numpy formulas of the spec, never against this backend.
"""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numba
import numpy as np
import pytest
import softmaxkit_numba_cpu.rows as rows
import torch

import softmaxkit as sk
from softmaxkit.testing.tolerance import assert_within, log_bound, softmax_bound, vjp_bound

NAME = "numba-cpu"


def softmax64(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def lse64(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def check_softmax(got, x, dtype, axis=-1):
    """Within the spec's softmax bound of the float64 softmax of the represented ``x``."""
    x = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
    p = softmax64(x)
    got = np.moveaxis(np.asarray(got, dtype=np.float64), axis, -1)
    assert_within(got, p, softmax_bound(p, x, x.shape[-1], dtype), f"softmax {dtype}")


def check_log(got, value, n, dtype):
    """Within the spec's bound for a log-domain value (log_softmax, logsumexp, loss)."""
    assert_within(np.asarray(got, dtype=np.float64), value, log_bound(value, n, dtype),
                  f"log-domain {dtype}")


def ran_on(fn):
    with sk.backend_opts(trace=True) as trace:
        result = fn()
    return trace[-1].backend, trace[-1].declined, result


def test_manifest_imports_no_numba():
    code = (
        "import sys, softmaxkit as sk; b = sk.backends(); "
        "assert 'numba-cpu' in b, sorted(b); "
        "assert 'numba' not in sys.modules, 'numba imported by discovery'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chosen_by_default_for_numpy_and_torch():
    x = np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32)
    name, _, p = ran_on(lambda: sk.softmax(x, axis=-1))
    assert name == NAME
    check_softmax(p, x, "float32")
    name, _, pt = ran_on(lambda: sk.softmax(torch.from_numpy(x), axis=-1))
    assert name == NAME and isinstance(pt, torch.Tensor) and pt.dtype == torch.float32
    check_softmax(pt.numpy(), x, "float32")


def test_torch_tensor_requiring_grad_and_bfloat16():
    x = torch.randn(3, 9, dtype=torch.bfloat16, requires_grad=True)
    p = sk.softmax(x, axis=-1, backend=NAME)
    assert p.dtype == torch.bfloat16 and p.grad_fn is not None  # autograd records it
    check_softmax(p.detach().float().numpy(), x.detach().float().numpy(), "bfloat16")


def test_declines_other_libraries_and_falls_back():
    import array_api_strict as xps

    x = xps.asarray(np.arange(6.0).reshape(2, 3))
    name, _, p = ran_on(lambda: sk.softmax(x, axis=-1))
    assert name == "reference"
    check_softmax(np.asarray(p), np.arange(6.0).reshape(2, 3), "float64")
    with pytest.raises(sk.NoBackendError, match="numpy arrays and torch CPU tensors"):
        sk.softmax(x, axis=-1, backend=NAME)


def test_declines_big_endian_and_subclasses():
    x = np.arange(12.0).reshape(3, 4).astype(">f8")
    name, declined, p = ran_on(lambda: sk.logsumexp(x, axis=-1))
    assert name == "reference" and "byte order" in declined[NAME]
    check_log(p, lse64(x.astype(np.float64)), 4, "float64")
    with pytest.raises(sk.NoBackendError, match="byte order"):
        sk.softmax(x, axis=-1, backend=NAME)
    masked = np.ma.MaskedArray(np.zeros((2, 3)), mask=[[0, 1, 0], [0, 0, 0]])
    with pytest.raises(sk.NoBackendError, match="subclass"):
        sk.softmax(masked, axis=-1, backend=NAME)


def test_strided_read_only_and_broadcast_mask():
    rng = np.random.default_rng(1)
    base = rng.normal(scale=3.0, size=(6, 40)).astype(np.float32)
    base.flags.writeable = False
    for x, axis in [(base, -1), (base.T, 0), (base[:, ::3], -1), (base[::2], 1)]:
        check_softmax(sk.softmax(x, axis=axis, backend=NAME), x, "float32", axis)
        check_log(sk.logsumexp(x, axis=axis, backend=NAME), lse64(x, axis), x.shape[axis],
                  "float32")
    where = rng.random(40) > 0.3  # one mask for every row, broadcast
    got = sk.softmax(base, axis=-1, where=where, backend=NAME)
    check_softmax(got, np.where(where, base.astype(np.float64), -np.inf), "float32")
    assert np.all(got[:, ~where] == 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_threaded_path_matches_float64(dtype):
    rng = np.random.default_rng(2)
    shape = (256, 1024)  # at PARALLEL_MIN_ELEMENTS
    assert rows.parallel(*shape) == (numba.get_num_threads() > 1)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = rng.normal(scale=4.0, size=shape).astype(np_dtype)
    x64 = x.astype(np.float64)
    n = shape[1]
    check_softmax(sk.softmax(x, axis=-1, backend=NAME), x64, dtype)
    if dtype == "float32":
        check_log(sk.logsumexp(x, axis=-1, backend=NAME), lse64(x64), n, dtype)
        logp = x64 - lse64(x64)[:, None]
        check_log(sk.log_softmax(x, axis=-1, backend=NAME), logp, n, dtype)
        target = rng.integers(0, n, size=shape[0])
        loss, grad = sk.cross_entropy(x, target, reduction="none", return_grad=True,
                                      backend=NAME)
        rows_ = np.arange(shape[0])
        check_log(loss, -logp[rows_, target], n, dtype)
        p = np.exp(logp)
        onehot = np.eye(n)[target]
        assert_within(grad, p - onehot, vjp_bound(p - onehot, p + onehot, n, dtype), "grad")
        g = rng.normal(size=shape).astype(np.float32)
        pf = p.astype(np.float32).astype(np.float64)
        expected = pf * (g - (pf * g).sum(-1, keepdims=True))
        scale = pf * (np.abs(g) + (pf * np.abs(g)).sum(-1, keepdims=True))
        got = sk.softmax_vjp(pf.astype(np.float32), g, axis=-1)
        assert_within(got, expected, vjp_bound(expected, scale, n, dtype), "softmax_vjp")


def test_one_thread_setting_is_followed():
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        assert not rows.parallel(256, 1024)
        x = np.random.default_rng(3).normal(size=(256, 1024)).astype(np.float32)
        check_softmax(sk.softmax(x, axis=-1, backend=NAME), x, "float32")
    finally:
        numba.set_num_threads(threads)


def test_long_rows_blocked_sum():
    # 2**17 terms per row: blocks of float32 lanes added in float64 keep lse accurate
    x = np.random.default_rng(4).normal(size=(2, 1 << 17)).astype(np.float32)
    got = sk.logsumexp(x, axis=-1, backend=NAME)
    assert np.all(np.abs(got - lse64(x)) <= 4 * 2.0**-24 * np.abs(lse64(x)))
    check_softmax(sk.softmax(x, axis=-1, backend=NAME), x, "float32")


@pytest.mark.parametrize("causal", [False, True])
def test_attention_threaded_heads_match_float64(causal):
    # 2 heads x 1024 x 2048 scores: large enough for one thread per head (BLAS on one thread)
    rng = np.random.default_rng(5)
    q = rng.normal(size=(1, 2, 1024, 32)).astype(np.float32)
    k = rng.normal(size=(1, 2, 2048, 32)).astype(np.float32)
    v = rng.normal(size=(1, 2, 2048, 16)).astype(np.float32)
    with sk.backend_opts(trace=True) as trace:
        out, lse = sk.attention(q, k, v, causal=causal, return_lse=True)
    assert trace[-1].backend == NAME
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(32)
    if causal:  # bottom-right: query i sees keys j <= i + 1024
        i = np.arange(1024)[:, None]
        s = np.where(np.arange(2048)[None, :] <= i + 1024, s, -np.inf)
    ref_lse = lse64(s)
    p = np.exp(s - ref_lse[..., None])
    ref = p @ v.astype(np.float64)
    check_log(lse, ref_lse, 2048, "float32")
    scale = p @ np.abs(v.astype(np.float64))
    assert_within(out, ref, vjp_bound(ref, scale, 2048, "float32"), "attention out")


def test_mid_size_calls_take_the_way_measured_cheaper():
    chooser = rows.Threads()
    EXPLORE_FIRST, EXPLORE_MAX = rows.EXPLORE_FIRST, rows.EXPLORE_MAX  # noqa: N806
    cost = {False: 2.0, True: 1.0}  # seconds per call, threads cheaper

    def step():
        use, _ = chooser.choose()  # every call timed: the estimator alone
        chooser.record(use, cost[use], 1)
        return use

    first = [step() for _ in range(2)]
    assert sorted(first) == [False, True]  # each way measured once
    ways = [step() for _ in range(EXPLORE_FIRST + 1)]
    assert ways[:EXPLORE_FIRST] == [True] * EXPLORE_FIRST and ways[-1] is False  # one try
    # the slower way is tried twice as rarely each time it loses again, up to a bound
    ways = [step() for _ in range(8 * EXPLORE_MAX)]
    assert 3 <= ways.count(False) <= 8 + (EXPLORE_MAX.bit_length() - EXPLORE_FIRST.bit_length())
    # the machine gets busy: threads now cost more, and the choice follows at its next try
    cost[True] = 10.0
    ways = [step() for _ in range(2 * EXPLORE_MAX + 2)]
    assert ways[-EXPLORE_FIRST:] == [False] * EXPLORE_FIRST



def test_a_few_slow_calls_of_the_winning_way_do_not_hand_over_the_long_wait():
    chooser = rows.Threads()
    EXPLORE_FIRST, EXPLORE_MAX = rows.EXPLORE_FIRST, rows.EXPLORE_MAX  # noqa: N806
    cost = {False: 2.0, True: 1.0}

    def step():
        use, _ = chooser.choose()  # every call timed: the estimator alone
        chooser.record(use, cost[use], 1)
        return use

    for _ in range(8 * EXPLORE_MAX):  # one thread loses try after try: the wait grows
        step()
    assert chooser.interval == EXPLORE_MAX
    while chooser.countdown < EXPLORE_FIRST + 4:  # mid-wait, threads in use
        step()
    cost[True] = 10.0  # two slow calls of the threads (a wake-up, a busy core) ...
    assert [step(), step()] == [True, True]
    cost[True] = 1.0  # ... then the threads are as fast as before: no switch
    assert [step() for _ in range(4)] == [True] * 4
    cost[True] = 10.0  # three slow calls of the last five: the median switches the choice
    assert [step() for _ in range(3)] == [True] * 3
    cost[True] = 1.0
    ways = [step() for _ in range(EXPLORE_FIRST + 4)]
    assert ways[0] is False
    assert ways[-3:] == [True] * 3  # the threads were tried again and won, long before
    assert ways.count(False) <= EXPLORE_FIRST  # EXPLORE_MAX calls of one thread


def test_a_way_less_than_the_margin_cheaper_does_not_take_over():
    chooser = rows.Threads()
    cost = {False: 1.0, True: 1.0}

    def step():
        use, _ = chooser.choose()  # every call timed: the estimator alone
        chooser.record(use, cost[use], 1)
        return use

    [step() for _ in range(2)]
    first = chooser.using
    cost[not first] = 1.0 / (0.9 * rows.MARGIN)  # the other way: a little cheaper now
    ways = [step() for _ in range(4 * rows.EXPLORE_MAX)]
    tries = rows.EXPLORE_MAX.bit_length() - rows.EXPLORE_FIRST.bit_length() + 4
    assert chooser.using is first and ways.count(not first) <= 2 * tries  # tries only
    cost[not first] = 1.0 / (1.1 * rows.MARGIN)  # past the margin: it takes over
    ways = [step() for _ in range(2 * rows.EXPLORE_MAX + 2)]
    assert chooser.using is not first
    assert ways[-rows.EXPLORE_MAX:].count(not first) >= rows.EXPLORE_MAX - 2  # and keeps it


def test_num_threads_follows_numba_setting():
    before = numba.get_num_threads()
    try:
        for n in {1, before}:
            numba.set_num_threads(n)
            assert rows.num_threads() == numba.get_num_threads() == n
    finally:
        numba.set_num_threads(before)

def test_threads_and_one_thread_give_the_same_bits():
    x = np.random.default_rng(3).normal(scale=3, size=(64, 1024)).astype(np.float32)
    results = {}
    for threads in (1, 2):
        with_threads = numba.get_num_threads()
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            for _ in range(3):
                results.setdefault(threads, []).append(
                    rows.softmax(np, x=x, where=None, masked="zero", out_dtype=x.dtype))
        finally:
            numba.set_num_threads(with_threads)
    assert rows._THREADS  # the mid-size input went through the chooser
    for got in results[1] + results[2]:
        assert np.array_equal(got, results[1][0])
