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
