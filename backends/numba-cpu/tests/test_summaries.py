"""numba-cpu's summary kernels: summarize, merge, normalize, merge_attention and its gradient.

The conformance kit runs them on small inputs (the one-thread loops); the tests below take
the threaded loops (rows cut into pieces, tiles of rows, many rows) with inputs large enough,
and compare with float64 definitions, never with this backend.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from softmaxkit_numba_cpu import summaries
from softmaxkit_numba_cpu.manifest import SUMMARY_OPS

import softmaxkit as sk
from softmaxkit.dispatch import run
from softmaxkit.registry import registry
from softmaxkit.testing import Unsupported, cases
from softmaxkit.testing.summary_cases import check_summary, definition
from softmaxkit.testing.tolerance import assert_within, log_bound, softmax_bound

NAME = "numba-cpu"
OPS = SUMMARY_OPS
# the cases of the operations and dtypes the backend declares (every one: 16-bit merge included)
_BACKEND = registry()[NAME]
CASES = [c for t in ("numpy", "torch-cpu") for c in cases(target=t, ops=OPS)
         if all(op in OPS and _BACKEND.serves_key(op, "cpu", c.dtype) for op in c.ops)]
THREADED = numba.get_num_threads() > 1


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.target.name}-{c}")
def test_kit_case(case):
    try:
        case.run(NAME)
    except Unsupported as exc:  # pragma: no cover - a failure, with the reason
        pytest.fail(f"numba-cpu declined a case it serves: {exc}")


def _numpy_target():
    from softmaxkit.testing.kit import target

    return target("numpy")


def _long_rows(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows that take every path of the one-pass loop, as float32."""
    rng = np.random.default_rng(60)
    x = rng.normal(scale=4.0, size=(5, n))
    x[0] = np.linspace(-60.0, 60.0, n)  # the maximum rises in every block: rescaled each time
    x[1, :5000] = -np.inf               # a NaN among leading -inf logits, then ordinary ones
    x[1, 1234] = np.nan
    x[2, -3] = np.inf                   # an allowed +inf at the very end
    x[4, : n // 2] += 30.0              # the maximum early, tiny terms later
    where = rng.random((5, n)) < 0.9
    where[1, :5000] = True
    where[2, -3] = True
    return x.astype(np.float32), where


@pytest.mark.parametrize("rows", [1, 5])
def test_summarize_threaded_pieces_and_rows(rows):
    n = (1 << 18) + 7
    x, where = _long_rows(n)
    x, where = x[:rows], where[:rows]
    assert summaries._pieces(rows, n) == (2 if rows == 1 and THREADED else 1)
    t = _numpy_target()
    x64 = x.astype(np.float64)
    got = sk.summarize(x, where=where, backend=NAME)
    regular = [i for i in (0, 3, 4) if i < rows]
    check_summary(t, "float32", sk.Summary(got.max[regular], got.mass[regular]),
                  definition(x64[regular], where[regular], None), "threaded summarize")
    if rows > 1:
        assert np.isnan(got.max[1]) and np.isnan(got.mass[1]), "NaN after leading -inf"
        assert got.max[2] == np.inf and np.isnan(got.mass[2]), "+inf row"
    # with values, on a shorter row (still cut in pieces when alone)
    v = np.random.default_rng(61).normal(size=(rows, 1 << 18, 3)).astype(np.float32)
    xs, ws, v = x[regular, : 1 << 18], where[regular, : 1 << 18], v[: len(regular)]
    got = sk.summarize(xs, where=ws, values=v, backend=NAME)
    check_summary(t, "float32", got, definition(xs.astype(np.float64), ws, v.astype(np.float64)),
                  "threaded summarize with values")


def test_one_row_summary_merges_its_pieces_exactly_at_special_values():
    n = 1 << 18
    for special, field in ((np.nan, "nan"), (np.inf, "inf"), (-np.inf, "empty")):
        x = np.full((1, n), -np.inf, dtype=np.float32) if field == "empty" else \
            np.random.default_rng(62).normal(size=(1, n)).astype(np.float32)
        x[0, n - 10] = special  # in the last piece only
        got = sk.summarize(x, backend=NAME)
        if field == "nan":
            assert np.isnan(got.max[0]) and np.isnan(got.mass[0])
        elif field == "inf":
            assert got.max[0] == np.inf and np.isnan(got.mass[0])
        else:
            assert got.max[0] == -np.inf and got.mass[0] == 0


def _normalize(x, where, maxes, masses, log, masked="zero"):
    return run("normalize", np, x, NAME, x=x, where=where, maxes=maxes, masses=masses,
               log=log, masked=masked, out_dtype=x.dtype)


@pytest.mark.parametrize("log", [False, True])
def test_normalize_threaded_tiles_against_the_row_softmax(log):
    rng = np.random.default_rng(63)
    n = (1 << 17) + 3  # several tiles per row, the last one short
    x = (rng.normal(scale=5.0, size=(3, n))).astype(np.float32)
    where = rng.random((3, n)) < 0.8
    where[2] = False  # an empty row
    half = n // 2
    # the row's summary from the summaries of its two halves, merged
    s = sk.merge(sk.summarize(x[:, :half], where=where[:, :half], backend=NAME),
                 sk.summarize(x[:, half:], where=where[:, half:], backend=NAME), backend=NAME)
    got = np.concatenate([_normalize(x[:, :half], where[:, :half], s.max, s.mass, log),
                          _normalize(x[:, half:], where[:, half:], s.max, s.mass, log)], axis=1)
    ref = sk.log_softmax if log else sk.softmax
    x64 = x.astype(np.float64)
    expected = ref(x64, axis=-1, where=where, backend="reference")
    bound = (log_bound(expected, n, "float32") if log else
             softmax_bound(expected, np.where(where, x64, -np.inf), n, "float32"))
    assert_within(got, expected, bound, f"threaded normalize log={log}")


def test_normalize_rejects_an_uncovered_tile_in_the_threaded_loop():
    x = np.random.default_rng(64).normal(size=(2, 1 << 17)).astype(np.float32)
    maxes = x.max(axis=-1)
    masses = np.exp(x - maxes[:, None]).sum(-1).astype(np.float32)
    x[1, 70_000] = maxes[1] + 1.0  # inside a middle tile of the second row
    for log in (False, True):
        with pytest.raises(ValueError, match="do not cover"):
            _normalize(x, None, maxes, masses, log)


def test_merge_many_rows_threaded():
    rng = np.random.default_rng(65)
    s, r, dv = 3, 6000, 4
    maxes = rng.normal(scale=10.0, size=(s, r))
    masses = rng.uniform(1.0, 50.0, size=(s, r))
    nums = rng.normal(size=(s, r, dv))
    maxes[1, :100], masses[1, :100], nums[1, :100] = -np.inf, 0.0, 0.0  # empty parts
    maxes[:, 100:110], masses[:, 100:110], nums[:, 100:110] = -np.inf, 0.0, 0.0  # all empty
    maxes[0, 200], masses[0, 200] = np.nan, np.nan
    parts = [sk.Summary(maxes[i].astype(np.float32), masses[i].astype(np.float32),
                        nums[i].astype(np.float32)) for i in range(s)]
    got = sk.merge(*parts, backend=NAME)
    f64 = [sk.Summary(p.max.astype(np.float64), p.mass.astype(np.float64),
                      p.numerator.astype(np.float64)) for p in parts]
    expected = sk.merge(*f64, backend="reference")
    assert got.max.dtype == np.float32
    np.testing.assert_array_equal(got.max, expected.max.astype(np.float32))
    assert np.isnan(got.mass[200]) and np.all(np.isnan(got.numerator[200]))
    fine = np.ones(r, bool)
    fine[200] = False
    np.testing.assert_allclose(got.mass[fine], expected.mass[fine], rtol=1e-6, atol=0)
    scale = sum(np.abs(p.numerator) * np.exp(np.where(
        np.isfinite(p.max), p.max - np.where(np.isfinite(expected.max), expected.max, 0), -np.inf
    ))[..., None] for p in f64)
    assert np.all(np.abs(got.numerator - expected.numerator)[fine] <= 1e-6 * scale[fine])
    assert np.all(got.mass[100:110] == 0) and np.all(got.max[100:110] == -np.inf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_attention_and_gradient_threaded(dtype):
    rng = np.random.default_rng(66)
    s, r, dv = 3, 3000, 8
    outs64 = rng.normal(size=(s, r, dv))
    lses64 = rng.normal(scale=3.0, size=(s, r))
    lses64[1, :50] = -np.inf
    lses64[:, 50:60] = -np.inf
    outs = torch.from_numpy(outs64).to(dtype)
    lses = torch.from_numpy(lses64).float()
    outs64 = outs.double().numpy()
    lses64 = lses.double().numpy()
    out, lse = sk.merge_attention_states(outs, lses, backend=NAME)
    assert out.dtype == dtype and lse.dtype == torch.float32
    e_out, e_lse = sk.merge_attention_states(outs64, lses64, backend="reference")
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    np.testing.assert_allclose(lse.numpy(), e_lse, rtol=0, atol=1e-5)
    assert np.all(np.abs(out.double().numpy() - e_out) <= 2 * u * (np.abs(e_out) + 1) + 1e-6)
    assert np.all(out[50:60].double().numpy() == 0) and np.all(lse[50:60].numpy() == -np.inf)
    dout64 = rng.normal(size=(r, dv))
    dlse64 = rng.normal(size=r)
    dout = torch.from_numpy(dout64).to(dtype)
    douts, dlses = sk.merge_attention_vjp(outs, lses, dout, torch.from_numpy(dlse64).float(),
                                          backend=NAME)
    e_douts, e_dlses = sk.merge_attention_vjp(outs64, lses64, dout.double().numpy(), dlse64,
                                              backend="reference")
    assert douts.dtype == dtype and dlses.dtype == torch.float32
    assert np.all(np.abs(douts.double().numpy() - e_douts) <= 2 * u * np.abs(e_douts) + 1e-6)
    np.testing.assert_allclose(dlses.numpy(), e_dlses, rtol=1e-4, atol=1e-5)
    assert np.all(douts[1, :50].double().numpy() == 0) and np.all(dlses[1, :50].numpy() == 0)


def test_chosen_by_default_and_by_the_dask_backend_for_numpy_chunks():
    da = pytest.importorskip("dask.array")
    import dask

    x = np.random.default_rng(67).normal(size=(2, 64)).astype(np.float32)
    with sk.backend_opts(trace=True) as trace:
        sk.summarize(x)
    assert trace[-1].backend == NAME
    xd = da.from_array(x, chunks=(2, 16))
    with dask.config.set(scheduler="synchronous"), sk.backend_opts(trace=True) as trace:
        got = sk.softmax(xd, axis=-1).compute()
    chunk_ops = {(t.op, t.backend) for t in trace if t.backend != "dask"}
    assert chunk_ops == {("summarize", NAME), ("normalize", NAME)}
    x64 = x.astype(np.float64)
    expected = sk.softmax(x64, axis=-1, backend="reference")
    assert_within(got, expected, softmax_bound(expected, x64, 64, "float32"), "dask softmax")
