"""cross_entropy without host reads: the mean's count on the device, the label-range policy.

Where the labels are not in host memory the frontend keeps the count of the rows that are not
``ignore_index`` as an array (the scale of the mean and of the fused gradient is a 0-d array
on the labels' device) and does not check the class-index range: an out-of-range label gives
its row a NaN loss and NaN gradient (spec/semantics.md, "cross_entropy").  Host labels are
checked and counted on the host; the tests take them as a GPU's too (``count_path``).  These tests
hold the device-count path to the host-count results bit for bit and to float64 references,
and check that a call on labels that are not on the host reads nothing back: under a torch
dispatch mode that refuses every scalar read, on ``meta`` tensors (which hold no data), and
under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import softmaxkit as sk
from softmaxkit import rows as frontend
from softmaxkit.reference import rows as reference
from softmaxkit.testing.tolerance import TOLERANCES

numba_cpu = pytest.importorskip("softmaxkit_numba_cpu.rows")

BACKENDS = ("reference", "numba-cpu")
KERNELS = {"reference": reference.cross_entropy, "numba-cpu": numba_cpu.cross_entropy}
IGNORE = -100


class HostReads(TorchDispatchMode):
    """Count the reads of a tensor's value to the host (``.item()``, ``bool()``, ``int()``,
    ``float()`` all end in ``aten._local_scalar_dense``); with ``forbid``, raise at the first."""

    NAMES = ("_local_scalar_dense", "item", "is_nonzero")

    def __init__(self, forbid: bool = False) -> None:
        super().__init__()
        self.forbid, self.reads = forbid, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.NAMES:
            self.reads.append(func)
            if self.forbid:
                raise AssertionError(f"host read of a tensor: {func}")
        return func(*args, **(kwargs or {}))


def _inputs(dtype: str, seed: int = 0, rows: int = 37, n: int = 11):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float64)
    index = rng.integers(0, n, rows)
    index[::3] = IGNORE
    where = rng.random((rows, n)) > 0.2
    return x, index, where


def _as(lib: str, a, dtype=None):
    if a is None:
        return None
    if lib == "numpy":
        return a if dtype is None else a.astype(dtype)
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if dtype is None else t.to(getattr(torch, dtype))


def _np(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().double().numpy()
    return np.asarray(a, dtype=np.float64)


def _host_count(frontend_kw: dict, x, index, where, backend: str, reduction: str):
    """What the frontend computed before the count moved to the device: the kernel's losses
    summed and scaled by ``1.0 / count`` as a Python float, the gradient with that float."""
    count = int(np.sum(_np(index) != IGNORE))
    scale = 1.0 / count if reduction == "mean" and count else 1.0
    xp = frontend.args.namespace(logits=x)
    loss, grad = KERNELS[backend](
        xp, logits=x, index=index, probs=None, where=where, ignore_index=IGNORE,
        grad_scale=scale, out_dtype=x.dtype, **frontend_kw,
    )
    if reduction == "none":
        return loss, grad
    total = xp.sum(loss) if reduction == "sum" else xp.sum(loss) * scale
    return total, grad


# ---------------------------------------------------------------------------------------------
# the device count gives what the host count gave


@pytest.fixture(params=["host", "device"])
def count_path(request, monkeypatch):
    """Host labels counted on the host, and the same labels taken as a GPU's (counted as an
    array, never read back)."""
    if request.param == "device":
        monkeypatch.setattr(frontend, "_labels_on_host", lambda index: False)
    return request.param


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("masked", [False, True])
def test_device_count_equals_host_count_and_float64(count_path, backend, lib, dtype,
                                                    reduction, smoothing, masked):
    if dtype == "bfloat16" and lib == "numpy":
        pytest.importorskip("ml_dtypes")
        dtype_np = __import__("ml_dtypes").bfloat16
    else:
        dtype_np = dtype
    x64, index, where = _inputs(dtype)
    x = _as(lib, x64.astype(dtype_np) if lib == "numpy" else x64, None if lib == "numpy"
            else dtype)
    idx, w = _as(lib, index), _as(lib, where) if masked else None
    loss, grad = sk.cross_entropy(x, idx, reduction=reduction, ignore_index=IGNORE,
                                  label_smoothing=smoothing, where=w, return_grad=True,
                                  backend=backend)
    # bit for bit what the Python float scale gave (kernel rows flattened as the frontend does)
    old_loss, old_grad = _host_count({"label_smoothing": smoothing}, x, idx, w, backend,
                                     reduction)
    old_loss = frontend.scalar_result(frontend.args.namespace(logits=x), old_loss)
    if isinstance(old_loss, torch.Tensor):
        old_loss = old_loss.to(x.dtype)
        torch.testing.assert_close(loss, old_loss, rtol=0, atol=0)
        torch.testing.assert_close(grad, old_grad, rtol=0, atol=0)
    else:
        np.testing.assert_array_equal(np.asarray(loss), np.asarray(old_loss).astype(x.dtype))
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(old_grad))
    # and within the dtype's tolerance of the float64 reference on the represented inputs
    rep = _np(x)
    ref_loss, ref_grad = sk.cross_entropy(rep, index, reduction=reduction, ignore_index=IGNORE,
                                          label_smoothing=smoothing,
                                          where=where if masked else None, return_grad=True,
                                          backend="reference")
    rtol, atol = TOLERANCES[dtype]
    finite = np.isfinite(ref_loss)
    np.testing.assert_allclose(_np(loss)[finite], np.asarray(ref_loss)[finite], rtol=rtol,
                               atol=atol)
    np.testing.assert_array_equal(_np(loss)[~finite], np.asarray(ref_loss)[~finite])
    np.testing.assert_allclose(_np(grad), ref_grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_all_rows_ignored_mean_is_zero_with_zero_gradient(count_path, backend, lib, smoothing):
    x64, _, _ = _inputs("float32")
    idx = _as(lib, np.full(len(x64), IGNORE))
    loss, grad = sk.cross_entropy(_as(lib, x64), idx, ignore_index=IGNORE,
                                  label_smoothing=smoothing, return_grad=True, backend=backend)
    assert float(loss) == 0.0 and not np.signbit(float(loss))
    assert np.all(_np(grad) == 0)


def test_array_api_strict_and_dask_take_the_device_count(count_path):
    xps = pytest.importorskip("array_api_strict")
    da = pytest.importorskip("dask.array")
    import dask

    x64, index, where = _inputs("float64")
    ref = sk.cross_entropy(x64, index, ignore_index=IGNORE, label_smoothing=0.2,
                           return_grad=True, backend="reference")
    got = sk.cross_entropy(xps.asarray(x64), xps.asarray(index), ignore_index=IGNORE,
                           label_smoothing=0.2, return_grad=True)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)

    computed = []

    def counting(dsk, keys, **kwargs):
        computed.append(keys)
        return dask.get(dsk, keys, **kwargs)

    with dask.config.set(scheduler=counting):
        loss, grad = sk.cross_entropy(da.from_array(x64, chunks=(10, 11)),
                                      da.from_array(index, chunks=10), ignore_index=IGNORE,
                                      label_smoothing=0.2, return_grad=True)
        assert computed == []  # lazy: neither the range check nor the count computed anything
        np.testing.assert_allclose(np.asarray(loss), ref[0], rtol=1e-14)
        np.testing.assert_allclose(np.asarray(grad), ref[1], rtol=1e-14, atol=1e-300)


# ---------------------------------------------------------------------------------------------
# out-of-range labels: the named error on the host, NaN rows elsewhere


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("smoothing", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("grad_scale", ["float", "array"])
def test_kernels_give_nan_rows_for_out_of_range_labels(backend, smoothing, grad_scale):
    x, index, where = _inputs("float32", seed=3)
    x = x.astype(np.float32)
    bad = index.copy()
    bad[1], bad[2], bad[4] = 11, -1, 10**9  # outside [0, 11) and not ignore_index
    in_range = index.copy()
    in_range[[1, 2, 4]] = 0
    scale = 0.25 if grad_scale == "float" else np.asarray(0.25, dtype=np.float32)
    xp = frontend.args.namespace(logits=x)
    kw = dict(logits=x, probs=None, where=where, ignore_index=IGNORE,
              label_smoothing=smoothing, grad_scale=scale, out_dtype=x.dtype)
    loss, grad = KERNELS[backend](xp, index=bad, **kw)
    good_loss, good_grad = KERNELS[backend](xp, index=in_range, **kw)
    rows = np.zeros(len(x), bool)
    rows[[1, 2, 4]] = True
    assert np.all(np.isnan(loss[rows])) and np.all(np.isnan(grad[rows]))
    np.testing.assert_array_equal(loss[~rows], good_loss[~rows])
    np.testing.assert_array_equal(grad[~rows], good_grad[~rows])
    ignored = index == IGNORE
    assert np.all(loss[ignored] == 0) and np.all(grad[ignored] == 0)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_host_labels_out_of_range_raise_the_named_error(lib):
    x, index, _ = _inputs("float64")
    bad = index.copy()
    bad[1] = 11
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=r"outside \[0, 11\).*ignore_index=-100"):
            sk.cross_entropy(_as(lib, x), _as(lib, bad), ignore_index=IGNORE, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_labels_off_the_host_out_of_range_give_nan(monkeypatch, backend, reduction):
    # what a CUDA call does (labels not in host memory): no check, NaN where it is wrong
    monkeypatch.setattr(frontend, "_labels_on_host", lambda index: False)
    x, index, _ = _inputs("float32")
    bad = index.copy()
    bad[1] = 11
    loss, grad = sk.cross_entropy(torch.from_numpy(x), torch.from_numpy(bad),
                                  reduction=reduction, ignore_index=IGNORE, return_grad=True,
                                  backend=backend)
    if reduction == "none":
        assert torch.isnan(loss[1]) and not torch.isnan(loss[torch.arange(len(x)) != 1]).any()
    else:
        assert torch.isnan(loss)
    assert torch.isnan(grad[1]).all() and not torch.isnan(grad[torch.arange(len(x)) != 1]).any()


def test_labels_on_host_policy():
    t = torch.zeros(3, dtype=torch.int64)
    assert frontend._labels_on_host(np.zeros(3, int))
    assert frontend._labels_on_host(t)
    assert not frontend._labels_on_host(t.to("meta"))
    da = pytest.importorskip("dask.array")
    assert not frontend._labels_on_host(da.zeros(3, dtype=int))


# ---------------------------------------------------------------------------------------------
# no host read


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_host_read_when_labels_are_off_the_host(monkeypatch, backend, reduction):
    x, index, where = _inputs("float32")
    args = (torch.from_numpy(x), torch.from_numpy(index))
    kw = dict(reduction=reduction, ignore_index=IGNORE, label_smoothing=0.1,
              where=torch.from_numpy(where), return_grad=True, backend=backend)
    with HostReads() as mode:
        eager = sk.cross_entropy(*args, **kw)
    # on the host: the range check, and the count of the mean (reads of host memory)
    assert len(mode.reads) == (2 if reduction == "mean" else 1)
    monkeypatch.setattr(frontend, "_labels_on_host", lambda index: False)
    with HostReads(forbid=True):
        captured = sk.cross_entropy(*args, **kw)
    for a, b in zip(captured, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_runs_on_meta_tensors(reduction, smoothing):
    # meta tensors hold no data: any read of a value (a check, a count) would raise
    x = torch.empty(6, 5, device="meta")
    t = torch.empty(6, dtype=torch.int64, device="meta")
    loss, grad = sk.cross_entropy(x, t, reduction=reduction, ignore_index=IGNORE,
                                  label_smoothing=smoothing, return_grad=True,
                                  backend="reference")
    assert loss.shape == ((6,) if reduction == "none" else ())
    assert grad.shape == (6, 5) and grad.device.type == "meta"


def test_torch_compile_fullgraph_with_ignore_index_mean():
    x64, index, _ = _inputs("float32")
    target = torch.from_numpy(index)

    def loss_fn(x, target):
        return sk.cross_entropy(x, target, ignore_index=IGNORE, label_smoothing=0.1)

    def fused(x, target):
        return sk.cross_entropy(x, target, ignore_index=IGNORE, label_smoothing=0.1,
                                return_grad=True)

    compiled = torch.compile(loss_fn, fullgraph=True, backend="eager")
    compiled_fused = torch.compile(fused, fullgraph=True, backend="eager")
    for t in (target, torch.full_like(target, IGNORE)):
        x = torch.from_numpy(x64).float().requires_grad_()
        y = torch.from_numpy(x64).float().requires_grad_()
        a, b = compiled(x, t), loss_fn(y, t)
        a.backward()
        b.backward()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)
        for got, want in zip(compiled_fused(x.detach(), t), fused(x.detach(), t), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
