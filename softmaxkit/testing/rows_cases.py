"""Conformance cases for the row operations (softmax, log_softmax, logsumexp, ...)."""

from __future__ import annotations

import numpy as np

import softmaxkit as sk

from .kit import Target, case
from .tolerance import assert_close


@case("softmax")
def case_softmax_random_rows(t: Target, dtype: str, backend: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(scale=4.0, size=(7, 33))
    xt = t.asarray(x, dtype)
    x64 = t.to_numpy(xt)  # the represented logits, in float64
    expected = np.exp(x64 - x64.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    got = t.to_numpy(sk.softmax(xt, axis=-1, backend=backend))
    assert_close(got, expected, dtype, "softmax")
