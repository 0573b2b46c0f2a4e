"""The kernels under Numba's CUDA simulator: the conformance kit, every row strategy and the
float32 / float64 attention kernels (the kit's attention cases, forced small tiles, and packed
variable-length attention through its padded batch).

numba reads NUMBA_ENABLE_CUDASIM once, at its first import, and other backends' tests import
numba in this process, so the simulated runs happen in subprocesses (``simulated.py``), each
printing one JSON line per result, in the background while the rest of the suite runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from softmaxkit.testing import cases

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from simulated import (  # noqa: E402
    ATTENTION_CASES,
    ATTENTION_HEAD_DIMS,
    ATTENTION_OPS,
    PLANS,
    ROW_OPS,
    SUMMARY_OPS,
    TILE_CASES,
    VARLEN_CASES,
)

sys.path.remove(str(HERE))

# the longest first (CPU seconds alone: plans 276, attention float32 143, float64 134, kit
# 119 and 106, varlen 44, tiles 30), so that the two running at a time finish together
JOBS = (("plans",), ("attention", "float32"), ("attention", "float64"),
        ("kit", "float32,float64"), ("kit", "float16,bfloat16"), ("varlen",),
        ("attention-tiles",))
KIT_IDS = [f"{c.name}[{c.dtype}]" for c in cases(target="numpy", ops=ROW_OPS + SUMMARY_OPS)]
ATTENTION_IDS = [f"{c.name}[{c.dtype}]" for c in cases(
    target="numpy", ops=ATTENTION_OPS, dtypes=("float32", "float64"),
    head_dims=ATTENTION_HEAD_DIMS) if c.name in ATTENTION_CASES[c.dtype]]
TILE_IDS = [f"attention-tiles[{name}][{d}]" for name, (_, dtypes) in TILE_CASES.items()
            for d in dtypes]
VARLEN_IDS = [f"varlen[{name}][{dtype}]" for name, (_, _, dtype) in VARLEN_CASES.items()]
PLAN_IDS = [f"plan[{p}]-{op}[{d}]" for p, (_, dtypes, ops) in PLANS.items() for d in dtypes
            for op in ops]


class SimulatedRuns:
    """The simulated runs of :data:`JOBS`, two at a time (CI has two cores) in the background,
    at the lowest priority (nice 19, ``simulated.py``), so that the suite's own tests come
    first.

    ``conftest.py`` starts them when this module's tests are collected and moves the tests to
    the end of the session, so the runs overlap the rest of the suite; :meth:`results` waits.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list = []
        self._procs: list[subprocess.Popen] = []
        self._stopped = False

    def start(self) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2)
            self._futures = [self._pool.submit(self._run, job) for job in JOBS]

    def _run(self, job: tuple[str, ...]) -> str:
        if self._stopped:
            return ""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SOFTMAXKIT_NUMBA_CUDA_")}
        env["NUMBA_ENABLE_CUDASIM"] = "1"
        proc = subprocess.Popen([sys.executable, str(HERE / "simulated.py"), *job], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._procs.append(proc)
        out, _ = proc.communicate(timeout=1800)
        assert proc.returncode == 0, f"{job}: exit {proc.returncode}\n{out[-4000:]}"
        return out

    def results(self) -> dict[str, dict]:
        """Every run's results by id, once all have finished."""
        self.start()
        results: dict[str, dict] = {}
        for future in self._futures:
            for line in future.result().splitlines():
                if line.startswith("RESULT "):
                    record = json.loads(line[len("RESULT "):])
                    results[record["id"]] = record
        return results

    def stop(self) -> None:
        """End the runs still going (a session that stops early)."""
        self._stopped = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


RUNS = SimulatedRuns()


@pytest.fixture(scope="module")
def simulated() -> dict[str, dict]:
    return RUNS.results()


def _check(results: dict[str, dict], rid: str) -> None:
    assert rid in results, f"{rid}: no result from the simulated run"
    record = results[rid]
    assert record["status"] != "failed", record["message"]


@pytest.mark.parametrize("rid", KIT_IDS)
def test_conformance_kit_under_simulator(simulated, rid):
    _check(simulated, rid)


@pytest.mark.parametrize("rid", ATTENTION_IDS)
def test_attention_kit_under_simulator(simulated, rid):
    _check(simulated, rid)
    assert simulated[rid]["status"] == "passed", simulated[rid]["message"]


@pytest.mark.parametrize("rid", TILE_IDS)
def test_attention_tiles_under_simulator(simulated, rid):
    _check(simulated, rid)
    assert simulated[rid]["status"] == "passed"


@pytest.mark.parametrize("rid", VARLEN_IDS)
def test_varlen_attention_under_simulator(simulated, rid):
    _check(simulated, rid)
    assert simulated[rid]["status"] == "passed"


@pytest.mark.parametrize("rid", PLAN_IDS)
def test_row_strategies_under_simulator(simulated, rid):
    _check(simulated, rid)
    assert simulated[rid]["status"] == "passed"
