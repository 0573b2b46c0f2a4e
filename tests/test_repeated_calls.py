"""Repeated calls on the GPU: a backend may keep the launch of a call shape and replay it with
the new arrays' addresses (cupy and numba-cuda do, for torch tensors).  Each call is checked
against float64 on fresh data, its result's memory poisoned first, so a replay that reused a
stale address or parameter would show.
"""

from __future__ import annotations

import pytest

import softmaxkit as sk


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


BACKENDS = [b for b in ("cupy", "numba-cuda") if b in sk.backends()]


def _call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, the test skipped where the backend declines the call."""
    try:
        return fn(*args, **kwargs)
    except sk.NoBackendError as exc:
        pytest.skip(str(exc))


def _poison(torch, numel: int, dtype) -> None:
    """Fill a block of the caching allocator with NaN and free it: the next result of this
    size starts as NaN."""
    torch.full((numel,), float("nan"), dtype=dtype, device="cuda")


@pytest.mark.skipif("not _cuda()")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(8,), (64, 1024), (3, 5, 300), (4096, 32768)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_repeated_calls_match_float64(backend, shape, dtype):
    import torch

    dt = getattr(torch, dtype)
    tol = 1e-5 if dtype == "float32" else 1e-2
    for seed in range(3):  # the first call records, the others replay
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = (torch.randn(shape, device="cuda", generator=g) * 4).to(dt)
        x64 = x.double()
        for op, ref in ((sk.softmax, torch.softmax), (sk.log_softmax, torch.log_softmax)):
            _poison(torch, x.numel(), dt)
            got = _call(op, x, axis=-1, backend=backend)
            torch.testing.assert_close(got.double(), ref(x64, -1).to(dt).double(), rtol=tol,
                                       atol=tol)
        _poison(torch, x.numel() // shape[-1], dt)
        got = _call(sk.logsumexp, x, axis=-1, backend=backend)
        torch.testing.assert_close(got.double(), torch.logsumexp(x64, -1), rtol=tol, atol=tol)


@pytest.mark.skipif("not _cuda()")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(64, 1024), (4096, 32768)])
@pytest.mark.parametrize("ignore_index", [None, 3])
def test_repeated_cross_entropy_matches_float64(backend, shape, ignore_index):
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
        loss, grad = _call(sk.cross_entropy, x, t, return_grad=True, backend=backend, **kw)
        # the inputs are the same bfloat16 values: loss and gradient are rounded to bfloat16
        # (relative 2**-8), the gradient's entries as small as 1 / (rows * classes)
        torch.testing.assert_close(loss.double(), want.detach(), rtol=2**-8, atol=0)
        scale = leaf.grad.abs().max().item()
        torch.testing.assert_close(grad.double(), leaf.grad, rtol=1e-2, atol=1e-3 * scale)
