"""The manifest, its discovery through the entry point, and the reasons calls are declined."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from softmaxkit_cupy import manifest as mf
from softmaxkit_cupy.configs import max_row_length

import softmaxkit as sk
from softmaxkit.ops import Call


def test_entry_point_registers_the_backend_without_importing_cupy() -> None:
    code = (
        "import sys, softmaxkit as sk\n"
        "info = sk.backends()['cupy']\n"
        "assert 'softmax' in info['operations'] and 'attention' in info['operations']\n"
        "assert 'cupy' not in sys.modules, 'the manifest imported cupy'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_manifest_serves_cuda_only() -> None:
    for entry in mf.manifest()["serves"]:
        assert entry["devices"] == ["cuda"]


def test_host_arrays_are_declined_with_the_reason() -> None:
    x = np.zeros((2, 8), dtype=np.float32)
    call = Call("softmax", np, "cuda", "float32",
                {"x": x, "where": None, "masked": "zero", "out_dtype": x.dtype})
    verdict = mf.can_run(call)
    assert isinstance(verdict, str) and "CuPy arrays or PyTorch CUDA tensors" in verdict


def test_cpu_torch_tensors_are_declined() -> None:
    torch = pytest.importorskip("torch")
    q = torch.zeros((1, 1, 4, 64), dtype=torch.bfloat16)
    call = Call("attention", None, "cpu", "bfloat16",
                {"q": q, "k": q, "v": q, "mask": None})
    assert isinstance(mf.can_run(call), str)


def test_strict_backend_on_host_data_raises_instead_of_running() -> None:
    with pytest.raises(sk.NoBackendError, match="cupy"):
        sk.softmax(np.arange(4.0), backend="cupy")


@pytest.mark.parametrize(
    ("op", "din", "dout", "shape", "weighted", "declined"),
    [
        ("softmax", "bfloat16", "bfloat16", (4, 4096), False, False),
        ("softmax", "float16", "float16", (3, 5, 7), False, False),
        ("log_softmax", "float32", "float32", (2, 100), False, False),
        ("logsumexp", "float32", "float32", (2, 100), False, False),
        ("softmax", "float64", "float64", (2, 100), False, True),
        ("softmax", "bfloat16", "float32", (2, 100), False, True),
        ("softmax", "bfloat16", "bfloat16", (2, 0), False, True),
        ("softmax", "bfloat16", "bfloat16", (0, 8), False, True),
        ("logsumexp", "float16", "float16", (2, 8), True, True),
        ("logsumexp", "float16", "float16", (2, 8), False, False),
        ("softmax", "bfloat16", "bfloat16", (1, max_row_length(2)), False, False),
        ("softmax", "bfloat16", "bfloat16", (1, max_row_length(2) + 1), False, True),
        ("softmax", "float32", "float32", (1, max_row_length(4) + 1), False, True),
    ],
)
def test_row_reasons(op, din, dout, shape, weighted, declined) -> None:
    reason = mf.row_reason(op, din, dout, shape, weighted=weighted)
    assert (reason is not None) == declined, reason


@pytest.mark.parametrize(("op", "din", "n", "declined"), [
    ("softmax", "float32", 32768, False),
    ("softmax", "float32", 32769, True),
    ("softmax", "bfloat16", 32768, False),  # the lean 16-bit kernels
    ("softmax", "bfloat16", 32769, True),
    ("logsumexp", "bfloat16", 65536, False),  # the general kernels
    ("logsumexp", "bfloat16", 65537, True),
])
def test_rows_on_a_device_without_clusters(op, din, n, declined) -> None:
    reason = mf.row_reason(op, din, din, (2, n), clusters=False)
    assert (reason is not None) == declined, reason
    assert reason is None or "without thread-block clusters" in reason
    # a device with clusters holds all of these
    assert mf.row_reason(op, din, din, (2, n)) is None


@pytest.mark.parametrize(
    ("dtype", "q", "k", "v", "declined"),
    [
        ("bfloat16", (2, 8, 100, 128), (2, 2, 300, 128), (2, 2, 300, 128), False),
        ("float16", (1, 4, 1, 64), (1, 4, 9, 64), (1, 4, 9, 64), False),
        ("float32", (1, 4, 16, 64), (1, 4, 16, 64), (1, 4, 16, 64), True),
        # head dimensions the kernels are not built for, and D != Dv: served zero-padded
        ("bfloat16", (1, 4, 16, 112), (1, 4, 16, 112), (1, 4, 16, 112), False),
        ("bfloat16", (1, 4, 16, 48), (1, 4, 16, 48), (1, 4, 16, 48), False),
        ("bfloat16", (1, 4, 16, 128), (1, 4, 16, 128), (1, 4, 16, 64), False),
        ("bfloat16", (1, 4, 16, 192), (1, 4, 16, 192), (1, 4, 16, 128), False),
        ("bfloat16", (1, 4, 16, 1), (1, 4, 16, 1), (1, 4, 16, 256), False),
        # ... up to 256
        ("bfloat16", (1, 4, 16, 264), (1, 4, 16, 264), (1, 4, 16, 264), True),
        ("bfloat16", (1, 4, 16, 128), (1, 4, 16, 128), (1, 4, 16, 300), False),  # blocks of Dv
        ("bfloat16", (1, 4, 16, 0), (1, 4, 16, 0), (1, 4, 16, 64), True),
        # the other head dimensions the kernels take
        *(("float16", (1, 4, 16, d), (1, 2, 40, d), (1, 2, 40, d), False)
          for d in (32, 80, 96, 160, 192, 256)),
        # no query row or no key: served without a launch (launch limits do not apply)
        ("bfloat16", (1, 4, 0, 128), (1, 4, 16, 128), (1, 4, 16, 128), False),
        ("float16", (1, 4, 5, 64), (1, 4, 0, 64), (1, 4, 0, 64), False),
        ("float16", (0, 4, 5, 64), (0, 2, 7, 64), (0, 2, 7, 64), False),
        ("float16", (2, 0, 5, 64), (2, 1, 7, 64), (2, 1, 7, 64), False),
        ("bfloat16", (1, 70000, 0, 64), (1, 1, 16, 64), (1, 1, 16, 64), False),
        ("bfloat16", (1, 4, 0, 112), (1, 4, 16, 112), (1, 4, 16, 112), False),
        ("float16", (1, 4, 5, 64), (1, 4, 0, 64), (1, 4, 0, 32), False),
        # ... but only at the head dimensions and dtypes the kernels serve
        ("bfloat16", (1, 4, 0, 272), (1, 4, 16, 272), (1, 4, 16, 272), True),
        ("float32", (1, 4, 5, 64), (1, 4, 0, 64), (1, 4, 0, 64), True),
        ("bfloat16", (1, 70000, 1, 64), (1, 1, 16, 64), (1, 1, 16, 64), True),
    ],
)
def test_attention_reasons(dtype, q, k, v, declined) -> None:
    reason = mf.attention_reason(dtype, q, k, v)
    assert (reason is not None) == declined, reason


@pytest.mark.parametrize(
    ("dtype", "q", "k", "declined"),
    [
        ("bfloat16", (2, 8, 100, 128), (2, 2, 300, 128), False),
        ("float16", (1, 4, 1, 64), (1, 4, 9, 64), False),
        ("float16", (1, 4, 7, 64), (1, 4, 0, 64), False),
        ("bfloat16", (1, 4, 0, 128), (1, 2, 9, 128), False),
        ("bfloat16", (1, 4, 0, 112), (1, 2, 9, 112), False),
        ("bfloat16", (1, 4, 0, 320), (1, 2, 9, 320), True),
        ("float32", (1, 4, 16, 64), (1, 4, 16, 64), True),
        ("bfloat16", (1, 4, 16, 16), (1, 4, 16, 16), False),
        ("bfloat16", (1, 4, 16, 320), (1, 4, 16, 320), True),
        *(("bfloat16", (1, 4, 16, d), (1, 2, 40, d), False) for d in (32, 80, 96, 160, 192, 256)),
    ],
)
def test_attention_vjp_reasons(dtype, q, k, declined) -> None:
    reason = mf.attention_vjp_reason(dtype, q, k, k)
    assert (reason is not None) == declined, reason


def test_attention_vjp_declines_mixed_dtypes_and_cpu_tensors() -> None:
    torch = pytest.importorskip("torch")
    q = torch.zeros((1, 1, 4, 64), dtype=torch.bfloat16)
    lse = torch.zeros((1, 1, 4), dtype=torch.float32)
    args = {"q": q, "k": q, "v": q, "out": q, "lse": lse, "dout": q, "mask": None}
    call = Call("attention_vjp", None, "cpu", "bfloat16", args)
    assert "CUDA tensors" in mf.can_run(call)


def test_kit_attention_cases_at_the_kernels_head_dims_are_accepted(monkeypatch) -> None:
    """``can_run`` accepts every attention, attention_vjp, merge_attention and packed
    variable-length case of the kit in the kernels' dtypes at their head dimensions (D == Dv):
    CPU tensors stand in for CUDA ones and the reference computes, so this checks the reasons,
    not the kernels."""
    pytest.importorskip("torch")
    from softmaxkit_cupy.configs import ATTENTION_DTYPES, ATTENTION_HEAD_DIMS

    from softmaxkit import registry
    from softmaxkit.testing import check_backend

    dense = ("attention", "attention_vjp", "merge_attention")
    ops = (*dense, *mf.VARLEN_OPS)
    monkeypatch.setattr(mf, "_library", lambda a: "torch")
    registry.register({
        "name": "cupy-reasons",
        "serves": [{"ops": list(ops), "devices": ["cpu"]}],
        "kernels": {op: f"softmaxkit.reference.{'attention' if op in dense else 'varlen'}:{op}"
                    for op in ops},
        "can_run": "softmaxkit_cupy.manifest:can_run",
    })
    try:
        # the kit runs most cases at the first head dimension given (64, as before; each
        # head dimension on its own would take the reference a minute on the CPU)
        dims = sorted(ATTENTION_HEAD_DIMS, key=lambda d: d != 64)
        results = check_backend("cupy-reasons", target="torch-cpu", ops=ops,
                                dtypes=ATTENTION_DTYPES, head_dims=[(d, d) for d in dims])
    finally:
        registry.unregister("cupy-reasons")
    names = {r.case for r in results}
    assert {"attention_broadcast_and_empty", "attention_vjp",
            "merge_attention_states_split_kv", "varlen_attention_tiled_lengths",
            "varlen_attention_vjp_tiled_lengths"} <= names
    left = [f"{r.case}[{r.dtype}]: {r.status} {r.message}" for r in results
            if r.status != "passed"]
    assert not left, "\n".join(left)


def test_varlen_ops_are_declared_for_cuda_in_the_attention_dtypes() -> None:
    from softmaxkit_cupy.configs import ATTENTION_DTYPES, F32_SERVED

    m = mf.manifest()
    entry = next(e for e in m["serves"] if "varlen_attention" in e["ops"])
    assert set(entry["ops"]) == {"varlen_attention", "varlen_attention_vjp"}
    f32 = ["float32"] if F32_SERVED else []
    assert entry["devices"] == ["cuda"] and entry["dtypes"] == [*ATTENTION_DTYPES, *f32]
    assert m["kernels"]["varlen_attention"] == "softmaxkit_cupy.varlen:varlen_attention"
    assert m["kernels"]["varlen_attention_vjp"] == "softmaxkit_cupy.varlen:varlen_attention_vjp"


def test_varlen_calls_on_cuda_try_cupy_before_the_reference() -> None:
    from softmaxkit import registry

    registry.reload()
    try:
        for op in mf.VARLEN_OPS:
            for dtype in ("bfloat16", "float16", "float32"):
                order, _ = registry.candidates(op, "cuda", dtype)
                assert "cupy" in order and "reference" in order, (op, dtype, order)
                assert order.index("cupy") < order.index("reference"), (op, dtype, order)
                # before numba-cuda's float32 kernels, which pad the sequences
                if "numba-cuda" in order:
                    assert order.index("cupy") < order.index("numba-cuda"), (op, order)
    finally:
        registry.reload()


@pytest.mark.parametrize(
    ("dtype", "batches", "q", "k", "v", "declined"),
    [
        ("bfloat16", 16, (20000, 16, 128), (20000, 4, 128), (20000, 4, 128), False),
        ("float16", 3, (70, 8, 64), (90, 8, 64), (90, 8, 64), False),
        # float32 on the exact kernels: their pairs up to 256, zero-padded between
        ("float32", 3, (70, 8, 64), (90, 8, 64), (90, 8, 64), False),
        ("float32", 3, (70, 8, 80), (90, 8, 80), (90, 8, 80), False),
        ("float32", 3, (70, 8, 192), (90, 8, 192), (90, 8, 128), False),
        ("float32", 3, (70, 8, 256), (90, 8, 256), (90, 8, 256), False),
        ("float32", 3, (70, 8, 264), (90, 8, 264), (90, 8, 264), True),
        ("float32", 3, (70, 8, 64), (90, 8, 64), (90, 8, 300), True),
        ("float64", 3, (70, 8, 64), (90, 8, 64), (90, 8, 64), True),
        ("bfloat16", 3, (70, 8, 112), (90, 8, 112), (90, 8, 112), False),
        *(("float16", 3, (70, 8, d), (90, 8, d), (90, 8, d), False) for d in (32, 80, 96, 256)),
        ("bfloat16", 3, (70, 8, 128), (90, 8, 128), (90, 8, 64), False),
        ("bfloat16", 3, (70, 8, 192), (90, 8, 192), (90, 8, 128), False),
        ("bfloat16", 3, (70, 8, 264), (90, 8, 264), (90, 8, 264), True),
        ("bfloat16", 3, (70, 8, 64), (90, 8, 64), (90, 8, 300), False),  # blocks of Dv
        # no query row or no key: no launch, so only the dtype and head dimension count
        ("bfloat16", 0, (0, 8, 64), (0, 8, 64), (0, 8, 64), False),
        ("bfloat16", 70000, (0, 8, 64), (9, 8, 64), (9, 8, 64), False),
        ("float16", 2, (5, 4, 128), (0, 2, 128), (0, 2, 128), False),
        ("float32", 2, (5, 4, 128), (0, 2, 128), (0, 2, 128), False),
        ("float32", 70000, (0, 8, 64), (9, 8, 64), (9, 8, 64), False),
        ("float32", 70000, (70000, 8, 64), (70000, 8, 64), (70000, 8, 64), True),
        # launch limits: sequences (grid z), heads (grid y), 32-bit row indices of the
        # padded work arrays
        ("bfloat16", 70000, (70000, 8, 64), (70000, 8, 64), (70000, 8, 64), True),
        ("bfloat16", 2, (9, 70000, 64), (9, 1, 64), (9, 1, 64), True),
        ("bfloat16", 2, (2**31 // 256, 1, 64), (9, 1, 64), (9, 1, 64), True),
        ("bfloat16", 1000, (2**23 - 64000, 1, 64), (9, 1, 64), (9, 1, 64), True),
        ("bfloat16", 1000, (2**23 - 129000, 1, 64), (9, 1, 64), (9, 1, 64), False),
        ("bfloat16", 1, (9, 1, 64), (2**31 // 256, 1, 64), (2**31 // 256, 1, 64), True),
    ],
)
def test_varlen_reasons(dtype, batches, q, k, v, declined) -> None:
    for kind in ("varlen", "backward"):
        reason = mf.varlen_reason(dtype, batches, q, k, v, kind=kind)
        assert (reason is not None) == declined, (kind, reason)


def test_float32_varlen_declines_tiles_the_device_cannot_hold() -> None:
    """The wide float32 backward tiles (up to 206 KB) on a device of compute capability 8.0
    (163 KB a block): declined with the sizes; the forward there takes its fitting tiles."""
    shapes = (3, (70, 8, 256), (90, 8, 256), (90, 8, 256))
    reason = mf.varlen_reason("float32", *shapes, shared_limit=163 * 1024, kind="backward")
    assert reason is not None and "shared memory" in reason
    assert mf.varlen_reason("float32", 3, (70, 8, 192), (90, 8, 192), (90, 8, 192),
                            shared_limit=163 * 1024) is None


def test_varlen_declines_cpu_tensors_and_mixed_dtypes(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    q = torch.zeros((5, 2, 64), dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 5])
    args = {"q": q, "k": q, "v": q, "cu_seqlens_q": cu, "cu_seqlens_k": cu}
    call = Call("varlen_attention", None, "cpu", "bfloat16", args)
    assert "CUDA tensors" in mf.can_run(call)
    monkeypatch.setattr(mf, "_library", lambda a: "torch")  # as if on CUDA
    assert mf.can_run(call) is True
    mixed = Call("varlen_attention", None, "cuda", "bfloat16", dict(args, v=q.half()))
    assert "one dtype" in mf.can_run(mixed)
    lse = torch.zeros((5, 2), dtype=torch.float32)
    grads = dict(args, out=q, lse=lse, dout=q)
    assert mf.can_run(Call("varlen_attention_vjp", None, "cuda", "bfloat16", grads)) is True
    assert "float32" in mf.can_run(Call("varlen_attention_vjp", None, "cuda", "bfloat16",
                                        dict(grads, lse=lse.double())))
    assert "one dtype" in mf.can_run(Call("varlen_attention_vjp", None, "cuda", "bfloat16",
                                          dict(grads, dout=q.half())))


def test_should_run_leaves_large_float32_calls_to_numba_cuda() -> None:
    from types import SimpleNamespace

    from softmaxkit import registry

    should_run = mf.should_run

    def call(shape: tuple[int, ...], dtype: str = "float32", op: str = "softmax") -> Call:
        return Call(op, None, "cuda", dtype, {"x": SimpleNamespace(shape=shape)})

    registry.reload()
    try:
        assert "numba-cuda" in registry.registry()
        assert "numba-cuda" in str(should_run(call((32768, 4096))))
        assert should_run(call((64, 1024))) is True  # small: the per-call cost decides
        assert "numba-cuda" in str(should_run(call((4096, 32768))))  # long rows too
        # 2**25 elements: softmax leaves, logsumexp (its own, larger threshold) stays
        assert "numba-cuda" in str(should_run(call((262144, 128))))
        assert should_run(call((262144, 128), op="logsumexp")) is True
        assert "numba-cuda" in str(should_run(call((4096, 32768), op="logsumexp")))
        assert should_run(call((4096, 1024))) is True  # 2**22 elements: here
        ce = Call("cross_entropy", None, "cuda", "bfloat16",
                  {"logits": SimpleNamespace(shape=(4096, 32768))})
        assert "numba-cuda" in str(should_run(ce))  # large cross-entropy, any dtype
        small_ce = Call("cross_entropy", None, "cuda", "bfloat16",
                        {"logits": SimpleNamespace(shape=(64, 1024))})
        assert should_run(small_ce) is True
        assert should_run(call((32768, 4096), "bfloat16")) is True
        with sk.backend_opts(prioritize="cupy"):
            assert should_run(call((32768, 4096))) is True
        with sk.backend_opts(disable="numba-cuda"):  # never left to the reference
            assert should_run(call((32768, 4096))) is True
        registry.unregister("numba-cuda")
        assert should_run(call((32768, 4096))) is True  # nobody else to take them
    finally:
        registry.reload()


SM80_SHARED, SM86_SHARED, SM90_SHARED = 163 * 1024, 99 * 1024, 227 * 1024
"""The shared memory a block may take once its kernel opts in, by compute capability."""


SMALL_SHARED = 48 * 1024
"""Less shared memory than any GPU the backend runs on gives a block: what a kernel too large
for its device meets."""


@pytest.mark.parametrize(("kind", "d", "limit", "declined"), [
    # every device the backend runs on gives every kernel tiles that fit: Hopper the
    # defaults, 8.0 the masked tiles at 256 for the unmasked and packed forward, 8.6 / 8.9 /
    # 12.0 the fitting tiles (configs.FITTING_*) where the defaults are too large
    *((kind, d, limit, False) for kind in ("forward", "decode", "varlen", "backward")
      for d in (32, 64, 80, 96, 128, 160, 192, 256)
      for limit in (SM90_SHARED, SM80_SHARED, SM86_SHARED)),
    # a smaller block is declined where even the fitting tiles do not fit
    ("forward", 64, SMALL_SHARED, False),  # 48 KB exactly
    ("forward", 80, SMALL_SHARED, True),
    ("backward", 32, SMALL_SHARED, False),
    ("backward", 128, SMALL_SHARED, True),
    ("varlen", 256, SMALL_SHARED, True),
])
def test_attention_declines_kernels_larger_than_the_device_s_shared_memory(
        kind, d, limit, declined) -> None:
    from softmaxkit_cupy.configs import attention_shared_bytes

    shapes = ((2, 4, 256, d), (2, 4, 256, d), (2, 4, 256, d))
    if kind == "varlen":
        reason = mf.varlen_reason("bfloat16", 2, (512, 4, d), (512, 4, d), (512, 4, d), limit)
    elif kind == "backward":
        reason = mf.attention_vjp_reason("bfloat16", *shapes, limit)
    elif kind == "decode":
        reason = mf.paged_reason("bfloat16", (2, 8, 1, d), (5, 2, 16, d), (5, 2, 16, d),
                                 (2, 3), limit)
    else:
        reason = mf.attention_reason("bfloat16", *shapes, limit)
    assert (reason is not None) == declined, reason
    assert (attention_shared_bytes(d, kind, limit) > limit) == declined
    if declined:
        assert f"takes {attention_shared_bytes(d, kind, limit)} bytes" in reason
        assert str(limit) in reason
    # calls with nothing to launch need no shared memory
    assert mf.attention_reason("bfloat16", (2, 4, 0, d), (2, 4, 256, d), (2, 4, 256, d),
                               limit) is None


def test_the_defaults_give_way_only_where_they_do_not_fit() -> None:
    """The tiles of a call are the defaults wherever they fit the device, the next smaller
    ones (the unmasked forward's masked tiles, then the fitting tiles) only where not."""
    from softmaxkit_cupy.attention import backward_config_for, forward_config
    from softmaxkit_cupy.configs import (
        ATTENTION_CONFIGS,
        BACKWARD_CONFIGS,
        DECODE_CONFIGS,
        FITTING_BACKWARD_CONFIGS,
        FITTING_CONFIGS,
        FITTING_DECODE_CONFIGS,
        UNMASKED_CONFIGS,
        attention_config,
        backward_config,
        decode_config,
        varlen_config,
    )

    assert (UNMASKED_CONFIGS[256].shared_bytes() > SM80_SHARED
            >= ATTENTION_CONFIGS[256].shared_bytes())
    assert attention_config(256, masked=False) == UNMASKED_CONFIGS[256]
    assert attention_config(256, masked=False, shared_limit=SM80_SHARED) == ATTENTION_CONFIGS[256]
    assert varlen_config(256, SM80_SHARED) == ATTENTION_CONFIGS[256]
    assert forward_config(80, 256, False, SM80_SHARED) == ATTENTION_CONFIGS[256]
    for limit in (None, SM90_SHARED, SM80_SHARED, SM86_SHARED):
        for d in ATTENTION_CONFIGS:
            for masked in (True, False):
                c = attention_config(d, masked, limit)
                assert c.mask or not masked
                assert limit is None or c.shared_bytes() <= limit
                unmasked = UNMASKED_CONFIGS.get(d) if not masked else None
                if unmasked is not None and (limit is None or unmasked.shared_bytes() <= limit):
                    assert c == unmasked
                elif limit is None or ATTENTION_CONFIGS[d].shared_bytes() <= limit:
                    assert c == ATTENTION_CONFIGS[d]
                else:
                    assert c == FITTING_CONFIGS[d]
            for chosen, default, fitting in (
                    (backward_config(d, limit), BACKWARD_CONFIGS[d], FITTING_BACKWARD_CONFIGS),
                    (decode_config(d, limit), DECODE_CONFIGS[d], FITTING_DECODE_CONFIGS)):
                fits = limit is None or default.shared_bytes() <= limit
                assert chosen == (default if fits else fitting[d])
                assert limit is None or chosen.shared_bytes() <= limit
            # below Hopper the backward is the mma.sync kernel on the tiles that fit
            assert backward_config_for(86, d, False, limit) == backward_config(d, limit)
    # the fitting tiles serve exactly the head dimensions whose defaults exceed 99 KB
    assert set(FITTING_CONFIGS) == {d for d, c in ATTENTION_CONFIGS.items()
                                    if c.shared_bytes() > SM86_SHARED}
    assert set(FITTING_BACKWARD_CONFIGS) == {d for d, c in BACKWARD_CONFIGS.items()
                                             if c.shared_bytes() > SM86_SHARED}
    assert set(FITTING_DECODE_CONFIGS) == {d for d, c in DECODE_CONFIGS.items()
                                           if c.shared_bytes() > SM86_SHARED}


def test_devices_below_compute_capability_8_are_declined(monkeypatch) -> None:
    """The kernels use cp.async and bfloat16 tensor-core products (8.0 and newer): a call on an
    older device goes to the next backend, with the reason."""
    import torch
    from softmaxkit_cupy import interop

    x = torch.zeros((2, 8), dtype=torch.float32)
    monkeypatch.setattr(mf, "_library", lambda a: "torch")
    monkeypatch.setattr(mf, "_device", lambda a: 0)
    args = {"x": x, "where": None, "masked": "zero", "out_dtype": torch.float32}
    for found, declined in ((75, True), (80, False), (86, False), (90, False), (120, False)):
        monkeypatch.setattr(interop, "capability", lambda device, found=found: found)
        reason = mf.can_run(Call("softmax", None, "cuda", "float32", args))
        assert (reason is not True) == declined, reason
        if declined:
            assert "compute capability 8.0 or newer; device 0 is 7.5" in reason
