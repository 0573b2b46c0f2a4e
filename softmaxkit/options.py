"""The user's choices among backends: :func:`backend_opts` and the environment variables.

Options live in a :class:`contextvars.ContextVar` and nest; ``SOFTMAXKIT_PRIORITIZE`` and
``SOFTMAXKIT_BLOCK`` are read once, when the backends are discovered, and rank below the
context.  :mod:`softmaxkit.registry` turns both into each call's ordered candidates.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .backend import REFERENCE

ENV_PRIORITIZE = "SOFTMAXKIT_PRIORITIZE"
ENV_BLOCK = "SOFTMAXKIT_BLOCK"


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
    kernel
        The backend's kernel that ran the call, where the backend names it
        (:func:`note_kernel`; the CuPy backend names its attention forward's), else None.
    """

    op: str
    device: str
    dtype: str
    backend: str
    declined: dict[str, str]
    kernel: str | None = None


_options: contextvars.ContextVar[_Options] = contextvars.ContextVar(
    "softmaxkit_backend_opts", default=_Options()  # noqa: B039 - frozen, its list is per-use
)


def _names(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.split(",")
    return tuple(dict.fromkeys(v.strip() for v in value if v.strip()))


def note_kernel(name: str) -> None:
    """Name the kernel that runs the call being traced, in its :class:`TraceRecord`.

    A backend calls this from its kernel, where it chooses among kernels of its own (by device
    or shape); outside ``backend_opts(trace=True)`` it does nothing.

    Parameters
    ----------
    name
        The kernel's name, as the backend spells it.
    """
    records = _options.get().trace
    if records:
        records[-1].kernel = name


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

    A gradient taken through the PyTorch operators runs under the options of the forward call
    it differentiates, whichever thread autograd runs it on and whatever options surround
    ``backward()``: its records join the forward's trace.

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


def captured() -> _Options:
    """The options in force where this is called, for :func:`applied` to restore elsewhere.

    An autograd backward may run on a thread of its own (PyTorch's engine runs CUDA work on a
    device thread), where the context of the forward call is absent.
    """
    return _options.get()


@contextlib.contextmanager
def applied(opts: _Options) -> Iterator[None]:
    """Run a block under options :func:`captured` elsewhere (the same object, so a cached
    dispatch decision stays valid)."""
    token = _options.set(opts)
    try:
        yield
    finally:
        _options.reset(token)


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
