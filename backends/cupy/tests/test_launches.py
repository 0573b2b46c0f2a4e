"""Packed launches: the parameter list of numpy-scalar arguments."""

from __future__ import annotations

import numpy as np
import pytest
from softmaxkit_cupy import launches


def test_codes_follow_the_numpy_scalar_types():
    args = (np.uint64(1), np.int64(2), np.int32(3), np.uint32(4), np.float32(5), np.float64(6))
    assert launches.codes_of(args) == "QqiIfd"


def test_unsupported_argument_names_its_type():
    with pytest.raises(TypeError, match="int"):
        launches.codes_of((5,))
