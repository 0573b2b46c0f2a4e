"""The numpy 2.5 compatibility shim: numba.cuda compiles although np.row_stack is gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import numpy as np
if hasattr(np, "row_stack"):  # gone from numpy 2.5 on
    del np.row_stack
{body}
"""


def _run(body: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    return subprocess.run([sys.executable, "-c", _PROBE.format(body=body)], env=env,
                          capture_output=True, text=True)


def test_shim_imports_the_module_that_names_row_stack():
    body = (
        "from softmaxkit_numba_cuda.compat import import_cuda\n"
        "cuda = import_cuda()\n"
        "import sys\n"
        "assert 'numba.cuda.np.arrayobj' in sys.modules\n"
        "assert not hasattr(np, 'row_stack'), 'numpy must be left as it was found'\n"
        "print('ok')\n"
    )
    done = _run(body)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_without_the_shim_the_import_fails():
    """The failure the shim exists for, so the shim's test above is a real test."""
    done = _run("import numba.cuda.np.arrayobj\n")
    if done.returncode == 0:
        pytest.skip("this numba-cuda no longer needs np.row_stack; the shim can go")
    assert "row_stack" in done.stderr


def test_shim_leaves_an_existing_row_stack_alone():
    code = (
        "import numpy as np\n"
        "np.row_stack = marker = lambda *a: None\n"
        "from softmaxkit_numba_cuda.compat import import_cuda\n"
        "import_cuda()\n"
        "assert np.row_stack is marker\n"
    )
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


_RACE = """
import sys, threading
import numpy as np
from numba.cuda.simulator.kernelapi import FakeCUDAShared
{setup}
sys.setswitchinterval(1e-6)  # thread switches between any two bytecodes
split = 0
for _ in range({rounds}):
    shared = FakeCUDAShared(0)
    start = threading.Barrier(16)
    got = [None] * 16
    def thread(t):
        start.wait()
        got[t] = shared.array(4, np.float32)  # one line: one array for the whole block
    threads = [threading.Thread(target=thread, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    split += len({{id(a) for a in got}}) != 1
    if split and {stop}:
        break
print(split)
"""


def _blocks_split(setup: str, rounds: int, stop: bool) -> int:
    """Blocks, of ``rounds``, whose threads got more than one array (``stop``: at the first)."""
    body = _RACE.format(setup=setup, rounds=rounds, stop=stop)
    done = subprocess.run([sys.executable, "-c", body],
                          env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_simulated_blocks_share_one_array_per_shared_line():
    """16 threads of a block reach one ``cuda.shared.array`` line together, 300 times: with
    the lock that :func:`import_cuda` installs under the simulator, all get one array."""
    setup = ("from softmaxkit_numba_cuda.compat import import_cuda\nimport_cuda()\n"
             "assert FakeCUDAShared.softmaxkit_locked\n")
    assert _blocks_split(setup, 300, stop=False) == 0


def test_unlocked_simulator_splits_blocks():
    """The race the lock exists for: the simulator's own allocation gives some blocks two
    arrays for one line (about 7% of the blocks here), so the test above is a real test."""
    assert _blocks_split("", 3000, stop=True) > 0
