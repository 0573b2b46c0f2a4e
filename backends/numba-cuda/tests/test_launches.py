"""Lean launches: the array views and argument packing they use instead of numba's dispatch.

The layout letter and the packing must be what numba's dispatcher makes of the same array,
or the kernel compiled for the view's type would read its arguments wrongly.  The layout is
checked here against numpy's contiguity flags (numba's rules are numpy's); the packing
against numba's own marshalling of a device array, on a GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from softmaxkit_numba_cuda import launches
from softmaxkit_numba_cuda.launches import DeviceView, layout

from softmaxkit.kernel_params import param_buffer


def _view(a: np.ndarray) -> DeviceView:
    return DeviceView(a.ctypes.data, a.shape, a.strides, a.dtype, a)


def _numba_layout(a: np.ndarray) -> str:
    """numba's rule for a device array: broadcast (a zero stride, not empty) is "A", else C
    before F by the contiguity flags."""
    if 0 in a.strides and a.size:
        return "A"
    return "C" if a.flags.c_contiguous else "F" if a.flags.f_contiguous else "A"


_BASE = np.zeros((6, 8, 4), dtype=np.float32)
CASES = {
    "c": _BASE,
    "f": np.asfortranarray(_BASE),
    "rows": _BASE.reshape(48, 4),
    "column": _BASE.reshape(-1)[:, None],
    "row": _BASE.reshape(-1)[None, :],
    "sliced": _BASE[:, ::2],
    "transposed": _BASE.transpose(1, 0, 2),
    "broadcast": np.broadcast_to(np.zeros((1, 4), np.float32), (5, 4)),
    "scalar-like": np.zeros((1, 1), np.int64),
    "empty": np.zeros((0, 4), np.float16),
    "one-d": np.zeros(7, np.bool_),
    "strided-one-d": np.zeros(14, np.float64)[::2],
    "unit-middle": np.zeros((3, 1, 5), np.float32),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layout_is_numbas(name):
    a = CASES[name]
    assert layout(a.shape, a.strides, a.itemsize) == _numba_layout(a)


def test_view_reinterprets_and_reshapes_without_copying():
    a = np.zeros((4, 6), np.int64)
    v = _view(a).view(np.uint64)
    assert (v.ptr, v.shape, v.strides, v.dtype) == (a.ctypes.data, (4, 6), (48, 8),
                                                    np.dtype(np.uint64))
    r = _view(a).reshape(2, 3, 4)
    assert r.shape == (2, 3, 4) and r.strides == (96, 32, 8) and r.size == 24
    assert r.key == (np.dtype(np.int64), 3, "C")
    with pytest.raises(ValueError):
        _view(a).view(np.int32)
    with pytest.raises(ValueError):
        _view(a[:, ::2]).reshape(12)


def test_pack_lays_out_arrays_and_scalars_as_numba_does():
    a = np.zeros((3, 5), np.float32)
    args = (_view(a), 7, np.int32(2), True, 0.5, np.float32(1.5))
    sig = launches.signature(args)
    names = [str(t) for t in launches.argument_types(sig)]
    assert names == ["array(float32, 2d, C)", "int64", "int32", "bool", "float64", "float32"]
    # the driver launch: the values under the parameter codes
    plain = launches.values(args)
    assert plain == [0, 0, 15, 4, a.ctypes.data, 3, 5, 20, 4, 7, 2, True, 0.5, 1.5]
    assert launches.codes(sig) == "qqqqQ" + "qq" * 2 + "qi?df"
    param_buffer(launches.codes(sig)).pack(plain)  # every value fits its code
    with pytest.raises(TypeError, match="complex"):
        launches.argument_types(launches.signature((1j,)))


def test_address_slots_find_each_arrays_address():
    a, b = np.zeros((3, 4), np.float32), np.zeros(5, np.int64)
    args = (DeviceView(a.ctypes.data, a.shape, a.strides, a.dtype, a), 7, True,
            DeviceView(b.ctypes.data, b.shape, b.strides, b.dtype, b), 0.5)
    slots = launches.address_slots(args, (0, 3))
    values = launches.values(args)
    assert [values[i] for i in slots] == [a.ctypes.data, b.ctypes.data]
    with pytest.raises(TypeError, match="argument 1"):
        launches.address_slots(args, (1,))


def test_cluster_launch_config_has_the_drivers_layout():
    # CUlaunchConfig: six dimensions and the shared bytes (28 bytes), the stream at 32, the
    # attribute pointer at 40, their count at 48; CUlaunchAttribute: an 8-byte id, 64 of value
    config, attribute = launches._Config, launches._Attribute
    assert (ctypes.sizeof(config), config.stream.offset, config.attrs.offset,
            config.count.offset) == (56, 32, 40, 48)
    assert (ctypes.sizeof(attribute), attribute.value.offset) == (72, 8)
    c = launches.cluster_config(64, 256, 1024, 8, 0)
    assert (list(c.grid), list(c.block), c.shared, c.count) == ([64, 1, 1], [256, 1, 1], 1024, 1)
    assert c.attrs[0].id == launches.CLUSTER_DIMENSION and list(c.attrs[0].value[:3]) == [8, 1, 1]
    assert launches.cluster_config(64, 256, 1024, 8, 0) is c
    with pytest.raises(ValueError, match="clusters of 8"):
        launches.cluster_config(60, 256, 0, 8, 0)


def _gpu() -> bool:
    from softmaxkit_numba_cuda.primitives import SIMULATOR, cuda

    return not SIMULATOR and cuda.is_available()


@pytest.mark.skipif("not _gpu()")
def test_pack_matches_numbas_marshalling_on_the_gpu():
    from numba import cuda

    @cuda.jit
    def kernel(x, n, flag, out):
        pass

    for host in (np.zeros((4, 8), np.float32), np.zeros((5, 1), np.int16),
                 np.zeros((2, 3, 4), np.float64)[:, 1:]):
        dev = cuda.to_device(np.ascontiguousarray(host))
        if host.ndim == 3:
            dev = dev[:, 1:]
        out = cuda.device_array(3, np.int64)
        cai = dev.__cuda_array_interface__
        view = DeviceView(cai["data"][0], dev.shape, dev.strides, dev.dtype, dev)
        ocai = out.__cuda_array_interface__
        oview = DeviceView(ocai["data"][0], out.shape, out.strides, out.dtype, out)
        args = (view, 9, False, oview)
        entry = launches.compiled_for(kernel, args, 0)
        expected_types = tuple(kernel.typeof_pyval(a) for a in (dev, 9, False, out))
        assert entry.compiled.argument_types == expected_types
        theirs: list = []
        for ty, value in zip(expected_types, (dev, 9, False, out), strict=True):
            entry.compiled._prepare_args(ty, value, 0, [], theirs)
        ours = launches.values(args)
        expected = [v.value if isinstance(v, ctypes._SimpleCData) else v for v in theirs]
        assert ours == expected


@pytest.mark.skipif("not _gpu()")
def test_cluster_launch_runs_every_block_on_the_gpu():
    from numba import cuda
    from softmaxkit_numba_cuda.arrays import kernel_view, run, stream_of

    @cuda.jit
    def kernel(out, n):
        i = cuda.blockIdx.x
        if cuda.threadIdx.x == 0 and i < n:
            out[i] = i + 1

    for cluster in (1, 2, 4):
        out = cuda.to_device(np.zeros(16, np.int64))
        run(kernel, 16, 32, stream_of(out, "numba"), kernel_view(out, "numba"), 16,
            cluster=cluster)
        cuda.synchronize()
        np.testing.assert_array_equal(out.copy_to_host(), np.arange(1, 17))


def test_stand_in_arrays_are_kept_per_device_ordinal(monkeypatch):
    """An absent argument's stand-in is made once per (library, device, dtype, rank), keyed
    by the device's ordinal: CuPy's Device objects cannot be hashed."""
    import contextlib

    from softmaxkit_numba_cuda import arrays

    class Device:  # as cupy.cuda.Device: its ordinal in .id, no hash
        __hash__ = None

        def __init__(self, id: int) -> None:
            self.id = id

    made = []
    monkeypatch.setattr(arrays, "SIMULATOR", False)
    monkeypatch.setattr(arrays, "_dummies", {})
    monkeypatch.setattr(arrays, "_on_device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(arrays, "kernel_view", lambda a, lib: a)
    monkeypatch.setattr(arrays.cuda, "device_array",
                        lambda shape, dtype: made.append(shape) or np.ones(shape, dtype))
    first = arrays.dummy("cupy", Device(0), "float32", 1)
    assert arrays.dummy("cupy", Device(0), "float32", 1) is first
    assert arrays.dummy("cupy", Device(1), "float32", 1) is not first
    assert made == [(1,), (1,)]
