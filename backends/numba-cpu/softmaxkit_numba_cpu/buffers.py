"""Memory for results: aligned to a cache line, and large buffers reused once released.

Two things make writing a large result slower than copying into an existing array:

* numpy's large arrays start 16 bytes past a cache line, so every row of a softmax would
  begin and end in the middle of a line; the kernels stream whole lines of large results
  and write shared ones with ordinary stores, and on a line-aligned result rows whose length
  is a multiple of a line share none.  Results of :data:`ALIGN_FROM` bytes or more (those
  the kernels stream) start on a line; smaller ones are stored plainly, and their alignment
  would cost more (finding an array's address takes about a microsecond) than it saves.
* Fresh memory costs the operating system a page fault and zeroing for every page touched:
  for a 64 MiB result that is about as long as the kernel's own work.  A result of at least
  :data:`REUSE_FROM` bytes is therefore carved from a buffer that this module takes back
  when the last array using it is released (a view, a torch tensor sharing it: any of them
  keeps it in use), and hands out again for a result of the same size; at most
  :data:`KEEP` released buffers are kept.  The setting ``reuse`` (:mod:`.settings`) turns
  reuse off; :func:`release` drops the buffers kept now.

Only the storage is reused: every element of a result is written by its kernel.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from .settings import SETTINGS

ALIGN_FROM = 1 << 22
"""Results of at least this many bytes start on a 64-byte cache line (and are streamed)."""
REUSE_FROM = 1 << 22
"""Results of at least this many bytes use a reusable buffer (smaller ones come from the
allocator's own free lists, whose memory is already mapped)."""
KEEP = 4
"""Released buffers kept for reuse, at most."""
_LINE = 64

REUSE = SETTINGS.reuse
"""Whether large buffers are reused."""

_kept: list[np.ndarray] = []
_lock = threading.Lock()


def _take(nbytes: int) -> np.ndarray:
    with _lock:
        for i, raw in enumerate(_kept):
            if raw.nbytes == nbytes:
                return _kept.pop(i)
    return np.empty(nbytes, dtype=np.uint8)


def _give_back(raw: np.ndarray) -> None:
    # called when a lease dies, which may happen in any thread, even one inside _take:
    # never wait for the lock (the buffer is then simply freed)
    if not _lock.acquire(blocking=False):
        return
    try:
        if REUSE and len(_kept) < KEEP:
            _kept.append(raw)
    finally:
        _lock.release()


def release() -> None:
    """Drop every released buffer kept for reuse (their memory goes back to the system)."""
    with _lock:
        _kept.clear()


class _Lease:
    """The memory of one result: numpy arrays made from it (and their views) keep it alive,
    and when the last one goes the buffer is given back for reuse."""

    def __init__(self, raw: np.ndarray, offset: int, nbytes: int):
        self._raw = raw
        self.__array_interface__ = {
            "data": (raw.ctypes.data + offset, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }

    def __del__(self) -> None:
        try:
            _give_back(self._raw)
        except Exception:  # interpreter shutdown: module globals may be gone
            pass


def result_array(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new C-contiguous array for a result: ``np.empty(shape, dtype)`` in effect.

    Large ones start on a cache line, and the largest reuse a released buffer (see the
    module's docstring).
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < ALIGN_FROM:
        return np.empty(shape, dtype=dtype)
    if REUSE and nbytes >= REUSE_FROM:
        raw = _take(nbytes + _LINE)
        skip = -raw.ctypes.data % _LINE
        flat = np.asarray(_Lease(raw, skip, nbytes))
    else:
        raw = np.empty(nbytes + _LINE, dtype=np.uint8)
        skip = -raw.ctypes.data % _LINE
        flat = raw[skip:skip + nbytes]
    return flat.view(dtype).reshape(shape)
