"""The golden vectors: reproducible from their script, and faithful to the seed's numbers."""

from __future__ import annotations

import importlib
import json
import math
from importlib import resources

import pytest

from softmaxkit.testing import vectors


def test_vectors_are_what_the_script_makes():
    make = importlib.import_module("softmaxkit._vectors.make_vectors")
    built = make.build()
    assert sorted(built) == sorted(f"{stem}.json" for stem in vectors.FILES)
    for filename, doc in built.items():
        stored = resources.files("softmaxkit._vectors").joinpath(filename).read_text("utf-8")
        assert json.loads(stored) == json.loads(json.dumps(doc)), (
            f"{filename} is stale: run python spec/vectors/make_vectors.py"
        )


def by_name(stem, name):
    return next(c for c in vectors.load(stem) if c["name"] == name)


def test_seed_worked_example():
    case = by_name("softmax", "seed_fp16_example")
    p = [float(v) for v in case["expected"]]
    # the seed prints five decimals: [0.84380, 0.11420, 0.04201, ~0]
    assert p[:3] == pytest.approx([0.84380, 0.11420, 0.04201], abs=1e-5)
    assert p[3] == pytest.approx(1.17e-11, rel=2e-3)
    assert case["dtypes"] == ["float16", "bfloat16", "float32", "float64"]
    assert sum(p) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("z, rounded", [(0.5, 0.622), (2.5, 0.924)])
def test_two_logit_family(z, rounded):
    p = [float(v) for v in by_name("softmax", f"two_logit_sigmoid_{z:g}")["expected"]]
    assert p[1] == pytest.approx(1 / (1 + math.exp(-z)), rel=1e-15)
    assert round(p[1], 3) == rounded
    assert p[0] == pytest.approx(1 - p[1], rel=1e-15)


def test_every_case_runs_in_float64_at_least():
    for stem in vectors.FILES:
        for case in vectors.load(stem):
            assert "float64" in case["dtypes"], (stem, case["name"])
