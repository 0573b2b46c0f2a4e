"""The Dask backend on a real ``distributed.LocalCluster``: two worker processes on loopback,
one thread each.  Results equal the threaded scheduler's bit for bit and the single-machine
reference within the spec's bounds, and a worker killed in the middle of a computation is
restarted and its tasks rerun without a wrong answer."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")
import dask  # noqa: E402
import dask.array as da  # noqa: E402

import softmaxkit as sk  # noqa: E402
from softmaxkit.testing.chunked import dies_once, random_rows  # noqa: E402

TIMEOUT = 120


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
        dashboard_address=None, silence_logs=logging.CRITICAL,
    ) as cluster, distributed.Client(cluster, set_as_default=False) as c:
        yield c


def _same(a, b) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


@pytest.mark.parametrize("seed", range(6))
def test_cluster_matches_the_threaded_scheduler_and_the_reference(client, seed):
    p = random_rows(100 + seed)
    x, where, b = p.dask()
    lazy = {
        "softmax": sk.softmax(x, axis=-1, where=where),
        "log_softmax": sk.log_softmax(x, axis=-1, where=where, masked="nan"),
        "logsumexp": sk.logsumexp(x, axis=-1, b=b, where=where, return_sign=True),
    }
    remote = client.compute(lazy).result(timeout=TIMEOUT)
    local = dask.compute(lazy, scheduler="threads")[0]
    for name in ("softmax", "log_softmax"):
        assert _same(remote[name], local[name]), name
    for r, loc in zip(remote["logsumexp"], local["logsumexp"], strict=True):
        assert _same(r, loc), "logsumexp"
    x64 = p.x.astype(np.float64)
    b64 = None if p.b is None else p.b.astype(np.float64)
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 4e-3}[str(p.x.dtype)]
    expected = sk.softmax(x64, axis=-1, where=p.where, backend="reference")
    np.testing.assert_allclose(remote["softmax"], expected, rtol=tol, atol=tol)
    lse, sign = sk.logsumexp(x64, axis=-1, b=b64, where=p.where, return_sign=True,
                             backend="reference")
    np.testing.assert_allclose(remote["logsumexp"][0], lse, rtol=tol, atol=tol)
    np.testing.assert_array_equal(remote["logsumexp"][1], sign)


def test_a_worker_killed_mid_computation_is_restarted_without_a_wrong_answer(client, tmp_path):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(8, 4096)) * 5
    w = rng.random(x.shape) > 0.2
    w[:, 1024:2048] = False  # a fully masked chunk too
    marker = str(tmp_path / "killed")
    # the task loading the third chunk kills its worker process the first time it runs
    xd = da.from_array(x, chunks=(4, 512)).map_blocks(dies_once, marker=marker,
                                                      meta=np.empty((0, 0)))
    wd = da.from_array(w, chunks=(4, 512))
    lazy = [sk.softmax(xd, axis=-1, where=wd), sk.logsumexp(xd, axis=-1, where=wd)]
    p, lse = (f.result(timeout=TIMEOUT) for f in client.compute(lazy))
    assert os.path.exists(marker), "no worker was killed"
    np.testing.assert_allclose(p, sk.softmax(x, axis=-1, where=w, backend="reference"),
                               rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(lse, sk.logsumexp(x, axis=-1, where=w, backend="reference"),
                               rtol=1e-13)
    client.wait_for_workers(2, timeout=60)


def test_sharded_attention_on_the_cluster(client):
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(1, 4, 96, 16)), rng.normal(size=(1, 2, 80, 16)),
               rng.normal(size=(1, 2, 80, 8)))
    lazy = sk.attention(da.from_array(q, chunks=(1, 4, 32, 16)),
                        da.from_array(k, chunks=(1, 2, 16, 16)),
                        da.from_array(v, chunks=(1, 2, 16, 8)), causal=True, return_lse=True)
    out, lse = (f.result(timeout=TIMEOUT) for f in client.compute(list(lazy)))
    ref, ref_lse = sk.attention(q, k, v, causal=True, return_lse=True, backend="reference")
    np.testing.assert_allclose(out, ref, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
