"""logsumexp where one term dominates, against mpmath, with the bound relative to the result.

spec/semantics.md, "Error bounds": without weights (or with weights of one sign)
``|l^ - l| <= 2 u_D |l| + u_D tiny_D + u_A (c + N) (|l - M| + E)``, ``E = sum p_i |a_i - M|``.
Where one term dominates, ``l - M`` and ``E`` are tiny, so the bound is relative to the
result: ``logsumexp([0, -40])`` must be ``4.25e-18`` to about 14 digits, not 0.

The CUDA backends run the same rows on a GPU (``test_dominated_rows_on_cuda_backends``,
skipped without one) and numba-cuda's kernels also under Numba's simulator, where this file
runs as a script (``NUMBA_ENABLE_CUDASIM=1 python tests/test_logsumexp_dominated.py``) with
each row strategy forced: a warp per row, a block per row, rows split over several blocks.
``python tests/test_logsumexp_dominated.py --cuda`` runs the GPU check without pytest.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

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


def long_rows(dtype: str) -> list[tuple[list[float], None]]:
    """Peaked rows long enough for every kernel layout of the GPU backends (packed rows,
    a block per row, clusters, rows split over blocks)."""
    far = 20.0 if dtype == "float32" else 40.0
    rng = np.random.default_rng(11)
    out = []
    for n in (4096, 70000, 250000):  # the longest: CuPy's largest cluster (262144)
        row = rng.normal(scale=2.0, size=n) - far
        row[n // 3] = 1.5
        out.append((list(row), None))
    return out


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


CUDA_BACKENDS = ("cupy", "numba-cuda")


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_dominated_rows_on_cuda_backends(backend):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if backend not in registry():
        pytest.skip(f"{backend} is not installed")
    ran = 0
    for dtype in ("float32", "float64"):
        if not registry()[backend].serves_key("logsumexp", "cuda", dtype):
            continue
        for values, weights in rows(dtype) + long_rows(dtype):
            if weights is not None and backend == "cupy":
                continue  # the CuPy backend declines weights (its manifest says so)
            a = np.asarray(values, dtype=dtype)
            b = None if weights is None else np.asarray(weights, dtype=dtype)
            tb = None if b is None else torch.from_numpy(b).cuda()
            got = sk.logsumexp(torch.from_numpy(a).cuda(), b=tb, backend=backend)
            check(float(got), a, b)
            ran += 1
    assert ran


def _simulated() -> None:
    """The rows on numba-cuda under the simulator, each row strategy forced; JSON lines."""
    forced = {"warp": "32,1", "block": "128,1", "split": "32,4"}
    for name, plan in forced.items():
        os.environ["SOFTMAXKIT_NUMBA_CUDA_PLAN"] = plan
        for dtype in ("float32", "float64"):
            for values, weights in rows(dtype):
                a = np.asarray(values, dtype=dtype)
                if a.size > 2000:
                    a = a[np.isfinite(a) | (np.arange(a.size) < 1500)][:1500]
                b = None if weights is None else np.asarray(weights, dtype=dtype)
                try:
                    check(sk.logsumexp(a, b=b, backend="numba-cuda"), a, b)
                    print(json.dumps({"id": f"{name}-{dtype}-{a.size}", "ok": True}))
                except Exception as exc:  # reported to the test below
                    print(json.dumps({"id": f"{name}-{dtype}-{a.size}", "ok": False,
                                      "message": str(exc)[-800:]}))


def test_dominated_rows_on_numba_cuda_under_the_simulator():
    pytest.importorskip("softmaxkit_numba_cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    failed = [f"{r['id']}: {r['message']}" for r in lines if not r["ok"]]
    assert not failed, "\n".join(failed)


def _cuda() -> int:
    """The CUDA backends on a GPU, without pytest: one line per backend, exit status 1 on a
    failure."""
    status = 0
    for backend in CUDA_BACKENDS:
        try:
            test_dominated_rows_on_cuda_backends(backend)
            print(f"{backend}: dominated logsumexp rows within the bound")
        except pytest.skip.Exception as exc:
            print(f"{backend}: skipped ({exc})")
            status = 1
        except Exception as exc:
            print(f"{backend}: FAILED {type(exc).__name__}: {exc}")
            status = 1
    return status


if __name__ == "__main__":
    if "--cuda" in sys.argv:
        sys.exit(_cuda())
    _simulated()
