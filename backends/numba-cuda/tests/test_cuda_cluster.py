"""Thread-block cluster launches: the launch configuration (no GPU needed)."""

from __future__ import annotations

import pytest
from softmaxkit_numba_cuda import arrays, launches


def test_cluster_launch_counts_the_grid_as_cuda_core_does():
    new = launches.cluster_launch(64, 256, 32768, 16, "1.2.2")
    assert new == {"grid": 4, "cluster": 16, "block": 256, "shmem_size": 32768}
    old = launches.cluster_launch(64, 256, 32768, 16, "0.4.0")  # grid in blocks before 1.0
    assert old["grid"] == 64 and old["cluster"] == 16
    with pytest.raises(ValueError):
        launches.cluster_launch(10, 256, 0, 4, "1.2.2")  # not whole clusters


def test_simulator_declines_clusters_of_several_blocks():
    if not arrays.SIMULATOR:
        pytest.skip("the simulator is off")
    with pytest.raises(NotImplementedError):
        arrays.run(None, 4, 32, 0, shared=0, cluster=2)


def test_a_device_without_clusters_plans_no_cluster(monkeypatch):
    """On a GPU below compute capability 9.0 (no thread-block clusters) a call runs with the
    clusters off, as ``SOFTMAXKIT_NUMBA_CUDA_CLUSTER=0`` would: rows of several chunks take
    the exchange through device memory instead of a cluster or the persistent grid."""
    from softmaxkit_numba_cuda import plan as plans
    from softmaxkit_numba_cuda import rows
    from softmaxkit_numba_cuda.settings import Settings

    given = Settings()
    monkeypatch.setattr(rows, "has_clusters", lambda a, lib: True)
    assert rows._on_device(given, None, "torch") is given
    monkeypatch.setattr(rows, "has_clusters", lambda a, lib: False)
    off = rows._on_device(given, None, "torch")
    assert off == given.replace(cluster="0")
    for words in (2 * 4096, 8 * 4096, 16 * 4096, 64 * 4096):  # 2 to 64 chunks of 64 KB
        assert plans.clustered(words, False, off.cluster) is None
        assert plans.persistent(words, False, mode=off.persist, cluster=off.cluster) is None
        assert plans.staged(words, False).chunks > 1  # the exchange through device memory
    # with clusters the same rows are clustered or persistent
    assert plans.clustered(2 * 4096, False, given.cluster) is not None
    assert plans.persistent(16 * 4096, False, mode=given.persist,
                            cluster=given.cluster) is not None
