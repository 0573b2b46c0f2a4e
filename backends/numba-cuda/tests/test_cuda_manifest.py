"""The manifest, the entry point, can_run and the row plans: no GPU and no numba needed."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import numpy as np
import pytest
from softmaxkit_numba_cuda import plan
from softmaxkit_numba_cuda.manifest import can_run, manifest


def test_manifest_imports_no_numba():
    code = (
        "import sys, softmaxkit_numba_cuda as b; m = b.manifest(); "
        "assert m['name'] == 'numba-cuda'; "
        "bad = [k for k in sys.modules if k.split('.')[0] in ('numba', 'cupy')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_entry_point_names_the_manifest():
    found = [ep for ep in entry_points(group="softmaxkit.backends") if ep.name == "numba-cuda"]
    assert len(found) == 1
    assert found[0].load()()["name"] == "numba-cuda"


def test_manifest_serves_cuda_row_operations(monkeypatch):
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    m = manifest()
    rows, summarize, merge = m["serves"]
    for entry in m["serves"]:
        assert entry["devices"] == ["cuda"]
    assert set(rows["dtypes"]) == set(summarize["dtypes"]) == {
        "float16", "bfloat16", "float32", "float64"}
    assert merge["dtypes"] == ["float32", "float64"]  # summaries are in the accumulator dtype
    served = {op for entry in m["serves"] for op in entry["ops"]}
    assert set(m["kernels"]) == served
    assert "attention" not in m["kernels"]


def _call(op, device, **args):
    return SimpleNamespace(op=op, device=device, args=args)


def test_can_run_declines_host_arrays_without_the_simulator(monkeypatch):
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    verdict = can_run(_call("softmax", "cpu", x=np.zeros((2, 3))))
    assert isinstance(verdict, str) and "CUDA" in verdict
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert can_run(_call("softmax", "cpu", x=np.zeros((2, 3)))) is True


@pytest.mark.parametrize("n", [0, 1, 31, 33, 128, 512, 513, 4096, 8192, 32768, 32769, 524288])
@pytest.mark.parametrize("max_slots", [32, 16, 8])
def test_plans_cover_every_row(n, max_slots):
    p = plan.choose(n, max_slots=max_slots)
    assert p.threads * p.slots * p.tiles >= n
    assert (p.threads % 32 == 0 or p.threads in (8, 16)) and p.block <= 1024
    if n <= 32 * min(16, max_slots):
        assert p.threads <= 32 and p.cached  # a warp (or part of one) per row, read once
    elif n <= 1024 * max_slots:
        assert p.rows_per_block == 1 and p.cached and p.slots <= max_slots
    else:
        assert not p.cached and p.slots <= max_slots


def test_plan_override(monkeypatch):
    monkeypatch.setenv(plan.OVERRIDE, "64,2")
    p = plan.choose(1000)
    assert (p.threads, p.slots, p.tiles) == (64, 2, 8)
    with pytest.raises(ValueError):
        plan.make(48, 2, 10)
    assert plan.make(16, 2, 10).rows_per_block == 16  # two rows per warp
