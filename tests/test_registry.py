"""The registry: discovery through real entry points, selection, overrides, trace, errors.

The ``loopback`` backend (tests/loopback) is a separate distribution that requirements/test.txt
installs with pip, so these tests see it exactly as a third-party backend is seen: through
``importlib.metadata`` and the ``softmaxkit.backends`` entry point.  Broken plugins are real
distributions too, written into a temporary directory and discovered in a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import threading
from importlib.metadata import distribution

import array_api_compat
import ml_dtypes
import numpy as np
import pytest
import torch

import softmaxkit as sk
from softmaxkit import registry
from softmaxkit.dtypes import dtype_name
from softmaxkit.ops import Call
from softmaxkit.registry import Backend, NoBackendError, choose
from softmaxkit.testing.tolerance import assert_close


def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture
def fresh():
    """Rediscover the backends (and re-read the environment) before and after a test."""
    registry.reload()
    yield
    registry.reload()


@pytest.fixture
def x32() -> np.ndarray:
    return np.random.default_rng(1).normal(scale=3.0, size=(5, 17)).astype(np.float32)


def ran_on(fn, *args, **kwargs) -> str:
    with sk.backend_opts(trace=True) as trace:
        fn(*args, **kwargs)
    assert len(trace) == 1
    return trace[0].backend


def without_loopback(x) -> str:
    """The backend softmax of ``x`` gets when loopback is out of the picture (other backends
    may be installed: first-party ones serve some of these keys)."""
    with sk.backend_opts(disable="loopback"):
        return choose(row_call("softmax", x))[0].name


# -- the loopback distribution, found through its entry point ---------------------------------


def test_loopback_is_a_pip_installed_distribution_found_through_its_entry_point():
    dist = distribution("softmaxkit-loopback")
    eps = [ep for ep in dist.entry_points if ep.group == "softmaxkit.backends"]
    assert [(ep.name, ep.value) for ep in eps] == [
        ("loopback", "softmaxkit_loopback.manifest:manifest")
    ]
    info = sk.backends()["loopback"]
    assert info["source"] == "softmaxkit_loopback.manifest:manifest"
    assert info["operations"] == ["log_softmax", "logsumexp", "softmax"]
    assert info["requires_opt_in"] is True


def row_call(op: str, x) -> Call:
    """The Call the frontend hands the registry for ``op`` on rows ``x`` (no kernel runs)."""
    xp = array_api_compat.array_namespace(x)
    args = {"x": x, "where": None, "masked": "zero", "out_dtype": x.dtype}
    if op == "logsumexp":
        args = {"x": x, "b": None, "where": None, "return_sign": False, "out_dtype": x.dtype}
    elif op == "cross_entropy":
        args = {"logits": x, "index": xp.zeros(x.shape[:-1], dtype=xp.int64), "probs": None,
                "where": None, "ignore_index": None, "label_smoothing": 0.0,
                "grad_scale": None, "out_dtype": x.dtype}
    return Call(op, xp, registry.device_type(x), dtype_name(x.dtype), args)


def test_loopback_never_changes_what_a_normal_call_gets(x32):
    calls = [row_call("softmax", x32), row_call("log_softmax", x32.astype(np.float64)),
             row_call("logsumexp", x32.astype(np.float16))]
    with sk.backend_opts(trace=True) as trace:
        normal = [choose(c)[0].name for c in calls]
    with sk.backend_opts(disable="loopback"):
        assert normal == [choose(c)[0].name for c in calls]
    assert "loopback" not in normal
    assert all("opt-in" in r.declined["loopback"] for r in trace)


def test_prioritized_loopback_is_chosen_by_operation_device_and_dtype(x32):
    with sk.backend_opts(prioritize="loopback", trace=True) as trace:
        y = sk.softmax(x32, axis=-1)  # served: (softmax, cpu, float32)
        lse = sk.logsumexp(x32.astype(np.float64), axis=-1)  # served
        sk.softmax(x32.astype(np.float16), axis=-1)  # served
        elsewhere = [
            choose(row_call("cross_entropy", x32))[0].name,  # operation not served
            choose(row_call("softmax", x32.astype(ml_dtypes.bfloat16)))[0].name,  # dtype
            choose(row_call("softmax", torch.from_numpy(x32)))[0].name,  # can_run declines
        ]
    got = [(r.op, r.dtype, r.backend) for r in trace]
    assert got[:3] == [("softmax", "float32", "loopback"), ("logsumexp", "float64", "loopback"),
                       ("softmax", "float16", "loopback")]
    assert "loopback" not in elsewhere and [r.backend for r in trace[3:]] == elsewhere
    assert trace[3].declined["loopback"] == "does not serve (cross_entropy, cpu, float32)"
    assert got[4][:2] == ("softmax", "bfloat16")
    assert "does not serve" in trace[4].declined["loopback"]
    assert got[5][:2] == ("softmax", "float32")
    assert "numpy arrays" in trace[5].declined["loopback"]
    assert trace[0].declined["reference"] == "ranked below loopback"
    assert_close(y, softmax64(x32), "float32", "softmax")
    x64 = x32.astype(np.float64)
    m = x64.max(-1)
    assert_close(lse, m + np.log(np.exp(x64 - m[:, None]).sum(-1)), "float64", "logsumexp")


def test_a_device_the_backend_does_not_serve_goes_elsewhere(x32):
    xp = array_api_compat.array_namespace(x32)
    args = {"x": x32, "where": None, "masked": "zero", "out_dtype": x32.dtype}
    with sk.backend_opts(prioritize="loopback"):
        on_cpu, _ = choose(Call("softmax", xp, "cpu", "float32", args))
        on_cuda, _ = choose(Call("softmax", xp, "cuda", "float32", args))
    assert on_cpu.name == "loopback"
    assert on_cuda.name != "loopback"


def test_disable_and_nesting(x32):
    default = without_loopback(x32)
    assert default != "loopback"
    with sk.backend_opts(prioritize="loopback"):
        assert ran_on(sk.softmax, x32) == "loopback"
        with sk.backend_opts(disable="loopback"):
            assert ran_on(sk.softmax, x32) == default
            with sk.backend_opts(prioritize=["loopback"]):  # inner wins over outer disable
                assert ran_on(sk.softmax, x32) == "loopback"
        assert ran_on(sk.softmax, x32) == "loopback"
    assert ran_on(sk.softmax, x32) == default
    with sk.backend_opts(prioritize="reference", disable="loopback"):
        assert ran_on(sk.softmax, x32) == "reference"
    with pytest.raises(ValueError, match="reference"):
        sk.backend_opts(disable="reference")
    with pytest.raises(ValueError, match="both"):
        sk.backend_opts(prioritize="loopback", disable="loopback")


def test_backend_opts_as_a_decorator(x32):
    @sk.backend_opts(prioritize="loopback")
    def run(a):
        return ran_on(sk.softmax, a)

    assert run(x32) == "loopback"
    assert ran_on(sk.softmax, x32) == without_loopback(x32)


def test_backend_argument_is_strict(x32):
    # no opt-in needed: naming a backend is the strongest request
    assert ran_on(sk.softmax, x32, backend="loopback") == "loopback"
    assert_close(sk.log_softmax(x32, axis=-1, backend="loopback"),
                 np.log(softmax64(x32)), "float32", "log_softmax")
    with pytest.raises(NoBackendError, match="numpy arrays"):
        sk.softmax(torch.from_numpy(x32), backend="loopback")  # can_run still applies
    with pytest.raises(NoBackendError, match="does not serve cross_entropy"):
        sk.cross_entropy(x32, np.zeros(5, dtype=np.int64), backend="loopback")
    with pytest.raises(NoBackendError, match=r"not installed.*'loopback'.*backend='reference'"):
        sk.softmax(x32, backend="no-such-backend")


def test_should_run_declines_but_an_explicit_backend_skips_it():
    big = np.broadcast_to(np.float32(0), (1 << 23,))  # a view: no memory, never computed
    xp = array_api_compat.array_namespace(big)
    call = Call("softmax", xp, "cpu", "float32",
                {"x": big, "where": None, "masked": "zero", "out_dtype": big.dtype})
    with sk.backend_opts(prioritize="loopback", trace=True) as trace:
        chosen, _ = choose(call)
        named, _ = choose(call, backend="loopback")
    assert chosen.name != "loopback"
    assert "more than loopback's" in trace[0].declined["loopback"]
    assert named.name == "loopback"


def test_environment_variables(fresh, monkeypatch, x32):
    monkeypatch.setenv("SOFTMAXKIT_PRIORITIZE", "not-installed, loopback")
    registry.reload()
    assert ran_on(sk.softmax, x32) == "loopback"
    assert registry.prioritized() == ("not-installed", "loopback")
    with sk.backend_opts(disable="loopback"):  # the context wins over the environment
        assert ran_on(sk.softmax, x32) != "loopback"
    monkeypatch.setenv("SOFTMAXKIT_BLOCK", "loopback")
    monkeypatch.delenv("SOFTMAXKIT_PRIORITIZE")
    registry.reload()
    with sk.backend_opts(prioritize="loopback", trace=True) as trace:
        sk.softmax(x32)  # the context wins over the environment again
        sk.softmax(x32, backend="loopback")  # and backend= over everything
    assert [r.backend for r in trace] == ["loopback", "loopback"]
    with sk.backend_opts(trace=True) as trace:
        sk.softmax(x32)
    assert trace[0].declined["loopback"] == "disabled"


def test_debug_log_says_what_ran_and_why_not_the_others(caplog, x32):
    with caplog.at_level(logging.DEBUG, logger="softmaxkit"):
        with sk.backend_opts(prioritize="loopback"):
            sk.softmax(x32)
        sk.softmax(x32)
    messages = [r.getMessage() for r in caplog.records if r.name == "softmaxkit"]
    assert any("ran on loopback" in m and "reference: ranked below loopback" in m
               for m in messages)
    default = without_loopback(x32)
    assert any(f"ran on {default}" in m and "loopback: requires opt-in" in m for m in messages)


def test_options_are_local_to_threads_and_tasks(x32):
    xp = array_api_compat.array_namespace(x32)
    call = Call("softmax", xp, "cpu", "float32",
                {"x": x32, "where": None, "masked": "zero", "out_dtype": x32.dtype})
    seen = {}

    def worker():
        seen["thread"] = choose(call)[0].name

    with sk.backend_opts(prioritize="loopback"):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        seen["main"] = choose(call)[0].name
    assert seen["main"] == "loopback"
    assert seen["thread"] == without_loopback(x32)

    async def task(prioritize):
        with sk.backend_opts(prioritize=prioritize):
            await asyncio.sleep(0)  # let the other task enter its own block
            await asyncio.sleep(0)
            return choose(call)[0].name

    async def both():
        return await asyncio.gather(task("loopback"), task("reference"))

    assert asyncio.run(both()) == ["loopback", "reference"]


# -- manifests, run-time registration, errors ---------------------------------------------------


GOOD = {
    "name": "scratch",
    "serves": [{"ops": ["softmax"], "devices": ["cpu"], "dtypes": ["float32"]}],
    "kernels": {"softmax": "softmaxkit.reference.rows:softmax"},
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": ""}, "'name'"),
        ({"name": "a,b"}, "'name'"),
        ({"kernels": {"softmax": "no colon"}}, "kernel for softmax"),
        ({"kernels": {"sofmax": "m:f"}}, "unknown operations"),
        ({"serves": [{"ops": "softmax"}]}, "serves ops"),
        ({"serves": ["cpu"]}, "serves"),
        ({"priority": "high"}, "priority"),
        ({"serves": [{"ops": ["softmax"], "priority": "high"}]}, "serves entry's 'priority'"),
        ({"can_run": 3}, "can_run"),
    ],
)
def test_bad_manifests_are_rejected_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        Backend.from_manifest({**GOOD, **change})


def test_a_serves_entry_priority_ranks_its_dtypes_only(fresh, x32):
    kernel = {"softmax": "softmaxkit.reference.rows:softmax"}
    both = {"ops": ["softmax"], "devices": ["cpu"]}
    registry.register({"name": "wide", "kernels": kernel, "priority": 1000,
                       "serves": [{**both, "dtypes": ["float32", "float64"]}]})
    registry.register({"name": "narrow", "kernels": kernel, "priority": 999, "serves": [
        {**both, "dtypes": ["float64"], "priority": 1001},
        {**both, "dtypes": ["float32"]},
    ]})
    try:
        chosen = {dt: choose(row_call("softmax", x32.astype(dt)))[0].name
                  for dt in ("float32", "float64")}
        assert chosen == {"float32": "wide", "float64": "narrow"}
        described = sk.backends()["narrow"]["serves"]
        assert [e.get("priority") for e in described] == [1001, None]
    finally:
        registry.unregister("wide")
        registry.unregister("narrow")


def test_register_before_discovery_and_name_clash(fresh, x32):
    registry.reload()
    done = []
    t = threading.Thread(target=lambda: done.append(registry.register(GOOD)), daemon=True)
    t.start()
    t.join(timeout=30)
    assert done, "register() before discovery did not return"
    assert "scratch" in sk.backends() and "loopback" in sk.backends()
    with sk.backend_opts(trace=True) as trace:
        sk.softmax(x32)
    # priority 0 beats the reference's -100 (other installed backends may rank higher)
    assert "scratch" == trace[0].backend or trace[0].declined["scratch"].startswith("ranked")
    assert "reference" not in [r.backend for r in trace]
    with pytest.warns(sk.BackendWarning, match="replaces"):
        registry.register(GOOD)
    registry.unregister("scratch")
    assert "scratch" not in sk.backends()
    with pytest.raises(ValueError):
        registry.unregister("reference")


def test_no_backend_error_lists_each_backend_and_the_fix(fresh, x32):
    only_cuda = Backend.from_manifest({
        "name": "only-cuda",
        "serves": [{"ops": ["softmax"], "devices": ["cuda"], "dtypes": ["*"]}],
        "kernels": {"softmax": "softmaxkit.reference.rows:softmax"},
        "install_hint": "pip install only-cuda",
    })
    # a registry without the reference, as a source tree with nothing installed can't be
    registry._set_registry({"only-cuda": only_cuda})
    xp = array_api_compat.array_namespace(x32)
    with pytest.raises(NoBackendError) as info:
        choose(Call("softmax", xp, "cpu", "float32", {"x": x32}))
    text = str(info.value)
    assert "only-cuda: does not serve (softmax, cpu, float32)" in text
    assert "pip install only-cuda" in text
    assert "backend='reference'" in text


# -- broken plugins, as real distributions --------------------------------------------------------


BROKEN_MANIFESTS = '''
def raises():
    raise RuntimeError("manifest exploded")

def bad():
    return {"name": "bad", "kernels": {"softmax": "not a path"}}

def _rows(name, **extra):
    return {"name": name, "priority": 50,
            "serves": [{"ops": ["softmax"], "devices": ["cpu"], "dtypes": ["*"]}],
            "kernels": {"softmax": "skbroken.kernels:softmax"}, **extra}

def badkernel():
    return _rows("badkernel")

def badhook():
    return _rows("badhook", can_run="skbroken_missing_hooks:can_run")

def clash():
    return _rows("reference")
'''

ENTRY_POINTS = """\
[softmaxkit.backends]
missing = skbroken_no_such_module:manifest
raises = skbroken.manifests:raises
bad = skbroken.manifests:bad
badkernel = skbroken.manifests:badkernel
badhook = skbroken.manifests:badhook
clash = skbroken.manifests:clash
"""

PROBE = """
import json, warnings

def caught(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    return out, [f"{x.category.__name__}: {x.message}" for x in w]

def first():
    import numpy as np
    import softmaxkit as sk
    from softmaxkit import registry
    return registry._registry is not None

discovered_at_import, at_import = caught(first)
import numpy as np
import softmaxkit as sk
found, at_discovery = caught(sk.backends)
x = np.linspace(-3.0, 3.0, 12).reshape(3, 4)

def calls():
    # the reference after them keeps this process from compiling a fast backend's kernels
    with sk.backend_opts(prioritize=["badkernel", "badhook", "reference"], trace=True) as trace:
        ys = [sk.softmax(x, axis=-1).tolist() for _ in range(2)]
    return ys, [(r.backend, r.declined) for r in trace]

(ys, trace), at_calls = caught(calls)
print(json.dumps({
    "discovered_at_import": discovered_at_import, "at_import": at_import,
    "at_discovery": at_discovery, "found": {k: v["source"] for k, v in found.items()},
    "at_calls": at_calls, "ys": ys, "trace": trace,
}))
"""


def test_broken_plugins_warn_once_and_are_skipped(tmp_path):
    pkg = tmp_path / "skbroken"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "manifests.py").write_text(textwrap.dedent(BROKEN_MANIFESTS))
    (pkg / "kernels.py").write_text("raise ImportError('a dependency is missing')\n")
    info = tmp_path / "skbroken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: skbroken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)

    assert out["at_import"] == [] and out["discovered_at_import"] is False
    # one warning per broken entry point, naming it; the clash keeps the core's reference
    assert len(out["at_discovery"]) == 4, out["at_discovery"]
    assert all(w.startswith("BackendWarning") for w in out["at_discovery"])
    for name, why in [("missing", "No module named"), ("raises", "manifest exploded"),
                      ("bad", "module:qualname"), ("reference", "two softmaxkit backends")]:
        assert any(name in w and why in w for w in out["at_discovery"]), name
    assert out["found"]["reference"] == "softmaxkit.reference:manifest"
    assert {"badkernel", "badhook", "loopback"} <= set(out["found"])
    assert not {"missing", "raises", "bad"} & set(out["found"])

    # a kernel or hook that fails to import: one warning each over two calls, then skipped
    assert len(out["at_calls"]) == 2, out["at_calls"]
    assert any("badkernel" in w and "a dependency is missing" in w for w in out["at_calls"])
    assert any("badhook" in w and "skbroken_missing_hooks" in w for w in out["at_calls"])
    for backend, declined in out["trace"]:
        assert backend == "reference"
        assert "failed to import" in declined["badkernel"]
        assert "failed to import" in declined["badhook"]
    x = np.linspace(-3.0, 3.0, 12).reshape(3, 4)
    for y in out["ys"]:
        assert_close(np.array(y), softmax64(x), "float64", "softmax")


NOTICING = {
    "manifests.py": '''
import warnings
warnings.warn("a dependency's notice", DeprecationWarning)

def manifest():
    warnings.warn("another", PendingDeprecationWarning)
    return {"name": "noticing", "priority": 50,
            "serves": [{"ops": ["softmax"], "devices": ["cpu"], "dtypes": ["*"]}],
            "kernels": {"softmax": "sknotice.kernels:softmax"}}
''',
    "kernels.py": '''
import warnings
warnings.warn("a dependency's notice", DeprecationWarning)
from softmaxkit.reference import rows

def softmax(**kw):
    return rows.softmax(**kw)
''',
}

NOTICING_PROBE = """
import json, warnings
import numpy as np
import softmaxkit as sk
warnings.simplefilter("error")  # as a test suite's -W error
x = np.linspace(-3.0, 3.0, 12).reshape(3, 4)
with sk.backend_opts(prioritize=["noticing", "reference"], trace=True) as trace:
    y = sk.softmax(x, axis=-1)
print(json.dumps({"ran": [r.backend for r in trace], "y": y.tolist()}))
"""


def test_deprecation_notices_of_a_backends_imports_do_not_lose_it(tmp_path):
    """A backend whose manifest and kernel modules warn of deprecations as they import, first
    used under ``warnings.simplefilter("error")``: the notices are ignored as Python's default
    filters ignore them, and the call runs on it (not on the next backend)."""
    pkg = tmp_path / "sknotice"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in NOTICING.items():
        (pkg / name).write_text(textwrap.dedent(text))
    info = tmp_path / "sknotice-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sknotice\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[softmaxkit.backends]\nnoticing = sknotice.manifests:manifest\n")
    proc = subprocess.run([sys.executable, "-c", NOTICING_PROBE], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ran"] == ["noticing"], out
    x = np.linspace(-3.0, 3.0, 12).reshape(3, 4)
    assert_close(np.array(out["y"]), softmax64(x), "float64", "softmax")
