"""The backend's kernels in the form the registry calls: ``fn(*, xp, **params)``.

Each function takes the frontend's ``[..., N]`` arrays (validated, dtype policy applied),
views them as ``[rows, N]`` without copying when they are contiguous, chooses the plan for
the row length (:mod:`.plan`) -- in 16-byte words when the rows allow it -- and launches the
row kernel on the caller's device and current stream.  Results are arrays of the caller's
library.  Each takes ``settings`` (:mod:`.settings`; the process's by default), which tests
replace to force a plan or strategy.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from softmaxkit.dtypes import FLOAT_DTYPES, accumulator_name, lookup
from softmaxkit.dtypes import dtype_name as _dtype_name

from . import cross_entropy_kernels, persistent, row_kernels, staged, staging, tiled
from . import plan as plans
from .arrays import (
    Replay,
    constant,
    dummy,
    empty,
    has_clusters,
    is_placeholder,
    kernel_view,
    library,
    memory_bandwidth,
    record,
    resident_clusters,
    rows,
    run,
    stream_of,
    vectorizable,
)
from .primitives import SIMULATOR
from .settings import SETTINGS, Settings
from .storage import VECTOR_WIDTH

WORD_SLOTS = {"float32": (4, 4, 8), "bfloat16": (2, 4, 4), "float16": (2, 4, 4),
              "float64": (2, 2, 2)}
"""16-byte words a thread holds for short, medium and long (split) rows: 8 to 32 values,
all loaded before the first use (chosen from the H200 sweeps of gpu_check.py)."""
SPLIT_THREADS = {"float32": 256, "bfloat16": 128, "float16": 128, "float64": 256}
"""Threads of a block holding one chunk of a split row (16-bit rows: 128 x 4 words, 8 KB)."""
PERSIST_THREADS = {"float32": 256, "bfloat16": 128, "float16": 128}
"""Threads of a block of the persistent cluster kernels (a 64 KB chunk: 16 words a thread for
float32, 32 for 16-bit rows, which measured faster than 256 threads of 16 words)."""
ELEMENT_SLOTS = {"float32": 16, "bfloat16": 16, "float16": 16, "float64": 8}
"""Elements a thread holds when rows are read element by element."""
TILE_VALUES = 8
"""Values per array a thread holds per tile in the tiled kernels (two arrays each)."""


def dtype_name(dtype: Any) -> str:
    """The name of a dtype, also for numpy scalar types such as ``np.float32``."""
    name = _dtype_name(dtype)
    if name not in FLOAT_DTYPES and isinstance(dtype, type):
        name = np.dtype(dtype).name
    return name


_replays: dict[tuple[Any, ...], Replay] = {}
"""Launches kept for calls on contiguous torch tensors without a mask, under
:func:`_replay_key`: a repeated call allocates its results and fills in their addresses."""


def _replay_key(op: str, x: Any, *options: Any) -> tuple[Any, ...] | None:
    """The key of ``op``'s kept launch on ``x`` (None where launches are not kept): dtype,
    shape, strides and 16-byte alignment decide the plan and the kernel's argument types; the
    options the rest."""
    if SIMULATOR or type(x).__module__ != "torch":
        return None
    return (op, x.dtype, x.shape, x.stride(), x.data_ptr() % 16, x.device, *options)


def _keep(key: tuple[Any, ...], replay: Replay | None) -> None:
    if replay is not None:
        if len(_replays) > 4096:
            _replays.clear()
        _replays[key] = replay


def _on_device(settings: Settings, x: Any, lib: str) -> Settings:
    """``settings`` for a call on ``x``'s device: clusters off where the device has none."""
    if settings.cluster == "0" or has_clusters(x, lib):
        return settings
    return settings.replace(cluster="0")


def _plan(n_words: int, kind: str, vector: bool, settings: Settings) -> plans.Plan:
    if vector:
        return plans.choose(n_words, WORD_SLOTS[kind], SIMULATOR, SPLIT_THREADS[kind],
                            settings.plan)
    return plans.choose(n_words, ELEMENT_SLOTS[kind], SIMULATOR, forced=settings.plan)


def _tiled_plan(n: int, kind: str, settings: Settings, width: int = 1) -> plans.Plan:
    values = TILE_VALUES // (2 if kind == "float64" else 1)
    return plans.choose(n, max(1, values // width), SIMULATOR, forced=settings.plan)


def _staged(kind: str, p: plans.Plan, vector: bool, same_dtype: bool,
            settings: Settings) -> bool:
    """Whether rows of plan ``p`` take a staged kernel (:mod:`.staged`, :mod:`.persistent`)."""
    return settings.staged and staging.enabled(kind, p.split, vector, same_dtype)


def _layout(lib: str, kin: str, kout: str, arrays: list[Any]) -> tuple[bool, int, list[Any]]:
    """Whether to use 16-byte words, the word width, and the kernel views of ``arrays``."""
    width = VECTOR_WIDTH[kin]
    vector = kin == kout and vectorizable(arrays, lib, width)
    return vector, (width if vector else 1), [kernel_view(a, lib) for a in arrays]


def _counters(xp: Any, like: Any, lib: str, p: plans.Plan, n_rows: int, acc: Any,
              fields: int) -> tuple[Any, Any]:
    """Kernel views of the summaries ``[fields, rows * chunks]`` and zeroed arrival counters
    ``[rows]`` of a split row whose last block writes the result (placeholders otherwise)."""
    device = getattr(like, "device", None)
    if not p.split:
        return dummy(lib, device, dtype_name(acc)), dummy(lib, device, "int32", ndim=1)
    ws = xp.empty((fields, n_rows * p.chunks), dtype=acc, device=device)
    sync = xp.zeros((n_rows,), dtype=xp.int32, device=device)
    return kernel_view(ws, lib), kernel_view(sync, lib)


def _slots(xp: Any, like: Any, lib: str, p: plans.Plan, n_rows: int, acc_name: str) -> Any:
    """Kernel view of the zeroed 64-bit summary slots of a split row whose blocks wait for
    the row's summary (a placeholder otherwise)."""
    device = getattr(like, "device", None)
    if not p.split:
        return dummy(lib, device, "uint64")
    fields = row_kernels.SLOT_FIELDS[acc_name]
    # int64 storage (every library has it), read as unsigned words by the kernel
    wsp = kernel_view(xp.zeros((fields, n_rows * p.chunks), dtype=xp.int64, device=device),
                      lib)
    return wsp.view(np.uint64)


class _RowLaunch(NamedTuple):
    """How rows of one length are normalized (everything but the persistent grid, which
    depends on the device's occupancy): the kernel, its plan, dynamic shared memory, cluster
    size, whether a row takes ``plan.chunks`` blocks of its own (staged and clustered
    kernels), and the plan of the zeroed summary slots."""

    kernel: Any
    plan: plans.Plan
    shared: int
    cluster: int
    block_per_chunk: bool
    slots: plans.Plan


@functools.lru_cache(maxsize=1024)
def _row_launch(op: str, kin: str, kout: str, vector: bool, n_words: int, has_where: bool,
                settings: Settings) -> _RowLaunch | None:
    """The launch of a normalization of rows of ``n_words`` words (values when not
    ``vector``), or None for the persistent grid; chosen once per call shape (cached)."""
    p = _plan(n_words, kin, vector, settings)
    forced = settings.stage_plan or settings.plan
    if _staged(kin, p, vector, kin == kout, settings):
        if plans.persistent(n_words, SIMULATOR, PERSIST_THREADS[kin], settings.persist,
                            settings.cluster, forced):
            return None
        clustered = plans.clustered(n_words, SIMULATOR, settings.cluster, forced)
        if clustered is not None:  # the chunks of a row are one thread-block cluster
            kernel = staged.normalize(op, kin, clustered.threads, clustered.slots, has_where,
                                      cluster=True)
            # clustered rows exchange through distributed shared memory: no slots to zero
            return _RowLaunch(kernel, clustered,
                              staging.shared_bytes(clustered.threads, clustered.slots),
                              clustered.chunks, True, plans.make(1, 1, 1))
        p = plans.staged(n_words, SIMULATOR, forced=forced)
        kernel = staged.normalize(op, kin, p.threads, p.slots, has_where)
        return _RowLaunch(kernel, p, staging.shared_bytes(p.threads, p.slots), 1, True, p)
    kernel = row_kernels.normalize(op, kin, kout, vector, p.threads, p.slots,
                                  p.rows_per_block, p.split, has_where)
    return _RowLaunch(kernel, p, 0, 1, False, p)


def _normalize(op: str, xp: Any, x: Any, where: Any, masked: str, out_dtype: Any,
               settings: Settings) -> Any:
    key = _replay_key(op, x, out_dtype, masked, settings) if where is None else None
    replay = _replays.get(key) if key is not None else None
    if replay is not None:
        out = x.new_empty(x.shape, dtype=out_dtype)
        replay(stream_of(x, "torch"), x.data_ptr(), out.data_ptr())
        return out
    lib = library(x)
    out = empty(xp, x, tuple(x.shape), out_dtype)
    if out.size == 0:
        return out
    settings = _on_device(settings, x, lib)
    xr = rows(x, lib)
    n_rows, n = xr.shape
    kin, kout = dtype_name(x.dtype), dtype_name(out_dtype)
    vector, width, (xv, ov) = _layout(lib, kin, kout, [xr, out.reshape(n_rows, n)])
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, x.device)
    launch = _row_launch(op, kin, kout, vector, n // width, where is not None, settings)
    if launch is None:
        _persistent(op, xp, x, lib, kin, n_rows, n // width, xv, w, where is not None, ov,
                    masked, settings)
        return out
    p = launch.plan
    blocks = n_rows * p.chunks if launch.block_per_chunk else p.grid(n_rows)
    wsp = _slots(xp, x, lib, launch.slots, n_rows, accumulator_name(kin))
    args = (xv, w, masked == "nan", ov, n_rows, n // width, p.chunks, wsp)
    stream = stream_of(x, lib)
    if key is not None and x.is_contiguous() and is_placeholder(wsp):
        _keep(key, record(launch.kernel, blocks, p.block, stream, *args, live=(0, 3),
                          shared=launch.shared, cluster=launch.cluster))
    else:
        run(launch.kernel, blocks, p.block, stream, *args, shared=launch.shared,
            cluster=launch.cluster)
    return out


def _persistent(op: str, xp: Any, x: Any, lib: str, kin: str, n_rows: int, n_words: int,
                xv: Any, w: Any, has_where: bool, ov: Any, masked: str,
                settings: Settings) -> None:
    """Normalize rows on a persistent grid of clusters, each walking rows."""
    forced = settings.stage_plan or settings.plan
    p = plans.persistent(n_words, SIMULATOR, PERSIST_THREADS[kin], settings.persist,
                         settings.cluster, forced)
    parts = plans.row_clusters(p, SIMULATOR)
    whole = n_words == p.chunks * p.chunk_words  # every chunk full
    held = persistent.HELD[kin] if not has_where else 0
    kept = plans.held(p, n_words, held, SIMULATOR) if held else None
    if kept is not None:  # chunks twice as long, ``held`` words a thread in registers
        p, parts, whole = kept, 1, True
    else:
        held = 0
    cluster = p.chunks // parts
    kernel = persistent.persistent(op, kin, p.threads, p.slots, has_where, whole,
                                   cluster if parts > 1 else 0, parts, held)
    shared = staging.shared_bytes(p.threads, p.slots)
    # several clusters a row exchange through zeroed slots in device memory, one a part
    wsp = _slots(xp, x, lib, plans.Plan(p.threads, p.slots, 1, parts), n_rows, "float32")
    args = (xv, w, masked == "nan", ov, n_rows, n_words, p.chunks, wsp)
    stream = stream_of(x, lib)
    policy = persistent.POLICY
    fit = resident_clusters(kernel, p.block, stream, args + (0,), shared, cluster,
                            policy)  # the typed arguments, the spread a placeholder
    rows_at_once = min(n_rows, max(1, fit // parts))
    spread = persistent.stagger(n_rows, rows_at_once, x.shape[-1] * x.dtype.itemsize,
                                memory_bandwidth(x, lib))
    run(kernel, rows_at_once * p.chunks, p.block, stream, *args, spread,
        shared=shared, cluster=cluster, policy=policy)


def softmax(*, xp: Any, x: Any, where: Any, masked: str, out_dtype: Any,
            settings: Settings = SETTINGS) -> Any:
    """Softmax along the last axis (see ``softmaxkit.reference.rows.softmax``)."""
    return _normalize("softmax", xp, x, where, masked, out_dtype, settings)


def log_softmax(*, xp: Any, x: Any, where: Any, masked: str, out_dtype: Any,
                settings: Settings = SETTINGS) -> Any:
    """Log-softmax along the last axis (see ``softmaxkit.reference.rows.log_softmax``)."""
    return _normalize("log_softmax", xp, x, where, masked, out_dtype, settings)


def row_reduce(op: str, xp: Any, x: Any, where: Any, out: Any, second: Any,
               return_second: bool, settings: Settings = SETTINGS,
               key: tuple[Any, ...] | None = None) -> None:
    """Launch the one-pass reduction ``op`` (``"logsumexp"`` or ``"summarize"``) of the rows of
    ``x`` into ``out`` and ``second`` (``[rows]`` arrays; ``second`` may be ``None``), and
    keep the launch under ``key`` (x and out its addresses) where it can be replayed."""
    lib = library(x)
    xr = rows(x, lib)
    n_rows, n = xr.shape
    kin, kout = dtype_name(x.dtype), dtype_name(out.dtype)
    vector, width, (xv,) = _layout(lib, kin, kin, [xr])
    p = _plan(n // width, kin, vector, settings)
    kernel = row_kernels.reduce(op, kin, kout, vector, p.threads, p.slots, p.rows_per_block,
                               p.split, where is not None)
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, x.device)
    acc = lookup(xp, accumulator_name(kin))
    ws, sync = _counters(xp, x, lib, p, n_rows, acc, 2)
    sv = (kernel_view(second.reshape(n_rows, 1), lib) if second is not None
          else dummy(lib, x.device, kout))
    stream = stream_of(x, lib)
    args = (xv, w, kernel_view(out.reshape(n_rows, 1), lib), sv, bool(return_second), n_rows,
            n // width, p.chunks, ws, sync)
    if key is not None and x.is_contiguous() and is_placeholder(ws) and is_placeholder(sync):
        _keep(key, record(kernel, p.grid(n_rows), p.block, stream, *args, live=(0, 2)))
    else:
        run(kernel, p.grid(n_rows), p.block, stream, *args)


def logsumexp(
    *, xp: Any, x: Any, b: Any, where: Any, return_sign: bool, out_dtype: Any,
    settings: Settings = SETTINGS,
) -> Any:
    """``log |sum(b * exp(x))|`` along the last axis, and its sign with ``return_sign``."""
    plain = b is None and where is None and not return_sign
    key = _replay_key("logsumexp", x, out_dtype, settings) if plain else None
    replay = _replays.get(key) if key is not None else None
    if replay is not None:
        out = x.new_empty(x.shape[:-1], dtype=out_dtype)
        replay(stream_of(x, "torch"), x.data_ptr(), out.data_ptr())
        return out
    lib = library(x)
    batch = tuple(x.shape[:-1])
    out = empty(xp, x, batch, out_dtype)
    sign = empty(xp, x, batch, out_dtype) if return_sign else None
    if out.size == 0:
        return (out, sign) if return_sign else out
    if b is None:
        row_reduce("logsumexp", xp, x, where, out, sign, return_sign, settings, key)
        return (out, sign) if return_sign else out
    xr = rows(x, lib)
    n_rows, n = xr.shape
    kin, kout = dtype_name(x.dtype), dtype_name(out_dtype)
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, x.device)
    s = (kernel_view(sign.reshape(n_rows, 1), lib) if return_sign
         else dummy(lib, x.device, kout))
    p = _tiled_plan(n, kout, settings)
    kernel = tiled.logsumexp_weighted(kin, dtype_name(b.dtype), kout, p.threads, p.slots,
                                      p.rows_per_block)
    stream = stream_of(x, lib)
    run(kernel, p.grid_rows(n_rows), p.block, stream,
        kernel_view(xr, lib), kernel_view(rows(b, lib), lib), w, where is not None,
        kernel_view(out.reshape(n_rows, 1), lib), s, bool(return_sign), n_rows, n,
        p.chunks)
    return (out, sign) if return_sign else out


def _scale(xp: Any, grad_scale: Any, acc: Any, device: Any, lib: str) -> Any:
    """The gradient scale as a one-element kernel argument."""
    if grad_scale is not None and hasattr(grad_scale, "shape"):
        return kernel_view(xp.reshape(xp.astype(grad_scale, acc, copy=False), (1,)), lib)
    value = 1.0 if grad_scale is None else float(grad_scale)
    kept = constant(value, dtype_name(acc), device, lib)
    if kept is not None:
        return kept
    return kernel_view(xp.full((1,), value, dtype=acc, device=device), lib)


def _index(xp: Any, index: Any, lib: str, device: Any) -> Any:
    """The class indices as a contiguous int64 vector (a placeholder without them)."""
    if index is None:
        return xp.zeros((1,), dtype=xp.int64, device=device)
    idx = xp.reshape(xp.astype(index, xp.int64, copy=False), (-1,))
    if lib == "torch":
        idx = idx.contiguous()
    return idx


def cross_entropy(
    *,
    xp: Any,
    logits: Any,
    index: Any,
    probs: Any,
    where: Any,
    ignore_index: int | None,
    label_smoothing: float,
    grad_scale: Any,
    out_dtype: Any,
    settings: Settings = SETTINGS,
) -> tuple[Any, Any]:
    """Per-row loss and, when ``grad_scale`` is given, the fused gradient, in one kernel."""
    if xp is None:
        import array_api_compat

        xp = array_api_compat.array_namespace(logits)
    kin, kout = dtype_name(logits.dtype), dtype_name(out_dtype)
    acc = lookup(xp, accumulator_name(kin))
    device = getattr(logits, "device", None)
    key = None
    if probs is None and where is None and index is not None:
        key = _replay_key("cross_entropy", logits, out_dtype, index.dtype, ignore_index,
                          float(label_smoothing), grad_scale is None, settings)
    replay = _replays.get(key) if key is not None else None
    if replay is not None:
        loss = logits.new_empty(logits.shape[:-1], dtype=acc)
        addresses = [logits.data_ptr(), _index(xp, index, "torch", device).data_ptr(),
                     _scale(xp, grad_scale, acc, device, "torch").ptr, loss.data_ptr()]
        grad = None
        if grad_scale is not None:
            grad = logits.new_empty(logits.shape, dtype=out_dtype)
            addresses.append(grad.data_ptr())
        replay(stream_of(logits, "torch"), *addresses)
        return loss, grad
    lib = library(logits)
    batch = tuple(logits.shape[:-1])
    loss = empty(xp, logits, batch, acc)
    grad = empty(xp, logits, tuple(logits.shape), out_dtype) if grad_scale is not None else None
    if loss.size == 0:
        return loss, grad
    settings = _on_device(settings, logits, lib)
    xr = rows(logits, lib)
    n_rows, n = xr.shape
    if grad is not None:
        vector, width, (xv, gv) = _layout(lib, kin, kout, [xr, grad.reshape(n_rows, n)])
    else:
        vector, width, (xv,) = _layout(lib, kin, kin, [xr])
        gv = dummy(lib, device, kout)
    scale = _scale(xp, grad_scale, acc, device, lib)
    idx = kernel_view(_index(xp, index, lib, device), lib)
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, device)
    ignore = 0 if ignore_index is None else int(ignore_index)
    lv = kernel_view(loss.reshape(n_rows, 1), lib)
    if probs is not None:  # probability targets: the tiled kernel
        p = _tiled_plan(n // width, kin, settings, width)
        kernel = tiled.cross_entropy(kin, kout, vector, p.threads, p.slots, p.rows_per_block,
                                     p.chunks == 1, dtype_name(probs.dtype))
        pv = kernel_view(rows(probs, lib), lib)
        stream = stream_of(logits, lib)
        run(kernel, p.grid_rows(n_rows), p.block, stream, xv, w, where is not None, idx,
            pv, scale, lv, gv, grad is not None, n_rows, n // width, p.chunks,
            float(label_smoothing), ignore_index is not None, ignore)
        return loss, grad
    p = _plan(n // width, kin, vector, settings)
    smooth = float(label_smoothing) != 0.0
    cluster = 1
    clustered = None
    is_staged = grad is not None and _staged(kin, p, vector, kin == kout, settings)
    forced = settings.stage_plan or settings.plan
    if is_staged:
        clustered = plans.clustered(n // width, SIMULATOR, settings.cluster, forced)
    if clustered is not None:
        p, cluster = clustered, clustered.chunks
        kernel = staged.cross_entropy(kin, p.threads, p.slots, where is not None, smooth,
                                      cluster=True)
        blocks, shared = n_rows * p.chunks, staging.shared_bytes(p.threads, p.slots)
    elif is_staged:
        p = plans.staged(n // width, SIMULATOR, forced=forced)
        kernel = staged.cross_entropy(kin, p.threads, p.slots, where is not None, smooth)
        blocks, shared = n_rows * p.chunks, staging.shared_bytes(p.threads, p.slots)
    else:
        kernel = cross_entropy_kernels.cross_entropy(kin, kout, vector, p.threads, p.slots,
                                          p.rows_per_block, p.split, where is not None,
                                          grad is not None, smooth)
        blocks, shared = p.grid(n_rows), 0
    if grad is not None:
        ws, sync = _counters(xp, logits, lib, plans.make(1, 1, 1), n_rows, acc, 0)
        wsp = _slots(xp, logits, lib, plans.make(1, 1, 1) if clustered else p, n_rows,
                     accumulator_name(kin))
    else:
        ws, sync = _counters(xp, logits, lib, p, n_rows, acc, 4 if smooth else 2)
        wsp = _slots(xp, logits, lib, plans.make(1, 1, 1), n_rows, accumulator_name(kin))
    stream = stream_of(logits, lib)
    args = (xv, w, idx, scale, lv, gv, n_rows, n // width, p.chunks, ws, sync, wsp,
            float(label_smoothing), ignore_index is not None, ignore)
    if (key is not None and logits.is_contiguous()
            and all(is_placeholder(a) for a in (ws, sync, wsp))):
        # the addresses of logits, labels, scale, loss and gradient change from call to call
        live = (0, 2, 3, 4, 5) if grad is not None else (0, 2, 3, 4)
        _keep(key, record(kernel, blocks, p.block, stream, *args, live=live, shared=shared,
                          cluster=cluster))
    else:
        run(kernel, blocks, p.block, stream, *args, shared=shared, cluster=cluster)
    return loss, grad


def _vjp(op: str, xp: Any, y: Any, c: Any, where: Any, out_dtype: Any,
         settings: Settings) -> Any:
    lib = library(y)
    out = empty(xp, y, tuple(y.shape), out_dtype)
    if out.size == 0:
        return out
    yr, cr = rows(y, lib), rows(c, lib)
    n_rows, n = yr.shape
    p = _tiled_plan(n, dtype_name(y.dtype), settings)
    kernel = tiled.vjp(
        op, dtype_name(y.dtype), dtype_name(c.dtype), dtype_name(out_dtype), p.threads,
        p.slots, p.rows_per_block, p.chunks == 1,
    )
    w = kernel_view(rows(where, lib), lib) if where is not None else dummy(lib, y.device)
    stream = stream_of(y, lib)
    run(kernel, p.grid_rows(n_rows), p.block, stream,
        kernel_view(yr, lib), kernel_view(cr, lib), w, where is not None,
        kernel_view(out.reshape(n_rows, n), lib), n_rows, n, p.chunks)
    return out


def softmax_vjp(*, xp: Any, probs: Any, cotangent: Any, where: Any, out_dtype: Any,
                settings: Settings = SETTINGS) -> Any:
    """``p * (c - sum(p * c))`` along the last axis."""
    return _vjp("softmax_vjp", xp, probs, cotangent, where, out_dtype, settings)


def log_softmax_vjp(
    *, xp: Any, logprobs: Any, cotangent: Any, where: Any, out_dtype: Any,
    settings: Settings = SETTINGS,
) -> Any:
    """``c - exp(logp) * sum(c)`` along the last axis."""
    return _vjp("log_softmax_vjp", xp, logprobs, cotangent, where, out_dtype, settings)


__all__ = [
    "cross_entropy",
    "log_softmax",
    "log_softmax_vjp",
    "logsumexp",
    "softmax",
    "softmax_vjp",
]
