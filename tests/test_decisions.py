"""The decision cache: a cached decision is the one a fresh dispatch makes, and every way the
decision can change (backend_opts, the environment with reload, registration, a hook that
declines on a declared property) changes it."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import softmaxkit as sk
from softmaxkit import dispatch, registry
from softmaxkit.dtypes import dtype_name
from softmaxkit.ops import Call
from softmaxkit.testing import Unsupported, cases
from softmaxkit.testing.kit import RanNothing

CALLS: dict[str, int] = {}


def _backend(name: str, priority: int = 200, **extra):
    return {
        "name": name,
        "serves": [{"ops": ["softmax"], "devices": ["cpu"], "dtypes": ["float32"]}],
        "kernels": {"softmax": "softmaxkit.reference.rows:softmax"},
        "priority": priority,
        **extra,
    }


def short_rows_only(call) -> bool | str:
    """Accept rows of at most 4 positions; counts its calls."""
    CALLS["short"] = CALLS.get("short", 0) + 1
    n = call.args["x"].shape[-1]
    return True if n <= 4 else f"rows of {n} are too long"


def counted(call) -> bool:
    CALLS["counted"] = CALLS.get("counted", 0) + 1
    return True


@pytest.fixture
def fresh():
    registry.reload()
    CALLS.clear()
    yield
    registry.reload()


def ran_on(x, **kwargs) -> str:
    with sk.backend_opts(trace=True) as trace:
        sk.softmax(x, axis=-1, **kwargs)
    return trace[-1].backend


@pytest.fixture
def compared(monkeypatch):
    """Make every dispatched call also choose afresh, without the cache, and compare: the
    cached decisions, and those a frontend keeps for repeated calls (``Binding``)."""
    seen = {"calls": 0, "hits": 0}

    def checked(op, xp, like, args, backend=None):
        call = Call(op, xp, registry.device_type(like), dtype_name(like.dtype), args)
        _, fresh_kernel = registry.choose(call, backend, cached=False)
        before = len(registry._decisions)
        got_kernel = registry.kernel_for(op, xp, like, args, backend)  # the cached path
        assert got_kernel == fresh_kernel, op
        seen["calls"] += 1
        seen["hits"] += len(registry._decisions) == before
        return got_kernel

    others = {}  # each binding's first call's arguments but x, which a kept call shares

    def checked_bind(op, xp, like, args):
        kernel, binding = registry.bind(op, xp, like, args)
        call = Call(op, xp, registry.device_type(like), dtype_name(like.dtype), args)
        assert kernel == registry.choose(call, cached=False)[1], op
        seen["calls"] += 1
        if binding is not None:
            others[id(binding)] = (binding, {k: v for k, v in args.items() if k != "x"})
        return kernel, binding

    kept = registry.Binding.kernel_for_array

    def checked_binding(binding, x):
        """A kept decision, used again: the kernel a fresh dispatch chooses."""
        kernel = kept(binding, x)
        if kernel is not None:
            args = {"x": x, **others[id(binding)][1]}
            call = Call(binding.op, binding.xp, binding.device, binding.dtype, args)
            assert kernel == registry.choose(call, cached=False)[1], binding.op
            seen["calls"] += 1
            seen["hits"] += 1
        return kernel

    monkeypatch.setattr(dispatch, "kernel_for", checked)
    monkeypatch.setattr(dispatch, "bind", checked_bind)
    monkeypatch.setattr(registry.Binding, "kernel_for_array", checked_binding)
    return seen


@pytest.mark.parametrize("target", ["numpy", "torch-cpu"])
def test_the_cache_decides_as_a_fresh_dispatch_over_the_conformance_kit(target, compared):
    ran = 0
    for case in cases(target):
        try:
            case.run(None)
        except RanNothing:
            pass  # with no backend named the kit counts no check, but the case ran through
        except Unsupported:
            continue
        ran += 1
    assert ran > 50 and compared["calls"] > ran
    assert compared["hits"] > compared["calls"] // 2  # repeated calls are served cached


def test_a_repeated_call_asks_declared_hooks_once(fresh):
    registry.register(_backend("short", can_run=f"{__name__}:short_rows_only",
                               hook_keys=["shapes"]))
    x = np.ones(3, np.float32)
    assert [ran_on(x) for _ in range(5)] == ["short"] * 5
    assert CALLS["short"] == 1


def test_an_undeclared_hook_is_asked_on_every_call(fresh):
    registry.register(_backend("counted", can_run=f"{__name__}:counted"))
    x = np.ones(3, np.float32)
    for _ in range(4):
        assert ran_on(x) == "counted"
    assert CALLS["counted"] == 4
    # an undeclared hook ranked below the winner does not stop the winner being cached
    registry.register(_backend("short", can_run=f"{__name__}:short_rows_only",
                               hook_keys=["shapes"], priority=300))
    for _ in range(3):
        assert ran_on(x) == "short"
    assert CALLS["short"] == 1 and CALLS["counted"] == 4


def test_a_hook_declining_on_a_declared_property_changes_the_decision(fresh):
    registry.register(_backend("short", can_run=f"{__name__}:short_rows_only",
                               hook_keys=["shapes"]))
    short, long = np.ones(4, np.float32), np.ones(8, np.float32)
    default = ran_on(long)
    assert default != "short"
    assert [ran_on(short), ran_on(long), ran_on(short), ran_on(long)] == [
        "short", default, "short", default]
    assert CALLS["short"] == 2  # once per shape


def test_backend_opts_change_the_decision_and_restore_it(fresh):
    x = np.ones(8, np.float32)
    default = ran_on(x)
    assert default == "numba-cpu"
    with sk.backend_opts(prioritize="reference"):
        assert ran_on(x) == "reference"
    assert ran_on(x) == default
    with sk.backend_opts(disable="numba-cpu"):
        assert ran_on(x) == "reference"
        with sk.backend_opts(prioritize="numba-cpu"):
            assert ran_on(x) == "numba-cpu"
        assert ran_on(x) == "reference"
    assert ran_on(x) == default


def test_the_environment_with_reload_changes_the_decision(fresh, monkeypatch):
    x = np.ones(8, np.float32)
    assert ran_on(x) == "numba-cpu"
    monkeypatch.setenv(registry.ENV_PRIORITIZE, "reference")
    assert ran_on(x) == "numba-cpu"  # read at discovery, as documented
    registry.reload()
    assert ran_on(x) == "reference"
    monkeypatch.delenv(registry.ENV_PRIORITIZE)
    monkeypatch.setenv(registry.ENV_BLOCK, "numba-cpu")
    registry.reload()
    assert ran_on(x) == "reference"
    monkeypatch.delenv(registry.ENV_BLOCK)
    registry.reload()
    assert ran_on(x) == "numba-cpu"


def test_registration_and_unregistration_change_the_decision(fresh):
    x = np.ones(8, np.float32)
    assert ran_on(x) == "numba-cpu"
    registry.register(_backend("newcomer", hook_keys=[]))
    assert ran_on(x) == "newcomer"
    registry.unregister("newcomer")
    assert ran_on(x) == "numba-cpu"


def test_the_array_type_dtype_and_options_are_part_of_the_key(fresh):
    x = np.ones(8, np.float32)
    assert ran_on(x) == "numba-cpu"
    # a byte-swapped dtype has the same name, but numba-cpu declines it
    assert ran_on(x.astype(">f4")) == "reference"
    assert ran_on(x) == "numba-cpu"
    # the same values as a torch tensor are another key, decided by the same hooks
    assert ran_on(torch.ones(8)) == "numba-cpu"
    with sk.backend_opts(disable="numba-cpu"):
        assert ran_on(torch.ones(8)) == "reference"


def test_strict_calls_are_cached_and_still_checked(fresh):
    registry.register(_backend("short", can_run=f"{__name__}:short_rows_only",
                               hook_keys=["shapes"], priority=-200))
    short, long = np.ones(4, np.float32), np.ones(8, np.float32)
    for _ in range(3):
        assert ran_on(short, backend="short") == "short"
    assert CALLS["short"] == 1
    for _ in range(2):
        with pytest.raises(sk.NoBackendError, match="too long"):
            sk.softmax(long, backend="short")


def test_trace_and_debug_log_report_a_cached_decision(fresh, caplog):
    x = np.ones(8, np.float32)
    with sk.backend_opts(trace=True) as trace:
        sk.softmax(x)
        sk.softmax(x)
    assert len(trace) == 2
    assert trace[0] == trace[1]
    assert trace[1].backend == "numba-cpu" and "reference" in trace[1].declined
    with caplog.at_level(logging.DEBUG, logger="softmaxkit"):
        sk.softmax(x)
    assert "ran on numba-cpu" in caplog.text


def test_hook_keys_must_name_known_properties():
    with pytest.raises(ValueError, match="hook_keys"):
        registry.Backend.from_manifest(_backend("bad", hook_keys=["shape_of_x"]))
    with pytest.raises(ValueError, match="hook_keys"):
        registry.Backend.from_manifest(_backend("bad", hook_keys="shapes"))


def test_a_backend_names_its_kernel_in_the_call_s_trace_record(fresh):
    from softmaxkit.options import note_kernel

    note_kernel("outside a trace")  # nothing to record into: nothing happens
    x = np.ones(8, np.float32)
    with sk.backend_opts(trace=True) as trace:
        note_kernel("before any call")
        assert trace == []
        sk.softmax(x)
        assert trace[-1].kernel is None  # its backend named no kernel
        note_kernel("sk_example<1>")  # what a backend's kernel does while the call runs
        sk.softmax(x)
    assert [r.kernel for r in trace] == ["sk_example<1>", None]


def test_the_devices_property_tells_devices_of_one_type_apart():
    """A hook that declares ``devices`` (a GPU backend whose kernels differ between compute
    capabilities) gets a decision per device; numpy arrays all live on the CPU."""
    import array_api_strict as xps

    from softmaxkit import decisions

    read = decisions.reader(frozenset({"arrays", "devices"}))
    plain = decisions.reader(frozenset({"arrays"}))
    on_cpu, on_meta = torch.ones(3), torch.ones(3, device="meta")
    assert read({"x": on_cpu}) != read({"x": on_meta})
    assert plain({"x": on_cpu}) == plain({"x": on_meta})
    assert read({"x": on_cpu}) == read({"x": torch.zeros(5)})
    assert read({"x": np.ones(3)}) == plain({"x": np.ones(3)})
    strict = xps.ones(3)
    assert read({"x": strict}) == read({"x": xps.zeros(4)})
    assert strict.device in read({"x": strict})[0]
    hash(read({"x": strict}))
    # a torch tensor's layout flags and device together (the inline reading)
    full = decisions.reader(frozenset({"arrays", "layout", "devices"}))
    assert full({"x": on_cpu}) == ((((torch.Tensor, torch.float32), (torch.strided, False, False)),
                                    on_cpu.device),)
    assert full({"x": on_cpu}) != full({"x": on_meta})


MARKED: list[str] = []


def marked_softmax(xp, *, x, where, masked, out_dtype):
    """The reference softmax, noting that it ran."""
    from softmaxkit.reference.rows import softmax

    MARKED.append("marked")
    return softmax(xp, x=x, where=where, masked=masked, out_dtype=out_dtype)


def _marked(priority: int = 200, **extra):
    return _backend("marked", priority, kernels={"softmax": f"{__name__}:marked_softmax"},
                    **extra)


def test_repeated_plain_calls_follow_every_change_of_the_decision(fresh, caplog):
    """Repeated unmasked calls with no ``backend=`` keep their decision in the frontend
    (``softmaxkit.rows._BOUND``, without trace=): registration, unregistration, backend_opts,
    reload and the DEBUG log each take effect on the next call."""
    from softmaxkit import rows

    x = np.arange(8, dtype=np.float32)
    expected = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    MARKED.clear()

    def marked_runs(calls: int = 3) -> int:
        before = len(MARKED)
        for _ in range(calls):
            np.testing.assert_allclose(sk.softmax(x), expected, rtol=1e-6)
        return len(MARKED) - before

    assert marked_runs() == 0
    assert any(key[0] == "softmax" for key in rows._BOUND)  # kept: the calls above used it
    registry.register(_marked(hook_keys=[]))
    assert marked_runs() == 3
    with sk.backend_opts(disable="marked"):
        assert marked_runs() == 0
    assert marked_runs() == 3
    registry.unregister("marked")
    assert marked_runs() == 0
    registry.register(_marked(priority=-200, hook_keys=[]))
    assert marked_runs() == 0
    with sk.backend_opts(prioritize="marked"):
        assert marked_runs() == 3
    assert marked_runs() == 0
    with caplog.at_level(logging.DEBUG, logger="softmaxkit"):
        sk.softmax(x)
    assert "ran on numba-cpu" in caplog.text  # the DEBUG log reports a kept decision


FORMED: list[str] = []
DECLINE: list[bool] = [False]


def formed_softmax(xp, *, x, where, masked, out_dtype):
    """The reference softmax, noting that the kernel ran; it gives a repeated form."""
    from softmaxkit.reference.rows import softmax

    FORMED.append("kernel")
    return softmax(xp, x=x, where=where, masked=masked, out_dtype=out_dtype)


def _formed_repeat(xp, args):
    """The form of a kind of call: the reference on the new ``x`` and the first call's other
    arguments, or None (the kernel then runs) while ``DECLINE[0]``."""
    from softmaxkit.reference.rows import softmax

    FORMED.append("made")
    others = {k: v for k, v in args.items() if k != "x"}

    def form(x):
        if DECLINE[0]:
            return None
        FORMED.append("form")
        return softmax(xp, x=x, **others)

    return form


formed_softmax.repeat = _formed_repeat  # type: ignore[attr-defined]


def test_a_kernels_repeated_form_serves_the_kept_calls(fresh, monkeypatch):
    """A kernel's ``repeat`` is asked once per binding; the form it gives runs the later calls
    of that kind (each result the spec's), and where it declines the kernel runs."""
    from softmaxkit import rows

    monkeypatch.setattr(rows, "_BOUND", {})
    registry.register(_backend("formed", kernels={"softmax": f"{__name__}:formed_softmax"},
                               hook_keys=[]))
    FORMED.clear()
    rng = np.random.default_rng(5)

    def call() -> None:
        x = (rng.standard_normal(8) * 4).astype(np.float32)
        e = np.exp(x.astype(np.float64) - x.max())
        np.testing.assert_allclose(sk.softmax(x), e / e.sum(), rtol=1e-6)

    for _ in range(3):
        call()
    assert FORMED == ["made", "kernel", "form", "form"]
    DECLINE[0] = True
    try:
        call()
    finally:
        DECLINE[0] = False
    assert FORMED[-1] == "kernel"
    registry.register(_backend("last", priority=-500))  # decide again: a new binding
    FORMED.clear()
    for _ in range(2):
        call()
    assert FORMED == ["made", "kernel", "form"]


def test_a_binding_goes_stale_when_a_declared_property_changes(fresh):
    """A kept decision stands only for calls whose declared properties read the same: a
    sparse tensor of the dense one's shape and dtype is another decision."""
    xp = sk.rows.args.namespace(x=torch.ones(4, 4))
    dense = torch.ones(4, 4)
    args = {"x": dense, "where": None, "masked": "zero", "out_dtype": torch.float32}
    kernel, binding = registry.bind("softmax", xp, dense, args)
    assert binding is not None and binding.kernel_for_array(dense) is kernel
    again = torch.zeros(4, 4)
    assert binding.kernel_for_array(again) is kernel
    assert binding.kernel_for_array(torch.ones(4, 4).to_sparse()) is None
    registry.reload()
    assert binding.kernel_for_array(again) is None  # the registry was reset: decide again
    with sk.backend_opts(trace=True):
        assert registry.bind("softmax", xp, dense, args)[1] is None  # traced: not kept


@pytest.mark.parametrize("x", [np.arange(8, dtype=np.float32), torch.ones(4, 16)],
                         ids=["numpy", "torch"])
def test_repeated_plain_calls_are_served_by_their_binding(fresh, monkeypatch, x):
    """After its first call, each kind of unmasked row call (softmax, log_softmax, logsumexp
    with and without signs) runs on the kept binding's kernel: the rows it passes read as the
    first call's did."""
    from softmaxkit import rows

    monkeypatch.setattr(rows, "_BOUND", {})  # kept by earlier tests: stale after `fresh`
    served = []
    kept = registry.Binding.kernel_for_array

    def counted(binding, x):
        kernel = kept(binding, x)
        served.append(kernel is not None)
        return kernel

    monkeypatch.setattr(registry.Binding, "kernel_for_array", counted)
    calls = (lambda: sk.softmax(x, axis=-1), lambda: sk.log_softmax(x, axis=-1),
             lambda: sk.logsumexp(x, axis=-1), lambda: sk.logsumexp(x, axis=-1, return_sign=True))
    for call in calls:
        for _ in range(3):
            call()
    assert served == [True] * (2 * len(calls))
