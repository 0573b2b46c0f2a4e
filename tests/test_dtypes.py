"""The dtype policy: names of every library's dtypes, accumulator and output rules."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import softmaxkit as sk
from softmaxkit.dtypes import HUGE, TINY, UNIT_ROUNDOFF, accumulator_dtype, dtype_name


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (np.float64, "float64"),  # a numpy scalar type, which is what xp.float64 is
        (np.dtype("float32"), "float32"),
        (np.float16, "float16"),
        (ml_dtypes.bfloat16, "bfloat16"),
        (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
        (torch.bfloat16, "bfloat16"),
        (torch.float64, "float64"),
        (np.int32, "int32"),
        (np.dtype(bool), "bool"),
    ],
)
def test_dtype_name(dtype: object, name: str) -> None:
    assert dtype_name(dtype) == name


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_format_constants_are_the_formats(name: str) -> None:
    """The written-out constants (numpy 2.5's finfo refuses ml_dtypes' bfloat16) are those of
    ml_dtypes' finfo, which knows all four formats."""
    info = ml_dtypes.finfo(ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name))
    assert HUGE[name] == float(info.max)
    assert TINY[name] == float(info.smallest_normal)
    assert UNIT_ROUNDOFF[name] == float(info.eps) / 2


def test_accumulator_dtype_round_trips_as_output_dtype() -> None:
    # accumulator_dtype returns numpy scalar types; used as an output dtype they must keep
    # their width (a float64 request must not be computed and returned as float32)
    x = np.array([1e-300, 0.0, -1e-300])
    acc = accumulator_dtype(np, x.dtype)
    assert dtype_name(acc) == "float64"
    out = sk.log_softmax(np.array([0.0, 40.0]), dtype=acc, backend="reference")
    assert out.dtype == np.float64
    assert out[0] == pytest.approx(-40.0 - np.log1p(np.exp(-40.0)), rel=1e-15)
