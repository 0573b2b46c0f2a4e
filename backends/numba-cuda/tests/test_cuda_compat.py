"""The numpy 2.5 compatibility shim: numba.cuda compiles although np.row_stack is gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import numpy as np
del np.row_stack  # as in numpy 2.5
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
