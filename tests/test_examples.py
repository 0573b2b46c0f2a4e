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


def test_training_page_examples_run():
    """Every Python block of docs/training.md runs (PyTorch always; JAX when installed)."""
    page = (EXAMPLES.parent / "docs" / "training.md").read_text()
    blocks = [b.split("```", 1)[0] for b in page.split("```python\n")[1:]]
    assert len(blocks) == 2
    for block in blocks:
        if "import jax" in block and importlib.util.find_spec("jax") is None:
            continue
        exec(compile(block, "docs/training.md", "exec"), {"__name__": "training_md"})
