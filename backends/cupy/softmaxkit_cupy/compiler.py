"""Build the CUDA C++ sources of ``kernels/`` through ``cupy.RawModule``, once per module.

A module is one source compiled for one list of name expressions (template instantiations).
Local ``#include "..."`` lines are inlined here, so the source CuPy sees (and keys its
on-disk cache by) is complete; modules live in a process-wide cache after the first build.
"""

from __future__ import annotations

import re
import threading
from functools import cache
from pathlib import Path
from typing import Any

from .configs import SM90_SOURCES

KERNELS = Path(__file__).parent / "kernels"
OPTIONS = ("-std=c++17",)
SM90_OPTIONS = ("-arch=sm_90a",)
"""Added for the sources of ``configs.SM90_SOURCES``: NVRTC builds for sm_90a when given this
beside the ``-arch=sm_<device>`` CuPy appends (checked with NVRTC 13.0, in either order)."""

_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)
_lock = threading.Lock()
_modules: dict[tuple[str, tuple[str, ...]], Any] = {}


@cache
def source(filename: str) -> str:
    """The text of ``kernels/filename`` with its local includes inlined (each once)."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (KERNELS / name).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text).replace("#pragma once", "")

    return expand(filename)


def module(filename: str, names: tuple[str, ...]) -> Any:
    """The compiled ``cupy.RawModule`` of ``kernels/filename`` for the name expressions."""
    key = (filename, names)
    found = _modules.get(key)
    if found is not None:
        return found
    import cupy

    with _lock:
        found = _modules.get(key)
        if found is None:
            options = OPTIONS + (SM90_OPTIONS if filename in SM90_SOURCES else ())
            found = cupy.RawModule(
                code=source(filename), options=options, name_expressions=list(names)
            )
            found.compile()
            _modules[key] = found
    return found


def function(filename: str, names: tuple[str, ...], name: str) -> Any:
    """The kernel ``name`` (one of ``names``) of the module built from ``kernels/filename``."""
    return module(filename, names).get_function(name)
