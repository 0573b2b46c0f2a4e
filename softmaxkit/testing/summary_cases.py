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

from ..dtypes import accumulator_name
from .kit import Target, case
from .tolerance import assert_within, log_bound, softmax_bound

SUMMARY_RTOL = {"float32": 1e-5, "float64": 1e-12}
"""Accumulator dtype -> relative bound of mass and numerator (spec "Summaries")."""


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
    acc = accumulator_name(dtype)
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
    atol = SUMMARY_RTOL[accumulator_name(dtype)] * 10
    assert np.allclose(lse[fin], expected[fin], rtol=0, atol=atol), (
        "Summary.logsumexp differs from the definition"
    )
    avg = t.to_numpy(sk.summarize(x, where=w, values=v, backend=backend).normalized())
    _, _, num, scale = definition(x64, where, v64)
    e_avg = num / np.where(fin, mass, 1.0)[..., None]
    assert np.all(avg[~fin] == 0), "Summary.normalized of an empty summary is not 0"
    rtol = SUMMARY_RTOL[accumulator_name(dtype)]
    bound = rtol * 2 * (scale / np.where(fin, mass, 1.0)[..., None])
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
    acc = accumulator_name(dtype)
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


UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
"""16-bit dtype -> its unit roundoff: the error of rounding a merged field once."""

SUBNORMAL_ROUNDING = {"float16": 2.0**-25, "bfloat16": 2.0**-134}
"""16-bit dtype -> half its smallest subnormal: the absolute error of rounding a tiny field."""


@case("merge", dtypes=("float16", "bfloat16"))
def case_merge_of_16bit_summaries(t: Target, dtype: str, backend: str) -> None:
    """Summaries a caller holds in a 16-bit dtype: the merge is keyed by that dtype, returns
    it, and accumulates in float32, so each merged field is rounded once."""
    from ..reference import summary as ref_summary

    rng = np.random.default_rng(44)
    n_parts, n_rows, width, dv = 4, 6, 8, 3
    maxes, masses, nums = [], [], []
    for p in range(n_parts):
        x64 = rng.normal(scale=5.0, size=(n_rows, width))
        x64[5] += 12.0 * p  # far-apart maxima: the lower parts' factors underflow
        v64 = rng.normal(size=(n_rows, width, dv))
        e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
        maxes.append(x64.max(axis=-1))
        masses.append(e.sum(axis=-1))
        nums.append(np.einsum("rn,rnd->rd", e, v64))
    m64, mass64, num64 = np.stack(maxes), np.stack(masses), np.stack(nums)
    m64[1, 1], mass64[1, 1], num64[1, 1] = -np.inf, 0.0, 0.0  # an empty part
    m64[:, 2], mass64[:, 2], num64[:, 2] = -np.inf, 0.0, 0.0  # every part empty
    m64[2, 3], mass64[2, 3], num64[2, 3] = np.nan, np.nan, np.nan  # an allowed NaN
    m64[0, 4], mass64[0, 4], num64[0, 4] = np.inf, np.nan, np.nan  # an allowed +inf
    parts = [sk.Summary(t.asarray(m64[p], dtype), t.asarray(mass64[p], dtype),
                        t.asarray(num64[p], dtype)) for p in range(n_parts)]
    # the float64 merge of the fields as the dtype represents them, and of their magnitudes
    xp64 = _numpy_namespace()
    held = [np.stack([t.to_numpy(getattr(s, f)) for s in parts])
            for f in ("max", "mass", "numerator")]
    with np.errstate(invalid="ignore"):
        e_m, e_mass, e_num = ref_summary.merge(xp64, maxes=held[0], masses=held[1],
                                               numerators=held[2])
        _, s_mass, s_num = ref_summary.merge(xp64, maxes=held[0], masses=np.abs(held[1]),
                                             numerators=np.abs(held[2]))
    got = sk.merge(*parts, backend=backend)
    u, tiny = UNIT_ROUNDOFF[dtype], SUBNORMAL_ROUNDING[dtype]
    for name, field, e, scale in (("max", got.max, e_m, None),
                                  ("mass", got.mass, e_mass, s_mass),
                                  ("numerator", got.numerator, e_num, s_num)):
        field_dtype = str(getattr(field.dtype, "name", field.dtype)).rsplit(".", 1)[-1]
        assert field_dtype == dtype, f"merge [{dtype}]: {name} has dtype {field_dtype}"
        g = t.to_numpy(field)
        assert g.shape == e.shape, f"merge [{dtype}]: {name} shape {g.shape} != {e.shape}"
        assert np.array_equal(np.isnan(g), np.isnan(e)), (
            f"merge [{dtype}]: {name} NaN at {np.argwhere(np.isnan(g) != np.isnan(e))}")
        fin = np.isfinite(e)
        assert np.array_equal(g[~fin & ~np.isnan(e)], e[~fin & ~np.isnan(e)]), (
            f"merge [{dtype}]: {name} infinities differ")
        if scale is None:
            assert np.array_equal(g[fin], e[fin]), f"merge [{dtype}]: max is not exact"
            continue
        # one rounding to the dtype, after a float32 accumulation (5 parts)
        bound = u * np.abs(e) + SUMMARY_RTOL["float32"] * scale + tiny
        err = np.abs(g - e)
        assert np.all(err[fin] <= bound[fin]), (
            f"merge [{dtype}]: {name} error {np.max(err[fin] / bound[fin]):.3g} x the bound "
            "(a 16-bit running sum rounds once per part)")
    assert np.all(t.to_numpy(got.mass)[2] == 0) and np.all(t.to_numpy(got.numerator)[2] == 0)
    empty = sk.Summary(t.asarray(np.full(n_rows, -np.inf), dtype),
                       t.asarray(np.zeros(n_rows), dtype), t.asarray(np.zeros((n_rows, dv)), dtype))
    alone = sk.merge(parts[0], empty, backend=backend)
    for name in ("max", "mass", "numerator"):
        assert np.array_equal(t.to_numpy(getattr(alone, name)),
                              t.to_numpy(getattr(parts[0], name)), equal_nan=True), (
            f"merge [{dtype}]: the empty summary changed {name}")


# -- normalize: a row's softmax, chunk by chunk, from the row's summary ------------------------


def _normalize(t: Target, x: Any, where: Any, maxes: Any, masses: Any, *, log: bool,
               masked: str, out: str | None, backend: str) -> Any:
    """The ``normalize`` kernel of ``backend`` (strict), called as the chunked backend does."""
    from ..dispatch import run
    from ..dtypes import lookup

    out_dtype = x.dtype if out is None else lookup(t.xp, out)
    return run("normalize", t.xp, x, backend, x=x, where=where, maxes=maxes, masses=masses,
               log=log, masked=masked, out_dtype=out_dtype)


def _special_rows(t: Target, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of every class the row operations distinguish, as the dtype represents them."""
    rng = np.random.default_rng(seed)
    x64 = rng.normal(scale=5.0, size=(7, 40))
    where = rng.random((7, 40)) < 0.8
    where[0] = False                    # empty: nothing allowed
    x64[1, 17] = np.nan                 # NaN row
    where[1, 17] = True
    x64[2, [3, 30]] = np.inf            # +inf row: NaN at its +inf positions in log space
    where[2, [3, 30]] = True
    x64[3, :25] = -np.inf               # -inf logits are excluded like masked positions
    x64[4, [5, 6]] = np.nan, np.inf     # excluded NaN and +inf must not leak
    where[4, [5, 6]] = False
    x64[5, 20:] += 40.0                 # the maximum lies in a late chunk
    x64[6] = -np.inf                    # empty through -inf logits
    return t.to_numpy(t.asarray(x64, dtype)), where


@case("normalize")
def case_normalize_chunks_of_a_row(t: Target, dtype: str, backend: str) -> None:
    from ..reference import rows as ref_rows
    from ..reference import summary as ref_summary

    x64, where = _special_rows(t, dtype, 50)
    xp64 = _numpy_namespace()
    with np.errstate(invalid="ignore", over="ignore"):
        m, mass, _ = ref_summary.summarize(xp64, x=x64, where=where, values=None)
    acc = accumulator_name(dtype)
    maxes, masses = t.asarray(m, acc), t.asarray(mass, acc)  # the max is exact in acc
    bounds = (0, 7, 7, 19, 40)  # a chunk of length 0 among them
    n = x64.shape[-1]
    for log in (False, True):
        for masked in ("zero", "nan"):
            for out in (None, "float64" if dtype == "float32" else "float32"):
                parts = []
                for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                    got = _normalize(t, t.asarray(x64[:, lo:hi], dtype),
                                     t.asarray(where[:, lo:hi], None), maxes, masses,
                                     log=log, masked=masked, out=out, backend=backend)
                    want = dtype if out is None else out
                    got_dtype = str(getattr(got.dtype, "name", got.dtype)).rsplit(".", 1)[-1]
                    assert got_dtype == want, f"normalize wrote {got_dtype}, expected {want}"
                    parts.append(t.to_numpy(got))
                got = np.concatenate(parts, axis=-1)
                op = ref_rows.log_softmax if log else ref_rows.softmax
                with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                    expected = op(xp64, x=x64, where=where, masked=masked,
                                  out_dtype=np.float64)
                xs = np.where(where, x64, -np.inf)
                bound_dtype = dtype if out is None else "float32"
                what = (f"normalize log={log} masked={masked} out={out or dtype} "
                        f"[{dtype}] against the row's {'log_' if log else ''}softmax")
                if log:
                    bound = log_bound(expected, n, bound_dtype)
                else:
                    bound = softmax_bound(expected, xs, n, bound_dtype)
                assert_within(got, expected, bound, what)


@case("normalize")
def case_normalize_rejects_a_summary_that_does_not_cover_x(
    t: Target, dtype: str, backend: str
) -> None:
    from ..reference import summary as ref_summary

    rng = np.random.default_rng(51)
    x64 = t.to_numpy(t.asarray(rng.normal(scale=3.0, size=(3, 16)), dtype))
    xp64 = _numpy_namespace()
    acc = accumulator_name(dtype)
    m, mass, _ = ref_summary.summarize(xp64, x=x64[:, :8], where=None, values=None)
    maxes, masses = t.asarray(m, acc), t.asarray(mass, acc)
    x64[:, 8:] = x64[:, :8].max(axis=-1, keepdims=True) + 1.0  # above the first half's max
    nan64 = x64[:, :8].copy()
    nan64[1, 2] = np.nan
    empty = (t.asarray(np.full(3, -np.inf), acc), t.asarray(np.zeros(3), acc))
    problems = {
        "a logit above the maximum": (x64, (maxes, masses)),
        "an allowed NaN under a finite maximum": (nan64, (maxes, masses)),
        "an allowed logit in a row summarized as empty": (x64[:, :8], empty),
    }
    for what, (xs, (mx, ms)) in problems.items():
        for log in (False, True):
            try:
                _normalize(t, t.asarray(xs, dtype), None, mx, ms, log=log, masked="zero",
                           out=None, backend=backend)
            except ValueError:
                continue
            raise AssertionError(f"normalize log={log} accepted {what}")
    # the same positions excluded by where= are no problem
    where = np.ones(x64.shape, bool)
    where[:, 8:] = False
    got = t.to_numpy(_normalize(t, t.asarray(x64, dtype), t.asarray(where, None), maxes,
                                masses, log=False, masked="zero", out=None, backend=backend))
    assert np.all(got[:, 8:] == 0), "normalize: masked positions must give 0"


def _numpy_namespace() -> Any:
    import array_api_compat.numpy as xp

    return xp
