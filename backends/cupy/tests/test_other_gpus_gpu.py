"""What GPUs other than the H200 run, run on the device at hand (skipped without one).

Below compute capability 9.0 the row kernels take configurations without thread-block
clusters (``configs.row_configs(clusters=False)``), and on devices with less shared memory
than the H200 the unmasked forward at head dim 256 takes the masked tiles (numba-cuda's
smaller micro-tiles: its tests/test_smaller_tiles.py).  Those kernels build for every
device, so they are checked here against float64 on fresh random data, their outputs
poisoned first.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from softmaxkit.testing.tolerance import assert_within, log_bound, softmax_bound

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)

torch = pytest.importorskip("torch")


def _rows64(x: np.ndarray, op: str) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        m = np.max(x, axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        s = np.sum(np.exp(x - m), axis=-1, keepdims=True)
        if op == "softmax":
            return np.exp(x - m) / s
        if op == "log_softmax":
            return x - m - np.log(s)
        return (m + np.log(s))[..., 0]


@pytest.mark.parametrize("n", [4097, 16384, 20000, 32768])
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_without_clusters(dtype: str, op: str, n: int) -> None:
    import array_api_compat.torch as xp
    from softmaxkit_cupy import rows
    from softmaxkit_cupy.configs import ITEMSIZE, row_config, row_lean

    config = row_config(n, ITEMSIZE[dtype], row_lean(op, dtype, dtype), clusters=False)
    assert config is not None and config.cluster == 1
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = (torch.randn((3, n), generator=gen, device="cuda") * 4).to(getattr(torch, dtype))
    x[1, : n // 3] = -math.inf  # a row whose leading third is excluded
    x[2, 7] = 30.0  # a dominant logit
    shape = (3,) if op == "logsumexp" else (3, n)
    out = torch.full(shape, math.nan, device="cuda", dtype=x.dtype)  # poisoned
    rows.launch_rows(op, xp, x, None, out, config=config)
    x64 = x.double().cpu().numpy()
    expected = _rows64(x64, op)
    got = out.double().cpu().numpy()
    bound = (softmax_bound(expected, x64, n, dtype) if op == "softmax"
             else log_bound(expected, n, dtype))
    assert_within(got, expected, bound, f"{op} {dtype} n={n} on {config.describe()}")


def _attention64(q: Any, k: Any, v: Any, scale: float) -> np.ndarray:
    q64, k64, v64 = (a.double() for a in (q, k, v))
    p = torch.softmax(q64 @ k64.transpose(-1, -2) * scale, dim=-1)
    return (p @ v64).cpu().numpy()


def test_unmasked_forward_on_the_masked_tiles_at_256() -> None:
    """The tiles a device of compute capability 8.0 takes for an unmasked call at 256."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy import attention
    from softmaxkit_cupy.configs import attention_config

    config = attention_config(256, masked=False, shared_limit=163 * 1024)
    assert config.mask and config.block_n == 32
    gen = torch.Generator(device="cuda").manual_seed(256)
    q, k, v = (torch.randn((2, 4, 300, 256), generator=gen, device="cuda",
                           dtype=torch.bfloat16) for _ in range(3))
    out, _ = attention.attention(xp, q=q, k=k, v=v, scale=256**-0.5, causal=None,
                                 window=(-1, -1), mask=None, softcap=None, return_lse=False,
                                 config=config)
    expected = _attention64(q, k, v, 256**-0.5)
    err = np.abs(out.double().cpu().numpy() - expected).max()
    assert err <= 2e-2, err  # bfloat16 output: a few units in its last place of |v| ~ 1
