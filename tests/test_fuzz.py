"""Differential fuzzing in CI: every installed backend that serves an operation on numpy and
torch CPU arrays agrees with the spec's reference on drawn inputs (special values, views,
masks, weights), forward and backward; and the fuzzer does catch a rule breaker."""

from __future__ import annotations

import numpy as np
import pytest
from softmaxkit_loopback import broken

import softmaxkit as sk
from softmaxkit import registry
from softmaxkit.testing import target
from softmaxkit.testing.fuzz import OPS, fuzz, main, serving

EXAMPLES = 25  # per backend, operation and target: CI stays at tens of seconds


@pytest.mark.parametrize("target_name", ["numpy", "torch-cpu"])
@pytest.mark.parametrize("op", OPS)
def test_every_backend_agrees_with_the_reference(op, target_name):
    t = target(target_name)
    names = serving(op, t)
    assert "reference" in names
    for name in names:
        result = fuzz(name, op, t, max_examples=EXAMPLES, seed=0)
        assert result.ok, f"{name}: {result.failure}"
        if name == "reference":
            assert result.compared >= EXAMPLES  # every draw ran and was compared


@pytest.fixture
def rule_breaker():
    name = registry.register(broken.manifest()).name
    yield name
    registry.unregister(name)


def test_the_fuzzer_catches_a_rule_breaker(rule_breaker):
    # its softmax makes +inf rows one-hot (the kit's cases catch its logsumexp too)
    result = fuzz(rule_breaker, "softmax", "numpy", max_examples=100, seed=0)
    assert not result.ok
    assert "input:" in result.failure  # the shrunk input is shown


@pytest.mark.parametrize("op", ["softmax", "logsumexp", "cross_entropy", "softmax_vjp"])
def test_zero_size_masked_rows_on_every_cpu_backend(op):
    """A (0, 0) array with a (0, 0) mask once crashed numba-cpu's shared-mask detection."""
    x = np.zeros((0, 0), np.float32)
    w = np.zeros((0, 0), bool)
    for name in serving(op, target("numpy")):
        try:
            out = call(op, x, w, name)
        except sk.NoBackendError:  # a backend for other arrays (Dask's) declines numpy's
            continue
        assert np.asarray(out).shape == (0,) * np.asarray(out).ndim


def call(op, x, w, backend):
    if op == "softmax":
        return sk.softmax(x, axis=0, where=w, backend=backend)
    if op == "logsumexp":
        return sk.logsumexp(x, axis=0, where=w, backend=backend)
    if op == "cross_entropy":
        return sk.cross_entropy(x, np.zeros((0, 0), np.float32), axis=0, where=w,
                                reduction="none", return_grad=True, backend=backend)[0]
    return sk.softmax_vjp(x, x, axis=0, where=w, backend=backend)


def test_python_dash_m_entry_point(capsys):
    assert main(["--target", "numpy", "--backend", "reference", "--ops", "softmax",
                 "logsumexp", "--examples", "10"]) == 0
    out = capsys.readouterr().out
    assert "reference    softmax" in out and out.rstrip().endswith("0 disagreements")
    # a backend on sys.path without an installed entry point, registered from its manifest
    try:
        assert main(["--target", "numpy", "--backend", "loopback-broken", "--ops", "softmax",
                     "--examples", "100", "--manifest",
                     "softmaxkit_loopback.broken:manifest"]) == 1
        assert "loopback-broken softmax" in capsys.readouterr().out
    finally:
        registry.unregister("loopback-broken")
