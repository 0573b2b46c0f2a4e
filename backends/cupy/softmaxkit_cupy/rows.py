"""Adapters from the softmaxkit kernel contract to the row kernels of ``kernels/rows.cu``.

Each function takes the contract's keyword arguments (softmaxkit/ops.py) for ``[..., N]``
inputs already validated by the frontend; :func:`softmaxkit_cupy.manifest.can_run` has
accepted the call (device, dtypes, row length, options), so every call here has a kernel.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

from softmaxkit.dtypes import dtype_name

from . import compiler, interop, launches
from .configs import (
    ITEMSIZE,
    NON_PORTABLE_CLUSTER,
    RowConfig,
    grad_config,
    grad_modules,
    grad_name,
    row_alternative_names,
    row_config,
    row_lean,
    row_modules,
)

_NAMES = {(op, din, dout): tuple(names) for op, din, dout, names in row_modules()}
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
"""``CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED`` (cuda.h; CuPy names no constant)."""
_CLUSTER_SCHEDULING_POLICY = 15
"""``CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE`` (values as RowConfig.policy)."""


_ROW_PARAMS = "QqQqQqqiii"
"""The row kernels' parameters (kernels/rows.cu): x, its row stride, where, its row stride,
out, its row stride, rows, n, whether 16-byte words are used, the masked-row policy."""
_VJP_PARAMS = "QqQqQqQqii"
"""The gradient kernels' parameters (kernels/rowgrads.cu): primal, cotangent, where and out
with their row strides (out's is n), rows, n, whether 16-byte words are used."""
_XENT_PARAMS = "QqQqQQQqiiqifQf"
"""The cross-entropy kernel's parameters (kernels/rowgrads.cu): logits and where with their
row strides, class indices, loss, gradient, rows, n, whether 16-byte words are used, the
ignored index and whether there is one, label smoothing, the scale's address and value."""


def _aligned(address: int, stride_bytes: int, width: int) -> bool:
    return address % width == 0 and stride_bytes % width == 0


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h), without launch attributes."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint),
                ("block_z", ctypes.c_uint), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("num_attrs", ctypes.c_uint)]


def max_active_clusters(kernel: Any, config: RowConfig) -> int:
    """How many clusters of ``kernel`` (launched as ``config``) fit on the device at once, from
    ``cuOccupancyMaxActiveClusters`` (CuPy wraps no cluster occupancy query); 0 where the
    driver does not answer.  The kernel's dynamic shared-memory limit and cluster attributes
    must be set first."""
    try:
        query = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    except (OSError, AttributeError):
        return 0
    query.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                      ctypes.POINTER(_LaunchConfig)]
    launch = _LaunchConfig(config.cluster, 1, 1, config.threads, 1, 1, config.shared_bytes(),
                           None, None, 0)
    count = ctypes.c_int(0)
    if query(ctypes.byref(count), ctypes.c_void_p(kernel.kernel.ptr), ctypes.byref(launch)):
        return 0
    return max(count.value, 0)


@functools.lru_cache(maxsize=4096)
def _plan(op: str, din: str, dout: str, n: int, rows: int, config: RowConfig | None,
          device: int) -> tuple[Any, int, int, int]:
    """The kernel, grid, block size and shared memory for ``rows`` rows of ``n`` elements
    on CUDA device ``device`` (cached per device: the kernel's attributes are set on that
    device's function, and a device without thread-block clusters takes other rows).

    ``config`` overrides the configuration (benchmarks compare alternatives; those build in a
    module of their own)."""
    import cupy

    with cupy.cuda.Device(device):
        return _plan_on_current(op, din, dout, n, rows, config,
                                interop.has_clusters(device))


def _plan_on_current(op: str, din: str, dout: str, n: int, rows: int,
                     config: RowConfig | None, clusters: bool) -> tuple[Any, int, int, int]:
    names = _NAMES[(op, din, dout)]
    if config is None:
        config = row_config(n, ITEMSIZE[din], row_lean(op, din, dout), clusters)
    elif config.name(op, din, dout) not in names:
        names = row_alternative_names(op, din, dout)
    if config is None or n > config.capacity(ITEMSIZE[din]):  # can_run declines these rows
        raise ValueError(f"rows of {n} elements are longer than the row kernels hold")
    kernel = compiler.function("rows.cu", names, config.name(op, din, dout))
    # the default limit of 48 KB covers dynamic and static shared memory together
    if config.shared_bytes() and config.shared_bytes() + kernel.shared_size_bytes > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = config.shared_bytes()
    if config.cluster > NON_PORTABLE_CLUSTER:
        from cupy.cuda import driver

        # 16-block clusters are non-portable: the kernel must opt in (sm_90 allows 16)
        driver.funcSetAttribute(kernel.kernel.ptr, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    if config.policy:
        from cupy.cuda import driver

        driver.funcSetAttribute(kernel.kernel.ptr, _CLUSTER_SCHEDULING_POLICY, config.policy)
    if config.persistent:
        # the clusters that fit at once walk the rows (any count is correct; more queue)
        grid = min(rows, max_active_clusters(kernel, config) or rows) * config.cluster
    elif config.cluster > 1 or config.staged:
        grid = rows * config.cluster
    else:
        grid = -(-rows // (config.threads // config.group))
    return kernel, grid, config.threads, config.shared_bytes()


class _Kept:
    """A row launch kept for one call shape on one device: the driver function, geometry and
    parameters, the addresses of x and out (parameters 0 and 4) filled in per call.

    A kept launch goes to the driver directly: the device was checked, the function loaded
    and its shared-memory limit raised when the launch was first made."""

    __slots__ = ("block", "current", "device", "function", "grid", "kernel", "params",
                 "shared", "stream")

    def __init__(self, kernel: Any, device: int, grid: int, block: int,
                 params: tuple[Any, ...], shared: int) -> None:
        self.kernel, self.device, self.grid, self.block, self.params, self.shared = (
            kernel, device, grid, block, params, shared)
        self.function = launches.function(kernel, device, shared)
        self.stream = interop.torch_stream_reader()
        self.current = interop.current_device_reader()

    def __call__(self, x: Any, out: Any) -> None:
        params = list(self.params)
        params[0], params[4] = x.data_ptr(), out.data_ptr()
        if self.current() != self.device:  # another device is current: switch, then launch
            interop.launch(self.kernel, x, self.grid, self.block, _ROW_PARAMS, params,
                           self.shared)
            return
        launches.launch_function(self.function, self.stream(self.device), self.grid, 1, 1,
                                 self.block, _ROW_PARAMS, params, self.shared)


_kept: dict[tuple[Any, ...], _Kept] = {}
"""Row launches on contiguous torch tensors without a mask, under :func:`_kept_key`: a
repeated call allocates its result and fills in two addresses."""


def _kept_key(op: str, x: Any, where: Any, *options: Any) -> tuple[Any, ...] | None:
    """Dtype, shape, strides and 16-byte alignment decide the kernel, its geometry and its
    parameters; the options the rest (None: a launch not kept)."""
    if where is not None or not interop.is_torch(x):
        return None
    return (op, x.dtype, x.shape, x.stride(), x.data_ptr() % 16, x.device, *options)


def launch_rows(
    op: str, xp: Any, x: Any, where: Any, out: Any, masked_nan: bool = False,
    config: RowConfig | None = None, keep: tuple[Any, ...] | None = None,
) -> None:
    """Run row operation ``op`` of ``x`` ([..., N]) into ``out`` ([..., N], or [...] for lse),
    and keep the launch under ``keep`` (from :func:`_kept_key`) where it can be replayed."""
    din, dout = interop.name(x), interop.name(out)
    n = int(x.shape[-1])
    rows = math.prod(x.shape[:-1])
    in_size, out_size = ITEMSIZE[din], ITEMSIZE[dout]
    vec = 16 // in_size
    kernel, grid, threads, shared = _plan(op, din, dout, n, rows, config,
                                          interop.device_index(x))
    x_ptr, ld_x, _keep_x = interop.row_pointer(xp, x)
    o_ptr = interop.pointer(out)
    ld_o = n if op != "logsumexp" else 1
    vec_ok = n % vec == 0 and _aligned(x_ptr, ld_x * in_size, 16)
    if op != "logsumexp":
        vec_ok = vec_ok and _aligned(o_ptr, n * out_size, min(16, vec * out_size))
    w_ptr, ld_w = 0, 0
    if where is not None:
        w_ptr, ld_w, _keep_w = interop.row_pointer(xp, where)
        vec_ok = vec_ok and _aligned(w_ptr, ld_w, vec)
    args = (x_ptr, ld_x, w_ptr, ld_w, o_ptr, ld_o, rows, n, vec_ok, masked_nan)
    interop.launch(kernel, x, grid, threads, _ROW_PARAMS, args, shared)
    if keep is not None and config is None and x.is_contiguous() and rows:
        if len(_kept) > 4096:
            _kept.clear()
        _kept[keep] = _Kept(kernel, interop.device_index(x), grid, threads, args, shared)


@functools.cache
def _torch_empty_like() -> Any:
    """``torch.empty_like``, looked up once (torch is imported by whoever passed a tensor)."""
    import torch

    return torch.empty_like


def _normalize(op: str, xp: Any, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    key = _kept_key(op, x, where, out_dtype, masked)
    kept = _kept.get(key) if key is not None else None
    if kept is not None:
        # x is contiguous (its strides are in the key), so its like is: torch's empty_like
        # parses less than new_empty (about 3.5 us against 6.3 a call on an H100's host)
        out = _torch_empty_like()(x, dtype=out_dtype)
        kept(x, out)
        return out
    out = interop.empty(x, tuple(x.shape), dtype_name(out_dtype))
    launch_rows(op, xp, x, where, out, masked_nan=masked == "nan", keep=key)
    return out


def softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Softmax along the last axis (contract: softmaxkit.ops, reference: reference/rows.py)."""
    return _normalize("softmax", xp, x, where, masked, out_dtype)


def log_softmax(xp: Any, *, x: Any, where: Any, masked: str, out_dtype: Any) -> Any:
    """Log-softmax along the last axis."""
    return _normalize("log_softmax", xp, x, where, masked, out_dtype)


def logsumexp(
    xp: Any, *, x: Any, b: Any, where: Any, return_sign: bool, out_dtype: Any
) -> Any:
    """Log-sum-exp along the last axis (without weights ``b``: can_run declines them)."""
    key = _kept_key("logsumexp", x, where, out_dtype)
    kept = _kept.get(key) if key is not None else None
    if kept is not None:
        out = x.new_empty(x.shape[:-1], dtype=out_dtype)
        kept(x, out)
    else:
        out = interop.empty(x, tuple(x.shape[:-1]), dtype_name(out_dtype))
        launch_rows("logsumexp", xp, x, where, out, keep=key)
    if not return_sign:
        return out
    # without weights the sum is positive unless the row is empty (0) or has a NaN (NaN)
    one = xp.ones_like(out)
    sign = xp.where(out == -math.inf, xp.zeros_like(out), one)
    sign = xp.where(xp.isnan(out), out, sign)
    return out, sign



_GRAD_NAMES = {(op, dtype): tuple(names) for op, dtype, names in grad_modules()}


@functools.lru_cache(maxsize=4096)
def _grad_plan(op: str, dtype: str, n: int, rows: int) -> tuple[Any, int, int]:
    config = grad_config(n, ITEMSIZE[dtype])
    if config is None:  # can_run declines these rows
        raise ValueError(f"rows of {n} elements are longer than the gradient kernels hold")
    kernel = compiler.function("rowgrads.cu", _GRAD_NAMES[(op, dtype)],
                               grad_name(op, dtype, config))
    return kernel, -(-rows // (config.threads // config.group)), config.threads


def _vjp(op: str, xp: Any, primal: Any, cotangent: Any, where: Any) -> Any:
    dtype = interop.name(primal)
    n = int(primal.shape[-1])
    rows = math.prod(primal.shape[:-1])
    kernel, grid, threads = _grad_plan(op, dtype, n, rows)
    a_ptr, ld_a, _keep_a = interop.row_pointer(xp, primal)
    c_ptr, ld_c, _keep_c = interop.row_pointer(xp, cotangent)
    out = interop.empty(primal, tuple(primal.shape), dtype)
    o_ptr = interop.pointer(out)
    size = ITEMSIZE[dtype]
    vec = 16 // size
    vec_ok = (n % vec == 0 and _aligned(a_ptr, ld_a * size, 16)
              and _aligned(c_ptr, ld_c * size, 16) and _aligned(o_ptr, n * size, 16))
    w_ptr, ld_w = 0, 0
    if where is not None:
        w_ptr, ld_w, _keep_w = interop.row_pointer(xp, where)
        vec_ok = vec_ok and _aligned(w_ptr, ld_w, vec)
    args = (a_ptr, ld_a, c_ptr, ld_c, w_ptr, ld_w, o_ptr, rows, n, vec_ok)
    interop.launch(kernel, primal, grid, threads, _VJP_PARAMS, args)
    return out


def softmax_vjp(xp: Any, *, probs: Any, cotangent: Any, where: Any, out_dtype: Any) -> Any:
    """``p * (c - sum(p * c))`` along the last axis (one read of each input, one write)."""
    return _vjp("softmax_vjp", xp, probs, cotangent, where)


def log_softmax_vjp(
    xp: Any, *, logprobs: Any, cotangent: Any, where: Any, out_dtype: Any
) -> Any:
    """``c - exp(logp) * sum(c)`` over the allowed positions along the last axis."""
    return _vjp("log_softmax_vjp", xp, logprobs, cotangent, where)


def cross_entropy(
    xp: Any, *, logits: Any, index: Any, probs: Any, where: Any, ignore_index: int | None,
    label_smoothing: float, grad_scale: Any, out_dtype: Any,
) -> tuple[Any, Any]:
    """Per-row loss and, with ``grad_scale``, the fused gradient ``scale * (p - y)``.

    Class-index targets only (can_run declines probability targets).  The loss is float32,
    as the reference's accumulator-dtype loss; the gradient has the logits' dtype.
    """
    dtype = interop.name(logits)
    n = int(logits.shape[-1])
    rows = math.prod(logits.shape[:-1])
    kernel, grid, threads = _grad_plan("cross_entropy", dtype, n, rows)
    x_ptr, ld_x, _keep_x = interop.row_pointer(xp, logits)
    idx = xp.reshape(xp.astype(index, xp.int64, copy=False), (rows,))
    idx = interop.contiguous(idx)
    loss = interop.empty(logits, tuple(logits.shape[:-1]), "float32")
    grad = None if grad_scale is None else interop.empty(logits, tuple(logits.shape), dtype)
    scale_ptr, scale_value, keep = 0, 1.0, None
    if grad_scale is not None:
        if isinstance(grad_scale, (int, float)):
            scale_value = float(grad_scale)
        else:  # a device scalar (1 / count for reduction="mean"): read on the device
            keep = interop.contiguous(xp.reshape(xp.astype(grad_scale, xp.float32), (1,)))
            scale_ptr = interop.pointer(keep)
    size = ITEMSIZE[dtype]
    vec = 16 // size
    g_ptr = interop.pointer(grad) if grad is not None else 0
    vec_ok = n % vec == 0 and _aligned(x_ptr, ld_x * size, 16)
    if grad is not None:
        vec_ok = vec_ok and _aligned(g_ptr, n * size, 16)
    w_ptr, ld_w = 0, 0
    if where is not None:
        w_ptr, ld_w, _keep_w = interop.row_pointer(xp, where)
        vec_ok = vec_ok and _aligned(w_ptr, ld_w, vec)
    args = (x_ptr, ld_x, w_ptr, ld_w, interop.pointer(idx), interop.pointer(loss), g_ptr, rows,
            n, vec_ok, ignore_index if ignore_index is not None else 0,
            ignore_index is not None, float(label_smoothing), scale_ptr, scale_value)
    interop.launch(kernel, logits, grid, threads, _XENT_PARAMS, args)
    del keep  # the launch is queued on the stream; the allocator keeps its block until then
    return loss, grad
