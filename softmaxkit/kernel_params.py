"""Kernel parameter buffers for backends that launch CUDA kernels through the driver.

``cuLaunchKernel`` reads a kernel's parameters through an array of pointers, one per
parameter.  A :class:`ParamBuffer` holds every parameter of one parameter list at its C
offset in one buffer, with that pointer array built once, so a launch costs one
``struct.pack_into`` of the values.  Buffers are per thread: a launch reads its buffer while
the driver queues it, and another thread may be filling its own meanwhile.
"""

from __future__ import annotations

import ctypes
import struct
import threading

__all__ = ["ParamBuffer", "param_buffer"]


class ParamBuffer:
    """The parameters of a kernel, ``codes`` in :mod:`struct`'s native format (one code a
    parameter, native size and alignment: ``"Q"`` an address, ``"q"`` an int64, ``"i"`` an
    int32, ``"?"`` a bool, ``"f"`` a float32, ...).

    Attributes
    ----------
    params : int
        The address of the pointer array to pass as ``cuLaunchKernel``'s ``kernelParams``.
    """

    __slots__ = ("buffer", "params", "pointers", "struct")

    def __init__(self, codes: str) -> None:
        self.struct = struct.Struct("@" + codes)
        self.buffer = (ctypes.c_char * max(self.struct.size, 1))()
        base = ctypes.addressof(self.buffer)
        # a parameter's offset: the size of those before it, aligned for it
        offsets = [struct.calcsize("@" + codes[:i + 1]) - struct.calcsize("@" + c)
                   for i, c in enumerate(codes)]
        self.pointers = (ctypes.c_void_p * max(len(codes), 1))(*[base + o for o in offsets])
        self.params = ctypes.addressof(self.pointers)

    def pack(self, values: tuple | list) -> int:
        """Write ``values`` (one a parameter) into the buffer; returns :attr:`params`."""
        self.struct.pack_into(self.buffer, 0, *values)
        return self.params


_local = threading.local()


def param_buffer(codes: str) -> ParamBuffer:
    """This thread's :class:`ParamBuffer` for parameter list ``codes``."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    found = buffers.get(codes)
    if found is None:
        found = buffers[codes] = ParamBuffer(codes)
    return found
