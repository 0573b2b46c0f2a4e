"""Messages a user reads: backends that failed to load, NoBackendError's summary and install
hint, and warnings that point at the caller's line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import softmaxkit as sk
from softmaxkit import registry

MANIFESTS = '''
def exploding():
    raise RuntimeError("manifest exploded")

def badkernel():
    return {"name": "badkernel", "priority": 50,
            "serves": [{"ops": ["softmax"], "devices": ["cpu"], "dtypes": ["*"]}],
            "kernels": {"softmax": "skmsg.kernels:softmax"},
            "install_hint": "pip install skmsg"}
'''

ENTRY_POINTS = """\
[softmaxkit.backends]
exploding = skmsg.manifests:exploding
badkernel = skmsg.manifests:badkernel
"""

# the line numbers below are asserted: the warnings must point at these calls
PROBE = """\
import json, warnings
import numpy as np
import softmaxkit as sk
x = np.linspace(-3.0, 3.0, 12).reshape(3, 4)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sk.softmax(x, backend="reference")  # line 7: discovery warns here
    with sk.backend_opts(prioritize=["badkernel", "reference"]):
        sk.softmax(x)  # line 9: the kernel's import fails here
messages = {}
for name in ("exploding", "badkernel", "missing"):
    try:
        sk.softmax(x, backend=name)
    except sk.NoBackendError as exc:
        messages[name] = [type(exc).__name__, str(exc)]
import contextlib, io
from softmaxkit.cli import main
info = io.StringIO()
with contextlib.redirect_stdout(info):
    main(["info", "--op", "softmax"])
print(json.dumps({"warnings": [[str(w.message), w.filename, w.lineno] for w in caught],
                  "messages": messages, "failed": sk.registry.failed_to_load(),
                  "info": info.getvalue()}))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    root = tmp_path_factory.mktemp("skmsg")
    pkg = root / "skmsg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "manifests.py").write_text(textwrap.dedent(MANIFESTS))
    (pkg / "kernels.py").write_text("raise ImportError('libfast.so: cannot open')\n")
    info = root / "skmsg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: skmsg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    script = root / "probe.py"
    script.write_text(PROBE)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=root, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return str(script), json.loads(proc.stdout)


def test_a_backend_that_failed_to_load_says_so_and_why(probe):
    _, out = probe
    kind, text = out["messages"]["exploding"]
    assert kind == "BackendLoadError"
    assert "is installed but failed to load" in text and "manifest exploded" in text
    assert "not installed" not in text.replace("is installed", "")
    assert "manifest exploded" in out["failed"]["exploding"]
    kind, text = out["messages"]["badkernel"]
    assert kind == "BackendLoadError"
    assert "libfast.so: cannot open" in text and "pip install skmsg" in text
    kind, text = out["messages"]["missing"]
    assert kind == "NoBackendError" and "is not installed" in text
    assert any(line.split()[:4] == ["exploding", "FAILED", "TO", "LOAD:"]
               and "manifest exploded" in line for line in out["info"].splitlines())


def test_warnings_point_at_the_callers_line(probe):
    script, out = probe
    found = {}
    for message, filename, lineno in out["warnings"]:
        key = "exploding" if "exploding" in message else "badkernel"
        found[key] = (filename, lineno)
    assert found == {"exploding": (script, 7), "badkernel": (script, 9)}, out["warnings"]


def test_no_backend_error_is_a_readable_summary_with_the_install_hint():
    x = np.zeros((2, 3))
    with pytest.raises(sk.NoBackendError) as info:
        sk.cross_entropy(x, np.zeros(2, dtype=np.int64), backend="loopback")
    text = str(info.value)
    assert "it serves log_softmax, logsumexp, softmax on cpu for float16, float32, float64" \
        in text
    assert "(install: pip install ./tests/loopback" in text
    assert "{" not in text  # no raw manifest dict


def test_register_warning_points_at_the_caller():
    manifest = {"name": "twice", "kernels": {"softmax": "softmaxkit.reference.rows:softmax"}}
    registry.register(manifest)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            registry.register(manifest)
    finally:
        registry.unregister("twice")
    (w,) = caught
    assert w.filename == __file__ and "replaces" in str(w.message)
