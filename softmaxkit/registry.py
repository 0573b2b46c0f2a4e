"""Backends as entry-point plugins, and the choice of a backend for each call.

A backend is a distribution that declares, in its ``pyproject.toml``::

    [project.entry-points."softmaxkit.backends"]
    mybackend = "mybackend.manifest:manifest"

``manifest()`` is cheap (it imports no kernel library) and returns a mapping:

``name``
    the backend's name (str).
``serves``
    a list of ``{"ops": [...], "devices": [...], "dtypes": [...]}`` entries; ``"*"`` in a list
    matches anything.  The backend serves the cross product of each entry.  An entry may
    carry its own ``"priority"`` (an int), which then applies to what it covers: a backend
    that wins some dtypes and loses others to a peer says so there.  An entry may also carry
    ``"precisions"``, the attention ``precision=`` values of the calls it serves (spec
    "Precision"; default: all, computed exactly); the call's precision is then part of the
    key, and only kernels of operations some entry declares precisions for receive the
    ``precision`` argument.
``kernels``
    ``{op: "module:qualname"}``, imported on first use.
``priority``
    an int, higher wins (default 0; the reference backend has -100), or a mapping
    ``{op: int}`` with an optional ``"*"`` default; a ``serves`` entry's own priority
    comes first.
``install_hint``
    what to install when the backend is missing, shown in errors (optional).
``can_run`` / ``should_run``
    optional ``"module:qualname"`` hooks called as ``hook(call)`` with a
    :class:`~softmaxkit.ops.Call`; ``True`` accepts, a string declines and says why.
    ``can_run`` declines what the backend cannot compute; ``should_run`` declines what it
    can compute but would not do well (a tiny input, say).  An explicit ``backend=`` skips
    ``should_run`` but never ``can_run``.
``hook_keys``
    the call properties the hooks look at, a list of names from
    :data:`softmaxkit.decisions.PROPERTIES` (``"arrays"``, ``"shapes"``, ``"out_dtype"``,
    ``"options"``, ``"layout"``, ``"chunks"``); the operation, namespace, device type and
    dtype are always part of the key.  With it the hooks' answers are cached: a later call
    that agrees on those properties reuses the decision without calling the hooks.  A
    backend whose hooks declare nothing has them called on every call (correct by default,
    but slower); keep such hooks cheap.
``requires_opt_in``
    ``True`` for a backend that is never chosen automatically: only when the user
    prioritizes it (:func:`backend_opts` or ``SOFTMAXKIT_PRIORITIZE``) or names it with
    ``backend=`` (optional, default ``False``).

A plugin whose manifest cannot be loaded or is malformed, or whose name is taken, is skipped
with one :class:`BackendWarning`; so is a backend whose kernel or hook fails to import (its
calls go to the next backend).  Discovery happens on the first call, not at import.

Choice per call, first rule that applies: the ``backend=`` argument (strict: it never falls
back) > :func:`softmaxkit.backend_opts` > the environment variables ``SOFTMAXKIT_PRIORITIZE``
and ``SOFTMAXKIT_BLOCK`` (comma-separated names, read when the backends are discovered; call
:func:`reload` after changing them in a running process) > manifest priorities > the reference
backend.  Names of backends that are not installed are ignored there, so portable code may
prioritize a backend that only some machines have.

Decisions are cached (:mod:`softmaxkit.decisions`).  The ordered candidates for each
(operation, device type, dtype, backend_opts) are computed once; the backend and kernel
chosen for a call are kept under a key of the operation, namespace, device type, dtype, the
active ``backend_opts`` and the properties the candidates' hooks declare in ``hook_keys``, so
a repeated call costs one dictionary lookup.  Every registration, unregistration and
:func:`reload` empties the cache; ``backend_opts`` are part of the key; ``trace=`` and the
DEBUG log report the decision, cached or not.  A caller that makes the same kind of call
again may keep the decision itself (:func:`bind`, :class:`Binding`), which checks on each
use that none of these has changed.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import array_api_compat
import numpy as np

from . import decisions
from .arguments import PRECISIONS
from .backend import (  # noqa: F401 - re-exported: the registry's public names
    REFERENCE,
    Backend,
    BackendLoadError,
    BackendWarning,
    NoBackendError,
    _load,
    _warn,
    importing,
    logger,
)
from .dtypes import dtype_name
from .ops import Call
from .options import (  # noqa: F401 - re-exported
    ENV_BLOCK,
    ENV_PRIORITIZE,
    TraceRecord,
    _effective,
    _environment,
    _Options,
    _options,
    backend_opts,
    prioritized,
)

GROUP = "softmaxkit.backends"


_lock = threading.RLock()
_registry: dict[str, Backend] | None = None
_generation = 0  # how many times the decision cache has been emptied (_set_registry)
_unloaded: dict[str, str] = {}  # entry-point name -> why its manifest failed to load


def _discover() -> dict[str, Backend]:
    from importlib.metadata import entry_points  # deferred: it costs import time

    found: dict[str, Backend] = {}
    _unloaded.clear()
    try:
        eps = list(entry_points(group=GROUP))
    except Exception as exc:  # unreadable installed metadata must not break every call
        _warn(f"softmaxkit could not read the installed entry points, so only the "
              f"reference backend is used: {type(exc).__name__}: {exc}")
        eps = []
    for ep in sorted(eps, key=lambda e: (e.name != REFERENCE, e.value)):
        try:
            manifest = importing(ep.load)
            backend = Backend.from_manifest(
                importing(manifest) if callable(manifest) else manifest, source=ep.value
            )
        except Exception as exc:
            reason = f"{ep.value} could not be loaded: {type(exc).__name__}: {exc}"
            _unloaded.setdefault(ep.name, reason)
            _warn(f"softmaxkit backend entry point {ep.name!r} ({ep.value}) could not be "
                  f"loaded and is skipped: {type(exc).__name__}: {exc}")
            continue
        if backend.name in found:
            _warn(f"two softmaxkit backends are named {backend.name!r} "
                  f"({found[backend.name].source} and {backend.source}); the first is kept")
            continue
        found[backend.name] = backend
    if REFERENCE not in found:  # running from a source tree that was never installed
        from .reference import manifest

        found[REFERENCE] = Backend.from_manifest(manifest(), source="softmaxkit.reference")
    logger.debug("softmaxkit backends discovered: %s", ", ".join(found))
    return found


def registry() -> dict[str, Backend]:
    """All registered backends by name, discovered on first use."""
    if _registry is None:
        with _lock:
            if _registry is None:
                _set_registry(_discover())
    return _registry  # type: ignore[return-value]


def failed_to_load() -> dict[str, str]:
    """Installed backends whose entry point or manifest failed to load, with the reason.

    Returns
    -------
    dict
        ``{entry-point name: reason}``; these backends are skipped by every call.
    """
    registry()
    return dict(_unloaded)


def register(manifest: Mapping[str, Any]) -> Backend:
    """Register a backend from a manifest mapping at run time (for tests and notebooks)."""
    backend = Backend.from_manifest(manifest, source="register()")
    with _lock:
        reg = dict(registry())
        if backend.name in reg:
            _warn(f"register() replaces the softmaxkit backend {backend.name!r}")
        reg[backend.name] = backend
        _set_registry(reg)
    return backend


def unregister(name: str) -> None:
    """Remove a backend registered with :func:`register` (the reference cannot be removed)."""
    if name == REFERENCE:
        raise ValueError("the reference backend cannot be unregistered")
    with _lock:
        reg = dict(registry())
        reg.pop(name, None)
        _set_registry(reg)


def _set_registry(reg: dict[str, Backend] | None) -> None:
    global _registry, _generation
    _registry = reg
    _generation += 1  # every Binding made before is stale
    _candidates.cache_clear()
    _environment.cache_clear()
    _plans.clear()
    _decisions.clear()


def reload() -> None:
    """Forget discovered backends and environment variables; the next call reads them again."""
    with _lock:
        _set_registry(None)


@functools.lru_cache(maxsize=1024)
def _candidates(
    op: str, device: str, dtype: str, prioritize: tuple[str, ...], disable: tuple[str, ...],
    precision: str = "float32",
) -> tuple[tuple[Backend, ...], tuple[tuple[str, str], ...]]:
    """Backends that may serve (op, device, dtype) at ``precision``, best first; and those
    left out, with why."""
    prioritize, disable = _effective(prioritize, disable)
    serving, left_out = [], []
    for backend in registry().values():
        if backend.name in disable and backend.name != REFERENCE:
            left_out.append((backend.name, "disabled"))
        elif not backend.serves_key(op, device, dtype, precision):
            left_out.append((backend.name, _not_served(backend, op, device, dtype, precision)))
        elif backend.requires_opt_in and backend.name not in prioritize:
            left_out.append((backend.name, "requires opt-in (prioritize it or pass backend=)"))
        else:
            serving.append(backend)

    def rank(b: Backend) -> tuple[int, bool, int]:
        preferred = prioritize.index(b.name) if b.name in prioritize else len(prioritize)
        return (preferred, b.name == REFERENCE, -b.priority_for(op, device, dtype))

    return tuple(sorted(serving, key=rank)), tuple(left_out)


def candidates(op: str, device: str, dtype: str,
               precision: str = "float32") -> tuple[list[str], dict[str, str]]:
    """The backends that would be tried for (op, device, dtype) here, best first (for an
    attention call, at its ``precision``).

    Returns
    -------
    order : list of str
        Names in the order they are tried; each one's ``can_run`` / ``should_run`` hooks
        still decide per call.
    left_out : dict
        ``{name: reason}`` for the registered backends that are not tried.
    """
    opts = _options.get()
    ordered, left_out = _candidates(op, device, dtype, opts.prioritize, opts.disable, precision)
    return [b.name for b in ordered], dict(left_out)


def _not_served(backend: Backend, op: str, device: str, dtype: str, precision: str) -> str:
    """Why ``backend`` is left out of (op, device, dtype) at ``precision``."""
    return f"does not serve ({op}, {device}, {dtype}){_at(backend, op, device, dtype, precision)}"


def _at(backend: Backend, op: str, device: str, dtype: str, precision: str) -> str:
    """`` at precision ...`` when ``backend`` serves (op, device, dtype) at other precisions
    only, else nothing."""
    if any(backend.serves_key(op, device, dtype, p) for p in PRECISIONS):
        return f" at precision {precision!r}"
    return ""


def _precision(args: dict[str, Any]) -> str:
    """The call's ``precision`` argument; ``"float32"`` for an operation without one."""
    return args.get("precision", "float32")


def device_type(x: Any) -> str:
    """The device type of array ``x``: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"mps"``, ...

    Dask arrays report the device type of their chunks' library (``"cpu"`` for numpy chunks,
    ``"cuda"`` for CuPy chunks).
    """
    read = _DEVICE_READERS.get(type(x))
    if read is not None:
        return read(x)
    if array_api_compat.is_torch_array(x):
        _DEVICE_READERS[type(x)] = _torch_device
        return _torch_device(x)
    if array_api_compat.is_dask_array(x):
        meta = getattr(x, "_meta", None)
        return device_type(meta) if meta is not None else "cpu"
    if array_api_compat.is_cupy_array(x):
        _DEVICE_READERS[type(x)] = _on_cuda
        return "cuda"
    if array_api_compat.is_jax_array(x):
        try:
            platform = next(iter(x.devices())).platform
        except Exception:
            return "cpu"
        return {"gpu": "cuda"}.get(platform, platform)
    dev = getattr(x, "device", "cpu")
    kind = getattr(dev, "type", None)
    if isinstance(kind, str):
        return kind
    return "cpu" if str(dev).lower() in ("cpu", "cpu_device") or "CPU" in str(dev) else str(dev)


def _on_cpu(x: Any) -> str:
    return "cpu"


def _on_cuda(x: Any) -> str:
    return "cuda"


def _torch_device(x: Any) -> str:
    return "cpu" if x.is_cpu else "cuda" if x.is_cuda else x.device.type


_DEVICE_READERS: dict[type, Callable[[Any], str]] = {np.ndarray: _on_cpu}
"""How to read the device type of each array type whose answer needs no library probe: a
numpy array is always on the CPU, a CuPy array on CUDA, a torch tensor says so itself.
Dask and JAX arrays are asked every time (their device is per array)."""


@dataclass(frozen=True, eq=False)  # hashed by identity: one plan per key until a reset
class _Plan:
    """The candidates for one (op, device, dtype, precision, options) and how their decision
    is keyed.

    ``cut`` is the index of the first candidate whose hooks declare no ``hook_keys``: a
    decision reached before it depends only on ``read(call)`` and is cached; one reached at
    or after it is made afresh on every call.
    """

    ordered: tuple[Backend, ...]
    left_out: tuple[tuple[str, str], ...]
    cut: int
    read: Callable[[dict[str, Any]], tuple[Any, ...]]
    value: Callable[[Any], Any]  # what read reads of one argument


@dataclass(frozen=True)
class _Decision:
    backend: Backend
    kernel: Callable[..., Any]
    # for trace= and the DEBUG log: the other backends and why each was not chosen
    others: tuple[tuple[str, str], ...]


_plans: dict[tuple[Any, ...], _Plan] = {}
_decisions: dict[tuple[Any, ...], _Decision] = {}
_MAX_DECISIONS = 4096  # a bound on memory; past it the cache starts again


def _plan(op: str, device: str, dtype: str, prioritize: tuple[str, ...],
          disable: tuple[str, ...], precision: str) -> _Plan:
    key = (op, device, dtype, prioritize, disable, precision)
    plan = _plans.get(key)
    if plan is None:
        ordered, left_out = _candidates(op, device, dtype, prioritize, disable, precision)
        cut = next((i for i, b in enumerate(ordered) if b.has_hooks and b.hook_keys is None),
                   len(ordered))
        names = frozenset().union(*(b.hook_keys or () for b in ordered[:cut]))
        plan = _plans[key] = _Plan(ordered, left_out, cut, decisions.reader(names),
                                   decisions.value_reader(names))
    return plan


def _store(key: tuple[Any, ...] | None, decision: _Decision) -> None:
    if key is None:
        return
    if len(_decisions) >= _MAX_DECISIONS:
        _decisions.clear()
    _decisions[key] = decision


def _lookup(key: tuple[Any, ...]) -> tuple[tuple[Any, ...] | None, _Decision | None]:
    try:
        return key, _decisions.get(key)
    except TypeError:  # an unhashable property (a dtype object of some library): no caching
        return None, None


def choose(
    call: Call, backend: str | None = None, *, cached: bool = True
) -> tuple[Backend, Callable[..., Any]]:
    """The backend and kernel that run ``call``.

    Parameters
    ----------
    call
        The operation, namespace, device type, dtype and kernel arguments.
    backend
        A backend name to use strictly; if it cannot run the call, raise and say why.
    cached
        Reuse (and keep) the decision made for an earlier call with the same key; ``False``
        asks every hook afresh (tests compare the two).

    Raises
    ------
    NoBackendError
        When no backend can run the call; the message lists every backend and its reason.
    """
    opts = _options.get()
    if backend is not None:
        return _choose_strict(call, backend, opts, cached)
    precision = _precision(call.args)
    plan = (_plans.get((call.op, call.device, call.dtype, opts.prioritize, opts.disable,
                        precision))
            or _plan(call.op, call.device, call.dtype, opts.prioritize, opts.disable,
                     precision))
    key: tuple[Any, ...] | None = None
    if cached and plan.cut:
        # the plan stands for (op, device, dtype, options): the cache is emptied with it
        key, hit = _lookup((plan, call.xp, plan.read(call.args)))
        if hit is not None:
            if opts.trace is not None or logger.isEnabledFor(logging.DEBUG):
                _record(opts, call, hit.backend.name, dict(hit.others))
            return hit.backend, hit.kernel
    ordered, left_out = plan.ordered, plan.left_out
    declined: list[tuple[str, str]] = []
    for index, candidate in enumerate(ordered):
        verdict = candidate.can_run(call)
        if verdict is True:
            verdict = candidate.should_run(call)
        if verdict is True:
            kernel = candidate._loaded.get(call.op)
            if kernel is None:
                try:
                    kernel = candidate.kernel(call.op)
                except ImportError as exc:
                    declined.append((candidate.name, str(exc)))
                    continue
            below = f"ranked below {candidate.name}"
            others = left_out + tuple(declined) + tuple(
                (b.name, below) for b in ordered[index + 1:]
            )
            if index < plan.cut:
                _store(key, _Decision(candidate, kernel, others))
            if opts.trace is not None or logger.isEnabledFor(logging.DEBUG):
                _record(opts, call, candidate.name, dict(others))
            return candidate, kernel
        declined.append((candidate.name, str(verdict)))
    raise NoBackendError(_no_backend_message(call, dict(left_out + tuple(declined)),
                                             registry()))


def kernel_for(
    op: str, xp: Any, like: Any, args: dict[str, Any], backend: str | None = None
) -> Callable[..., Any]:
    """The kernel that runs ``op`` on the kernel arguments ``args``: :func:`choose` on the
    call of ``like``'s device and dtype, with its common case made cheap.

    A call whose decision is cached, with no ``backend=``, no ``trace=`` and no DEBUG log,
    costs one plan lookup, the plan's reading of ``args`` and one decision lookup; no
    :class:`~softmaxkit.ops.Call` is built.  Every other call goes through :func:`choose`.
    """
    device, dtype = device_type(like), dtype_name(like.dtype)
    opts = _options.get()
    if backend is None and opts.trace is None:
        plan = _plans.get((op, device, dtype, opts.prioritize, opts.disable,
                           args.get("precision", "float32")))
        if plan is not None and plan.cut:
            try:
                hit = _decisions.get((plan, xp, plan.read(args)))
            except TypeError:  # an unhashable property: choose() decides
                hit = None
            if hit is not None and not logger.isEnabledFor(logging.DEBUG):
                return hit.kernel
    return choose(Call(op, xp, device, dtype, args), backend)[1]


@dataclass(frozen=True, eq=False)
class Binding:
    """A cached decision, kept by a caller for one kind of call (:func:`bind`).

    The caller keeps it under what selected the decision's plan and every kernel argument but
    the array ``x``: the operation, namespace, device type and dtype of the call (the
    precision too, for an operation that has one) and the other arguments' values.
    :meth:`kernel_for_array` gives the kernel again without a lookup while the decision
    stands: the cache not emptied since (registration, unregistration, :func:`reload`), the
    same ``backend_opts`` in force, the DEBUG log off (it reports every decision) and the same
    values of the properties the candidates' hooks declare, read of ``x`` alone.

    :attr:`repeat` is the kernel's own form for the later calls of this kind, where it has one
    (a kernel's optional ``repeat`` attribute, see docs/backends.md): a function of the array
    argument ``x`` alone, the other arguments being the first call's, giving the kernel's
    result or None where the kernel itself must run.
    """

    op: str
    xp: Any
    device: str
    dtype: str
    generation: int
    opts: _Options
    kernel: Callable[..., Any]
    value: Callable[[Any], Any]  # the plan's reading of one argument
    x_props: Any  # its reading of the first call's x
    repeat: Callable[[Any], Any] | None = None

    def kernel_for_array(self, x: Any) -> Callable[..., Any] | None:
        """The kernel for a call of this kind whose array is ``x`` (its other kernel
        arguments the first call's), or None when the decision may have changed (then
        :func:`bind` decides again)."""
        if (self.generation != _generation or self.opts is not _options.get()
                or logger.isEnabledFor(logging.DEBUG) or self.value(x) != self.x_props):
            return None
        return self.kernel


def bind(
    op: str, xp: Any, like: Any, args: dict[str, Any]
) -> tuple[Callable[..., Any], Binding | None]:
    """:func:`kernel_for` with no ``backend=``, and a :class:`Binding` of the decision where
    it is cached (None where it is made afresh on every call, or traced)."""
    kernel = kernel_for(op, xp, like, args)
    opts = _options.get()
    if opts.trace is not None:
        return kernel, None
    device, dtype = device_type(like), dtype_name(like.dtype)
    plan = _plans.get((op, device, dtype, opts.prioritize, opts.disable, _precision(args)))
    if plan is None or not plan.cut or "x" not in args:
        return kernel, None
    props = plan.read(args)
    _, hit = _lookup((plan, xp, props))
    if hit is None or hit.kernel is not kernel:
        return kernel, None
    make = getattr(kernel, "repeat", None)
    return kernel, Binding(op, xp, device, dtype, _generation, opts, kernel, plan.value,
                           props[list(args).index("x")],
                           None if make is None else make(xp, args))


def _choose_strict(
    call: Call, name: str, opts: _Options, cached: bool
) -> tuple[Backend, Callable[..., Any]]:
    """:func:`_strict`, its decision cached under the named backend's declared properties."""
    reg = registry()
    chosen = reg.get(name)
    key: tuple[Any, ...] | None = None
    if cached and chosen is not None and (chosen.hook_keys is not None or not chosen.has_hooks):
        key, hit = _lookup((name, call.op, call.xp, call.device, call.dtype,
                            _precision(call.args),
                            decisions.reader(chosen.hook_keys or frozenset())(call.args)))
        if hit is not None:
            if opts.trace is not None or logger.isEnabledFor(logging.DEBUG):
                _record(opts, call, name, dict(hit.others))
            return hit.backend, hit.kernel
    backend, kernel = _strict(call, name, reg)
    asked = f"backend={name!r} was asked for"
    _store(key, _Decision(backend, kernel, tuple((other, asked) for other in reg
                                                  if other != name)))
    return backend, kernel


def _strict(call: Call, name: str, reg: dict[str, Backend]) -> tuple[Backend, Callable[..., Any]]:
    chosen = reg.get(name)
    if chosen is None:
        if name in _unloaded:
            raise BackendLoadError(
                f"backend={name!r} is installed but failed to load: {_unloaded[name]}. "
                "Reinstall it or fix its import error, or pass backend='reference'."
            )
        raise NoBackendError(
            f"backend={name!r} is not installed; installed backends: {sorted(reg)}. "
            "Install the package that provides it, or pass backend='reference'."
        )
    hint = f" (install: {chosen.install_hint})" if chosen.install_hint else ""
    precision = _precision(call.args)
    if not chosen.serves_key(call.op, call.device, call.dtype, precision):
        at = _at(chosen, call.op, call.device, call.dtype, precision)
        raise NoBackendError(
            f"backend={name!r} does not serve {call.op} for device {call.device!r} and dtype "
            f"{call.dtype!r}{at}; it serves {_serves_summary(chosen)}{hint}"
        )
    if call.op in chosen._broken:
        raise BackendLoadError(f"backend={name!r} cannot run {call.op}: "
                               f"{chosen._broken[call.op]}{hint}")
    verdict = chosen.can_run(call)
    if verdict is not True:
        failed = isinstance(chosen._hooks.get(chosen.can_run_path or ""), str)
        raise (BackendLoadError if failed else NoBackendError)(
            f"backend={name!r} cannot run {call.op}: {verdict}" + (hint if failed else ""))
    try:
        kernel = chosen.kernel(call.op)
    except ImportError as exc:
        raise BackendLoadError(f"backend={name!r} cannot run {call.op}: {exc}{hint}") from exc
    opts = _options.get()
    if opts.trace is not None or logger.isEnabledFor(logging.DEBUG):
        asked = f"backend={name!r} was asked for"
        _record(opts, call, name, {other: asked for other in reg if other != name})
    return chosen, kernel


def _serves_summary(backend: Backend) -> str:
    """What a backend serves, in words: 'softmax, logsumexp on cpu for float32, float64'."""
    def names(values: frozenset[str], anything: str) -> str:
        return anything if "*" in values else ", ".join(sorted(values))

    parts = [f"{names(ops & set(backend.kernels) if '*' not in ops else ops, 'every operation')}"
             f" on {names(devices, 'any device')} for {names(dtypes, 'any dtype')}"
             + ("" if precs is None else f" at precisions {names(precs, '')}")
             for ops, devices, dtypes, _, precs in backend.serves]
    return "; ".join(parts) or "nothing"


def _record(opts: _Options, call: Call, name: str, declined: dict[str, str]) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        others = "; ".join(f"{k}: {v}" for k, v in declined.items()) or "no other candidate"
        logger.debug("%s on %s/%s ran on %s (%s)", call.op, call.device, call.dtype, name, others)
    if opts.trace is not None:
        opts.trace.append(TraceRecord(call.op, call.device, call.dtype, name, dict(declined)))


def _no_backend_message(call: Call, declined: dict[str, str], reg: dict[str, Backend]) -> str:
    lines = [f"no softmaxkit backend can run {call.op} on {call.device}/{call.dtype}:"]
    for name, reason in declined.items():
        backend = reg.get(name)
        if backend is not None and reason.startswith("does not serve"):
            reason += f"; it serves {_serves_summary(backend)}"
        hint = backend.install_hint if backend is not None else ""
        lines.append(f"  {name}: {reason}" + (f" (install: {hint})" if hint else ""))
    for name, reason in _unloaded.items():
        lines.append(f"  {name}: installed but failed to load: {reason}")
    lines.append("Install a backend that serves this device, or pass backend='reference'.")
    return "\n".join(lines)


def backends() -> dict[str, dict[str, Any]]:
    """The registered backends and what each serves, by name.

    Returns
    -------
    dict
        ``{name: {"operations", "serves", "priority", "install_hint", "can_run",
        "should_run", "requires_opt_in", "source"}}``.
    """
    return {name: b.describe() for name, b in registry().items()}
