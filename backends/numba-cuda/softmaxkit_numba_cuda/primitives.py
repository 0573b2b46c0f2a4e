"""Device-level primitives with one implementation for the GPU and one for the simulator.

Numba's CUDA simulator runs kernels as Python threads and has neither libdevice nor warp
shuffles, so each primitive here has a GPU form (libdevice, ``shfl.sync``) and a simulator
form (numpy on the same bits, a block-wide exchange).  Kernels call only these names, so
the kernel logic the simulator runs in CI is the logic the GPU runs.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
from numba import float32, float64, int32, int64, uint32, uint64

from softmaxkit.dtypes import accumulator_name

from .compat import import_cuda, simulator_enabled

cuda = import_cuda()
SIMULATOR = simulator_enabled()

LOG2E = 1.4426950408889634
NEG_INF = -math.inf
POS_INF = math.inf
NAN = math.nan

if SIMULATOR:

    def exp_f64(x):
        """``e**x`` in float64."""
        with np.errstate(all="ignore"):
            return np.float64(np.exp(np.float64(x)))

    def log_f32(x):
        """Natural logarithm in float32 (``log(0) = -inf``)."""
        with np.errstate(all="ignore"):
            return np.float32(np.log(np.float32(x)))

    def log_f64(x):
        """Natural logarithm in float64 (``log(0) = -inf``)."""
        with np.errstate(all="ignore"):
            return np.float64(np.log(np.float64(x)))

    def f32_from_bits(bits):
        """The float32 whose bit pattern is the unsigned 32-bit integer ``bits``."""
        return np.array(int(bits) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]

    def bits_from_f32(value):
        """The bit pattern of float32 ``value`` as an unsigned 32-bit integer."""
        return int(np.array(value, dtype=np.float32).view(np.uint32)[()])

    def f64_from_words(lo, hi):
        """The float64 whose bit pattern is ``hi << 32 | lo`` (two unsigned 32-bit words)."""
        bits = (int(hi) & 0xFFFFFFFF) << 32 | (int(lo) & 0xFFFFFFFF)
        return np.array(bits, dtype=np.uint64).view(np.float64)[()]

    def words_from_f64(value):
        """The low and high 32-bit words of float64 ``value``'s bit pattern."""
        bits = int(np.array(value, dtype=np.float64).view(np.uint64)[()])
        return np.uint32(bits & 0xFFFFFFFF), np.uint32(bits >> 32)

    def u64_from_f64(value):
        """The bit pattern of float64 ``value`` as an unsigned 64-bit integer."""
        return np.array(value, dtype=np.float64).view(np.uint64)[()]

    def f64_from_u64(bits):
        """The float64 whose bit pattern is the unsigned 64-bit integer ``bits``."""
        return np.array(bits, dtype=np.uint64).view(np.float64)[()]

    def shfl_xor(value, lane_mask):
        """The ``value`` of lane ``lane ^ lane_mask``; every thread of the block must call it."""
        th = threading.current_thread()
        box = th._manager.__dict__.setdefault("softmaxkit_shuffle", {})
        box[th.thread_id] = value
        th.syncthreads()
        other = box[th.thread_id ^ lane_mask]
        th.syncthreads()
        return other

    def warp_butterfly(value, combine, offsets=(16, 8, 4, 2, 1)):
        """The xor-butterfly all-reduce of ``value`` over the warp, as ``shfl_xor`` steps do it.

        Lane 0 replays the five exchange steps for all 32 lanes (two barriers instead of ten);
        every thread of the block must call it.  A block of fewer than 32 threads is one
        partial warp (the offsets then stay below its size).
        """
        th = threading.current_thread()
        state = th._manager.__dict__
        deposit = state.setdefault("softmaxkit_deposit", {})
        result = state.setdefault("softmaxkit_result", {})
        lane = th.thread_id % 32
        base = th.thread_id - lane
        deposit[th.thread_id] = value
        th.syncthreads()
        if lane == 0:
            width = min(32, th._manager._block_dim[0])
            vals = [deposit[base + k] for k in range(width)]
            for off in offsets:
                vals = [combine(vals[k], vals[k ^ off]) for k in range(width)]
            result[base] = vals
        th.syncthreads()
        return result[base][lane]

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def exp_f64(x):
        """``e**x`` in float64."""
        return libdevice.exp(x)

    @cuda.jit(device=True)
    def log_f32(x):
        """Natural logarithm in float32 (``log(0) = -inf``)."""
        return libdevice.logf(x)

    @cuda.jit(device=True)
    def log_f64(x):
        """Natural logarithm in float64 (``log(0) = -inf``)."""
        return libdevice.log(x)

    @cuda.jit(device=True)
    def f32_from_bits(bits):
        """The float32 whose bit pattern is the unsigned 32-bit integer ``bits``."""
        return libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True)
    def bits_from_f32(value):
        """The bit pattern of float32 ``value`` as an unsigned 32-bit integer."""
        return uint32(libdevice.float_as_int(value))

    @cuda.jit(device=True)
    def f64_from_words(lo, hi):
        """The float64 whose bit pattern is ``hi << 32 | lo`` (two unsigned 32-bit words)."""
        return libdevice.hiloint2double(int32(hi), int32(lo))

    @cuda.jit(device=True)
    def words_from_f64(value):
        """The low and high 32-bit words of float64 ``value``'s bit pattern."""
        return uint32(libdevice.double2loint(value)), uint32(libdevice.double2hiint(value))

    @cuda.jit(device=True)
    def u64_from_f64(value):
        """The bit pattern of float64 ``value`` as an unsigned 64-bit integer."""
        return uint64(libdevice.double_as_longlong(value))

    @cuda.jit(device=True)
    def f64_from_u64(bits):
        """The float64 whose bit pattern is the unsigned 64-bit integer ``bits``."""
        return libdevice.longlong_as_double(int64(bits))

    @cuda.jit(device=True)
    def shfl_xor(value, lane_mask):
        """The ``value`` of lane ``lane ^ lane_mask`` (all 32 lanes take part)."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, lane_mask)


def device_function(fn, inline: bool = False):
    """``fn`` as a device function; with ``inline``, inlined into its callers at the Numba IR
    level, so the kernel compiles as if its body were written there.

    In the simulator, a function that does not name ``cuda`` stays plain Python: wrapping it
    would only add the simulator's per-call swap of the ``cuda`` module, which dominates the
    simulated run time.
    """
    if SIMULATOR and "cuda" not in fn.__code__.co_names:
        return fn
    if inline:
        return cuda.jit(device=True, inline="always")(fn)
    return cuda.jit(device=True)(fn)


@device_function
def bf16_to_f32(bits):
    """float32 value of the bfloat16 whose bits are the low 16 bits of ``bits``."""
    return f32_from_bits(uint32((int32(bits) & 0xFFFF) << 16))


@device_function
def f32_to_bf16(value):
    """bfloat16 bits (in the low 16 bits) of float32 ``value``, rounded to nearest even."""
    if value != value:
        return int32(0x7FC0)
    u = bits_from_f32(float32(value))
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return int32(rounded & 0xFFFF)


NUMBA_FLOATS = {"float32": float32, "float64": float64}


def logarithm(acc_name: str):
    """The device function of the natural logarithm in accumulator ``acc_name``
    (:func:`log_f64` for float64, else :func:`log_f32`)."""
    return log_f64 if acc_name == "float64" else log_f32


def accumulator(kind: str) -> tuple[str, object]:
    """The accumulator of inputs of dtype ``kind`` (:func:`softmaxkit.dtypes.accumulator_name`)
    and its numba type."""
    name = accumulator_name(kind)
    return name, NUMBA_FLOATS[name]


_REGISTERS = {1: 32, 2: 32, 4: 32, 8: 40, 16: 56, 32: 80}


def register_cap(block: int, values: int, wide: bool = False) -> int:
    """Registers per thread allowed to a kernel of ``block`` threads holding ``values`` values.

    The budget grows with the values each thread holds (doubled for float64, ``wide``), is
    capped so that a block always fits one multiprocessor (64K registers), and is low enough
    for short rows that 2048 threads can be resident per multiprocessor, keeping enough loads
    in flight to saturate memory.
    """
    budget = _REGISTERS.get(values, 64) * (2 if wide else 1)
    return max(32, min(255, budget, 65536 // block))


@functools.cache
def group_coordinates(threads: int, rows_per_block: int):
    """Device function ``coordinates(n_rows) -> (lane, row, live)`` of a thread of a kernel
    whose groups of ``threads`` threads each take a row (``rows_per_block`` rows a block when
    ``threads <= 32``, one otherwise); a thread past the last row is not ``live`` and reads
    row 0."""

    def coordinates(n_rows):
        tid = cuda.threadIdx.x
        if threads <= 32:
            lane = tid % threads
            row = cuda.blockIdx.x * rows_per_block + tid // threads
        else:
            lane = tid
            row = cuda.blockIdx.x
        live = row < n_rows
        return lane, (row if live else 0), live

    return device_function(coordinates)


def kernel(block: int, values: int, wide: bool = False, registers: int | None = None):
    """Decorator compiling a kernel for blocks of ``block`` threads holding ``values`` values
    per thread, under :func:`register_cap` registers (or ``registers``, where given)."""
    if SIMULATOR:
        return cuda.jit
    return cuda.jit(max_registers=registers or register_cap(block, values, wide))
