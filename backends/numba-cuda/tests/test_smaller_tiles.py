"""numba-cuda's attention on the smaller micro-tiles a device of 99 KB of shared memory a
block takes (compute capability 8.6, 8.9, 12.0), run on the GPU at hand against float64
(skipped without one): the kernels build for any tile of the tables."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _gpu() -> bool:
    from softmaxkit_numba_cuda.primitives import SIMULATOR, cuda

    return not SIMULATOR and cuda.is_available() and torch.cuda.is_available()


def _attention64(q: Any, k: Any, v: Any, scale: float) -> np.ndarray:
    q64, k64, v64 = (a.double() for a in (q, k, v))
    p = torch.softmax(q64 @ k64.transpose(-1, -2) * scale, dim=-1)
    return (p @ v64).cpu().numpy()


@pytest.mark.skipif("not _gpu()")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_numba_cuda_attention_on_smaller_tiles(dtype: str) -> None:
    """The micro-tiles numba-cuda takes on a device of 99 KB of shared memory a block."""
    import array_api_compat.torch as xp
    from softmaxkit_numba_cuda import attention
    from softmaxkit_numba_cuda import attention_kernels as k

    d = 256
    fwd = k.tiles_within(dtype, d, d, 99 * 1024)
    bwd = k.tiles_within(dtype, d, d, 99 * 1024, backward=True)
    assert fwd != k.tiles(k.FORWARD_TILES, dtype, d, d)
    gen = torch.Generator(device="cuda").manual_seed(99)
    q, kk, v = (torch.randn((1, 2, 70, d), generator=gen, device="cuda",
                            dtype=getattr(torch, dtype), requires_grad=False)
                for _ in range(3))
    out, lse = attention.attention(xp=xp, q=q, k=kk, v=v, scale=d**-0.5, causal=None,
                                   window=(-1, -1), mask=None, softcap=None, return_lse=True,
                                   tiles=fwd)
    expected = _attention64(q, kk, v, d**-0.5)
    tol = 1e-5 if dtype == "float32" else 1e-12
    assert np.abs(out.double().cpu().numpy() - expected).max() <= tol
    # the backward on its smaller tiles against float64 autograd
    dout = torch.randn(out.shape, generator=gen, device="cuda", dtype=out.dtype)
    dq, dk, dv = attention.attention_vjp(
        xp=xp, q=q, k=kk, v=v, out=out, lse=lse, dout=dout, scale=d**-0.5, causal=None,
        window=(-1, -1), mask=None, softcap=None, tiles=bwd)
    q64, k64, v64 = (a.double().requires_grad_() for a in (q, kk, v))
    p = torch.softmax(q64 @ k64.transpose(-1, -2) * d**-0.5, dim=-1)
    (p @ v64).backward(dout.double())
    for name, got, want in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        err = (got.double() - want).abs().max().item()
        assert err <= 50 * tol * max(1.0, want.abs().max().item()), (name, err)
