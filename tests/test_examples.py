"""The training examples run and agree with plain PyTorch (small CPU configurations)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_lm_curves_agree_with_torch():
    result = _load("train_lm").main([
        "--steps", "25", "--seq", "16", "--dim", "16", "--heads", "4", "--kv-heads", "2",
        "--batch", "4", "--vocab", "32", "--quiet",
    ])
    ours, theirs = result["softmaxkit"], result["torch"]
    assert len(ours) == len(theirs) == 25
    # float32: same weights, same batches; only rounding differs between the two models
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
    assert ours[-1] < ours[0] - 0.3  # it learns


def test_grad_check_passes_on_cpu():
    status = _load("grad_check").main([
        "--device", "cpu", "--backends", "reference", "--ops", "softmax", "cross_entropy",
        "attention",
    ])
    assert status == 0


def test_grad_check_cross_entropy_reductions_on_cpu():
    status = _load("grad_check").main([
        "--device", "cpu", "--backends", "numba-cpu", "reference", "--ops",
        "cross_entropy-sum", "cross_entropy-none",
    ])
    assert status == 0


@pytest.mark.parametrize("backend", ["reference", "numba-cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grad_check_replay_comparisons_with_an_eager_step(monkeypatch, backend, dtype):
    """The comparisons ``--graphs`` makes after each replay, with an eager step in place of
    the CUDA graph (labels treated as on a GPU: out-of-range rows are NaN, not an error)."""
    import torch

    from softmaxkit import rows

    monkeypatch.setattr(rows, "_labels_on_host", lambda index: False)
    grad_check = _load("grad_check")
    cases = grad_check.cases("cpu")
    dt = getattr(torch, dtype)
    for op in ("cross_entropy", "cross_entropy-sum", "cross_entropy-none", "softmax"):
        fn, ref, inputs = cases[op]
        xs = [x.detach().to(dt).requires_grad_() for x in inputs]

        def step(fn=fn, xs=xs):
            out = fn(backend, *xs)
            return out.detach(), torch.autograd.grad(out.float().sum(), xs)

        ok, notes = grad_check.check_replays(op, ref, inputs, dt, xs, step)
        assert ok, f"{op}: {notes}"
        if op.startswith("cross_entropy"):
            assert "NaN row as the spec says" in notes and "0 / 0 as the spec says" in notes
        # a replay that does not see the fresh data is caught
        stale = step()
        ok, notes = grad_check.check_replays(op, ref, inputs, dt, xs, lambda stale=stale: stale)
        assert not ok, f"{op}: a stale replay passed: {notes}"


def test_grad_check_compiled_step_with_eager_backend(monkeypatch):
    """``--graphs``' torch.compile check, compiled with the eager backend on the CPU."""
    from softmaxkit import rows

    monkeypatch.setattr(rows, "_labels_on_host", lambda index: False)
    grad_check = _load("grad_check")
    cases = grad_check.cases("cpu")
    import torch

    for op in ("cross_entropy", "cross_entropy-none"):
        fn, ref, inputs = cases[op]
        ok, notes = grad_check.compiled(fn, ref, inputs, torch.float32, "reference", op,
                                        {"backend": "eager"})
        assert ok, f"{op}: {notes}"
        assert "NaN row as the spec says" in notes and "0 / 0 as the spec says" in notes


def test_training_page_examples_run():
    """Every Python block of docs/training.md runs (PyTorch always; JAX when installed)."""
    page = (EXAMPLES.parent / "docs" / "training.md").read_text()
    blocks = [b.split("```", 1)[0] for b in page.split("```python\n")[1:]]
    assert len(blocks) == 2
    for block in blocks:
        if "import jax" in block and importlib.util.find_spec("jax") is None:
            continue
        exec(compile(block, "docs/training.md", "exec"), {"__name__": "training_md"})
