"""The cupy backend serves float32 attention at precisions "tf32" and "tf32x3" (its TF32
kernels) and, once ``configs.F32_SERVED`` says so, at "float32", and float32 gradients and
packed sequences at every precision (its exact CUDA-core kernels), leaves every other
float32 call to numba-cuda's exact kernels, and declines the head dimensions its kernels
are not built for, and tiles the device's shared memory cannot hold, with the reason."""

from __future__ import annotations

import pytest
from softmaxkit_cupy import manifest as mf
from softmaxkit_cupy.configs import F32_SERVED, TF32_CONFIGS, tf32_config, tf32_names

from softmaxkit import registry
from softmaxkit.backend import Backend


def test_float32_attention_is_served_at_the_declared_precisions() -> None:
    backend = Backend.from_manifest(mf.manifest())
    assert backend.takes_precision("attention")
    assert backend.takes_precision("attention_vjp") is F32_SERVED
    for precision, served in (("float32", F32_SERVED), ("tf32x3", True), ("tf32", True)):
        assert backend.serves_key("attention", "cuda", "float32", precision) is served
        assert backend.serves_key("attention_vjp", "cuda", "float32", precision) is F32_SERVED
        for op in ("varlen_attention", "varlen_attention_vjp"):  # exact at every precision
            assert backend.serves_key(op, "cuda", "float32", precision) is F32_SERVED
    for dtype in ("float16", "bfloat16"):  # 16-bit calls always carry "float32"
        assert backend.serves_key("attention", "cuda", dtype, "float32")
        assert backend.serves_key("attention_vjp", "cuda", dtype, "float32")


def test_dispatch_orders_cupy_first_where_it_serves() -> None:
    registry.reload()
    try:
        order, _ = registry.candidates("attention", "cuda", "float32", "tf32x3")
        exact = [name for name in ("numba-cuda", "reference") if name in order]
        assert exact and all(order.index("cupy") < order.index(name) for name in exact)
        order, left_out = registry.candidates("attention", "cuda", "float32")
        if F32_SERVED:
            assert all(order.index("cupy") < order.index(name) for name in exact)
        else:
            assert "cupy" not in order and "at precision 'float32'" in left_out["cupy"]
        for precision in ("float32", "tf32"):
            order, _ = registry.candidates("attention_vjp", "cuda", "float32", precision)
            if F32_SERVED:
                assert all(order.index("cupy") < order.index(name) for name in exact)
            else:
                assert "cupy" not in order
    finally:
        registry.reload()


@pytest.mark.parametrize(("q", "k", "v", "declined"), [
    ((2, 8, 300, 64), (2, 2, 400, 64), (2, 2, 400, 64), False),
    ((1, 4, 1, 128), (1, 4, 5000, 128), (1, 4, 5000, 128), False),
    ((1, 4, 0, 32), (1, 4, 10, 32), (1, 4, 10, 32), False),
    ((1, 4, 16, 80), (1, 4, 16, 80), (1, 4, 16, 80), False),  # padded to 96
    ((1, 4, 16, 64), (1, 4, 16, 64), (1, 4, 16, 128), False),  # padded to 128
    ((1, 4, 16, 160), (1, 4, 16, 160), (1, 4, 16, 160), True),
    ((1, 4, 16, 64), (1, 4, 16, 64), (1, 4, 16, 136), True),
    ((70000, 1, 16, 64), (70000, 1, 16, 64), (70000, 1, 16, 64), True),
])
def test_tf32_reasons(q, k, v, declined) -> None:
    reason = mf.tf32_reason(q, k, v)
    assert (reason is not None) is declined, reason


def test_every_head_dimension_has_masked_and_unmasked_kernels() -> None:
    names = set(tf32_names())
    for d in TF32_CONFIGS:
        for masked in (True, False):
            config = tf32_config(d, masked)
            assert config.mask is masked
            assert {config.name("tf32"), config.name("tf32x3")} <= names
    assert tf32_config(80, True) is None


def test_head_dims_run_at_the_smallest_built_width_that_holds_them() -> None:
    from softmaxkit_cupy.configs import tf32_width

    assert [tf32_width(d, d) for d in (1, 32, 33, 64, 80, 96, 100, 128, 129)] == [
        32, 32, 64, 64, 96, 96, 128, 128, None]
    assert tf32_width(64, 40) == 64 and tf32_width(16, 100) == 128


def test_float32_calls_at_the_tf32_precisions_are_taken(monkeypatch) -> None:
    """``can_run`` takes float32 attention its TF32 kernels are built for (D, Dv up to 128),
    wider calls at a reduced precision for the exact kernels (up to 256) and declines wider
    ones with the reason; the registry offers cupy float32 attention at every precision."""
    torch = pytest.importorskip("torch")

    from softmaxkit.ops import Call

    monkeypatch.setattr(mf, "_library", lambda a: "torch")  # CPU tensors stand in for CUDA
    q = torch.zeros(1, 4, 16, 64)
    call = Call("attention", None, "cuda", "float32",
                {"q": q, "k": q, "v": q, "mask": None, "precision": "tf32"})
    assert mf.can_run(call) is True
    monkeypatch.setattr(mf, "_shared_limit", lambda a: 227 * 1024)
    wide = torch.zeros(1, 4, 16, 160)
    call = Call("attention", None, "cuda", "float32",
                {"q": wide, "k": wide, "v": wide, "mask": None, "precision": "tf32x3"})
    assert mf.can_run(call) is True
    huge = torch.zeros(1, 4, 16, 264)
    call = Call("attention", None, "cuda", "float32",
                {"q": huge, "k": huge, "v": huge, "mask": None, "precision": "tf32"})
    assert "up to 256" in mf.can_run(call)
    from softmaxkit.registry import registry

    cupy = registry()["cupy"]
    assert cupy.serves_key("attention", "cuda", "float32", "tf32")
    assert cupy.serves_key("attention", "cuda", "float32", "tf32x3")
    assert cupy.serves_key("attention", "cuda", "float32", "float32") is F32_SERVED
    assert cupy.serves_key("attention_vjp", "cuda", "float32", "tf32") is F32_SERVED


@pytest.mark.parametrize(("q", "k", "v", "limit", "declined"), [
    ((2, 8, 300, 64), (2, 2, 400, 64), (2, 2, 400, 64), None, False),
    ((1, 4, 16, 80), (1, 4, 16, 80), (1, 4, 16, 80), None, False),  # padded to 96
    ((1, 4, 16, 192), (1, 4, 16, 192), (1, 4, 16, 128), None, False),  # its own pair
    ((1, 4, 16, 256), (1, 4, 16, 256), (1, 4, 16, 256), 227 * 1024, False),
    ((1, 4, 16, 256), (1, 4, 16, 256), (1, 4, 16, 256), 163 * 1024, True),  # sm_80
    ((1, 4, 16, 128), (1, 4, 16, 128), (1, 4, 16, 128), 99 * 1024, True),  # sm_86
    ((1, 4, 16, 32), (1, 4, 16, 32), (1, 4, 16, 32), 99 * 1024, False),
    ((1, 4, 0, 256), (1, 4, 10, 256), (1, 4, 10, 256), 1024, False),  # no launch
    ((1, 4, 16, 264), (1, 4, 16, 264), (1, 4, 16, 264), None, True),
    ((1, 4, 16, 64), (1, 4, 16, 64), (1, 4, 16, 300), None, True),
    ((70000, 1, 16, 64), (70000, 1, 16, 64), (70000, 1, 16, 64), None, True),
])
def test_f32_reasons(q, k, v, limit, declined) -> None:
    reason = mf.f32_reason(q, k, v, limit)
    assert (reason is not None) is declined, reason


@pytest.mark.parametrize(("q", "k", "v", "limit", "declined"), [
    ((2, 8, 300, 64), (2, 2, 400, 64), (2, 2, 400, 64), None, False),
    ((1, 4, 16, 80), (1, 4, 16, 80), (1, 4, 16, 80), None, False),  # padded to 96
    ((1, 4, 16, 128), (1, 4, 16, 128), (1, 4, 16, 64), None, False),  # padded to 128
    ((1, 4, 16, 128), (1, 4, 16, 128), (1, 4, 16, 128), 99 * 1024, True),  # sm_86
    ((1, 4, 16, 32), (1, 4, 16, 32), (1, 4, 16, 32), 48 * 1024, False),
    ((1, 4, 16, 160), (1, 4, 16, 160), (1, 4, 16, 160), None, False),
    ((1, 4, 16, 64), (1, 4, 16, 64), (1, 4, 16, 136), None, False),  # padded to 160
    ((1, 4, 16, 192), (1, 4, 16, 192), (1, 4, 16, 128), None, False),  # its own pair
    ((1, 4, 16, 256), (1, 4, 16, 256), (1, 4, 16, 256), 227 * 1024, False),
    ((1, 4, 16, 256), (1, 4, 16, 256), (1, 4, 16, 256), 163 * 1024, True),  # sm_80
    ((1, 4, 16, 264), (1, 4, 16, 264), (1, 4, 16, 264), None, True),  # numba-cuda's
    ((1, 4, 0, 264), (1, 4, 10, 264), (1, 4, 10, 264), None, True),  # no such kernel
    ((1, 4, 0, 128), (1, 4, 10, 128), (1, 4, 10, 128), 1024, False),  # no launch
    ((70000, 1, 16, 64), (70000, 1, 16, 64), (70000, 1, 16, 64), None, True),
])
def test_f32_backward_reasons(q, k, v, limit, declined) -> None:
    reason = mf.f32_reason(q, k, v, limit, backward=True)
    assert (reason is not None) is declined, reason
    if declined and q[3] > 256:
        assert "backward takes D and Dv up to 256" in reason


def test_exact_float32_calls_are_taken_with_their_precision(monkeypatch) -> None:
    """A float32 call at the default precision goes to the exact kernels' reason (asked once
    they are served): head dimensions up to 256; at a reduced precision too where the TF32
    kernels (up to 128) hold none of its head dims."""
    torch = pytest.importorskip("torch")

    from softmaxkit.ops import Call

    monkeypatch.setattr(mf, "_library", lambda a: "torch")  # CPU tensors stand in for CUDA
    monkeypatch.setattr(mf, "_shared_limit", lambda a: 227 * 1024)
    wide = torch.zeros(1, 4, 16, 160)
    for precision in ("float32", "tf32"):
        call = Call("attention", None, "cuda", "float32",
                    {"q": wide, "k": wide, "v": wide, "mask": None, "precision": precision})
        assert mf.can_run(call) is True
    huge = torch.zeros(1, 4, 16, 320)
    call = Call("attention", None, "cuda", "float32",
                {"q": huge, "k": huge, "v": huge, "mask": None, "precision": "float32"})
    assert "up to 256" in mf.can_run(call)


def test_exact_float32_gradients_are_taken_at_every_precision(monkeypatch) -> None:
    """A float32 gradient goes to the exact backward's reason whatever its precision: head
    dimensions up to 256, wider ones declined for numba-cuda's kernels."""
    torch = pytest.importorskip("torch")

    from softmaxkit.ops import Call

    monkeypatch.setattr(mf, "_library", lambda a: "torch")  # CPU tensors stand in for CUDA
    monkeypatch.setattr(mf, "_shared_limit", lambda a: 227 * 1024)
    for d, taken in ((96, True), (160, True), (264, False)):
        x = torch.zeros(1, 4, 16, d)
        lse = torch.zeros(1, 4, 16)
        for precision in ("float32", "tf32x3", "tf32"):
            call = Call("attention_vjp", None, "cuda", "float32", {
                "q": x, "k": x, "v": x, "out": x, "lse": lse, "dout": x, "mask": None,
                "precision": precision})
            reason = mf.can_run(call)
            assert (reason is True) is taken, reason
            if not taken:
                assert "backward takes D and Dv up to 256" in reason
