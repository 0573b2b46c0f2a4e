"""The backend's row kernels as softmaxkit calls them: ``fn(*, xp, **params)`` on ``[..., N]``.

Each function adapts the arrays (:mod:`.adapters`), picks the threaded or the one-thread
loop (:func:`parallel`) and runs the compiled kernel (:mod:`.row_kernels`); the result is in
the caller's library.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from softmaxkit.dtypes import accumulator_dtype

from . import addresses as a
from . import row_kernels as k
from .adapters import (
    _NO_MASK,
    Output,
    accumulator,
    compute_input,
    mask_rows,
    numpy_dtype,
    numpy_view,
    rows,
    storage,
)
from .buffers import ALIGN_FROM, result_array

PARALLEL_MIN_ELEMENTS = 1 << 18
"""Below this many elements one thread is faster than starting Numba's thread pool.

Measured on the 2-core machine: launching a ``prange`` loop costs about 150 us with the
OpenMP layer, the time one core needs for a softmax over about 150 000 float32 elements.
"""


def parallel(r: int, n: int) -> bool:
    """Whether a call over ``r`` rows of ``n`` elements should use the threaded loop."""
    return r > 1 and r * n >= PARALLEL_MIN_ELEMENTS and num_threads() > 1


_read_threads: Callable[[], int] | None = None


def num_threads() -> int:
    """``numba.get_num_threads()``: the threads this thread's parallel loops use.

    Numba's function takes two locks on every call to check that its threading layer has
    started (about 1 us, as much as the rest of a mid-size call's host work); once it has,
    the reader that function then calls is used directly (a seventh of the time).
    """
    global _read_threads
    if _read_threads is None:
        threads = numba.get_num_threads()  # starts the threading layer
        from numba.np.ufunc import parallel as layer

        read = getattr(layer, "_get_num_threads", None)
        # a Numba without that reader, or one that reads something else: the public function
        _read_threads = (read if callable(read) and read() == threads
                         else numba.get_num_threads)
    return _read_threads()


SPLIT_MIN_BATCHES = 2
"""The streamed kernels (softmax, log_softmax, logsumexp) may use the threads for inputs of
at least this many batches of rows (:data:`~.row_kernels.BATCH_BYTES` each, 128 KiB in all).

Their threads take whole batches from a shared counter, so a smaller input (one row, or rows
within one batch) cannot be split and never starts the pool.
"""

SPLIT_BYTES = SPLIT_MIN_BATCHES * k.BATCH_BYTES

EXPLORE_FIRST = 16
"""Calls of a mid-size input between two tries of the way that was slower, at first."""
EXPLORE_MAX = 1024
"""... and at most, after the slower way has stayed slower try after try."""


KEEP_TIMES = 5
"""Recent times kept of each way; their median is its estimate."""

TIME_EVERY = 8
"""Between tries, one call in this many is timed (a try's calls always are): timing a call
and taking in its time cost about 4 us of Python right after a threaded 64 x 1024 softmax,
whose caches the kernel has just turned over, a sixth of the kernel's own time."""

MARGIN = 1.2
"""How many times cheaper the other way's estimate must be to take over from the way in use:
one lucky try of the other way, or a few stalled calls of the way in use, do not switch a
choice that is right (on an idle 2-core machine about one threaded call in ten of a 64 x 1024
softmax takes 1.3 times the median, one in twenty 1.5 times)."""


def _middle(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


class Threads:
    """For mid-size inputs of one streamed kernel: threads or one thread, by measured cost.

    Between :data:`SPLIT_MIN_BATCHES` batches and :data:`PARALLEL_MIN_ELEMENTS` elements
    neither way always wins.  On an idle 2-core machine a ``prange`` launch costs a few
    microseconds, so two threads take about 60% of the time of one (a float32 64 x 1024
    softmax: about 42 us on one core, 25 on two); on a machine whose cores are busy with
    other work the launch and the join wait until the second thread gets a core, which can
    take milliseconds, and one thread is many times faster.  So the time per byte of each
    way is measured on the calls themselves, the median of its last :data:`KEEP_TIMES`
    times is its estimate, and the way in use keeps running until the other's estimate is
    :data:`MARGIN` times lower (a median, so that neither stalled calls nor one lucky call
    decide, while a way that stalls on most calls loses within three of its timed ones).

    Between tries one call in :data:`TIME_EVERY` is timed, so the way in use is estimated from
    its recent timed calls. The other way is tried again after :data:`EXPLORE_FIRST` calls,
    twice as rarely each time it loses again (at most every :data:`EXPLORE_MAX` calls); its try
    replaces its older, stale times. When the way in use itself gets that much slower than the
    other's estimate, the choice switches and the way left is tried again within
    :data:`EXPLORE_FIRST` calls: a long wait is earned by lost tries, and a few slow calls of
    the way that was winning (the first ones after its threads went to sleep, or while another
    program's threads held a core) are not a lost try. A try of the threads makes two calls and
    keeps the second's time: after a stretch on one thread the pool's threads have gone to
    sleep, and the first call pays for waking them. Both ways give bitwise the same result:
    every row is computed by the same code.
    """

    __slots__ = ("times", "middles", "using", "countdown", "interval", "trying")

    def __init__(self) -> None:
        # seconds per byte of the recent calls, and their medians: one thread, threads
        self.times: tuple[list[float], list[float]] = ([], [])
        self.middles = [math.inf, math.inf]
        self.using = True  # the way chosen between tries
        self.countdown = 0  # calls of the way in use before the other is tried again
        self.interval = EXPLORE_FIRST
        self.trying = 0  # calls left of a try of the other way (the last one is timed)

    def _switch(self) -> bool:
        """Take the other way if its estimate is :data:`MARGIN` times lower; whether it did."""
        one, many = self.middles
        if (one * MARGIN < many) if self.using else (many * MARGIN < one):
            self.using = not self.using
            return True
        return False

    def choose(self) -> tuple[bool, bool]:
        """Whether the next call runs on the threads, and whether it is to be timed (and
        its time given to :meth:`record`)."""
        if self.countdown > 0:  # the common call: both ways measured, no try under way
            self.countdown -= 1
            return self.using, self.countdown % TIME_EVERY == 0
        one, many = self.times
        if not many or not one:  # each way is measured once first
            return not many, True
        if not self.trying:
            self.trying = 1 if self.using else 2
        return not self.using, True  # the other way, tried again

    def record(self, threads: bool, seconds: float, nbytes: int) -> None:
        """Take in the time of a call made the way :meth:`choose` said."""
        if self.trying > 1:  # the call that woke the threads: not timed
            self.trying -= 1
            return
        one, many = self.times
        measured = bool(one and many)
        # the tried way's older times are stale: its try replaces them; the lists are
        # replaced whole, so a call in another thread never sees one empty
        kept = [] if self.trying else (many if threads else one)[1 - KEEP_TIMES:]
        kept.append(seconds / nbytes)
        self.times = (one, kept) if threads else (kept, many)
        self.middles[threads] = _middle(kept)
        if self.trying:
            self.trying = 0
            lost_again = not self._switch()
            self.interval = min(2 * self.interval, EXPLORE_MAX) if lost_again else EXPLORE_FIRST
            self.countdown = self.interval
        elif not measured and all(self.times):  # both ways now measured once
            self.using = self.middles[1] < self.middles[0]
            self.countdown = self.interval
        elif measured and self._switch():
            # the way in use got slower than the other's estimate: try the way left again
            # within EXPLORE_FIRST calls, not after the long wait that its rival's lost tries
            # earned (a few slow calls, such as the first ones after the pool's threads went
            # to sleep, would otherwise hand up to EXPLORE_MAX calls to the slower way)
            self.countdown = min(self.countdown, EXPLORE_FIRST)


_THREADS: dict[tuple[str, int], Threads] = {}


def run_rows(name: str, ser: Any, par: Any, r: int, size: int, itemsize: int,
             *args: Any) -> None:
    """Run streamed kernel ``name`` with arguments ``args`` over ``r`` rows of ``size``
    elements in all, of ``itemsize`` bytes: on one thread (``ser``), on the threads
    (``par``, which takes their count last), or as :class:`Threads` decides for a mid-size
    input."""
    nbytes = size * itemsize
    if nbytes < SPLIT_BYTES or r < 2:
        ser(*args)
        return
    threads = (_read_threads or num_threads)()
    if threads < 2:
        ser(*args)
    elif size >= PARALLEL_MIN_ELEMENTS:
        par(*args, threads)
    else:
        # one estimate per size within a factor of two
        chooser = _THREADS.get((name, nbytes.bit_length())) or _chooser(name, nbytes)
        use, timed = chooser.choose()
        if not timed:  # the common call: nothing to time
            if use:
                par(*args, threads)
            else:
                ser(*args)
            return
        start = time.perf_counter()
        if use:
            par(*args, threads)
        else:
            ser(*args)
        chooser.record(use, time.perf_counter() - start, nbytes)


def _chooser(name: str, nbytes: int) -> Threads:
    """The :class:`Threads` of kernel ``name`` for inputs of about ``nbytes``, made once."""
    return _THREADS.setdefault((name, nbytes.bit_length()), Threads())


def _plan(x: Any, out_dtype: Any) -> tuple[np.ndarray, np.ndarray, np.dtype]:
    """``x``'s numpy view, the ``[R, N]`` storage rows the kernel reads, and their dtype.

    When the result dtype differs from the input's, the kernel runs in the input's
    accumulator dtype (:func:`~.adapters.compute_input`) and the result is converted once.
    """
    view = numpy_view(x)
    xin = compute_input(view, out_dtype)
    return view, rows(storage(xin)), xin.dtype


_DIRECT = (np.dtype(np.float32), np.dtype(np.float64))


def _direct(x: Any, where: Any, out_dtype: Any) -> np.ndarray | None:
    """``x``'s numpy view when the kernel reads it as it is and writes a result of its dtype:
    float32 or float64, C-contiguous, writable, no mask and no conversion.  ``None``
    otherwise (the general path then adapts the arrays)."""
    if where is not None:
        return None
    if type(x) is np.ndarray:
        view = x
        dtype = view.dtype
        if dtype not in _DIRECT or (out_dtype is not dtype and numpy_dtype(out_dtype) != dtype):
            return None
    else:  # a torch CPU tensor: its own dtype objects tell, before any view is made
        if not _direct_dtype(x, out_dtype):
            return None
        view = numpy_view(x) if x.requires_grad else _tensor_view(x)
    return view if view.size and _in_place(view) else None


def _in_place(view: np.ndarray) -> bool:
    """Whether the kernel reads numpy view ``view`` as it is: C-contiguous and writable."""
    flags = view.flags
    return flags.c_contiguous and flags.writeable


def _direct_dtype(x: Any, out_dtype: Any) -> bool:
    """Whether torch tensor ``x`` is float32 or float64 and its result of its own dtype."""
    return x.dtype is out_dtype and out_dtype in (_TORCH_DIRECT or _torch_direct())


def _tensor_view(x: Any) -> np.ndarray:
    """:func:`~.adapters.numpy_view` of a float32 or float64 tensor that requires no grad,
    with the checks it makes already made."""
    try:
        return x.numpy()
    except (RuntimeError, TypeError):  # a negative bit
        return numpy_view(x)


_TORCH_DIRECT: dict[Any, np.dtype] = {}
"""The torch dtypes of :data:`_DIRECT` and their numpy dtypes, once a tensor has been seen
(:func:`_torch_direct`)."""
_from_numpy: Callable[[np.ndarray], Any] | None = None
_empty_like: Callable[..., Any] | None = None
_empty: Callable[..., Any] | None = None
"""``torch.from_numpy``, ``torch.empty_like`` and ``torch.empty``, likewise."""


def _torch_direct() -> dict[Any, np.dtype]:
    """Fill :data:`_TORCH_DIRECT` and torch's functions above (torch is imported by whoever
    passed a tensor); module globals, read without a call on every later one."""
    global _TORCH_DIRECT, _from_numpy, _empty_like, _empty
    import torch

    _from_numpy, _empty_like, _empty = torch.from_numpy, torch.empty_like, torch.empty
    _TORCH_DIRECT = {torch.float32: _DIRECT[0], torch.float64: _DIRECT[1]}
    return _TORCH_DIRECT


def _addressed(x: Any, where: Any, out_dtype: Any) -> bool:
    """Whether ``x``, a torch tensor, goes to its kernel by address (:mod:`.addresses`): the
    direct path's float32 or float64 rows of the result's dtype with no mask, C-contiguous
    with no negative bit, and a result below :data:`~.buffers.ALIGN_FROM` bytes (a larger
    one takes a line-aligned, reused buffer through numpy, :func:`_result`)."""
    if where is not None or type(x) is np.ndarray or not _direct_dtype(x, out_dtype):
        return False
    return 0 < x.numel() * x.element_size() < ALIGN_FROM and _contiguous(x)


def _contiguous(x: Any) -> bool:
    """Whether torch tensor ``x`` is C-contiguous with no negative bit (its memory holds its
    values in order)."""
    return x.is_contiguous() and not x.is_neg()


def _rows_of(x: Any) -> tuple[int, int, np.dtype]:
    """Rows, row length and numpy dtype of a tensor :func:`_addressed` took."""
    n = x.shape[-1]
    return x.numel() // n, n, _TORCH_DIRECT[x.dtype]


def _result(like: Any, view: np.ndarray, shape: tuple[int, ...],
            small: bool) -> tuple[Any, np.ndarray]:
    """A result of ``view``'s dtype in ``like``'s library, and its numpy view; ``small``
    says it is below :data:`~.buffers.ALIGN_FROM` bytes, so plain ``np.empty`` is what
    :func:`~.buffers.result_array` would give.  ``like`` is an array :func:`_direct` took."""
    out = np.empty(shape, view.dtype) if small else result_array(shape, view.dtype)
    return (out if type(like) is np.ndarray else _from_numpy(out)), out  # type: ignore[misc]


_KERNELS = {"softmax": (k.softmax_ser, k.softmax_par),
            "log_softmax": (k.log_softmax_ser, k.log_softmax_par)}
"""The one-thread and threaded kernels of each normalization."""


def _normalize_direct(which: str, nan: bool, like: Any, view: np.ndarray) -> Any:
    """The normalization ``which`` of a view :func:`_direct` took, straight to its kernel."""
    shape = view.shape
    x2 = view if len(shape) == 2 else view.reshape(-1, shape[-1])
    result, out = _result(like, view, shape, view.nbytes < ALIGN_FROM)
    o2 = out if len(shape) == 2 else out.reshape(x2.shape)
    run_rows(which, *_KERNELS[which], x2.shape[0], x2.size, x2.itemsize, x2, _NO_MASK, 0,
             False, nan, o2)
    return result


_ADDRESSED = {"softmax": (a.softmax_ser, a.softmax_par),
              "log_softmax": (a.log_softmax_ser, a.log_softmax_par)}
""":data:`_KERNELS` by address."""


def _normalize_at(which: str, nan: bool, x: Any, r: int, n: int, dtype: np.dtype) -> Any:
    """The normalization ``which`` of a tensor :func:`_addressed` took, of ``r`` rows of
    ``n`` elements of ``dtype``, into ``torch.empty_like(x)``."""
    out = _empty_like(x)  # type: ignore[misc]
    run_rows(which, *_ADDRESSED[which], r, r * n, dtype.itemsize, x.data_ptr(), out.data_ptr(),
             r, n, dtype, _NO_MASK, nan)
    return out


def _normalize(which: str, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    if _addressed(x, where, out_dtype):
        return _normalize_at(which, masked == "nan", x, *_rows_of(x))
    view = _direct(x, where, out_dtype)
    if view is not None:  # the common call, straight to its kernel
        return _normalize_direct(which, masked == "nan", x, view)
    view, x2, compute = _plan(x, out_dtype)
    w2, wstep, has_where = mask_rows(where)
    out = Output(view.shape, out_dtype, x, compute)
    o2 = out.storage.reshape(x2.shape)
    nan = masked == "nan"
    run_rows(which, *_KERNELS[which], x2.shape[0], x2.size, x2.itemsize, x2, w2, wstep,
             has_where, nan, o2)
    return out.finish()


def softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Softmax along the last axis (see the reference kernel of the same name)."""
    return _normalize("softmax", x, where, masked, out_dtype)


def log_softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Log-softmax along the last axis (see the reference kernel of the same name)."""
    return _normalize("log_softmax", x, where, masked, out_dtype)


def _logsumexp_direct(return_sign: bool, like: Any, view: np.ndarray) -> Any:
    """Unweighted logsumexp of a view :func:`_direct` took, straight to its kernel."""
    x2 = view.reshape(-1, view.shape[-1])
    small = view.nbytes < ALIGN_FROM  # the results are smaller than the input
    (lse, lse_s), (sign, sign_s) = (_result(like, view, view.shape[:-1], small)
                                    for _ in range(2))
    run_rows("logsumexp", k.logsumexp_ser, k.logsumexp_par, x2.shape[0], x2.size, x2.itemsize,
             x2, _NO_MASK, 0, False, lse_s.reshape(-1), sign_s.reshape(-1))
    return (lse, sign) if return_sign else lse


def _logsumexp_at(return_sign: bool, x: Any, r: int, n: int, dtype: np.dtype) -> Any:
    """Unweighted logsumexp of a tensor :func:`_addressed` took, as :func:`_normalize_at`."""
    batch = x.shape[:-1]
    lse, sign = _empty(batch, dtype=x.dtype), _empty(batch, dtype=x.dtype)  # type: ignore[misc]
    run_rows("logsumexp", a.logsumexp_ser, a.logsumexp_par, r, r * n, dtype.itemsize,
             x.data_ptr(), lse.data_ptr(), sign.data_ptr(), r, n, dtype, _NO_MASK)
    return (lse, sign) if return_sign else lse


def logsumexp(
    xp: Any, *, x: Any, b: Any, where: Any, return_sign: bool, out_dtype: Any
) -> Any:
    """``log |sum b exp(x)|`` along the last axis, and its sign when ``return_sign``."""
    if b is None and _addressed(x, where, out_dtype):
        return _logsumexp_at(return_sign, x, *_rows_of(x))
    view = _direct(x, where, out_dtype) if b is None else None
    if view is not None:  # the common call, straight to its kernel
        return _logsumexp_direct(return_sign, x, view)
    w2, wstep, has_where = mask_rows(where)
    if b is None:
        view, x2, compute = _plan(x, out_dtype)
    else:
        # weighted: x and b in the accumulator of the result dtype (float64 if either is)
        view = numpy_view(x)
        compute = np.dtype(accumulator(numpy_dtype(out_dtype)))
        x2 = rows(view.astype(compute))
        b2 = rows(numpy_view(b).astype(compute))
    batch = view.shape[:-1]
    lse = Output(batch, out_dtype, x, compute)
    sign = Output(batch, out_dtype, x, compute)
    lse_s, sign_s = lse.storage.reshape(-1), sign.storage.reshape(-1)
    if b is None:
        run_rows("logsumexp", k.logsumexp_ser, k.logsumexp_par, x2.shape[0], x2.size,
                 x2.itemsize, x2, w2, wstep, has_where, lse_s, sign_s)
    else:
        k.logsumexp_b_ser(x2, b2, w2, wstep, has_where, bool(return_sign), lse_s, sign_s)
    return (lse.finish(), sign.finish()) if return_sign else lse.finish()


# -- repeated calls (registry.Binding.repeat): the direct path, its checks of the kind made once


def _kept_view(x: Any) -> np.ndarray | None:
    """The numpy view of ``x``, of a kind of call :func:`_direct` took, when the kernel reads
    it as it is, as that call's (its strides may differ; ``None``: the kernel's own path then
    runs, which copies)."""
    if type(x) is np.ndarray:
        view = x
    else:
        try:
            view = x.numpy()
        except RuntimeError:  # a negative bit (or a grad): numpy_view's work, in the kernel
            return None
    return view if _in_place(view) else None


def _repeat_form(args: dict[str, Any], at: Callable[..., Any],
                 viewed: Callable[..., Any]) -> Callable[[Any], Any] | None:
    """The repeated form of the kind of call whose first call had kernel arguments ``args``:
    by address where :func:`_addressed` took it (``at(x, r, n, dtype)`` runs a call), through
    a numpy view where :func:`_direct` did (``viewed(x, view)``), else None."""
    x, where, out_dtype = args["x"], args["where"], args["out_dtype"]
    if _addressed(x, where, out_dtype):
        r, n, dtype = _rows_of(x)

        def by_address(x: Any) -> Any:
            return at(x, r, n, dtype) if _contiguous(x) else None

        return by_address
    if _direct(x, where, out_dtype) is None:
        return None

    def by_view(x: Any) -> Any:
        view = _kept_view(x)
        return None if view is None else viewed(x, view)

    return by_view


def _repeat_normalize(which: str) -> Callable[[Any, dict[str, Any]], Any]:
    def repeat(xp: Any, args: dict[str, Any]) -> Callable[[Any], Any] | None:
        nan = args["masked"] == "nan"
        return _repeat_form(args, functools.partial(_normalize_at, which, nan),
                            functools.partial(_normalize_direct, which, nan))

    return repeat


def _repeat_logsumexp(xp: Any, args: dict[str, Any]) -> Callable[[Any], Any] | None:
    if args["b"] is not None:
        return None
    sign = args["return_sign"]
    return _repeat_form(args, functools.partial(_logsumexp_at, sign),
                        functools.partial(_logsumexp_direct, sign))


softmax.repeat = _repeat_normalize("softmax")  # type: ignore[attr-defined]
log_softmax.repeat = _repeat_normalize("log_softmax")  # type: ignore[attr-defined]
logsumexp.repeat = _repeat_logsumexp  # type: ignore[attr-defined]


def _scale(grad_scale: Any, acc: Any) -> Any:
    """The gradient's scale as an accumulator scalar: a Python float, or the 0-d array the
    frontend computes for a mean over the rows not ignored (read in place, CPU memory)."""
    if grad_scale is None:
        return acc(0.0)
    if isinstance(grad_scale, np.generic):
        return acc(grad_scale)
    if hasattr(grad_scale, "shape"):
        return acc(numpy_view(grad_scale).reshape(-1)[0])
    return acc(float(grad_scale))


def cross_entropy(
    xp: Any,
    *,
    logits: Any,
    index: Any,
    probs: Any,
    where: Any,
    ignore_index: int | None,
    label_smoothing: float,
    grad_scale: Any,
    out_dtype: Any,
) -> tuple[Any, Any]:
    """Per-row cross-entropy from logits and, when ``grad_scale`` is given, its gradient."""
    view, x2, compute = _plan(logits, out_dtype)
    acc = accumulator(view.dtype)
    w2, wstep, has_where = mask_rows(where)
    r = x2.shape[0]
    if index is not None:
        target = numpy_view(index).astype(np.int64).reshape(-1)
        p2, pstep = np.zeros((1, 0), dtype=acc), 0
    else:
        target = np.zeros(1, dtype=np.int64)
        p2, pstep = rows(numpy_view(probs).astype(acc)), 1
    loss = Output(view.shape[:-1], accumulator_dtype(xp, logits.dtype), logits,
                  np.dtype(acc))
    want_grad = grad_scale is not None
    grad = Output(view.shape if want_grad else (1, 0), out_dtype, logits, compute)
    grad_s = grad.storage.reshape(x2.shape if want_grad else (1, 0))
    run = k.cross_entropy_par if parallel(*x2.shape) else k.cross_entropy_ser
    run(
        x2, w2, wstep, has_where, target, p2, pstep, index is not None,
        acc(label_smoothing), -1 if ignore_index is None else int(ignore_index),
        ignore_index is not None, _scale(grad_scale, acc), want_grad,
        loss.storage.reshape(r), grad_s, 1 if want_grad else 0,
    )
    return loss.finish(), grad.finish() if want_grad else None


def _vjp(which: str, primal: Any, cotangent: Any, where: Any, out_dtype: Any) -> Any:
    view, cot = numpy_view(primal), numpy_view(cotangent)
    out_np = numpy_dtype(out_dtype)
    if view.dtype == cot.dtype == out_np:
        compute = out_np
    else:  # mixed dtypes: both in the accumulator of the result dtype, as the reference
        compute = np.dtype(accumulator(out_np))
        view, cot = view.astype(compute, copy=False), cot.astype(compute, copy=False)
    p2, c2 = rows(storage(view)), rows(storage(cot))
    w2, wstep, has_where = mask_rows(where)
    out = Output(view.shape, out_dtype, primal, compute)
    o2 = out.storage.reshape(p2.shape)
    par = parallel(*p2.shape)
    if which == "softmax":
        run = k.softmax_vjp_par if par else k.softmax_vjp_ser
    else:
        run = k.log_softmax_vjp_par if par else k.log_softmax_vjp_ser
    run(p2, c2, w2, wstep, has_where, o2)
    return out.finish()


def softmax_vjp(xp: Any, *, probs: Any, cotangent: Any, where: Any, out_dtype: Any) -> Any:
    """``p * (g - sum(p * g))`` along the last axis."""
    return _vjp("softmax", probs, cotangent, where, out_dtype)


def log_softmax_vjp(
    xp: Any, *, logprobs: Any, cotangent: Any, where: Any, out_dtype: Any
) -> Any:
    """``g - exp(logp) * sum(g)`` along the last axis."""
    return _vjp("log_softmax", logprobs, cotangent, where, out_dtype)
