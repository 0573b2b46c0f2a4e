"""Kernel parameter buffers: each parameter lands at its C offset, read back as written."""

from __future__ import annotations

import ctypes
import struct
import threading

from softmaxkit.kernel_params import param_buffer


def test_parameters_sit_at_their_c_offsets():
    codes = "Qiqf?d"
    values = (0xDEADBEEF00, -3, 7, 0.5, True, 2.25)
    buf = param_buffer(codes)
    assert buf.pack(values) == buf.params == ctypes.addressof(buf.pointers)
    base = ctypes.addressof(buf.buffer)
    offsets = [p - base for p in buf.pointers]
    assert offsets == [0, 8, 16, 24, 28, 32]  # an int64 after an int32 aligns to 8, as in C
    raw = bytes(buf.buffer)
    read = [struct.unpack_from("@" + c, raw, o)[0] for c, o in zip(codes, offsets, strict=True)]
    assert read == list(values)


def test_buffers_are_per_parameter_list_and_per_thread():
    a = param_buffer("Qi")
    assert param_buffer("Qi") is a
    assert param_buffer("iQ") is not a
    other = []
    t = threading.Thread(target=lambda: other.append(param_buffer("Qi")))
    t.start()
    t.join()
    assert other[0] is not a and other[0].buffer is not a.buffer
