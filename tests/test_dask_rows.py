"""The Dask backend's row operations against the single-machine reference, on the threaded
scheduler: the conformance kit on chunked arrays, random chunkings with special values and
fully masked chunks, dispatch of each chunk to the chunk's backend, and any-axis calls."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
import dask  # noqa: E402

import softmaxkit as sk  # noqa: E402
from softmaxkit.testing import Unsupported, cases  # noqa: E402
from softmaxkit.testing.chunked import dask_target, random_rows  # noqa: E402
from softmaxkit.testing.tolerance import TOLERANCES  # noqa: E402

ROW_OPS = ("softmax", "log_softmax", "logsumexp")


@pytest.fixture(autouse=True)
def _threads():
    with dask.config.set(scheduler="threads"):
        yield


def kit_cases():
    for c in cases(dask_target(3), ops=ROW_OPS):
        yield pytest.param(c, id=f"dask-{c}")


@pytest.mark.parametrize("case", list(kit_cases()))
def test_conformance_kit_on_chunked_arrays(case):
    """Every row case of the kit, with the chunks computed by the reference backend, so that
    what is checked is the chunking and merging (the fast backends pass the kit on their own)."""
    try:
        with dask.config.set(scheduler="synchronous"), sk.backend_opts(prioritize="reference"):
            case.run("dask")
    except Unsupported as exc:
        if set(case.ops) <= set(ROW_OPS):
            raise AssertionError(f"the dask backend declined a row case: {exc}") from None
        pytest.skip(str(exc))


def assert_as_accurate(got, truth, single, dtype: str, what: str) -> None:
    """``got`` has the NaN and infinities of the float64 ``truth``, and each finite value is
    within the spec's bound of it or at most twice as far as the single-machine result."""
    got, truth, single = (np.asarray(a, dtype=np.float64) for a in (got, truth, single))
    assert got.shape == truth.shape, what
    assert np.array_equal(np.isnan(got), np.isnan(truth)), f"{what}: NaN positions differ"
    inf = np.isinf(truth)
    assert np.array_equal(got[inf], truth[inf]), f"{what}: infinities differ"
    fin = np.isfinite(truth)
    assert np.all(np.isfinite(got[fin])), f"{what}: non-finite where finite expected"
    rtol, atol = TOLERANCES[dtype]
    err = np.abs(got[fin] - truth[fin])
    bound = atol + rtol * np.abs(truth[fin]) + 2 * np.abs(single[fin] - truth[fin])
    assert np.all(err <= bound), f"{what}: worst excess {np.max(err - bound):.3g}"


def _f64(a):
    return None if a is None else a.astype(np.float64)


@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_normalizations_match_single_machine(seed, op):
    p = random_rows(seed)
    x, where, _ = p.dask()
    f = getattr(sk, op)
    for masked in ("zero", "nan"):
        got = f(x, axis=-1, where=where, masked=masked)
        assert isinstance(got, da.Array) and got.chunks == x.chunks
        truth = f(_f64(p.x), axis=-1, where=p.where, masked=masked, backend="reference")
        single = f(p.x, axis=-1, where=p.where, masked=masked, backend="reference")
        out = got.compute()
        assert out.dtype == p.x.dtype
        assert_as_accurate(out, truth, single, str(p.x.dtype), f"{op} masked={masked}")


@pytest.mark.parametrize("seed", range(24))
def test_logsumexp_matches_single_machine(seed):
    p = random_rows(seed)
    x, where, b = p.dask()
    dtype = str(np.result_type(p.x.dtype, p.b.dtype)) if p.b is not None else str(p.x.dtype)
    for return_sign in (False, True):
        got = sk.logsumexp(x, axis=-1, b=b, where=where, return_sign=return_sign)
        truth = sk.logsumexp(_f64(p.x), axis=-1, b=_f64(p.b), where=p.where,
                             return_sign=return_sign, backend="reference")
        single = sk.logsumexp(p.x, axis=-1, b=p.b, where=p.where, return_sign=return_sign,
                              backend="reference")
        names = ("lse", "sign") if return_sign else ("lse",)
        if not return_sign:
            got, truth, single = (got,), (truth,), (single,)
        for g, t, s, name in zip(dask.compute(*got), truth, single, names, strict=True):
            assert str(g.dtype) == dtype
            assert_as_accurate(g, t, s, dtype, f"logsumexp {name} return_sign={return_sign}")


def test_every_chunk_masked_but_one_and_row_of_one_element_chunks():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(3, 64)) * 10 + 500
    w = np.zeros_like(x, dtype=bool)
    w[0, 40:44] = True  # one chunk of sixteen allowed
    w[1, 63] = True  # the last element only
    xd = da.from_array(x, chunks=(3, 1))  # 64 chunks of one element
    wd = da.from_array(w, chunks=(3, 16))
    for op in ("softmax", "log_softmax"):
        got = getattr(sk, op)(xd, axis=-1, where=wd).compute()
        expected = getattr(sk, op)(x, axis=-1, where=w, backend="reference")
        np.testing.assert_allclose(got, expected, rtol=1e-13, atol=0)
    got = sk.logsumexp(xd, axis=-1, where=wd).compute()
    np.testing.assert_allclose(got, sk.logsumexp(x, axis=-1, where=w, backend="reference"),
                               rtol=1e-14)
    assert got[2] == -np.inf


def test_any_axis_and_keepdims_through_the_frontend():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 5, 8))
    xd = da.from_array(x, chunks=(2, 5, 3))
    for axis in (0, 1, (0, 2), None):
        got = sk.softmax(xd, axis=axis).compute()
        np.testing.assert_allclose(got, sk.softmax(x, axis=axis, backend="reference"),
                                   rtol=1e-13, atol=1e-16)
        got = sk.logsumexp(xd, axis=axis, keepdims=True).compute()
        np.testing.assert_allclose(
            got, sk.logsumexp(x, axis=axis, keepdims=True, backend="reference"), rtol=1e-14
        )


def test_the_dask_backend_runs_and_each_chunk_goes_to_a_chunk_backend():
    x = da.from_array(np.linspace(-3.0, 3.0, 40, dtype=np.float32), chunks=10)
    with dask.config.set(scheduler="synchronous"), sk.backend_opts(trace=True) as trace:
        sk.softmax(x).compute()
        sk.logsumexp(x).compute()
    top = [r for r in trace if r.backend == "dask"]
    assert [r.op for r in top] == ["softmax", "logsumexp"]
    per_chunk = [r for r in trace if r.backend != "dask"]
    # four chunks: a summary and a normalization each for softmax, one log-sum-exp each for
    # logsumexp (a summary without a summarize kernel is a log-sum-exp of the shifted chunk,
    # a normalization without a normalize kernel a rescaled softmax)
    summaries = [r for r in per_chunk if r.op in ("summarize", "logsumexp")]
    assert len(summaries) == 8
    assert sum(r.op in ("normalize", "softmax") for r in per_chunk) == 4
    assert all(r.device == "cpu" and r.dtype == "float32" for r in per_chunk)


def test_results_stay_lazy_until_computed():
    calls = []

    def load(block):
        calls.append(1)
        return block

    x = da.from_array(np.arange(12.0), chunks=4).map_blocks(load, meta=np.empty(0))
    p = sk.softmax(x)
    lse = sk.logsumexp(x)
    assert calls == [] and isinstance(p, da.Array) and isinstance(lse, da.Array)


def test_can_run_declines_other_arrays_and_the_manifest_imports_no_dask():
    from softmaxkit.chunked import can_run
    from softmaxkit.ops import Call

    call = Call("softmax", None, "cpu", "float64", {"x": np.zeros(3)})
    assert can_run(call) == "serves Dask arrays only"
    assert can_run(Call("softmax", None, "cpu", "float64", {"x": da.zeros(3)})) is True
    code = ("import sys, softmaxkit as sk, numpy as np; sk.backends(); "
            "sk.softmax(np.zeros(3)); print('dask' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_scaling_page_examples_run():
    import doctest
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "scaling.md"
    result = doctest.testfile(str(page), module_relative=False,
                              optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted and result.failed == 0


def test_the_threaded_scheduler_runs_each_chunk_under_the_options_of_compute():
    """Dask's threads run the tasks in the context of ``compute()``: its options choose (and
    trace) every chunk's backend."""
    x = da.from_array(np.linspace(-3.0, 3.0, 40, dtype=np.float32), chunks=10)
    with dask.config.set(scheduler="threads"), sk.backend_opts(
            disable="numba-cpu", trace=True) as trace:
        got = sk.softmax(x).compute()
    per_chunk = [r for r in trace if r.backend != "dask"]
    assert len(per_chunk) == 8 and {r.backend for r in per_chunk} == {"reference"}
    np.testing.assert_allclose(got, sk.softmax(np.asarray(x), backend="reference"), rtol=1e-6)
