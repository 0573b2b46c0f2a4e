"""The call-cost benchmark: its checks reject wrong results, and ``bench --calls`` runs."""

from __future__ import annotations

import numpy as np

from softmaxkit import callcost
from softmaxkit.cli import main


def test_the_check_accepts_the_reference_and_rejects_wrong_or_unwritten_results():
    x, target = callcost._inputs((4, 16), seed=3)
    x64 = x.astype(np.float64)
    for op in callcost.OPS:
        expected = callcost._reference(op, x64, target)
        assert callcost._check(expected, expected, x64, "float32") == ""
        wrong = tuple(e + 0.01 for e in expected)
        assert "wrong" in callcost._check(wrong, expected, x64, "float32")
        poisoned = tuple(np.full_like(e, np.nan) for e in expected)
        assert "wrong" in callcost._check(poisoned, expected, x64, "float32")


def test_the_cross_entropy_reference_is_the_mean_loss_and_its_gradient():
    x = np.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    loss, grad = callcost._reference("cross_entropy", x, np.array([0, 2]))
    p = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    assert np.isclose(loss, -(np.log(p[0, 0]) + np.log(p[1, 2])) / 2)
    assert np.allclose(grad, (p - np.eye(3)[[0, 2]]) / 2)


def test_bench_calls_prints_the_default_dispatch_next_to_the_peers(tmp_path, capsys):
    log = tmp_path / "calls.log"
    code = main(["bench", "--calls", "--ops", "softmax", "cross_entropy", "--dtype", "float32",
                 "--shapes", "8", "--repeats", "1", "--log", str(log)])
    out = capsys.readouterr().out
    assert code == 0
    short = out.rsplit("scipy", 1)[0]
    assert "default" in short and "torch" in out and "scipy" in out
    assert "sk:reference" in log.read_text()
    assert "not timed" not in log.read_text()
    # JAX arrays beside them, timed against jax.nn: each row's input, contender and a time
    rows = [line.split() for line in log.read_text().splitlines()]
    jax_rows = {(r[0], r[4]) for r in rows
                if len(r) > 5 and r[3] == "jax" and r[5].replace(".", "", 1).isdigit()}
    assert {("softmax", "default"), ("softmax", "jax"), ("cross_ent+grad", "default"),
            ("cross_ent+grad", "jax")} <= jax_rows
