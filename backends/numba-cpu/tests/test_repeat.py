"""The repeated-call forms of the row kernels (``kernel.repeat``, kept by a ``registry.Binding``).

A kept call of softmax, log_softmax or logsumexp runs the form its backend gave for that kind
of call; each result here is checked against float64 formulas of the spec on fresh data, and
every input the form must not take (another layout of the same shape, a read-only array, a
tensor with a negative bit) must come back from the kernel's own path with the same bounds.
"""

from __future__ import annotations

import numpy as np
import pytest
import softmaxkit_numba_cpu.rows as rows
import torch

import softmaxkit as sk
from softmaxkit import registry
from softmaxkit import rows as frontend
from softmaxkit.testing.tolerance import assert_within, log_bound, softmax_bound

SHAPES = [(8,), (64, 1024), (3, 4, 33), (1024, 1024)]
"""Torch tensors of results below 4 MiB go by address (addresses.py), larger ones through a
numpy view into a reused buffer: (1024, 1024) float32 is the first of those."""


def softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def lse64(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]


def check_softmax(got, x, dtype):
    """Within the spec's softmax bound of the float64 softmax of the represented ``x``."""
    x = np.asarray(x, dtype=np.float64)
    p = softmax64(x)
    assert_within(np.asarray(got, dtype=np.float64), p, softmax_bound(p, x, x.shape[-1], dtype),
                  f"softmax {dtype}")


def check_log(got, value, n, dtype):
    """Within the spec's bound for a log-domain value (log_softmax, logsumexp)."""
    assert_within(np.asarray(got, dtype=np.float64), value, log_bound(value, n, dtype),
                  f"log-domain {dtype}")


def _fresh(rng, shape, lib):
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    return x if lib == "numpy" else torch.from_numpy(x.copy())


def _bindings(op):
    return [b for key, (_, _, _, b) in frontend._BOUND.items() if key[0] == op]


@pytest.fixture
def counted(monkeypatch):
    """Count the repeated forms' answers: a result, or None (the kernel then ran)."""
    seen = {"served": 0, "declined": 0, "forms": set()}
    made = {}
    for op in ("softmax", "log_softmax", "logsumexp"):
        kernel = getattr(rows, op)
        make = made[op] = kernel.repeat

        def counting(xp, args, make=make):
            form = make(xp, args)
            if form is None:
                return None
            seen["forms"].add(form.__name__)  # "by_address" or "by_view"

            def call(x):
                y = form(x)
                seen["served" if y is not None else "declined"] += 1
                return y

            return call

        monkeypatch.setattr(kernel, "repeat", counting)
    monkeypatch.setattr(frontend, "_BOUND", {})
    registry.reload()  # no binding made before the counting forms
    yield seen
    registry.reload()


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_repeated_calls_run_the_kept_form_within_the_spec(counted, lib, shape):
    rng = np.random.default_rng(sum(shape))
    for _ in range(4):
        x = _fresh(rng, shape, lib)
        ref = np.asarray(x, dtype=np.float64)
        n = shape[-1]
        p = sk.softmax(x, axis=-1)
        check_softmax(np.asarray(p), ref, "float32")
        lp = sk.log_softmax(x, axis=-1)
        check_log(np.asarray(lp), np.log(softmax64(ref)), n, "float32")
        lse, sign = sk.logsumexp(x, axis=-1, return_sign=True)
        check_log(np.asarray(lse), lse64(ref), n, "float32")
        assert np.all(np.asarray(sign) == 1.0)
        for y in (p, lp):
            assert type(y) is type(x) and y.dtype == x.dtype
        assert lse.dtype == x.dtype and lse.shape == shape[:-1]  # a numpy scalar for (8,)
    assert counted["served"] == 3 * 3 and counted["declined"] == 0  # calls 2-4 of each op
    by_address = lib == "torch" and np.prod(shape) * 4 < rows.ALIGN_FROM
    assert counted["forms"] == {"by_address" if by_address else "by_view"}
    assert all(b.repeat is not None for op in ("softmax", "log_softmax", "logsumexp")
               for b in _bindings(op))


def test_other_layouts_of_the_kept_shape_run_the_kernel(counted):
    """Same type, dtype and shape, so the same kept call: the form declines what its direct
    path cannot take, and the kernel's own path gives the result."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((32, 32)) * 4).astype(np.float32)
    check_softmax(sk.softmax(x, axis=-1), x, "float32")  # kept: C-contiguous, writable
    transposed = np.ascontiguousarray(x.T).T  # the same values, Fortran order
    read_only = x.copy()
    read_only.flags.writeable = False
    for other in (transposed, read_only):
        check_softmax(sk.softmax(other, axis=-1), x, "float32")
        check_log(sk.logsumexp(other, axis=-1), lse64(x), 32, "float32")
    assert counted["declined"] == 2 and counted["served"] == 0

    t = torch.from_numpy(x.copy())
    sk.softmax(t, axis=-1)
    negative = torch.from_numpy(-x)._neg_view()  # a negative bit: values of x, lazily
    assert negative.is_neg()
    check_softmax(sk.softmax(negative, axis=-1).numpy(), x, "float32")
    t_transposed = torch.from_numpy(np.ascontiguousarray(x.T)).T
    assert not t_transposed.is_contiguous()
    check_softmax(sk.softmax(t_transposed, axis=-1).numpy(), x, "float32")
    assert counted["declined"] == 4


def test_a_tensor_inside_another_goes_by_its_own_address():
    """Rows 1 to 31 of a tensor (contiguous, 4 KiB into its storage), by address."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((32, 256)) * 4).astype(np.float32)
    inner = torch.from_numpy(x)[1:]
    assert inner.is_contiguous() and inner.storage_offset() == 256
    for _ in range(3):
        check_softmax(sk.softmax(inner, axis=-1).numpy(), x[1:], "float32")
        check_log(sk.logsumexp(inner, axis=-1).numpy(), lse64(x[1:]), 256, "float32")
    assert np.array_equal(inner.numpy(), x[1:])  # the input is left as it was


def test_no_form_where_the_first_call_is_not_direct(counted):
    """A kind of call the direct path does not take (a 16-bit input, a result dtype of its
    own) keeps no form: its later calls run the kernel."""
    rng = np.random.default_rng(3)
    x16 = (rng.standard_normal((4, 9)) * 4).astype(np.float16)
    x32 = x16.astype(np.float32)
    for _ in range(3):
        check_softmax(sk.softmax(x16, axis=-1), x32, "float16")
        check_softmax(sk.softmax(x32, axis=-1, dtype=np.float64), x32, "float32")
    assert [b.repeat for b in _bindings("softmax")] == [None, None]
    assert counted["served"] == counted["declined"] == 0
