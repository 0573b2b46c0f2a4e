"""``import softmaxkit`` stays light: no kernel library, no peer library, no discovery."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("numba", "cupy", "cupyx", "torch", "scipy", "jax", "dask", "matplotlib", "tqdm")

PROBE = f"""
import json, sys
import softmaxkit
from softmaxkit import registry
after_import = sorted(m for m in {HEAVY!r} if m in sys.modules)
discovered = registry._registry is not None
names = sorted(softmaxkit.backends())  # loads every installed manifest, no kernel
after_discovery = sorted(m for m in ("numba", "cupy", "cupyx") if m in sys.modules)
kernels = sorted(m for m in sys.modules if m.startswith("softmaxkit_loopback.k"))
print(json.dumps([after_import, discovered, names, after_discovery, kernels]))
"""


def test_import_pulls_in_no_kernel_library_and_manifests_stay_cheap():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    after_import, discovered, names, after_discovery, kernels = json.loads(proc.stdout)
    assert after_import == []
    assert discovered is False  # entry points are read on the first call, not at import
    assert {"reference", "loopback"} <= set(names)
    assert after_discovery == []  # every installed manifest, first-party ones included
    assert kernels == []  # kernels load on first use


def test_every_package_of_the_source_tree_is_installed():
    # pyproject.toml lists the packages: one left out installs as missing in a wheel, while an
    # editable install (CI's) still finds it on disk
    import pathlib

    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    root = pathlib.Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    on_disk = {
        ".".join(p.parent.relative_to(root).parts)
        for p in (root / "softmaxkit").rglob("__init__.py")
    }
    assert on_disk <= listed, sorted(on_disk - listed)
