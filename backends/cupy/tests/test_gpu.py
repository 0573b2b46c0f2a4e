"""The conformance kit against ``backend="cupy"`` on a CUDA device (skipped without one).

The kit's attention cases, packed variable-length attention's among them, run at the head
dimensions the kernels take (:data:`~softmaxkit_cupy.configs.ATTENTION_HEAD_DIMS`): the whole
kit with 64 first (the kit runs most cases at the first head dimension given), then the
attention operations' cases at each other one on its own, and at head dimensions served on
zero-padded copies (D != Dv, and D between the built ones).
"""

from __future__ import annotations

import pytest
from softmaxkit_cupy.configs import ATTENTION_HEAD_DIMS

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)


@pytest.mark.parametrize(
    ("target", "dtypes"),
    [("torch-cuda", ["bfloat16", "float16", "float32"]), ("cupy", ["float16", "float32"])],
)
def test_conformance_kit(target: str, dtypes: list[str]) -> None:
    if target == "torch-cuda":
        pytest.importorskip("torch")
    from softmaxkit.testing import check_backend

    # the attention cases at the head dimensions the kernels take (D == Dv); the kit runs
    # most of them at the first pair given: 64
    head_dims = tuple((d, d) for d in sorted(ATTENTION_HEAD_DIMS, key=lambda d: d != 64))
    _check_kit(check_backend("cupy", target=target, dtypes=dtypes, head_dims=head_dims))


_KIT_ATTENTION_OPS = ("attention", "attention_vjp", "merge_attention", "varlen_attention",
                      "varlen_attention_vjp")


def _check_kit(results) -> None:
    from softmaxkit_cupy.configs import ATTENTION_DTYPES

    failed = [f"{r.case}[{r.dtype}]: {r.message}" for r in results if r.status == "failed"]
    assert not failed, "\n".join(failed)
    assert any(r.status == "passed" for r in results)
    # every attention case (dense and packed variable-length) in the kernels' dtypes runs:
    # none is left to another backend
    declined = [f"{r.case}[{r.dtype}]: {r.message}" for r in results
                if r.status == "unsupported" and r.dtype in ATTENTION_DTYPES
                and set(r.ops) & set(_KIT_ATTENTION_OPS)]
    assert not declined, "\n".join(declined)


@pytest.mark.parametrize("d", [d for d in ATTENTION_HEAD_DIMS if d != 64])
def test_conformance_kit_attention_at_head_dim(d: int) -> None:
    """The kit's attention cases at each other head dimension the kernels take, on its own."""
    pytest.importorskip("torch")
    from softmaxkit_cupy.configs import ATTENTION_DTYPES

    from softmaxkit.testing import check_backend

    _check_kit(check_backend("cupy", target="torch-cuda", ops=_KIT_ATTENTION_OPS,
                             dtypes=list(ATTENTION_DTYPES), head_dims=[(d, d)]))


@pytest.mark.parametrize("pair", [(192, 128), (128, 192), (40, 40)], ids=str)
def test_conformance_kit_attention_at_padded_head_dims(pair: tuple[int, int]) -> None:
    """The kit's attention cases at head dimensions the kernels serve on zero-padded copies
    (softmaxkit_cupy/head_dims.py), each pair on its own: every case runs at it."""
    pytest.importorskip("torch")
    from softmaxkit_cupy.configs import ATTENTION_DTYPES

    from softmaxkit.testing import check_backend

    results = check_backend("cupy", target="torch-cuda",
                            ops=(*_KIT_ATTENTION_OPS, "paged_attention"),
                            dtypes=list(ATTENTION_DTYPES), head_dims=[pair])
    _check_kit(results)
    assert any(r.status == "passed" and "paged_attention" in r.ops for r in results)
    declined = [f"{r.case}[{r.dtype}]: {r.message}" for r in results
                if r.status == "unsupported" and r.dtype in ATTENTION_DTYPES]
    assert not declined, "\n".join(declined)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
def test_repeated_calls_on_torch_tensors_replay_a_kept_launch(op: str, dtype: str) -> None:
    """A repeated row call on contiguous torch tensors replays the launch kept by the first
    (softmaxkit_cupy/rows.py, ``_kept``): on fresh logits each time, into results whose memory
    held NaN just before (torch's caching allocator hands the freed block back), it matches a
    float64 reference within the spec's bound."""
    torch = pytest.importorskip("torch")
    import numpy as np
    from softmaxkit_cupy import rows

    import softmaxkit as sk
    from softmaxkit.testing.tolerance import assert_within, log_bound, softmax_bound

    shape, tdtype = (64, 1000), getattr(torch, dtype)
    fn = getattr(sk, op)
    rng = np.random.default_rng(7)
    first = None
    for _ in range(3):
        x = torch.tensor(rng.normal(scale=4.0, size=shape), dtype=tdtype, device="cuda")
        key = rows._kept_key(op, x, None, tdtype, *(() if op == "logsumexp" else ("zero",)))
        torch.full(shape if op != "logsumexp" else shape[:-1], float("nan"), dtype=tdtype,
                   device="cuda")  # freed at once: the result's memory held NaN
        got = fn(x, axis=-1, backend="cupy").double().cpu().numpy()
        # the first call kept its launch; the later ones replayed it (a new launch would
        # keep a new one)
        first = first or rows._kept[key]
        assert rows._kept[key] is first
        x64 = x.double().cpu().numpy()
        m = x64.max(axis=-1, keepdims=True)
        lse = (m + np.log(np.exp(x64 - m).sum(axis=-1, keepdims=True)))
        if op == "softmax":
            p = np.exp(x64 - lse)
            assert_within(got, p, softmax_bound(p, x64, shape[-1], dtype), op)
        elif op == "log_softmax":
            ref = x64 - lse
            assert_within(got, ref, log_bound(ref, shape[-1], dtype), op)
        else:
            ref = lse[:, 0]
            assert_within(got, ref, log_bound(ref, shape[-1], dtype), op)
