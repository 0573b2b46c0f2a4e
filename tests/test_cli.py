"""The ``softmaxkit`` command: info, verify and bench."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import softmaxkit as sk
from softmaxkit import registry
from softmaxkit.cli import main

# a backend that computes the wrong thing: log-probabilities where probabilities are due
WRONG = {
    "name": "wrong",
    "serves": [{"ops": ["softmax"], "devices": ["cpu"], "dtypes": ["float32", "float64"]}],
    "kernels": {"softmax": "softmaxkit.reference.rows:log_softmax"},
}


@pytest.fixture
def wrong():
    registry.register(WRONG)
    yield "wrong"
    registry.unregister("wrong")


def test_info_prints_backends_and_the_dispatch_table(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "softmaxkit_loopback.manifest:manifest" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  softmax ")]
    cpu32 = next(r for r in rows if r[1:3] == ["cpu", "float32"])
    assert "reference" in " ".join(cpu32) and not cpu32[3].startswith("loopback")
    assert "loopback (opt-in only)" in " ".join(cpu32)
    bf16 = next(r for r in rows if r[1:3] == ["cpu", "bfloat16"])
    assert "loopback" not in " ".join(bf16)
    # the 'numpy runs on' column names the backend a numpy call really gets
    with sk.backend_opts(trace=True) as trace:
        sk.softmax(np.zeros((2, 8), dtype=np.float32), axis=-1)
    header = next(line for line in out.splitlines() if line.startswith("  operation ")
                  and "numpy runs on" in line)
    line = next(line for line in out.splitlines() if line.startswith("  softmax ")
                and line.split()[1:3] == ["cpu", "float32"])
    column = header.index("numpy runs on")
    assert line[column:].split()[0] == trace[0].backend
    for op in sk.ops.OPERATIONS:
        assert any(line.split()[:1] == [op] for line in out.splitlines()), op


def test_info_follows_backend_opts(capsys):
    with sk.backend_opts(prioritize="loopback"):
        assert main(["info", "--op", "softmax", "--device", "cpu", "--dtype", "float32"]) == 0
    row = [line.split() for line in capsys.readouterr().out.splitlines()
           if line.startswith("  softmax ") and line.split()[1] == "cpu"]
    assert len(row) == 1 and row[0][3] == "loopback?,"


def test_info_shows_what_runs_the_arrays_of_each_device_present(capsys):
    assert main(["info", "--op", "softmax", "attention"]) == 0
    out = capsys.readouterr().out
    head = out.split("\nbackends:")[0]
    assert "\ncpu: numpy arrays" in head
    grid = [line.split() for line in head.splitlines() if line.startswith("  softmax ")]
    with sk.backend_opts(trace=True) as trace:
        sk.softmax(np.zeros((2, 8), dtype=np.float32), axis=-1)
    assert grid[0][3] == trace[0].backend  # the float32 column: what a numpy call gets
    import torch

    if not torch.cuda.is_available():
        assert "\ncuda:" not in head and "--all shows every device type" in head
        assert main(["info", "--all", "--op", "softmax"]) == 0
        assert "\ncuda: no device of this type here" in capsys.readouterr().out


def test_verify_loopback_through_the_installed_command():
    script = Path(sys.executable).with_name("softmaxkit")
    assert script.exists(), "the [project.scripts] entry point is not installed"
    proc = subprocess.run([str(script), "verify", "--backend", "loopback"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = [line for line in proc.stdout.splitlines() if line.startswith("loopback:")]
    assert len(summary) == 1 and " 0 failed" in summary[0]
    assert int(summary[0].split()[1]) > 0  # some cases passed
    assert "FAILED" not in proc.stdout


def test_python_dash_m_runs_the_same_command():
    proc = subprocess.run([sys.executable, "-m", "softmaxkit", "verify", "--backend",
                           "loopback", "--target", "array_api_strict", "--ops", "softmax"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    expected = "nothing ran: loopback serves none of these cases on target array_api_strict"
    assert expected in proc.stdout


def test_verify_reports_a_wrong_backend_and_exits_1(wrong, capsys):
    assert main(["verify", "--backend", "wrong", "--ops", "softmax"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "wrong:" in out


def test_verify_in_processes_gives_the_same_results(capsys):
    args = ["verify", "--backend", "numba-cpu", "reference", "--ops", "softmax", "logsumexp"]
    assert main(args) == 0
    alone = capsys.readouterr().out.splitlines()
    assert main([*args, "--jobs", "2"]) == 0
    spread = capsys.readouterr().out.splitlines()
    assert sorted(spread) == sorted(alone)  # the rows in any order, the counts last
    assert spread[-2:] == alone[-2:] and " 0 failed" in alone[-1]


def test_a_dead_worker_fails_its_cases_and_the_rest_go_on():
    from softmaxkit.cli import _kit_in_processes
    from softmaxkit.testing import cases

    selected = cases("numpy", ["softmax"])[:3]
    # a target the workers cannot make: each part raises there, as a crashed worker would
    got = list(_kit_in_processes(["reference"], selected, "no-such-target", ["softmax"], 2))
    assert sorted((r.case, r.dtype) for _, r in got) == sorted(
        (c.name, c.dtype) for c in selected)
    assert all(r.status == "failed" and "worker process failed" in r.message for _, r in got)


def test_verify_rejects_unknown_backend_and_target(capsys):
    assert main(["verify", "--backend", "no-such-backend"]) == 2
    assert main(["verify", "--target", "no-such-target"]) == 2
    err = capsys.readouterr().err
    assert "not installed" in err and "no-such-target" in err
    with pytest.raises(SystemExit):
        main(["verify", "--jobs", "0"])
    assert "'0' is not a positive integer" in capsys.readouterr().err


def test_bench_quick_table_and_plot(tmp_path, capsys):
    png = tmp_path / "bench.png"
    # the reference keeps this test about the bench, not about compiling a fast backend
    with sk.backend_opts(prioritize="reference"):
        assert main(["bench", "--quick", "--no-progress", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for name in ("softmaxkit", "torch", "scipy", "copy", "GB/s", "max err"):
        assert name in out, name
    for op in ("softmax", "log_softmax", "logsumexp"):
        assert any(line.split()[:1] == [op] for line in out.splitlines()), op
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_checks_results_before_timing(wrong, capsys):
    with sk.backend_opts(prioritize="wrong"):
        code = main(["bench", "--ops", "softmax", "--shapes", "8x64", "--no-progress"])
    assert code == 1
    assert "nothing was timed" in capsys.readouterr().err


def test_bench_on_cuda_without_a_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the CUDA path is exercised by the GPU benchmarks")
    assert main(["bench", "--device", "cuda", "--quick"]) == 2
    assert "CUDA device" in capsys.readouterr().err


def test_bench_rejects_a_malformed_shape():
    with pytest.raises(SystemExit) as info:
        main(["bench", "--shapes", "4096"])
    assert info.value.code == 2


def test_bench_counts_bytes_read_and_written():
    from softmaxkit import bench

    with sk.backend_opts(prioritize="reference"):
        result = bench.run(shapes=[(8, 64)], dtypes=["float32", "float64"], repeats=1,
                           progress=False, min_time=0.0)
    for r in result.results:
        if r.note.startswith("TypeError"):  # a peer without this dtype
            continue
        nbytes = 8 * 64 * (4 if r.dtype == "float32" else 8)
        moved = nbytes if r.op == "logsumexp" and r.contender != "copy" else 2 * nbytes
        assert abs(r.gbps * r.seconds * 1e9 - moved) <= 1e-6 * moved, r
        if r.contender != "copy":
            assert r.max_error < (1e-5 if r.dtype == "float32" else 1e-12), r
