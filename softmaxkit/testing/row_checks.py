"""What the row-operation conformance cases share: the operations' names, a strict
floating-point context, and checks of a result's library and dtype."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import softmaxkit as sk

from ..backend import BackendWarning
from ..dtypes import dtype_name
from ..registry import BackendLoadError, NoBackendError
from .kit import Target, Unsupported

ROW_OPS = ("softmax", "log_softmax", "logsumexp", "cross_entropy", "softmax_vjp",
           "log_softmax_vjp")


@contextmanager
def strict_fp() -> Iterator[None]:
    """Turn every warning, and numpy's divide / overflow / invalid flags, into exceptions.

    Underflow stays silent: a shifted exponential below the smallest normal number is a
    probability below the format's resolution, and flushing it is the spec's behaviour.  A
    backend's load warning (:class:`~softmaxkit.BackendWarning`, given once per backend) is
    passed on as a warning: it is about the installation, not the arithmetic, and the call
    it comes from fails on its own.
    """
    with warnings.catch_warnings(), np.errstate(divide="raise", over="raise", invalid="raise"):
        warnings.simplefilter("error")
        warnings.simplefilter("always", BackendWarning)
        yield


def random_logits(seed: int, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Normal logits of standard deviation ``scale``, the same for the same ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.normal(scale=scale, size=shape)


def represented(t: Target, a: np.ndarray, dtype: str) -> tuple[Any, np.ndarray]:
    """``a`` on the target in ``dtype``, and the float64 values it represents there."""
    arr = t.asarray(a, dtype)
    return arr, t.to_numpy(arr)


def masked(x: np.ndarray, where: np.ndarray | None) -> np.ndarray:
    return x if where is None else np.where(where, x, -np.inf)


def same_library(t: Target, out: Any, what: str) -> None:
    import array_api_compat

    got = array_api_compat.array_namespace(out)
    want = array_api_compat.array_namespace(t.asarray(np.zeros(1), None))
    assert got is want, f"{what}: result is a {got.__name__} array, expected {want.__name__}"


def check_dtype(out: Any, dtype: str, what: str) -> None:
    name = dtype_name(out.dtype)
    assert name == dtype, f"{what}: output dtype {name}, expected {dtype}"


def run_parts(parts: dict[str, Callable[[], None]]) -> None:
    """Run each operation's part of a case.  A part whose operation the backend does not
    serve is skipped; the case is unsupported when some part was declined and no other part
    called the backend (a part with nothing to check in this dtype calls nothing)."""
    declined, ran = [], 0
    with sk.backend_opts() as trace:  # the runner's record of the backend's calls
        for op, part in parts.items():
            before = len(trace)
            try:
                part()
            except BackendLoadError:
                raise  # a backend that fails to load fails the case
            except NoBackendError as exc:
                declined.append(f"{op}: {exc}")
            ran += len(trace) - before
    if declined and not ran:
        raise Unsupported("; ".join(declined))
