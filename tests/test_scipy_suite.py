"""SciPy's own tests of logsumexp, softmax and log_softmax pass with softmaxkit swapped in.

SciPy's installed ``scipy/special/tests/test_logsumexp.py`` runs twice in subprocesses, with
``SCIPY_ARRAY_API`` on numpy, array_api_strict, torch (CPU) and dask.array: once as SciPy
ships it, and once with ``scipy.special``'s three functions replaced by softmaxkit's
(``scipy_suite/swap_softmaxkit.py``).  Both runs keep the real-valued cases only
(``scipy_suite/select_real.py``).  Every case SciPy passes must pass with softmaxkit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

scipy = pytest.importorskip("scipy")
pytest.importorskip("torch")
pytest.importorskip("dask.array")
pytest.importorskip("array_api_strict")

PLUGINS = Path(__file__).resolve().parent / "scipy_suite"
BACKENDS = ["numpy", "array_api_strict", "torch", "dask.array"]

# SciPy 1.17's file has 161 real-valued cases that SciPy passes on numpy, array_api_strict and
# torch (backend-free cases included once) and 52 on dask.array; two more are expected
# failures of SciPy's own on array_api_strict (integer softmax inputs).  The counts depend on
# SciPy's version, which requirements/test.txt pins.
EXPECTED = {"eager": 161, "dask.array": 52}


def _run(tmp: Path, swap: bool) -> subprocess.Popen:
    env = dict(os.environ)
    env["SCIPY_ARRAY_API"] = json.dumps(BACKENDS)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), env.get("PYTHONPATH")]))
    report = tmp / ("softmaxkit.xml" if swap else "scipy.xml")
    env["SOFTMAXKIT_SWAP_RECORD"] = str(tmp / "swapped.json")
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "select_real",
        *(["-p", "swap_softmaxkit"] if swap else []),
        f"--junitxml={report}", "--pyargs", "scipy.special.tests.test_logsumexp",
    ]
    # outside the repository, so that SciPy's conftest (its xp fixture) is the one in force
    return subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _outcomes(report: Path) -> dict[str, str]:
    """``{case id: "passed" | "failed" | "skipped"}`` from a JUnit XML report."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"  # xfailed cases are reported as skipped
        out[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return out


def _group(case: str) -> str:
    return "dask.array" if "[dask.array" in case else "eager"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scipy_suite")
    procs = {swap: _run(tmp, swap) for swap in (False, True)}  # the two run side by side
    logs = {swap: p.communicate(timeout=900)[0] for swap, p in procs.items()}
    swapped = tmp / "swapped.json"
    return {
        "scipy": (_outcomes(tmp / "scipy.xml"), logs[False]),
        "softmaxkit": (_outcomes(tmp / "softmaxkit.xml"), logs[True]),
        "swapped": json.loads(swapped.read_text()) if swapped.exists() else {},
    }


def test_the_swapped_run_used_softmaxkit(runs):
    assert runs["swapped"] == {name: "softmaxkit.rows"
                               for name in ("logsumexp", "softmax", "log_softmax")}


def test_scipy_passes_the_counted_cases(runs):
    outcomes, log = runs["scipy"]
    passed = [c for c, o in outcomes.items() if o == "passed"]
    counts = {g: sum(_group(c) == g for c in passed) for g in EXPECTED}
    assert counts == EXPECTED, log[-3000:]


def test_softmaxkit_passes_every_case_scipy_passes(runs):
    theirs, _ = runs["scipy"]
    ours, log = runs["softmaxkit"]
    assert set(ours) == set(theirs), "the two runs selected different cases"
    failed = sorted(c for c, o in theirs.items() if o == "passed" and ours[c] != "passed")
    assert not failed, f"{len(failed)} of SciPy's passing cases fail with softmaxkit:\n" + (
        "\n".join(failed) + "\n" + log[-6000:])
