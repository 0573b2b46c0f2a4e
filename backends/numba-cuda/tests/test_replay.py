"""Kept launches: a repeated call on torch tensors of one shape replays the launch of the
first with the new arrays' addresses.  Each call is checked against float64 on fresh data,
its result's memory poisoned first, so a replay that reused a stale address or parameter
would show.
"""

from __future__ import annotations

import pytest
from softmaxkit_numba_cuda import launches
from softmaxkit_numba_cuda.launches import DeviceView

import softmaxkit as sk


def test_address_slots_find_each_arrays_address():
    import numpy as np

    a, b = np.zeros((3, 4), np.float32), np.zeros(5, np.int64)
    args = (DeviceView(a.ctypes.data, a.shape, a.strides, a.dtype, a), 7, True,
            DeviceView(b.ctypes.data, b.shape, b.strides, b.dtype, b), 0.5)
    slots = launches.address_slots(args, (0, 3))
    values = launches.values(args)
    assert [values[i] for i in slots] == [a.ctypes.data, b.ctypes.data]
    with pytest.raises(TypeError, match="argument 1"):
        launches.address_slots(args, (1,))


def _gpu() -> bool:
    from softmaxkit_numba_cuda.primitives import SIMULATOR, cuda

    return not SIMULATOR and cuda.is_available()


def _poison(torch, numel: int, dtype) -> None:
    """Fill a block of the caching allocator with NaN and free it: the next result of this
    size starts as NaN."""
    torch.full((numel,), float("nan"), dtype=dtype, device="cuda")


@pytest.mark.skipif("not _gpu()")
@pytest.mark.parametrize("shape", [(8,), (64, 1024), (3, 5, 300), (4096, 32768)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_repeated_calls_match_float64(shape, dtype):
    import torch

    dt = getattr(torch, dtype)
    tol = 1e-5 if dtype == "float32" else 1e-2
    for seed in range(3):  # the first call records, the others replay
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = (torch.randn(shape, device="cuda", generator=g) * 4).to(dt)
        x64 = x.double()
        for op, ref in ((sk.softmax, torch.softmax), (sk.log_softmax, torch.log_softmax)):
            _poison(torch, x.numel(), dt)
            got = op(x, axis=-1, backend="numba-cuda")
            torch.testing.assert_close(got.double(), ref(x64, -1).to(dt).double(), rtol=tol,
                                       atol=tol)
        _poison(torch, x.numel() // shape[-1], dt)
        got = sk.logsumexp(x, axis=-1, backend="numba-cuda")
        torch.testing.assert_close(got.double(), torch.logsumexp(x64, -1), rtol=tol, atol=tol)


@pytest.mark.skipif("not _gpu()")
@pytest.mark.parametrize("shape", [(64, 1024), (4096, 32768)])
@pytest.mark.parametrize("ignore_index", [None, 3])
def test_repeated_cross_entropy_matches_float64(shape, ignore_index):
    import torch

    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = (torch.randn(shape, device="cuda", generator=g) * 3).to(torch.bfloat16)
        t = torch.randint(0, shape[-1], shape[:-1], device="cuda", generator=g)
        t[::7] = 3
        leaf = x.double().requires_grad_()
        kw = {} if ignore_index is None else {"ignore_index": ignore_index}
        want = torch.nn.functional.cross_entropy(leaf, t, **kw)
        want.backward()
        _poison(torch, x.numel(), torch.bfloat16)
        loss, grad = sk.cross_entropy(x, t, return_grad=True, backend="numba-cuda", **kw)
        # the inputs are the same bfloat16 values: loss and gradient are rounded to bfloat16
        # (relative 2**-8), the gradient's entries as small as 1 / (rows * classes)
        torch.testing.assert_close(loss.double(), want.detach(), rtol=2**-8, atol=0)
        scale = leaf.grad.abs().max().item()
        torch.testing.assert_close(grad.double(), leaf.grad, rtol=1e-2, atol=1e-3 * scale)
