"""Online summaries: summarize, merge, Summary.logsumexp / normalized (reference backend).

References: the float64 definition, scipy.special.logsumexp and softmax, and mpmath for rows
whose exponentials overflow float64 without the shift.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
import scipy.special
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import softmaxkit as sk
from softmaxkit.testing import cases
from softmaxkit.testing.summary_cases import definition


@pytest.mark.parametrize("target", ["numpy", "array_api_strict"])
def test_conformance_cases_pass_on_reference(target):
    found = cases(target, ops=("summarize", "merge"))
    assert found, "no summary cases registered"
    for c in found:
        if c.dtype in c.target.dtypes:
            c.run("reference")


def test_matches_scipy_and_the_seed_example():
    x = np.array([20.0, 18.0, 17.0, -5.0])
    s = sk.summarize(x, values=np.eye(4))
    assert float(s.max) == 20.0
    np.testing.assert_allclose(s.mass, 1.185122, rtol=1e-6)
    np.testing.assert_allclose(s.logsumexp(), scipy.special.logsumexp(x), rtol=1e-15)
    np.testing.assert_allclose(s.normalized(), scipy.special.softmax(x), rtol=1e-14)


def test_huge_logits_against_mpmath():
    x = np.array([1000.0, 999.0, -1000.0, 1000.5])
    s = sk.merge(sk.summarize(x[:2]), sk.summarize(x[2:]))
    expected = mpmath.log(mpmath.fsum(mpmath.exp(mpmath.mpf(float(v))) for v in x))
    assert abs(float(s.logsumexp()) - float(expected)) < 1e-12


def test_sixteen_bit_fields_are_float32():
    x = np.linspace(-3, 3, 50).astype(np.float16)
    s = sk.summarize(x, values=np.ones((50, 2), np.float16))
    assert s.max.dtype == s.mass.dtype == s.numerator.dtype == np.float32


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 10, dtype=torch.bfloat16)
    s = sk.summarize(x, values=torch.randn(3, 10, 4))
    assert isinstance(s.max, torch.Tensor) and s.mass.dtype == torch.float32
    assert s.numerator.dtype == torch.float32  # bfloat16 and float32 promote to float32
    merged = sk.merge(s, s)
    torch.testing.assert_close(merged.mass, 2 * s.mass)


rows = hnp.arrays(np.float64, st.integers(1, 40),
                  elements=st.floats(-300, 300, allow_nan=False, allow_infinity=False))


@st.composite
def _row_split(draw):
    x = draw(rows)
    n = x.shape[0]
    where = draw(hnp.arrays(np.bool_, n))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    order = draw(st.permutations(range(len(cuts) + 1)))
    how = draw(st.sampled_from(["n-ary", "sequential", "reversed", "tree"]))
    seed = draw(st.integers(0, 2**16))
    return x, where, [0, *cuts, n], list(order), how, seed


def _merge_in(parts, how, rng):
    if how == "n-ary":
        return sk.merge(*parts)
    if how in ("sequential", "reversed"):
        seq = parts if how == "sequential" else parts[::-1]
        acc = seq[0]
        for p in seq[1:]:
            acc = sk.merge(acc, p)
        return acc
    parts = list(parts)
    while len(parts) > 1:
        i = int(rng.integers(0, len(parts) - 1))
        parts[i:i + 2] = [sk.merge(parts[i], parts[i + 1])]
    return parts[0]


@settings(max_examples=80, deadline=None)
@given(_row_split())
def test_any_split_merged_in_any_order_matches_the_whole(case):
    x, where, bounds, order, how, seed = case
    rng = np.random.default_rng(seed)
    values = rng.normal(size=x.shape + (3,))
    parts = [sk.summarize(x[a:b], where=where[a:b], values=values[a:b])
             for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    got = _merge_in([parts[i] for i in order], how, rng)
    m, mass, num, scale = definition(x, where, values)
    assert float(got.max) == m
    np.testing.assert_allclose(got.mass, mass, rtol=1e-13)
    assert np.all(np.abs(got.numerator - num) <= 1e-13 * scale)
    if mass == 0:
        assert got.logsumexp() == -np.inf and np.all(got.normalized() == 0)


@settings(max_examples=40, deadline=None)
@given(rows, st.sampled_from([np.float16, np.float32, np.float64]))
def test_merge_with_empty_is_exactly_the_identity(x, dtype):
    x = x.astype(dtype)
    values = np.arange(x.size * 2, dtype=dtype).reshape(x.size, 2)
    s = sk.summarize(x, values=values)
    empty = sk.summarize(x, where=np.zeros(x.shape, bool), values=values)
    assert float(empty.max) == -np.inf and float(empty.mass) == 0
    for got in (sk.merge(s, empty), sk.merge(empty, s), sk.merge(empty, s, empty)):
        for name in ("max", "mass", "numerator"):
            np.testing.assert_array_equal(getattr(got, name), getattr(s, name))


@settings(max_examples=40, deadline=None)
@given(rows, rows)
def test_merge_is_commutative(a, b):
    sa, sb = sk.summarize(a), sk.summarize(b)
    ab, ba = sk.merge(sa, sb), sk.merge(sb, sa)
    assert float(ab.max) == float(ba.max)
    np.testing.assert_allclose(ab.mass, ba.mass, rtol=1e-15)


def test_averaging_normalized_tiles_is_wrong_but_merging_is_exact():
    # two tiles of ordinary output magnitude whose masses differ by a factor e^10
    x = np.array([10.0, 10.0, 0.0, 0.0])
    values = np.array([[1.0], [1.0], [-1.0], [-1.0]])
    a, b = sk.summarize(x[:2], values=values[:2]), sk.summarize(x[2:], values=values[2:])
    naive = (a.normalized() + b.normalized()) / 2
    exact = sk.merge(a, b).normalized()
    p = scipy.special.softmax(x)
    np.testing.assert_allclose(exact, p @ values, rtol=1e-15)
    assert abs(float(naive[0]) - float((p @ values)[0])) > 0.9


def test_batched_summaries_broadcast_in_merge():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6))
    whole = sk.summarize(x, axis=0)
    shared = sk.summarize(x[:1], axis=0)  # shape (6,)
    rest = sk.summarize(x[1:], axis=0)
    got = sk.merge(shared, rest)
    np.testing.assert_allclose(got.mass, whole.mass, rtol=1e-14)
    np.testing.assert_array_equal(got.max, whole.max)


def test_errors_name_the_argument():
    x = np.zeros((2, 3))
    with pytest.raises(ValueError, match="values"):
        sk.summarize(x, values=np.zeros((2, 4, 1)))
    with pytest.raises(ValueError, match="at least one dimension"):
        sk.summarize(np.float64(1.0))
    with pytest.raises(ValueError, match="numerator"):
        sk.merge(sk.summarize(x), sk.summarize(x, values=np.zeros((2, 3, 1))))
    with pytest.raises(ValueError, match="numerator"):
        sk.summarize(x).normalized()
    with pytest.raises(ValueError, match="at least one"):
        sk.merge()
    with pytest.raises(TypeError, match="Summary"):
        sk.merge(sk.summarize(x), x)
    with pytest.raises(TypeError, match="where"):
        sk.summarize(x, where=np.ones((2, 3)))


def test_the_guide_examples_run():
    import pathlib
    import re

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "summaries.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(guide), "exec"), namespace)  # noqa: S102


def test_explicit_empty_summary_starts_an_online_loop():
    rng = np.random.default_rng(1)
    x, v = rng.normal(size=(3, 50)), rng.normal(size=(3, 50, 2))
    running = sk.Summary.empty((3,), 2, like=x)
    for i in range(0, 50, 8):
        running = sk.merge(running, sk.summarize(x[:, i:i + 8], values=v[:, i:i + 8]))
    whole = sk.summarize(x, values=v)
    np.testing.assert_allclose(running.normalized(), whole.normalized(), rtol=1e-13)
    assert sk.Summary.empty(like=np.zeros(2, np.float16)).max.dtype == np.float32
