"""The conformance kit against ``backend="cupy"`` on a CUDA device (skipped without one)."""

from __future__ import annotations

import pytest


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _has_gpu(), reason="no CUDA device")


@pytest.mark.parametrize(
    ("target", "dtypes"),
    [("torch-cuda", ["bfloat16", "float16", "float32"]), ("cupy", ["float16", "float32"])],
)
def test_conformance_kit(target: str, dtypes: list[str]) -> None:
    if target == "torch-cuda":
        pytest.importorskip("torch")
    from softmaxkit.testing import check_backend

    results = check_backend("cupy", target=target, dtypes=dtypes)
    failed = [f"{r.case}[{r.dtype}]: {r.message}" for r in results if r.status == "failed"]
    assert not failed, "\n".join(failed)
    assert any(r.status == "passed" for r in results)
