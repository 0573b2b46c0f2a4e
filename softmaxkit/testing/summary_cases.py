"""Conformance cases for online summaries: ``summarize`` and the exact ``merge``.

The reference is the float64 definition on the represented inputs: ``max`` over the allowed
positions, ``mass = sum(exp(x - max))``, ``numerator = sum(exp(x - max) * v)``.  The maximum is
exact (it is one of the inputs); mass and numerator are held to the accumulator's bound, the
numerator relative to ``sum(exp(x - max) * |v|)`` since it may cancel.  Empty summaries and the
identity of merge are checked exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import softmaxkit as sk

from .kit import Target, case

SUMMARY_RTOL = {"float32": 1e-5, "float64": 1e-12}
"""Accumulator dtype -> relative bound of mass and numerator (spec "Summaries")."""


def _acc(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def definition(
    x: np.ndarray, where: np.ndarray | None, values: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(max, mass, numerator, sum of |terms|) of rows of ``x`` [..., N] in float64."""
    x = np.asarray(x, np.float64)
    allowed = np.ones(x.shape, bool) if where is None else np.broadcast_to(where, x.shape)
    allowed = allowed & (x != -np.inf)
    xs = np.where(allowed, x, -np.inf)
    m = xs.max(axis=-1, initial=-np.inf)
    shift = np.where(m == -np.inf, 0.0, m)
    e = np.where(allowed, np.exp(xs - shift[..., None]), 0.0)
    if values is None:
        return m, e.sum(-1), None, None
    vals = np.where(allowed[..., None], values, 0.0)
    return m, e.sum(-1), np.einsum("...n,...nd->...d", e, vals), \
        np.einsum("...n,...nd->...d", e, np.abs(vals))


def check_summary(
    t: Target, dtype: str, got: sk.Summary, expected: tuple[Any, ...], what: str
) -> None:
    """Compare a summary with the float64 definition under the accumulator's bound."""
    m, mass, num, scale = expected
    acc = _acc(dtype)
    rtol = SUMMARY_RTOL[acc]
    for name, field in (("max", got.max), ("mass", got.mass)):
        field_dtype = str(getattr(field.dtype, "name", field.dtype)).rsplit(".", 1)[-1]
        assert field_dtype == acc, f"{what}: {name} has dtype {field_dtype}, expected {acc}"
    gm, gmass = t.to_numpy(got.max), t.to_numpy(got.mass)
    assert gm.shape == m.shape, f"{what}: max shape {gm.shape} != {m.shape}"
    assert np.array_equal(gm, m), f"{what}: max differs from the largest allowed logit"
    err = np.abs(gmass - mass)
    assert np.all(err <= rtol * mass), f"{what} [{dtype}]: mass error {err.max():.3g}"
    empty = m == -np.inf
    assert np.all(gmass[empty] == 0), f"{what}: an empty summary has nonzero mass"
    if num is None:
        assert got.numerator is None, f"{what}: a numerator without values"
        return
    gnum = t.to_numpy(got.numerator)
    assert gnum.shape == num.shape, f"{what}: numerator shape {gnum.shape} != {num.shape}"
    err = np.abs(gnum - num)
    assert np.all(err <= rtol * scale + 1e-300), (
        f"{what} [{dtype}]: numerator error {err.max():.3g}"
    )
    assert np.all(gnum[empty] == 0), f"{what}: an empty summary has a nonzero numerator"


def _rows(t: Target, dtype: str, seed: int, shape: tuple[int, ...], dv: int = 3):
    rng = np.random.default_rng(seed)
    x = t.asarray(rng.normal(scale=5.0, size=shape), dtype)
    v = t.asarray(rng.normal(size=shape + (dv,)), dtype)
    where = rng.random(shape) < 0.7
    where[0] = False  # an empty row
    return x, v, where, t.to_numpy(x), t.to_numpy(v)


@case("summarize")
def case_summarize_rows(t: Target, dtype: str, backend: str) -> None:
    x, v, where, x64, v64 = _rows(t, dtype, 40, (5, 37))
    w = t.asarray(where, None)
    got = sk.summarize(x, where=w, values=v, backend=backend)
    check_summary(t, dtype, got, definition(x64, where, v64), "summarize with where and values")
    got = sk.summarize(x, backend=backend)
    check_summary(t, dtype, got, definition(x64, None, None), "summarize")
    lse = t.to_numpy(sk.summarize(x, where=w, backend=backend).logsumexp())
    m, mass, _, _ = definition(x64, where, None)
    expected = np.where(mass > 0, m + np.log(np.where(mass > 0, mass, 1.0)), -np.inf)
    assert lse[0] == -np.inf, "Summary.logsumexp of an empty summary is not -inf"
    fin = mass > 0
    assert np.allclose(lse[fin], expected[fin], rtol=0, atol=SUMMARY_RTOL[_acc(dtype)] * 10), (
        "Summary.logsumexp differs from the definition"
    )
    avg = t.to_numpy(sk.summarize(x, where=w, values=v, backend=backend).normalized())
    _, _, num, scale = definition(x64, where, v64)
    e_avg = num / np.where(fin, mass, 1.0)[..., None]
    assert np.all(avg[~fin] == 0), "Summary.normalized of an empty summary is not 0"
    bound = SUMMARY_RTOL[_acc(dtype)] * 2 * (scale / np.where(fin, mass, 1.0)[..., None])
    assert np.all(np.abs(avg - e_avg)[fin] <= bound[fin] + 1e-300), "Summary.normalized"


@case("summarize")
def case_summarize_axis_and_broadcast(t: Target, dtype: str, backend: str) -> None:
    rng = np.random.default_rng(41)
    x = t.asarray(rng.normal(scale=3.0, size=(4, 9, 2)), dtype)
    v = t.asarray(rng.normal(size=(9, 5)), dtype)  # shared by every row, broadcast
    x64, v64 = t.to_numpy(x), t.to_numpy(v)
    got = sk.summarize(x, axis=1, values=v, backend=backend)
    rows = np.moveaxis(x64, 1, -1)
    check_summary(t, dtype, got, definition(rows, None, np.broadcast_to(v64, (4, 2, 9, 5))),
                  "summarize axis=1 with broadcast values")


@case("summarize")
def case_summarize_empty_and_special(t: Target, dtype: str, backend: str) -> None:
    x64 = np.array([[-np.inf, -np.inf, -np.inf],   # every logit -inf: empty
                    [1.0, 2.0, 3.0],               # masked below: empty
                    [np.nan, 1.0, 0.0],            # allowed NaN: NaN summary
                    [np.inf, 1.0, 0.0],            # allowed +inf: max +inf, NaN mass
                    [np.nan, np.inf, 2.0]])        # excluded NaN and +inf: no leak
    where = np.array([[True] * 3, [False] * 3, [True] * 3, [True] * 3, [False, False, True]])
    values = np.ones((5, 3, 2))
    values[4, :2] = np.nan  # excluded positions' values must not leak either
    x, v = t.asarray(x64, dtype), t.asarray(values, dtype)
    s = sk.summarize(x, where=t.asarray(where, None), values=v, backend=backend)
    m, mass, num = t.to_numpy(s.max), t.to_numpy(s.mass), t.to_numpy(s.numerator)
    assert np.all(m[:2] == -np.inf) and np.all(mass[:2] == 0) and np.all(num[:2] == 0), (
        "an empty row must give the summary (-inf, 0, 0)"
    )
    assert np.isnan(m[2]) and np.isnan(mass[2]) and np.all(np.isnan(num[2])), "NaN row"
    assert m[3] == np.inf and np.isnan(mass[3]) and np.all(np.isnan(num[3])), "+inf row"
    assert m[4] == 2.0 and mass[4] == 1.0 and np.all(num[4] == 1.0), "excluded NaN leaked"
    lse = t.to_numpy(s.logsumexp())
    assert lse[0] == -np.inf and lse[1] == -np.inf and np.isnan(lse[2]) and lse[3] == np.inf
    avg = t.to_numpy(s.normalized())
    assert np.all(avg[:2] == 0) and np.all(avg[4] == 1.0)
    zero = sk.summarize(t.asarray(np.zeros((2, 0)), dtype), backend=backend)
    assert np.all(t.to_numpy(zero.max) == -np.inf) and np.all(t.to_numpy(zero.mass) == 0)


def _summary_on(t: Target, dtype: str, x64: np.ndarray, where: np.ndarray | None,
                v64: np.ndarray | None) -> sk.Summary:
    """A summary built directly from the float64 definition, rounded to the accumulator."""
    m, mass, num, _ = definition(x64, where, v64)
    acc = _acc(dtype)
    return sk.Summary(t.asarray(m, acc), t.asarray(mass, acc),
                      None if num is None else t.asarray(num, acc))


@case("merge")
def case_merge_any_split_any_order(t: Target, dtype: str, backend: str) -> None:
    rng = np.random.default_rng(42)
    x64 = rng.normal(scale=6.0, size=(4, 40))
    x64[1, :30] += 40.0  # a chunk whose mass dwarfs the others'
    x64 = t.to_numpy(t.asarray(x64, dtype))  # the logits as the dtype represents them
    v64 = rng.normal(size=(4, 40, 3))
    where = rng.random((4, 40)) < 0.8
    where[2] = False  # an empty row
    where[3, 10:25] = False  # an empty chunk in a nonempty row
    bounds = (0, 10, 25, 25, 33, 40)
    parts = [_summary_on(t, dtype, x64[:, a:b], where[:, a:b], v64[:, a:b])
             for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    expected = definition(x64, where, v64)
    orders = {
        "n-ary": lambda ps: sk.merge(*ps, backend=backend),
        "sequential": lambda ps: _fold(ps, backend),
        "reversed": lambda ps: _fold(ps[::-1], backend),
        "tree": lambda ps: sk.merge(sk.merge(ps[0], ps[3], backend=backend),
                                    sk.merge(ps[4], sk.merge(ps[2], ps[1], backend=backend),
                                             backend=backend), backend=backend),
    }
    for name, order in orders.items():
        # merging rounds each part to the accumulator once more: twice the bound
        got = order(parts)
        check_summary(t, dtype, got, expected, f"merge ({name})")


def _fold(parts: list[sk.Summary], backend: str) -> sk.Summary:
    acc = parts[0]
    for p in parts[1:]:
        acc = sk.merge(acc, p, backend=backend)
    return acc


@case("merge")
def case_merge_empty_is_identity(t: Target, dtype: str, backend: str) -> None:
    rng = np.random.default_rng(43)
    x64 = t.to_numpy(t.asarray(rng.normal(scale=4.0, size=(3, 7)), dtype))
    v64 = rng.normal(size=(3, 7, 2))
    s = _summary_on(t, dtype, x64, None, v64)
    empty = _summary_on(t, dtype, x64, np.zeros((3, 7), bool), v64)
    for got in (sk.merge(s, empty, backend=backend), sk.merge(empty, s, backend=backend),
                sk.merge(empty, s, empty, backend=backend)):
        for name in ("max", "mass", "numerator"):
            assert np.array_equal(t.to_numpy(getattr(got, name)),
                                  t.to_numpy(getattr(s, name))), (
                f"merge with the empty summary changed {name}"
            )
    both = sk.merge(empty, empty, backend=backend)
    assert np.all(t.to_numpy(both.max) == -np.inf) and np.all(t.to_numpy(both.mass) == 0)
    assert np.all(t.to_numpy(both.numerator) == 0), "merging two empty summaries"
