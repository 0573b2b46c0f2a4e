"""Import numba.cuda, working around known incompatibilities of the installed versions.

numba-cuda 0.30 registers an overload for ``np.row_stack``, which numpy 2.5 removed; the
module doing so (``numba.cuda.np.arrayobj``) is imported at the first compilation, so every
kernel launch fails with ``AttributeError`` under numpy 2.5.  :func:`import_cuda` imports
that module while ``np.row_stack`` is briefly an alias of ``np.vstack`` (what it was until
numpy 2.5), then removes the alias, so numpy is left exactly as it was found.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

from .settings import simulator_requested

_lock = threading.Lock()
_PATCHED_MODULE = "numba.cuda.np.arrayobj"


def simulator_enabled() -> bool:
    """Whether Numba's CUDA simulator is (or will be) active in this process."""
    try:
        from numba import config
    except ImportError:
        return simulator_requested()
    return bool(config.ENABLE_CUDASIM)


def import_cuda() -> ModuleType:
    """Return ``numba.cuda`` with ``numba.cuda.np.arrayobj`` imported under numpy 2.5 too."""
    import numpy as np

    with _lock:
        added = not hasattr(np, "row_stack")
        if added:
            np.row_stack = np.vstack  # what numpy < 2.5 exported under this name
        try:
            cuda = importlib.import_module("numba.cuda")
            importlib.import_module(_PATCHED_MODULE)
        finally:
            if added:
                del np.row_stack
    return cuda
