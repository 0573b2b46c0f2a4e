"""Timing of the row operations on the default path against the installed peers.

A run times every (operation, dtype, shape) for softmaxkit (whatever backend the registry
picks for the input), for each peer library that is installed (torch, scipy.special on CPU,
cupyx.scipy.special on CUDA) and for a plain copy of the same array, the bandwidth ceiling.
Each contender's result is first compared with a float64 reference on the same inputs;
softmaxkit must be within the spec's tolerance before anything is timed.  Times are medians
of several repeats after a warm-up, the samples of the contenders of a case taken in turn so
that a change of load on a shared machine weighs on all of them alike; on CUDA they are
measured with events after a synchronize.  The table's first line gives the versions, the
thread counts and the load average at the start and the end of the run.  Throughput counts
the bytes read and written (only the bytes read for logsumexp, whose output is one value per
row).

Extending: add an :class:`Operation` to :data:`OPERATIONS`, a :class:`Peer` to
:data:`PEERS`, or shapes to :data:`DEFAULT_SHAPES` / :data:`QUICK_SHAPES`.  The CUDA eager
table's shapes, its headline summary, the cross-entropy figures and the checks made on the
device are in :mod:`softmaxkit.bench_cuda`.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((4096, 4096), (32768, 512), (256, 65536))
"""Rows x row length timed by default: square, many short rows, few long rows (64 MiB each
in float32)."""

QUICK_SHAPES: tuple[tuple[int, int], ...] = ((512, 512), (64, 8192))
"""Small shapes for ``--quick``, so a run finishes in seconds."""


# -- float64 references ----------------------------------------------------------------------


def _softmax64(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _logsumexp64(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]


@dataclass(frozen=True)
class Operation:
    """A timed operation: its float64 reference and whether its output is a full array."""

    name: str
    reference: Callable[[np.ndarray], np.ndarray]
    writes_rows: bool = True  # False: one value per row, so only the bytes read count

    def traffic(self, nbytes: int) -> int:
        """Bytes moved by one call on an input of ``nbytes`` bytes."""
        return 2 * nbytes if self.writes_rows else nbytes


OPERATIONS: dict[str, Operation] = {
    "softmax": Operation("softmax", _softmax64),
    "log_softmax": Operation("log_softmax", _log_softmax64),
    "logsumexp": Operation("logsumexp", _logsumexp64, writes_rows=False),
}


# -- contenders ------------------------------------------------------------------------------


@dataclass
class Peer:
    """A library timed side by side with softmaxkit.

    Attributes
    ----------
    name
        Shown in the table.
    devices
        Device types it runs on (``"cpu"``, ``"cuda"``).
    load
        Returns ``(to_native, ops)`` or raises ImportError when the library is missing:
        ``to_native(x_float32_numpy, dtype_name, device)`` builds its input and ``ops`` maps
        an operation name to ``fn(native) -> result``.
    skip
        Dtypes it is not timed in, each with the reason shown in the table.
    """

    name: str
    devices: tuple[str, ...]
    load: Callable[[], tuple[Callable[[np.ndarray, str, str], Any], dict[str, Callable]]]
    skip: dict[str, str] = field(default_factory=dict)


def _torch_native(x: np.ndarray, dtype: str, device: str) -> Any:
    import torch

    return torch.from_numpy(x).to(device=device, dtype=getattr(torch, dtype))


def _numpy_native(x: np.ndarray, dtype: str, device: str) -> Any:
    from .dtypes import lookup

    return np.ascontiguousarray(x.astype(lookup(np, dtype)))


def _load_softmaxkit(backend: str | None = None) -> tuple[Callable, dict[str, Callable]]:
    import softmaxkit as sk

    def native(x: np.ndarray, dtype: str, device: str) -> Any:
        # numpy is the default path on CPU; on CUDA the input is a torch tensor
        return _numpy_native(x, dtype, device) if device == "cpu" else _torch_native(
            x, dtype, device)

    return native, {
        "softmax": lambda a: sk.softmax(a, axis=-1, backend=backend),
        "log_softmax": lambda a: sk.log_softmax(a, axis=-1, backend=backend),
        "logsumexp": lambda a: sk.logsumexp(a, axis=-1, backend=backend),
    }


def _load_torch() -> tuple[Callable, dict[str, Callable]]:
    import torch

    return _torch_native, {
        "softmax": lambda a: torch.softmax(a, dim=-1),
        "log_softmax": lambda a: torch.log_softmax(a, dim=-1),
        "logsumexp": lambda a: torch.logsumexp(a, dim=-1),
    }


def _load_scipy() -> tuple[Callable, dict[str, Callable]]:
    from scipy import special

    return _numpy_native, {
        "softmax": lambda a: special.softmax(a, axis=-1),
        "log_softmax": lambda a: special.log_softmax(a, axis=-1),
        "logsumexp": lambda a: special.logsumexp(a, axis=-1),
    }


def _load_cupyx() -> tuple[Callable, dict[str, Callable]]:
    import cupy
    from cupyx.scipy import special

    def native(x: np.ndarray, dtype: str, device: str) -> Any:
        if dtype == "bfloat16":
            raise TypeError("CuPy has no bfloat16")
        return cupy.asarray(x.astype(dtype))

    return native, {
        "softmax": lambda a: special.softmax(a, axis=-1),
        "log_softmax": lambda a: special.log_softmax(a, axis=-1),
        "logsumexp": lambda a: special.logsumexp(a, axis=-1),
    }


SOFTMAXKIT = Peer("softmaxkit", ("cpu", "cuda"), _load_softmaxkit)
PEERS: list[Peer] = [
    Peer("torch", ("cpu", "cuda"), _load_torch),
    Peer("scipy", ("cpu",), _load_scipy, skip=dict.fromkeys(
        ("float16", "bfloat16"), "not timed: numpy emulates 16-bit arithmetic (seconds a call)")),
    Peer("cupyx", ("cuda",), _load_cupyx),
]
"""The peers, tried in this order; a peer whose library is missing is left out."""


def _copier(native: Any) -> Callable[[], Any]:
    """A plain copy of ``native`` into a preallocated array: the bandwidth ceiling."""
    if isinstance(native, np.ndarray):
        out = np.empty_like(native)
        return lambda: np.copyto(out, native)
    out = native.clone() if hasattr(native, "clone") else native.copy()
    return lambda: out.copy_(native) if hasattr(out, "copy_") else out.__setitem__(
        Ellipsis, native)


def _to_float64(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):  # torch
        import torch

        return a.detach().to(torch.float64).cpu().numpy()
    if hasattr(a, "get") and not isinstance(a, np.ndarray):  # cupy
        return np.asarray(a.get(), dtype=np.float64)
    return np.asarray(a, dtype=np.float64)


# -- timing ----------------------------------------------------------------------------------


def cuda_available() -> bool:
    """Whether PyTorch is installed and sees a CUDA device (CUDA timing uses its events)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _synchronizer(device: str) -> Callable[[], None]:
    if device == "cpu":
        return lambda: None
    import torch

    return torch.cuda.synchronize


def time_call(fn: Callable[[], Any], device: str = "cpu", repeats: int = 5,
              min_time: float = 0.02) -> float:
    """The median time of one call of ``fn`` in seconds.

    A warm-up call comes first.  Each of ``repeats`` samples runs ``fn`` enough times to
    last about ``min_time`` seconds; on CUDA the samples are timed with CUDA events on the
    current stream after a synchronize.
    """
    return time_calls([fn], device, repeats, min_time)[0]


def time_calls(fns: Sequence[Callable[[], Any]], device: str = "cpu", repeats: int = 5,
               min_time: float = 0.02) -> list[float]:
    """The median time of one call of each of ``fns`` in seconds, sampled in turn.

    Like :func:`time_call`, but the samples of the functions alternate (sample 1 of each,
    then sample 2 of each, ...), so a change of load on a shared machine during the run
    slows every contender alike instead of whichever happened to run then.
    """
    sync = _synchronizer(device)
    numbers = []
    for fn in fns:
        start = time.perf_counter()
        fn()
        sync()
        first = time.perf_counter() - start
        numbers.append(max(1, min(1000, int(min_time / max(first, 1e-7)))))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, number, mine in zip(fns, numbers, samples, strict=True):
            mine.append(_sample(fn, number, device, sync))
    return [statistics.median(mine) for mine in samples]


@functools.cache
def _do_bench() -> Callable[..., float] | None:
    try:
        from triton.testing import do_bench
    except Exception:  # triton is optional
        return None
    return do_bench


def cuda_timer() -> str:
    """How CUDA samples are timed: ``"triton.testing.do_bench median"`` or ``"CUDA events"``."""
    return "triton.testing.do_bench median" if _do_bench() else "CUDA events"


def _sample(fn: Callable[[], Any], number: int, device: str, sync: Callable[[], None]) -> float:
    """Seconds per call over ``number`` calls of ``fn`` (on CUDA with triton installed, the
    median of ``triton.testing.do_bench``, which times each call by itself)."""
    do_bench = _do_bench() if device != "cpu" else None
    if do_bench is not None:
        return do_bench(fn, return_mode="median") / 1e3
    if device == "cpu":
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        return (time.perf_counter() - t0) / number
    import torch

    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    sync()
    begin.record()
    for _ in range(number):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / number


# -- a run -----------------------------------------------------------------------------------


@dataclass
class Result:
    """One contender on one (operation, dtype, shape)."""

    op: str
    dtype: str
    shape: tuple[int, int]
    contender: str
    seconds: float = math.nan
    gbps: float = math.nan
    max_error: float = math.nan
    note: str = ""


@dataclass
class Run:
    """What :func:`run` measured, with the table and plot made from it."""

    device: str
    results: list[Result] = field(default_factory=list)
    environment: str = ""

    def table(self) -> str:
        """The results as a text table, with each contender's speed relative to softmaxkit."""
        head = (f"{'op':<12} {'dtype':<9} {'shape':<12} {'contender':<14} {'ms':>9} "
                f"{'GB/s':>8} {'sk speed-up':>11} {'max err':>9}  note")
        lines = [self.environment, head, "-" * len(head)] if self.environment else [
            head, "-" * len(head)]
        by_case: dict[tuple, list[Result]] = {}
        for r in self.results:
            by_case.setdefault((r.op, r.dtype, r.shape), []).append(r)
        for (op, dtype, shape), group in by_case.items():
            ours = next((r for r in group if r.contender == "softmaxkit"), None)
            for r in group:
                ratio, note = "", r.note
                if ours is not None and r is not ours and not math.isnan(ours.gbps):
                    if r.contender == "copy":
                        note = f"{note}: softmaxkit reaches {ours.gbps / r.gbps:.0%} of it"
                    elif not math.isnan(r.seconds):
                        ratio = f"{r.seconds / ours.seconds:.2f}x"
                err = "" if math.isnan(r.max_error) else f"{r.max_error:.1e}"
                ms = "" if math.isnan(r.seconds) else f"{r.seconds * 1e3:.3f}"
                gbps = "" if math.isnan(r.gbps) else f"{r.gbps:.1f}"
                lines.append(
                    f"{op:<12} {dtype:<9} {'x'.join(map(str, shape)):<12} {r.contender:<14} "
                    f"{ms:>9} {gbps:>8} {ratio:>11} {err:>9}  {note}"
                )
        lines.append("sk speed-up: the contender's time / softmaxkit's (above 1: softmaxkit is "
                     "faster); GB/s counts bytes read + written (read only for logsumexp).")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Save a bar chart of GB/s per case and contender to ``path`` (PNG)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cases = list(dict.fromkeys((r.op, r.dtype, r.shape) for r in self.results))
        names = list(dict.fromkeys(r.contender for r in self.results))
        width = 0.8 / max(len(names), 1)
        fig, ax = plt.subplots(figsize=(min(24.0, max(6.0, 1.4 * len(cases))), 4.5))
        for i, name in enumerate(names):
            values = [next((r.gbps for r in self.results
                            if (r.op, r.dtype, r.shape) == c and r.contender == name), 0.0)
                      for c in cases]
            ax.bar([j + i * width for j in range(len(cases))],
                   [0.0 if math.isnan(v) else v for v in values], width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"{op}\n{dt}\n{'x'.join(map(str, s))}" for op, dt, s in cases],
                           fontsize=8)
        ax.set_ylabel("GB/s (bytes read + written)")
        ax.set_title(f"softmaxkit and peers on {self.device}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _progress(items: Sequence[Any], show: bool) -> Iterator[Any]:
    if show:
        try:
            from tqdm import tqdm
        except ImportError:  # the bench extra is not installed: no bar
            pass
        else:
            yield from tqdm(items, desc="bench", unit="case", leave=False)
            return
    yield from items


def run(
    ops: Iterable[str] = tuple(OPERATIONS),
    dtypes: Iterable[str] = ("float32",),
    shapes: Iterable[tuple[int, int]] = DEFAULT_SHAPES,
    device: str = "cpu",
    repeats: int = 5,
    progress: bool = True,
    seed: int = 0,
    min_time: float = 0.02,
    backends: Sequence[str] = (),
) -> Run:
    """Time ``ops`` for every dtype and shape, softmaxkit next to each installed peer.

    Each timed sample repeats a call for about ``min_time`` seconds (see :func:`time_call`).
    Each backend named in ``backends`` is also timed on its own (contender ``sk:NAME``, the
    call made with ``backend=NAME``), next to softmaxkit's default choice, to compare
    backends that serve the same calls.

    Raises
    ------
    AssertionError
        When softmaxkit's result is outside the spec's tolerance (nothing is timed then).
    """
    from .bench_cuda import check_torch, torch64, torch_max_error, torch_reference

    forced = [Peer(f"sk:{b}", SOFTMAXKIT.devices, functools.partial(_load_softmaxkit, b))
              for b in backends]
    contenders = []
    for peer in [SOFTMAXKIT, *forced, *PEERS]:
        if device not in peer.devices:
            continue
        try:
            contenders.append((peer.name, *peer.load(), peer.skip))
        except ImportError:
            continue
    out = Run(device, environment=_environment(device, [c[0] for c in contenders]))
    load_at_start = _load()
    rng = np.random.default_rng(seed)
    cases = [(dt, tuple(s), op) for dt in dtypes for s in shapes for op in ops]
    x32: np.ndarray | None = None
    key: tuple[str, tuple[int, int]] | None = None
    for dtype, shape, op in _progress(cases, progress):
        if key != (dtype, shape):  # one input per (dtype, shape): large shapes are 64 MiB
            key, x32 = (dtype, shape), None  # the previous input is freed first
            x32 = rng.normal(scale=4.0, size=shape).astype(np.float32)
            copy_native = (_numpy_native if device == "cpu" else _torch_native)(
                x32, dtype, device)
        assert x32 is not None
        timed: list[tuple[Result, Callable[[], Any], int]] = []
        expected = None
        for name, to_native, fns, skip in contenders:
            result = Result(op, dtype, shape, name)
            out.results.append(result)
            if dtype in skip:
                result.note = skip[dtype]
                continue
            try:
                native = to_native(x32, dtype, device)
                # the result's size: the input's, or one value a row
                _poison(native, _nbytes(native) // (1 if OPERATIONS[op].writes_rows
                                                    else shape[-1]))
                with _trace() as trace:
                    got = fns[op](native)
            except Exception as exc:  # a peer without this dtype or op
                result.note = f"{type(exc).__name__}: {str(exc)[:60]}"
                continue
            on_device = device != "cpu"
            if expected is None:
                # the float64 reference of the values the contenders actually see (computed
                # on the device there, through torch: host references of 0.5 GB inputs take
                # longer than the timing)
                expected = (torch_reference(op, torch64(native)) if on_device
                            else OPERATIONS[op].reference(_to_float64(native)))
            got64 = torch64(got) if on_device else _to_float64(got)
            if on_device:
                result.max_error = torch_max_error(got64, expected)
            else:
                finite = np.isfinite(expected)
                result.max_error = float(np.max(np.abs(got64 - expected)[finite], initial=0.0))
            if name == "softmaxkit" or name.startswith("sk:"):
                result.note = "on " + ", ".join(dict.fromkeys(r.backend for r in trace))
                if on_device:
                    check_torch(op, got64, expected, torch64(native), dtype)
                else:
                    _check(op, got64, expected, _to_float64(native), dtype)
            del got, got64
            timed.append((result, functools.partial(fns[op], native),
                          OPERATIONS[op].traffic(_nbytes(native))))
        copy = Result(op, dtype, shape, "copy", note="bandwidth ceiling")
        out.results.append(copy)
        timed.append((copy, _copier(copy_native), 2 * _nbytes(copy_native)))
        seconds = time_calls([fn for _, fn, _ in timed], device, repeats, min_time)
        for (result, _, moved), sec in zip(timed, seconds, strict=True):
            result.seconds, result.gbps = sec, moved / sec / 1e9
    out.environment += f", load average {load_at_start} at the start, {_load()} at the end"
    return out


def _poison(like: Any, nbytes: int) -> None:
    from .callcost import _poison as poison

    poison(like, nbytes)


def _load() -> str:
    """The one-minute load average, or "n/a" where the system does not report one."""
    import os

    try:
        return f"{os.getloadavg()[0]:.1f}"
    except (AttributeError, OSError):
        return "n/a"


def _check(op: str, got: np.ndarray, expected: np.ndarray, x: np.ndarray, dtype: str) -> None:
    """Refuse to time a wrong softmaxkit result.

    Probabilities are held to the spec's bound.  A log-domain value ``x_i - m - log(s)`` is
    the difference of terms as large as the row's logits, so its rounding error scales with
    them, not with the (possibly tiny) result: the bound is relative to ``|x| + |expected|``.
    """
    from .testing.tolerance import TOLERANCES, assert_close

    if op == "softmax":
        assert_close(got, expected, dtype, f"bench {op}")
        return
    rtol, atol = TOLERANCES[dtype]
    scale = np.abs(x).max(axis=-1, keepdims=True)
    if got.ndim < x.ndim:
        scale = scale[..., 0]
    bound = atol + rtol * (np.abs(expected) + scale)
    err = np.abs(got - expected)
    if not np.all(err <= bound):
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"bench {op} [{dtype}]: error {err[worst]:.3g} exceeds "
                             f"{bound[worst]:.3g}; softmaxkit is not timed on a wrong result")


def _trace() -> Any:
    from .registry import backend_opts

    return backend_opts(trace=True)


def _environment(device: str, names: list[str]) -> str:
    """One line naming the versions and thread counts the figures depend on."""
    import os

    import softmaxkit

    parts = [f"device {device}", f"softmaxkit {softmaxkit.__version__}", f"numpy {np.__version__}"]
    if "torch" in names:
        import torch

        parts.append(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    if "scipy" in names:
        import scipy

        parts.append(f"scipy {scipy.__version__}")
    if "jax" in names:
        try:
            import jax
        except ImportError:
            pass
        else:
            parts.append(f"jax {jax.__version__}")
    parts.append(f"{os.cpu_count()} CPUs")
    return ", ".join(parts)


def _nbytes(a: Any) -> int:
    return int(a.nbytes) if hasattr(a, "nbytes") else a.numel() * a.element_size()
