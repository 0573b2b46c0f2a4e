"""The benchmark scripts run, and the references they check results against are right (small
CPU configurations; the timings themselves are never asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def grid():
    module = _load("attention_grid")
    module.DEVICE[0] = "cpu"
    return module


@pytest.mark.parametrize("feature", ["plain", "causal", "gqa", "window", "mask", "softcap"])
@pytest.mark.parametrize("dims", [(16, 16), (24, 8)])
def test_attention_grid_reference_is_the_definition(grid, feature, dims):
    """The grid's float64 reference against the reference backend's attention."""
    import softmaxkit as sk

    case = grid.Case(dims[0], dims[1], "float32", feature)
    t = grid.inputs(case, 2, 8, 300, seed=3)
    q, k, v = (t[n].double() for n in ("q", "k", "v"))
    want = sk.attention(q.numpy(), k.numpy(), v.numpy(), backend="reference",
                        **{n: (a.numpy() if n == "mask" else a)
                           for n, a in grid.sk_kwargs(case, t).items()})
    got = grid.reference(case, q, k, v, t["mask"])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


def test_attention_grid_runs_and_checks(grid, capsys):
    status = grid.main(["--device", "cpu", "--dims", "16", "24/8", "--dtypes", "float32",
                        "--features", "plain", "window", "--feature-dims", "16",
                        "--length", "256", "--batch", "1", "--heads", "4"])
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "float32" in line]
    assert len(rows) == 3  # 16 and 24/8 plain, 16 window
    assert all(float(r.split("|")[5]) < grid.BOUNDS["float32"] for r in rows)


@pytest.fixture(scope="module")
def decode():
    return _load("decode")


def test_decode_reference_is_grouped_attention(decode):
    """The decode benchmark's float64 reference against the reference backend's attention,
    over more sequences than it takes at a time."""
    import softmaxkit as sk

    g = torch.Generator().manual_seed(4)
    q = torch.randn(6, 8, 1, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(6, 2, 40, 16, generator=g, dtype=torch.float64) for _ in range(2))
    want = sk.attention(q.numpy(), k.numpy(), v.numpy(), backend="reference")
    np.testing.assert_allclose(decode.reference(q, k, v).numpy(), want, rtol=1e-12,
                               atol=1e-12)


def test_decode_pages_hold_each_key_where_the_table_says(decode):
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(3, 2, 48, 8, generator=g) for _ in range(2))
    k_pages, v_pages, table = decode.paged(k, v, page_size=16, seed=1)
    assert table.dtype == torch.int32 and sorted(table.reshape(-1).tolist()) == list(range(9))
    for b in range(3):
        for p in range(48):
            page, slot = int(table[b, p // 16]), p % 16
            assert torch.equal(k_pages[page, :, slot], k[b, :, p])
            assert torch.equal(v_pages[page, :, slot], v[b, :, p])


def test_varlen_check_measures_the_error_against_float64():
    """The varlen benchmark's check on the CPU: softmaxkit's bfloat16 results are within the
    bound, and float16's (three more mantissa bits) is smaller: it measures the rounding,
    not a constant."""
    varlen = _load("varlen")
    err = varlen.check("bfloat16", 64, True, device="cpu")
    assert 1e-4 < err <= varlen.BOUNDS["bfloat16"]
    assert varlen.check("float16", 32, False, device="cpu") < err


def test_varlen_padded_batch_holds_each_sequence():
    """The varlen benchmark's padded peer: each sequence's rows of the padded batch's
    attention (top-left causal, the padding keys past the diagonal) are the packed call's
    (float64 on the CPU), and its gradient call runs."""
    import torch

    import softmaxkit as sk

    varlen = _load("varlen")
    lens = [5, 9, 1]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(sum(lens), 2, 8, generator=g, dtype=torch.float64)
                     for _ in range(4))
    forward, backward = varlen.padded_calls(q, k, v, dout, lens, True)
    out, _ = forward()
    cu = torch.tensor([0, 5, 14, 15])
    packed = sk.varlen_attention(q, k, v, cu, cu, causal="top_left")
    for b, n in enumerate(lens):
        torch.testing.assert_close(out[b, :, :n].transpose(0, 1), packed[cu[b]:cu[b] + n])
    assert all(tuple(g.shape) == (3, 2, 9, 8) for g in backward())


def test_attention_calls_runs_and_checks(capsys):
    """The host-cost benchmark checks softmaxkit against torch in float64 before it times,
    and prints a row per head dim and kind of call."""
    module = _load("attention_calls")
    status = module.main(["--device", "cpu", "--dims", "16", "--calls", "4"])
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line for line in out.splitlines() if line.strip().startswith("D16")]
    assert len(rows) == 2 and all(float(r.split("error")[1]) <= 1e-5 for r in rows), out
