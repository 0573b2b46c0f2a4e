"""The conformance kit's own honesty: a case that checked nothing is not a pass, a backend
that fails to load fails, rule breakers are caught, and a missing dtype library means
unsupported, not failed."""

from __future__ import annotations

import sys

import pytest
from softmaxkit_loopback import broken

from softmaxkit import registry
from softmaxkit.cli import main
from softmaxkit.testing import STATUSES, RanNothing, check_backend, target
from softmaxkit.testing.kit import Case


@pytest.fixture
def register():
    """Register manifests for one test, and remove them afterwards."""
    names = []

    def add(manifest):
        registry.register(manifest)
        names.append(manifest["name"])
        return manifest["name"]

    yield add
    for name in names:
        registry.unregister(name)


def test_a_case_that_checks_nothing_ran_nothing():
    # loopback serves no VJP: whatever vectors a dtype has, nothing is checked, so nothing
    # passes
    results = [r for r in check_backend("loopback", ops=["softmax_vjp"])
               if r.case == "vjp_vectors"]
    assert len(results) == 4
    for r in results:
        assert r.status in ("unsupported", "ran nothing") and r.checks == 0, r
    # a case whose checks do not apply here
    idle = Case("idle", ("softmax",), "float64", lambda t, dtype, backend: None,
                target("numpy"))
    with pytest.raises(RanNothing):
        idle.run("reference")


def test_a_passed_case_counts_its_checks():
    results = check_backend("loopback", ops=["logsumexp"], dtypes=["float64"])
    passed = [r for r in results if r.status == "passed"]
    assert passed and all(r.checks > 0 for r in passed)
    assert {r.status for r in results} <= set(STATUSES)


def test_a_kernel_that_fails_to_import_is_a_failure(register, capsys):
    name = register({
        "name": "badimport",
        "serves": [{"ops": ["softmax"], "devices": ["cpu"], "dtypes": ["float64"]}],
        "kernels": {"softmax": "softmaxkit_loopback.no_such_module:softmax"},
    })
    with pytest.warns(registry.BackendWarning, match="failed to import"):
        results = check_backend(name, ops=["softmax"], dtypes=["float64"])
    failed = [r for r in results if r.status == "failed"]
    assert failed and all("failed to load" in r.message for r in failed)
    assert not [r for r in results if r.status == "passed"]
    assert main(["verify", "--backend", name, "--ops", "softmax"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_a_backend_that_breaks_the_zero_weight_and_inf_rules_is_caught(register):
    name = register(broken.manifest())
    results = {(r.case, r.dtype): r for r in check_backend(name, dtypes=["float32"])}
    for case in ("infinite_rows", "logsumexp_zero_weights"):
        assert results[case, "float32"].status == "failed", results[case, "float32"]
    assert "+inf rows" in results["infinite_rows", "float32"].message
    assert "zero weights" in results["logsumexp_zero_weights", "float32"].message
    # the kit is specific: what the backend gets right passes
    for case in ("random_rows", "random_logsumexp", "masks_and_policies"):
        assert results[case, "float32"].status == "passed", results[case, "float32"]


def test_bfloat16_without_ml_dtypes_is_unsupported_on_numpy(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now fails
    results = check_backend("reference", ops=["softmax"], dtypes=["bfloat16"])
    assert results and {r.status for r in results} == {"unsupported"}
    assert all("install ml_dtypes" in r.message for r in results)


def test_verify_prints_the_checks_of_each_case_and_counts_every_status(capsys):
    assert main(["verify", "--backend", "loopback", "--ops", "softmax_vjp", "-v"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.startswith("  loopback ")]
    assert lines
    for fields in lines:
        status_at = 3 if fields[3] != "ran" else 4
        assert fields[status_at + 1].isdigit(), fields
        if fields[3] in ("ran", "unsupported"):
            assert fields[status_at + 1] == "0", fields
    summary = next(line for line in out.splitlines() if line.startswith("loopback:"))
    for status in STATUSES:
        assert f" {status}" in summary, summary
