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
    that wins some dtypes and loses others to a peer says so there.
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
DEBUG log report the decision, cached or not.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import array_api_compat
import numpy as np

from . import decisions
from .ops import OPERATIONS, Call

GROUP = "softmaxkit.backends"
REFERENCE = "reference"
ENV_PRIORITIZE = "SOFTMAXKIT_PRIORITIZE"
ENV_BLOCK = "SOFTMAXKIT_BLOCK"

logger = logging.getLogger("softmaxkit")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class NoBackendError(RuntimeError):
    """No backend can run a call; the message lists every backend and why it declined."""


class BackendLoadError(NoBackendError):
    """A backend is installed but its manifest, a kernel or a hook failed to import."""


class BackendWarning(UserWarning):
    """A plugin could not be loaded or clashes with another; it is skipped."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn(message: str) -> None:
    """Warn with a :class:`BackendWarning` that points at the first line outside softmaxkit
    (the caller's), however deep in the library the warning is raised."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, BackendWarning, stacklevel=level)


def _load(path: str) -> Any:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _path(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _PATH.match(value):
        raise ValueError(f"{what} must be a 'module:qualname' string, got {value!r}")
    return value


def _strings(value: Any, what: str) -> frozenset[str]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ValueError(f"{what} must be a list of strings, got {value!r}")
    items = list(value)
    if not all(isinstance(v, str) for v in items):
        raise ValueError(f"{what} must be a list of strings, got {value!r}")
    return frozenset(items)


@dataclass(eq=False)
class Backend:
    """A registered backend, built from its manifest; kernels are imported on first use."""

    name: str
    # (ops, devices, dtypes, priority or None) per serves entry
    serves: tuple[tuple[frozenset[str], frozenset[str], frozenset[str], int | None], ...]
    kernels: Mapping[str, str]
    priority: Mapping[str, int]
    install_hint: str = ""
    can_run_path: str | None = None
    should_run_path: str | None = None
    requires_opt_in: bool = False
    source: str = ""
    # the call properties the hooks look at; None: undeclared, so hooks run on every call
    hook_keys: frozenset[str] | None = None
    _loaded: dict[str, Callable[..., Any]] = field(default_factory=dict, repr=False)
    _broken: dict[str, str] = field(default_factory=dict, repr=False)
    _hooks: dict[str, Callable[[Call], Any] | str] = field(default_factory=dict, repr=False)
    _warned: bool = field(default=False, repr=False)

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], source: str = "") -> Backend:
        """Validate a manifest mapping and build the backend it describes.

        Raises
        ------
        ValueError
            When a field is missing or malformed; the message names the field.
        """
        if not isinstance(manifest, Mapping):
            raise ValueError(f"a manifest must be a mapping, got {type(manifest).__name__}")
        name = manifest.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(
                f"manifest 'name' must be a non-empty name of letters, digits, '_', '.' or "
                f"'-', got {name!r}"
            )
        kernels = manifest.get("kernels", {})
        if not isinstance(kernels, Mapping):
            raise ValueError(f"manifest of {name!r}: 'kernels' must be a mapping op -> path")
        unknown = sorted(set(kernels) - set(OPERATIONS))
        if unknown:
            raise ValueError(f"manifest of {name!r} names unknown operations {unknown}")
        kernels = {op: _path(p, f"manifest of {name!r}: kernel for {op}") for op, p in
                   kernels.items()}
        serves = []
        for entry in manifest.get("serves", ()):
            if not isinstance(entry, Mapping):
                raise ValueError(f"manifest of {name!r}: each 'serves' entry must be a mapping")
            own = entry.get("priority")
            if own is not None and (not isinstance(own, int) or isinstance(own, bool)):
                raise ValueError(f"manifest of {name!r}: a serves entry's 'priority' must be "
                                 f"an int, got {own!r}")
            serves.append((*(
                _strings(entry.get(key, ("*",)), f"manifest of {name!r}: serves {key}")
                for key in ("ops", "devices", "dtypes")
            ), own))
        priority = manifest.get("priority", 0)
        if not isinstance(priority, Mapping):
            priority = {"*": priority}
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in priority.values()):
            raise ValueError(f"manifest of {name!r}: 'priority' must be an int or op -> int")
        hooks = {}
        for key in ("can_run", "should_run"):
            value = manifest.get(key)
            hooks[key] = None if value is None else _path(value, f"manifest of {name!r}: {key}")
        hook_keys = manifest.get("hook_keys")
        if hook_keys is not None:
            hook_keys = _strings(hook_keys, f"manifest of {name!r}: hook_keys")
            unknown = sorted(hook_keys - set(decisions.PROPERTIES))
            if unknown:
                raise ValueError(f"manifest of {name!r}: hook_keys names unknown properties "
                                 f"{unknown}; known: {sorted(decisions.PROPERTIES)}")
        return cls(
            name=name,
            hook_keys=hook_keys,
            serves=tuple(serves),
            kernels=kernels,
            priority=dict(priority),
            install_hint=str(manifest.get("install_hint", "")),
            can_run_path=hooks["can_run"],
            should_run_path=hooks["should_run"],
            requires_opt_in=bool(manifest.get("requires_opt_in", False)),
            source=source,
        )

    def serves_key(self, op: str, device: str, dtype: str) -> bool:
        """Whether the manifest declares (op, device, dtype) and names a kernel for op."""
        if op not in self.kernels:
            return False
        return any(
            (op in ops or "*" in ops)
            and (device in devices or "*" in devices)
            and (dtype in dts or "*" in dts)
            for ops, devices, dts, _ in self.serves
        )

    def priority_for(self, op: str, device: str = "*", dtype: str = "*") -> int:
        """The declared priority of this backend for (op, device, dtype): that of the first
        serves entry covering it that declares one, else the backend's for ``op``."""
        for ops, devices, dts, own in self.serves:
            if own is not None and all(
                v in names or "*" in names for v, names in
                ((op, ops), (device, devices), (dtype, dts))
            ):
                return own
        return int(self.priority.get(op, self.priority.get("*", 0)))

    def _warn_once(self, message: str) -> None:
        # one warning per backend: a broken module usually breaks every kernel it holds
        if not self._warned:
            self._warned = True
            _warn(f"softmaxkit backend {self.name!r}: {message}")
        logger.debug("backend %s: %s", self.name, message)

    def kernel(self, op: str) -> Callable[..., Any]:
        """Import (once) and return the kernel for ``op``; raises ImportError with the reason."""
        fn = self._loaded.get(op)
        if fn is not None:
            return fn
        if op in self._broken:
            raise ImportError(self._broken[op])
        try:
            fn = _load(self.kernels[op])
        except Exception as exc:
            reason = f"kernel {self.kernels[op]!r} failed to import: {type(exc).__name__}: {exc}"
            self._broken[op] = reason
            self._warn_once(f"{reason}; it is skipped")
            raise ImportError(reason) from exc
        self._loaded[op] = fn
        return fn

    def _hook(self, path: str, call: Call) -> bool | str:
        hook = self._hooks.get(path)
        if hook is None:
            try:
                hook = _load(path)
            except Exception as exc:
                hook = f"hook {path!r} failed to import: {type(exc).__name__}: {exc}"
                self._warn_once(f"{hook}; it is skipped")
            self._hooks[path] = hook
        if isinstance(hook, str):
            return hook
        try:
            verdict = hook(call)
        except Exception as exc:
            return f"{path} raised {type(exc).__name__}: {exc}"
        return True if verdict is True or verdict is None else str(verdict or "declined")

    def can_run(self, call: Call) -> bool | str:
        """Ask the backend's ``can_run`` hook; ``True`` or the reason it cannot."""
        if call.op in self._broken:
            return self._broken[call.op]
        return True if self.can_run_path is None else self._hook(self.can_run_path, call)

    def should_run(self, call: Call) -> bool | str:
        """Ask the backend's ``should_run`` hook; ``True`` or the reason it should not."""
        return True if self.should_run_path is None else self._hook(self.should_run_path, call)

    @property
    def has_hooks(self) -> bool:
        """Whether a ``can_run`` or ``should_run`` hook decides per call."""
        return self.can_run_path is not None or self.should_run_path is not None

    def describe(self) -> dict[str, Any]:
        """What the backend serves, as plain data (for :func:`backends` and ``info``)."""
        return {
            "name": self.name,
            "operations": sorted(self.kernels),
            "serves": [
                {"ops": sorted(o), "devices": sorted(d), "dtypes": sorted(t),
                 **({} if own is None else {"priority": own})}
                for o, d, t, own in self.serves
            ],
            "priority": dict(self.priority),
            "install_hint": self.install_hint,
            "can_run": self.can_run_path,
            "should_run": self.should_run_path,
            "requires_opt_in": self.requires_opt_in,
            "hook_keys": None if self.hook_keys is None else sorted(self.hook_keys),
            "source": self.source,
        }


_lock = threading.RLock()
_registry: dict[str, Backend] | None = None
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
            manifest = ep.load()
            backend = Backend.from_manifest(
                manifest() if callable(manifest) else manifest, source=ep.value
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
    global _registry
    _registry = reg
    _candidates.cache_clear()
    _environment.cache_clear()
    _plans.clear()
    _decisions.clear()


def reload() -> None:
    """Forget discovered backends and environment variables; the next call reads them again."""
    with _lock:
        _set_registry(None)


# -- options ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    prioritize: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    trace: list[TraceRecord] | None = None


@dataclass
class TraceRecord:
    """Which backend ran one call, and why each other candidate did not.

    Attributes
    ----------
    op, device, dtype
        The selection key of the call.
    backend
        The name of the backend that ran it.
    declined
        ``{name: reason}`` for every other registered backend that was not chosen.
    """

    op: str
    device: str
    dtype: str
    backend: str
    declined: dict[str, str]


_options: contextvars.ContextVar[_Options] = contextvars.ContextVar(
    "softmaxkit_backend_opts", default=_Options()  # noqa: B039 - frozen, its list is per-use
)


def _names(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.split(",")
    return tuple(dict.fromkeys(v.strip() for v in value if v.strip()))


class backend_opts:  # noqa: N801 - used as a function, like contextlib's managers
    """Prefer, disable or trace backends within a block or a decorated function.

    Parameters
    ----------
    prioritize
        Backend names tried first, in this order (a name, a comma-separated string or an
        iterable of names).  Prioritizing a backend also opts in to one whose manifest
        ``requires_opt_in``.  Names that are not installed are ignored.
    disable
        Backend names never chosen (the reference cannot be disabled).
    trace
        Record each call's choice; the records are the list returned by ``__enter__``.

    Notes
    -----
    The options live in a :class:`contextvars.ContextVar`, so they are local to the thread
    and to the asyncio task, and they nest: inner options are tried before outer ones, and an
    inner ``prioritize`` re-enables a backend an outer ``disable`` turned off (and the other
    way round).  They take precedence over ``SOFTMAXKIT_PRIORITIZE`` / ``SOFTMAXKIT_BLOCK``
    but never over an explicit ``backend=``.

    Examples
    --------
    >>> import numpy as np, softmaxkit as sk
    >>> with sk.backend_opts(prioritize="reference", trace=True) as trace:
    ...     _ = sk.softmax(np.arange(3.0))
    >>> trace[0].backend
    'reference'
    """

    def __init__(
        self,
        prioritize: str | Iterable[str] | None = None,
        disable: str | Iterable[str] | None = None,
        trace: bool = False,
    ) -> None:
        self._prioritize = _names(prioritize)
        self._disable = _names(disable)
        if REFERENCE in self._disable:
            raise ValueError("disable: the reference backend cannot be disabled")
        both = sorted(set(self._prioritize) & set(self._disable))
        if both:
            raise ValueError(f"backends {both} are both prioritized and disabled")
        self._trace = bool(trace)
        self._tokens: list[contextvars.Token[_Options]] = []

    def __enter__(self) -> list[TraceRecord]:
        outer = _options.get()
        records: list[TraceRecord] | None = [] if self._trace else outer.trace
        inner = _Options(
            prioritize=self._prioritize + tuple(
                n for n in outer.prioritize if n not in self._prioritize + self._disable
            ),
            disable=tuple(n for n in outer.disable if n not in self._prioritize) + tuple(
                n for n in self._disable if n not in outer.disable
            ),
            trace=records,
        )
        self._tokens.append(_options.set(inner))
        return records if records is not None else []

    def __exit__(self, *exc: object) -> None:
        _options.reset(self._tokens.pop())

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with backend_opts(self._prioritize, self._disable, self._trace):
                return fn(*args, **kwargs)

        return wrapper


@functools.lru_cache(maxsize=1)
def _environment() -> tuple[tuple[str, ...], tuple[str, ...]]:
    return _names(os.environ.get(ENV_PRIORITIZE)), _names(os.environ.get(ENV_BLOCK))


def _effective(
    prioritize: tuple[str, ...], disable: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Merge the context's options with the environment (the context wins)."""
    env_prioritize, env_block = _environment()
    merged_prioritize = prioritize + tuple(
        n for n in env_prioritize if n not in prioritize and n not in disable
    )
    merged_disable = disable + tuple(
        n for n in env_block if n not in disable and n not in prioritize
    )
    return merged_prioritize, merged_disable


def prioritized() -> tuple[str, ...]:
    """The backend names prioritized where this is called, by the context and environment.

    A ``should_run`` hook may use it to accept work only when the user asked for its
    backend.
    """
    opts = _options.get()
    return _effective(opts.prioritize, opts.disable)[0]


@functools.lru_cache(maxsize=1024)
def _candidates(
    op: str, device: str, dtype: str, prioritize: tuple[str, ...], disable: tuple[str, ...]
) -> tuple[tuple[Backend, ...], tuple[tuple[str, str], ...]]:
    """Backends that may serve (op, device, dtype), best first; and those left out, with why."""
    prioritize, disable = _effective(prioritize, disable)
    serving, left_out = [], []
    for backend in registry().values():
        if backend.name in disable and backend.name != REFERENCE:
            left_out.append((backend.name, "disabled"))
        elif not backend.serves_key(op, device, dtype):
            left_out.append((backend.name, f"does not serve ({op}, {device}, {dtype})"))
        elif backend.requires_opt_in and backend.name not in prioritize:
            left_out.append((backend.name, "requires opt-in (prioritize it or pass backend=)"))
        else:
            serving.append(backend)

    def rank(b: Backend) -> tuple[int, bool, int]:
        preferred = prioritize.index(b.name) if b.name in prioritize else len(prioritize)
        return (preferred, b.name == REFERENCE, -b.priority_for(op, device, dtype))

    return tuple(sorted(serving, key=rank)), tuple(left_out)


def candidates(op: str, device: str, dtype: str) -> tuple[list[str], dict[str, str]]:
    """The backends that would be tried for (op, device, dtype) here, best first.

    Returns
    -------
    order : list of str
        Names in the order they are tried; each one's ``can_run`` / ``should_run`` hooks
        still decide per call.
    left_out : dict
        ``{name: reason}`` for the registered backends that are not tried.
    """
    opts = _options.get()
    ordered, left_out = _candidates(op, device, dtype, opts.prioritize, opts.disable)
    return [b.name for b in ordered], dict(left_out)


def device_type(x: Any) -> str:
    """The device type of array ``x``: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"mps"``, ...

    Dask arrays report the device type of their chunks' library (``"cpu"`` for numpy chunks,
    ``"cuda"`` for CuPy chunks).
    """
    if type(x) is np.ndarray:  # the common cases first, without the library probes below
        return "cpu"
    if array_api_compat.is_torch_array(x):
        return "cpu" if x.is_cpu else "cuda" if x.is_cuda else x.device.type
    if array_api_compat.is_dask_array(x):
        meta = getattr(x, "_meta", None)
        return device_type(meta) if meta is not None else "cpu"
    if array_api_compat.is_cupy_array(x):
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


@dataclass(frozen=True, eq=False)  # hashed by identity: one plan per key until a reset
class _Plan:
    """The candidates for one (op, device, dtype, options) and how their decision is keyed.

    ``cut`` is the index of the first candidate whose hooks declare no ``hook_keys``: a
    decision reached before it depends only on ``read(call)`` and is cached; one reached at
    or after it is made afresh on every call.
    """

    ordered: tuple[Backend, ...]
    left_out: tuple[tuple[str, str], ...]
    cut: int
    read: Callable[[Call], tuple[Any, ...]]


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
          disable: tuple[str, ...]) -> _Plan:
    key = (op, device, dtype, prioritize, disable)
    plan = _plans.get(key)
    if plan is None:
        ordered, left_out = _candidates(op, device, dtype, prioritize, disable)
        cut = next((i for i, b in enumerate(ordered) if b.has_hooks and b.hook_keys is None),
                   len(ordered))
        names = set().union(*(b.hook_keys or () for b in ordered[:cut]))
        plan = _plans[key] = _Plan(ordered, left_out, cut, decisions.reader(frozenset(names)))
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
    plan = (_plans.get((call.op, call.device, call.dtype, opts.prioritize, opts.disable))
            or _plan(call.op, call.device, call.dtype, opts.prioritize, opts.disable))
    key: tuple[Any, ...] | None = None
    if cached and plan.cut:
        # the plan stands for (op, device, dtype, options): the cache is emptied with it
        key, hit = _lookup((plan, call.xp, plan.read(call)))
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


def _choose_strict(
    call: Call, name: str, opts: _Options, cached: bool
) -> tuple[Backend, Callable[..., Any]]:
    """:func:`_strict`, its decision cached under the named backend's declared properties."""
    reg = registry()
    chosen = reg.get(name)
    key: tuple[Any, ...] | None = None
    if cached and chosen is not None and (chosen.hook_keys is not None or not chosen.has_hooks):
        key, hit = _lookup((name, call.op, call.xp, call.device, call.dtype,
                            decisions.reader(chosen.hook_keys or frozenset())(call)))
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
    if not chosen.serves_key(call.op, call.device, call.dtype):
        raise NoBackendError(
            f"backend={name!r} does not serve {call.op} for device {call.device!r} and dtype "
            f"{call.dtype!r}; it serves {_serves_summary(chosen)}{hint}"
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
             for ops, devices, dtypes, _ in backend.serves]
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
