"""The conformance kit against ``backend="cupy"`` on a CUDA device (skipped without one).

The kit's attention cases, packed variable-length attention's among them, run at the head
dimensions the kernels take (64 and 128).
"""

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
    from softmaxkit_cupy.configs import ATTENTION_DTYPES, ATTENTION_HEAD_DIMS

    from softmaxkit.testing import check_backend

    # the attention cases at the head dimensions the kernels take (D == Dv)
    head_dims = tuple((d, d) for d in ATTENTION_HEAD_DIMS)
    results = check_backend("cupy", target=target, dtypes=dtypes, head_dims=head_dims)
    failed = [f"{r.case}[{r.dtype}]: {r.message}" for r in results if r.status == "failed"]
    assert not failed, "\n".join(failed)
    assert any(r.status == "passed" for r in results)
    # every attention case (dense and packed variable-length) in the kernels' dtypes runs:
    # none is left to another backend
    declined = [f"{r.case}[{r.dtype}]: {r.message}" for r in results
                if r.status == "unsupported" and r.dtype in ATTENTION_DTYPES
                and set(r.ops) & {"attention", "attention_vjp", "merge_attention",
                                  "varlen_attention", "varlen_attention_vjp"}]
    assert not declined, "\n".join(declined)
