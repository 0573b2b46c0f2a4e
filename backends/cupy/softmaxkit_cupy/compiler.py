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

KERNELS = Path(__file__).parent / "kernels"
OPTIONS = ("-std=c++17",)

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
            found = cupy.RawModule(
                code=source(filename), options=OPTIONS, name_expressions=list(names)
            )
            found.compile()
            _modules[key] = found
    return found


def function(filename: str, names: tuple[str, ...], name: str) -> Any:
    """The kernel ``name`` (one of ``names``) of the module built from ``kernels/filename``."""
    return module(filename, names).get_function(name)
