"""logsumexp where one term dominates, against mpmath, with the bound relative to the result.

spec/semantics.md, "Error bounds": without weights (or with weights of one sign)
``|l^ - l| <= 2 u_D |l| + u_D tiny_D + u_A (c + N) (|l - M| + E)``, ``E = sum p_i |a_i - M|``.
Where one term dominates, ``l - M`` and ``E`` are tiny, so the bound is relative to the
result: ``logsumexp([0, -40])`` must be ``4.25e-18`` to about 14 digits, not 0.
"""

from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest

import softmaxkit as sk
from softmaxkit.registry import registry

C = 8
U = {"float32": 2.0**-24, "float64": 2.0**-53}
TINY = {"float32": 2.0**-126, "float64": 2.0**-1022}


def exact(a: np.ndarray, b: np.ndarray | None) -> tuple[mp.mpf, mp.mpf]:
    """``(l, bound)`` for one row, in 60-digit arithmetic on the represented inputs."""
    dtype = str(a.dtype)
    u, tiny = U[dtype], TINY[dtype]
    with mp.workdps(60):
        # excluded positions (b = 0, a = -inf) contribute nothing; N stays the row length
        keep = [i for i in range(a.size) if (b is None or b[i] != 0) and a[i] != -np.inf]
        av = [mp.mpf(float(a[i])) for i in keep]
        bv = [mp.mpf(1) if b is None else mp.mpf(float(b[i])) for i in keep]
        total = mp.fsum(w * mp.exp(v) for v, w in zip(av, bv, strict=True))
        lse = mp.log(abs(total))
        m = max(av)
        e = mp.fsum(abs(w) * mp.exp(v - lse) * (m - v) for v, w in zip(av, bv, strict=True))
        bound = 2 * u * abs(lse) + u * tiny + u * (C + a.size) * (abs(lse - m) + e)
    return lse, bound


def rows(dtype: str) -> list[tuple[list[float], list[float] | None]]:
    far = 20.0 if dtype == "float32" else 40.0
    rng = np.random.default_rng(7)
    long = np.full(5000, -np.inf)  # several blocks of the numba-cpu kernel, chunks of dask
    long[17], long[4321], long[4999] = 3.0, 3.0 - far, 3.0 - far - 2.5
    peaked = rng.normal(scale=2.0, size=300) - far
    peaked[123] = 0.0
    return [
        ([0.0, -far], None),  # gh-18295
        ([-far, 0.0, -far - 3.0, -far], None),
        ([1000.0, 1000.0 - far], None),
        ([-1000.0, -1000.0 - far], None),
        (list(long), None),
        (list(peaked), None),
        ([0.0, -far, 5.0, -7.0], [1.0, 2.5, 0.0, 0.5]),  # a zero weight excludes 5.0
        ([2.0, 2.0 - far], [0.25, 3.0]),
    ]


def check(got: float, a: np.ndarray, b: np.ndarray | None) -> None:
    lse, bound = exact(a, b)
    err = abs(mp.mpf(float(got)) - lse)
    assert err <= bound, f"error {mp.nstr(err, 3)} above the bound {mp.nstr(bound, 3)} " \
                         f"(exact {mp.nstr(lse, 17)}, got {got!r})"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("backend", ["reference", "numba-cpu"])
def test_dominated_rows_on_cpu_backends(backend, dtype):
    if backend not in registry():
        pytest.skip(f"{backend} is not installed")
    for values, weights in rows(dtype):
        a = np.asarray(values, dtype=dtype)
        b = None if weights is None else np.asarray(weights, dtype=dtype)
        check(sk.logsumexp(a, b=b, backend=backend), a, b)
        # the same row inside a batch, with a mask that excludes an extra position
        batch = np.stack([a, a[::-1]])
        where = np.ones_like(batch, dtype=bool)
        lse = sk.logsumexp(batch, axis=-1, b=None if b is None else np.stack([b, b[::-1]]),
                           where=where, backend=backend)
        check(lse[0], a, b)
        check(lse[1], a[::-1], None if b is None else b[::-1])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dominated_rows_on_the_dask_path(dtype):
    da = pytest.importorskip("dask.array")
    for values, weights in rows(dtype):
        a = np.asarray(values, dtype=dtype)
        b = None if weights is None else np.asarray(weights, dtype=dtype)
        # chunks of one or a few positions: the dominant term and the others are merged
        # from different chunks
        size = max(1, a.size // 7)
        got = sk.logsumexp(da.from_array(a, chunks=size),
                           b=None if b is None else da.from_array(b, chunks=size))
        check(got.compute(), a, b)


def test_gh18295_value():
    # the case SciPy's issue names, as a number a reader can check
    got = float(sk.logsumexp([0.0, -40.0]))
    assert got == pytest.approx(math.log1p(math.exp(-40.0)), rel=1e-14)
    assert got != 0.0
