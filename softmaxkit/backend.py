"""A registered backend, built from and validated against its manifest.

The manifest's fields are described in :mod:`softmaxkit.registry`, which discovers the
backends and chooses one for each call; here is what one backend is: what it serves, at which
priority, and its kernels and hooks, imported on first use.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import decisions
from .arguments import PRECISIONS
from .ops import OPERATIONS, Call

REFERENCE = "reference"

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
    level = 2
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, BackendWarning, stacklevel=level)


_NOTICES = (DeprecationWarning, PendingDeprecationWarning, ImportWarning)
"""Warnings Python ignores by default outside ``__main__``: what a backend's dependencies say
about themselves as they import."""


def importing(load: Callable[[], Any]) -> Any:
    """``load()`` (an import of a backend's manifest, kernel or hook) with the notices of
    :data:`_NOTICES` ignored, as Python's default filters ignore them, whatever filters the
    caller set.  Imports happen at the first call that needs them, often under a caller's
    ``warnings.simplefilter("error")`` (a test suite's ``-W error``): a dependency's
    deprecation notice raised there would lose the backend for the session, and the calls
    would fall back to a slower one.  Other warnings keep the caller's filters."""
    with warnings.catch_warnings():
        for category in _NOTICES:
            warnings.simplefilter("ignore", category)
        return load()


def _load(path: str) -> Any:
    module, _, qualname = path.partition(":")
    obj: Any = importing(lambda: importlib.import_module(module))
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _without_precision(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` called without the ``precision`` argument, which a backend that declares no
    precisions computes exactly whatever it says (spec "Attention", "Precision")."""

    def call(*, precision: str = "float32", **args: Any) -> Any:
        return kernel(**args)

    call.__wrapped__ = kernel  # type: ignore[attr-defined]
    return call


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
    # (ops, devices, dtypes, priority or None, precisions or None) per serves entry
    serves: tuple[tuple[frozenset[str], frozenset[str], frozenset[str], int | None,
                        frozenset[str] | None], ...]
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
            ops, devices, dtypes = (
                _strings(entry.get(key, ("*",)), f"manifest of {name!r}: serves {key}")
                for key in ("ops", "devices", "dtypes")
            )
            precisions = entry.get("precisions")
            if precisions is not None:
                precisions = _strings(precisions, f"manifest of {name!r}: serves precisions")
                unknown = sorted(precisions - set(PRECISIONS))
                if unknown or not precisions:
                    raise ValueError(f"manifest of {name!r}: serves precisions must name some "
                                     f"of {PRECISIONS}, got {sorted(precisions)}")
            serves.append((ops, devices, dtypes, own, precisions))
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

    def serves_key(self, op: str, device: str, dtype: str, precision: str = "float32") -> bool:
        """Whether the manifest declares (op, device, dtype) at ``precision`` (an attention
        call's ``precision`` argument; entries that declare no precisions serve every one)
        and names a kernel for op."""
        if op not in self.kernels:
            return False
        return any(
            (op in ops or "*" in ops)
            and (device in devices or "*" in devices)
            and (dtype in dts or "*" in dts)
            and (precs is None or precision in precs)
            for ops, devices, dts, _, precs in self.serves
        )

    def takes_precision(self, op: str) -> bool:
        """Whether the kernel for ``op`` receives the call's ``precision`` argument: only when
        a serves entry covering ``op`` declares precisions (the other kernels compute every
        precision exactly and are called without it)."""
        return any(precs is not None and (op in ops or "*" in ops)
                   for ops, _, _, _, precs in self.serves)

    def priority_for(self, op: str, device: str = "*", dtype: str = "*") -> int:
        """The declared priority of this backend for (op, device, dtype): that of the first
        serves entry covering it that declares one, else the backend's for ``op``."""
        for ops, devices, dts, own, _ in self.serves:
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
        if "precision" in OPERATIONS[op] and not self.takes_precision(op):
            fn = _without_precision(fn)
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
                 **({} if own is None else {"priority": own}),
                 **({} if precs is None else {"precisions": sorted(precs)})}
                for o, d, t, own, precs in self.serves
            ],
            "priority": dict(self.priority),
            "install_hint": self.install_hint,
            "can_run": self.can_run_path,
            "should_run": self.should_run_path,
            "requires_opt_in": self.requires_opt_in,
            "hook_keys": None if self.hook_keys is None else sorted(self.hook_keys),
            "source": self.source,
        }
