"""Import numba.cuda, working around known incompatibilities of the installed versions.

numba-cuda 0.30 registers an overload for ``np.row_stack``, which numpy 2.5 removed; the
module doing so (``numba.cuda.np.arrayobj``) is imported at the first compilation, so every
kernel launch fails with ``AttributeError`` under numpy 2.5.  :func:`import_cuda` imports
that module while ``np.row_stack`` is briefly an alias of ``np.vstack`` (what it was until
numpy 2.5), then removes the alias, so numpy is left exactly as it was found.

Under the simulator, :func:`lock_simulator_shared_arrays` makes a block's static shared arrays
one per block whatever the timing of its threads.
"""

from __future__ import annotations

import importlib
import sys
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
    if simulator_enabled():
        lock_simulator_shared_arrays()
    return cuda


def lock_simulator_shared_arrays() -> None:
    """Give the threads of a simulated block one array per ``cuda.shared.array`` line.

    numba-cuda's simulator finds a line's array with an unlocked check-then-insert on a dict:
    two threads of a block that reach the line together can each create an array, and the
    block's exchange through it then loses values (seen in CI, under load, as a split row
    whose block missed the other chunk's summary).  The check and the insert are made under
    one lock here, with the simulator's key (the caller's file and line).
    """
    from numba.cuda.simulator import kernelapi

    shared = kernelapi.FakeCUDAShared
    if getattr(shared, "softmaxkit_locked", False):
        return
    unlocked = shared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the refusal
            return unlocked(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            found = self._allocations.get(caller)
            if found is None:
                found = self._allocations[caller] = kernelapi.np.empty(shape, dtype)
        return found

    shared.array = array
    shared.softmaxkit_locked = True
