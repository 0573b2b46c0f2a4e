"""Case registry, array targets and the runner of the conformance kit.

A case is a function ``fn(t: Target, dtype: str, backend: str) -> None`` registered with
:func:`case`.  It builds inputs with numpy, moves them to the target with ``t.asarray``, calls
the public API with ``backend=`` (strict, so nothing silently falls back), brings results back
with ``t.to_numpy`` and compares them with a float64 / mpmath reference under the tolerances of
spec/semantics.md, raising ``AssertionError`` on a mismatch.  A backend that does not serve a
case's operation, dtype or device is reported as unsupported, not as a failure; a backend
whose kernel or hook fails to import is a failure.

A *check* is one call of the backend under test whose result the case compared with the
spec; the runner counts them (through :func:`softmaxkit.backend_opts` tracing), and a case
that ran no check is reported as "ran nothing", never as passed.

The attention cases take their head dimensions from the target (:attr:`Target.head_dims`), so
a backend whose kernels serve only a few head dimensions runs every attention case at those:
``check_backend("mine", target="torch-cuda", head_dims=((64, 64), (128, 128)))``.
"""

from __future__ import annotations

import dataclasses
import importlib
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dtypes import FLOAT_DTYPES
from ..registry import BackendLoadError, NoBackendError, backend_opts

CASE_MODULES = (
    "softmaxkit.testing.rows_vector_cases",
    "softmaxkit.testing.rows_random_cases",
    "softmaxkit.testing.rows_special_cases",
    "softmaxkit.testing.rows_hygiene_cases",
    "softmaxkit.testing.summary_cases",
    "softmaxkit.testing.attention_cases",
    "softmaxkit.testing.paged_cases",
    "softmaxkit.testing.varlen_cases",
)


HEAD_DIMS: tuple[tuple[int, int], ...] = (
    (16, 8), (16, 16), (32, 24), (64, 32), (128, 128), (256, 64),
)
"""The attention cases' default ``(D, Dv)`` pairs (key and value head dimensions): small first
pairs keep the cases fast under simulators, and value dimensions that differ from the key's
are covered."""


class Unsupported(Exception):
    """The backend declines this case (it does not serve the op, dtype or device)."""


class RanNothing(Unsupported):
    """No check of the case applies here (say, its vectors exist only in other dtypes)."""


STATUSES = ("passed", "failed", "unsupported", "ran nothing")
"""The outcomes of a case, in the order ``softmaxkit verify`` counts them."""


@dataclass(frozen=True)
class Target:
    """An array library and device the cases run on.

    Attributes
    ----------
    name
        ``"numpy"``, ``"array_api_strict"``, ``"torch-cpu"``, ``"torch-cuda"``, ``"cupy"``, ...
    xp
        The array namespace (through array-api-compat).
    asarray
        ``asarray(numpy_array, dtype_name) -> array`` on the target, in that dtype.
    to_numpy
        ``to_numpy(array) -> numpy.ndarray`` in float64 (or the array's integer/bool dtype).
    device
        The device type the registry sees (``"cpu"``, ``"cuda"``).
    dtypes
        The dtypes the library has; cases in other dtypes are unsupported on the target.
    head_dims
        The ``(D, Dv)`` pairs of key and value head dimensions the attention cases use
        (:data:`HEAD_DIMS` unless :func:`cases` is given others).  The cases that sweep head
        dimensions run every pair; a case with a value dimension of its own (grouped-query
        attention, the gradient) takes the first pair; the other cases take the first pair
        with ``D == Dv`` (the first pair when none has).  The merges of partial results take
        any value dimension and keep their own small sizes.
    """

    name: str
    xp: Any
    asarray: Callable[[np.ndarray, str | None], Any]
    to_numpy: Callable[[Any], np.ndarray]
    device: str = "cpu"
    dtypes: tuple[str, ...] = FLOAT_DTYPES
    head_dims: tuple[tuple[int, int], ...] = HEAD_DIMS


def _numpy_target() -> Target:
    import array_api_compat.numpy as xp

    from ..dtypes import lookup

    try:  # numpy spells bfloat16 through ml_dtypes; without it the target has none
        import ml_dtypes  # noqa: F401
    except ImportError:
        dtypes: tuple[str, ...] = tuple(d for d in FLOAT_DTYPES if d != "bfloat16")
    else:
        dtypes = FLOAT_DTYPES

    def asarray(a: np.ndarray, dtype: str | None = None) -> Any:
        a = np.asarray(a)
        return a.astype(lookup(xp, dtype)) if dtype else a

    def to_numpy(a: Any) -> np.ndarray:
        a = np.asarray(a)
        return a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a

    return Target("numpy", xp, asarray, to_numpy, dtypes=dtypes)


def _strict_target() -> Target:
    import array_api_strict as xp

    def asarray(a: np.ndarray, dtype: str | None = None) -> Any:
        a = np.asarray(a)
        return xp.asarray(a, dtype=getattr(xp, dtype) if dtype else None)

    def to_numpy(a: Any) -> np.ndarray:
        out = np.asarray(a)
        return out.astype(np.float64) if out.dtype.kind == "f" else out

    return Target("array_api_strict", xp, asarray, to_numpy,
                  dtypes=("float32", "float64"))


def _torch_target(device: str) -> Target:
    import array_api_compat.torch as xp
    import torch

    def asarray(a: np.ndarray, dtype: str | None = None) -> Any:
        t = torch.from_numpy(np.array(a, order="C", copy=True)).to(device)
        return t.to(getattr(torch, dtype)) if dtype else t

    def to_numpy(a: Any) -> np.ndarray:
        if a.dtype.is_floating_point:
            a = a.to(torch.float64)
        return a.detach().cpu().numpy()

    return Target(f"torch-{device}", xp, asarray, to_numpy, device=device)


def _cupy_target() -> Target:
    import array_api_compat.cupy as xp
    import cupy

    def asarray(a: np.ndarray, dtype: str | None = None) -> Any:
        if dtype == "bfloat16":
            raise Unsupported("CuPy has no bfloat16 dtype; use the torch-cuda target")
        return cupy.asarray(a, dtype=getattr(cupy, dtype) if dtype else None)

    def to_numpy(a: Any) -> np.ndarray:
        out = cupy.asnumpy(a)
        return out.astype(np.float64) if out.dtype.kind == "f" else out

    return Target("cupy", xp, asarray, to_numpy, device="cuda",
                  dtypes=("float16", "float32", "float64"))


TARGETS: dict[str, Callable[[], Target]] = {
    "numpy": _numpy_target,
    "array_api_strict": _strict_target,
    "torch-cpu": lambda: _torch_target("cpu"),
    "torch-cuda": lambda: _torch_target("cuda"),
    "cupy": _cupy_target,
}


def target(name: str) -> Target:
    """The :class:`Target` called ``name`` (a key of :data:`TARGETS`)."""
    try:
        return TARGETS[name]()
    except KeyError:
        raise ValueError(f"target={name!r} is unknown: expected one of {sorted(TARGETS)}") from None


@dataclass(frozen=True)
class Case:
    """One registered case, for one operation set and dtype."""

    name: str
    ops: tuple[str, ...]
    dtype: str
    fn: Callable[[Target, str, str], None]
    target: Target = field(compare=False)

    def __str__(self) -> str:
        return f"{self.name}[{self.dtype}]"

    def run(self, backend: str) -> int:
        """Run on ``backend`` and return how many checks ran.

        Raises
        ------
        AssertionError
            When a result breaks the spec, or the backend failed to load
            (:class:`~softmaxkit.registry.BackendLoadError`).  Every exception raised
            carries the number of checks run until then as its ``checks`` attribute.
        Unsupported
            When the target lacks the dtype or the backend declines every part of the case;
            :class:`RanNothing` (an ``Unsupported``) when no check ran.
        """
        if self.dtype not in self.target.dtypes:
            hint = " (install ml_dtypes)" if self.target.name == "numpy" else ""
            raise Unsupported(f"target {self.target.name} has no {self.dtype}{hint}")
        with backend_opts(trace=True) as trace:
            try:
                try:
                    self.fn(self.target, self.dtype, backend)
                except BackendLoadError as exc:
                    raise AssertionError(f"the backend failed to load: {exc}") from None
                except NoBackendError as exc:
                    raise Unsupported(str(exc)) from None
            except Exception as exc:
                exc.checks = _count(trace, backend)  # type: ignore[attr-defined]
                raise
        checks = _count(trace, backend)
        if not checks:
            raise RanNothing(f"no check of {self} applies to backend {backend!r} on target "
                             f"{self.target.name}")
        return checks


def _count(trace: list[Any], backend: str) -> int:
    return sum(record.backend == backend for record in trace)


_REGISTERED: list[tuple[str, tuple[str, ...], tuple[str, ...], Callable[..., None]]] = []


def case(*ops: str, dtypes: Iterable[str] = FLOAT_DTYPES) -> Callable[[Callable], Callable]:
    """Register a conformance case exercising ``ops`` for each of ``dtypes``."""

    def register(fn: Callable[[Target, str, str], None]) -> Callable[[Target, str, str], None]:
        _REGISTERED.append((fn.__name__.removeprefix("case_"), ops, tuple(dtypes), fn))
        return fn

    return register


def _load_cases() -> None:
    for module in CASE_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def _head_dims(head_dims: Iterable[Iterable[int]]) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((operator.index(d), operator.index(dv)) for d, dv in head_dims)
    except (TypeError, ValueError):
        raise TypeError(
            f"head_dims={head_dims!r} is not valid: expected a sequence of (D, Dv) int pairs"
        ) from None
    if not pairs or any(d < 1 or dv < 1 for d, dv in pairs):
        raise ValueError(
            f"head_dims={head_dims!r} is not valid: expected at least one (D, Dv) pair of "
            "positive ints"
        )
    return pairs


def cases(
    target: str | Target = "numpy",
    ops: Iterable[str] | None = None,
    dtypes: Iterable[str] | None = None,
    head_dims: Iterable[Iterable[int]] | None = None,
) -> list[Case]:
    """Every registered case, on ``target``, optionally restricted to ``ops`` and ``dtypes``.

    Parameters
    ----------
    target : str or Target, optional
        Where the cases run: a name of :data:`TARGETS` or a :class:`Target`.
    ops : iterable of str, optional
        Only the cases that exercise one of these operations.
    dtypes : iterable of str, optional
        Only these dtypes.
    head_dims : iterable of (int, int), optional
        ``(D, Dv)`` pairs of key and value head dimensions for the attention cases, replacing
        the target's (:attr:`Target.head_dims`, :data:`HEAD_DIMS` by default); how each case
        picks its pair is described there.  A backend whose kernels serve only some head
        dimensions passes those, e.g. ``((64, 64), (128, 128))``.

    Returns
    -------
    list of Case
        One case per registered function and dtype.
    """
    _load_cases()
    t = target if isinstance(target, Target) else globals()["target"](target)
    if head_dims is not None:
        t = dataclasses.replace(t, head_dims=_head_dims(head_dims))
    wanted_ops = set(ops) if ops is not None else None
    wanted_dtypes = set(dtypes) if dtypes is not None else None
    out = []
    for name, case_ops, case_dtypes, fn in _REGISTERED:
        if wanted_ops is not None and not wanted_ops & set(case_ops):
            continue
        for dtype in case_dtypes:
            if wanted_dtypes is None or dtype in wanted_dtypes:
                out.append(Case(name, case_ops, dtype, fn, t))
    return out


@dataclass
class CaseResult:
    """The outcome of one case.

    Attributes
    ----------
    case, ops, dtype
        The case's name, the operations it exercises and its dtype.
    status
        One of :data:`STATUSES`: ``"passed"`` (every check held, and at least one ran),
        ``"failed"``, ``"unsupported"`` (the backend or target declines it) or
        ``"ran nothing"`` (no check ran: nothing of the case applies here).
    message
        Why it failed or is unsupported.
    checks
        How many checks ran (calls of the backend whose results were compared).
    """

    case: str
    ops: tuple[str, ...]
    dtype: str
    status: str
    message: str = ""
    checks: int = 0

    @property
    def passed(self) -> bool:
        """True unless the case failed (an unsupported case is not a failure)."""
        return self.status != "failed"


def check_backend(
    backend: str,
    *,
    target: str | Target = "numpy",
    ops: Iterable[str] | None = None,
    dtypes: Iterable[str] | None = None,
    head_dims: Iterable[Iterable[int]] | None = None,
) -> list[CaseResult]:
    """Run the conformance kit against ``backend`` on ``target`` and return every outcome.

    Parameters
    ----------
    backend : str
        The backend's registered name; every call is strict (``backend=``), so nothing falls
        back to another backend.
    target, ops, dtypes, head_dims
        As for :func:`cases`.

    Returns
    -------
    list of CaseResult
        One result per case: passed, failed (with the message), unsupported (with the
        backend's reason) or ran nothing, each with the number of checks it ran.
    """
    return list(run_cases(backend, cases(target, ops, dtypes, head_dims)))


def run_cases(backend: str, selected: Iterable[Case]) -> Iterator[CaseResult]:
    """:func:`check_backend` over the cases ``selected``, each outcome given as soon as its
    case has run (a GPU backend compiling its kernels takes minutes over the whole kit)."""
    from ..registry import failed_to_load

    unloaded = failed_to_load().get(backend)
    for c in selected:
        if unloaded is not None:
            yield CaseResult(c.name, c.ops, c.dtype, "failed",
                             f"the backend failed to load: {unloaded}")
            continue
        try:
            checks = c.run(backend)
        except RanNothing as exc:
            yield CaseResult(c.name, c.ops, c.dtype, "ran nothing", str(exc))
        except Unsupported as exc:
            yield CaseResult(c.name, c.ops, c.dtype, "unsupported", str(exc))
        except Exception as exc:
            # a crash is a failure too, reported with its type
            message = str(exc) if isinstance(exc, AssertionError) else (
                f"{type(exc).__name__}: {exc}")
            yield CaseResult(c.name, c.ops, c.dtype, "failed", message,
                             getattr(exc, "checks", 0))
        else:
            yield CaseResult(c.name, c.ops, c.dtype, "passed", checks=checks)
