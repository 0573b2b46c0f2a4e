"""What one call costs: softmaxkit's per-call time on small inputs, next to torch and SciPy.

``softmaxkit bench --calls`` runs :func:`run`.  For each operation (softmax, log_softmax,
logsumexp, cross_entropy with its gradient), dtype (float32, bfloat16) and small shape
((8,) and (64, 1024) by default) it times, on the inputs of each array library of the device
(numpy arrays, torch tensors and JAX arrays on the CPU, torch tensors on CUDA):

* ``default``: the public function with the default dispatch;
* ``sk:NAME``: the same call forced to each installed backend that serves it (``backend=``);
* the peers: ``torch`` (``torch.softmax``, ..., ``F.cross_entropy`` forward and backward) on
  torch inputs, ``scipy`` (``scipy.special``) on numpy inputs in float32, ``jax``
  (``jax.nn.softmax``, ..., the gradient of the mean of ``-log_softmax`` at the targets by
  ``jax.value_and_grad``) on JAX arrays, called eagerly as the others; every call on JAX
  arrays, softmaxkit's included, waits for its results (JAX dispatches asynchronously).

Every contender's result is first compared with a float64 reference on fresh random inputs,
its output memory poisoned with NaN just before (a buffer of the result's size is filled and
released, so the allocator hands the same memory to the result); a wrong result is reported
and not timed.  A time is the median over several samples of the wall clock of a few hundred
calls in a row; on CUDA each sample ends with a synchronize, so queued work is paid for.  The
samples are taken in rounds over the whole run, one sample of every contender of every case
a round: a host that slows for a moment (a shared machine does, for a second at a time) costs
one sample of a few cases, not every sample of one case.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SHAPES: tuple[tuple[int, ...], ...] = ((8,), (64, 1024))
OPS: tuple[str, ...] = ("softmax", "log_softmax", "logsumexp", "cross_entropy")
DTYPES: tuple[str, ...] = ("float32", "bfloat16")


@dataclass
class Timing:
    """One contender on one case: microseconds per call, or why it was not timed."""

    op: str
    dtype: str
    shape: tuple[int, ...]
    library: str
    contender: str
    us: float = math.nan
    note: str = ""


# -- inputs and float64 references -------------------------------------------------------------


def _inputs(shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(scale=3.0, size=shape).astype(np.float32)
    target = rng.integers(0, shape[-1], size=shape[:-1])
    return x, target


def _native(x: np.ndarray, dtype: str, library: str, device: str) -> Any:
    if library == "numpy":
        from .dtypes import lookup

        return np.ascontiguousarray(x.astype(lookup(np, dtype)))
    if library == "jax":
        import jax.numpy as jnp

        return jnp.asarray(x, dtype=getattr(jnp, dtype))
    import torch

    return torch.from_numpy(x).to(device=device, dtype=getattr(torch, dtype))


def _float64(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):
        import torch

        return a.detach().to(torch.float64).cpu().numpy()
    return np.asarray(a, dtype=np.float64)


def _reference(op: str, x: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, ...]:
    """float64 results of ``op`` along the last axis (cross_entropy: per-row loss, gradient
    of their mean)."""
    m = x.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    if op == "softmax":
        return (np.exp(x - lse),)
    if op == "log_softmax":
        return (x - lse,)
    if op == "logsumexp":
        return (lse[..., 0],)
    onehot = np.zeros_like(x)
    np.put_along_axis(onehot, target[..., None], 1.0, axis=-1)
    loss = (lse[..., 0] - (x * onehot).sum(axis=-1)).mean()
    rows = max(1, math.prod(x.shape[:-1]))
    return np.asarray(loss), (np.exp(x - lse) - onehot) / rows


def _check(got: Sequence[Any], expected: tuple[np.ndarray, ...], x: np.ndarray,
           dtype: str) -> str:
    """``""`` when every result is within the dtype's tolerance, scaled by the row's logits
    (log-domain values are differences of terms as large as the logits), else why not."""
    from .testing.tolerance import TOLERANCES

    rtol, atol = TOLERANCES[dtype]
    scale = float(np.abs(x).max()) + math.log(x.shape[-1] + 1)
    for g, e in zip(got, expected, strict=True):
        g64 = _float64(g)
        if g64.shape != e.shape:
            return f"shape {g64.shape} instead of {e.shape}"
        bound = 4 * (atol + rtol * (np.abs(e) + scale))
        err = np.abs(g64 - e)
        if not np.all(err <= bound):  # NaN (a poisoned output left unwritten) fails too
            worst = float(np.max(np.nan_to_num(err, nan=np.inf)))
            return f"wrong result: error {worst:.3g}"
    return ""


def _poison(like: Any, nbytes: int) -> None:
    """Fill a released buffer of ``nbytes`` with NaN so the next allocation of that size
    (the result's) most likely starts as NaN, not as an earlier correct result."""
    # all-ones bytes are NaN in every floating dtype
    junk: Any
    if hasattr(like, "detach"):
        import torch

        junk = torch.full((nbytes,), 255, dtype=torch.uint8, device=like.device)
    else:
        junk = np.full(nbytes, 255, dtype=np.uint8)
    del junk


# -- contenders --------------------------------------------------------------------------------


def _softmaxkit(op: str, backend: str | None) -> Callable[[Any, Any], Any]:
    import softmaxkit as sk

    if op == "cross_entropy":
        return lambda x, t: sk.cross_entropy(x, t, return_grad=True, backend=backend)
    fn = getattr(sk, op)
    return lambda x, t: (fn(x, axis=-1, backend=backend),)


def _torch_peer(op: str) -> Callable[[Any, Any], Any]:
    import torch

    if op == "cross_entropy":
        def forward_backward(x: Any, t: Any) -> tuple[Any, Any]:
            leaf = x.detach().requires_grad_()
            loss = torch.nn.functional.cross_entropy(leaf, t)
            loss.backward()
            return loss, leaf.grad

        return forward_backward
    fn = getattr(torch, op)
    return lambda x, t: (fn(x, dim=-1),)


def _jax_peer(op: str) -> Callable[[Any, Any], Any]:
    import jax
    import jax.numpy as jnp

    if op == "cross_entropy":
        def loss(x: Any, t: Any) -> Any:
            logp = jax.nn.log_softmax(x, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, t[..., None], axis=-1))

        value_and_grad = jax.value_and_grad(loss)
        return lambda x, t: value_and_grad(x, t)
    fn: Any = getattr(jax.nn, op)  # softmax, log_softmax, logsumexp
    return lambda x, t: (fn(x, axis=-1),)


def _waiting(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``fn`` returning only once its (JAX) results are computed."""
    import jax

    return lambda x, t: jax.block_until_ready(fn(x, t))


def _scipy_peer(op: str) -> Callable[[Any, Any], Any] | None:
    try:
        from scipy import special
    except ImportError:
        return None
    if op == "cross_entropy":
        return None
    fn = getattr(special, op)
    return lambda x, t: (fn(x, axis=-1),)


def _backends(op: str, device: str, dtype: str) -> list[str]:
    """Installed backends that declare (op, device, dtype), the reference last."""
    from .registry import REFERENCE, registry

    names = [n for n, b in registry().items() if b.serves_key(op, device, dtype)]
    return sorted(names, key=lambda n: (n == REFERENCE, n))


def _libraries(device: str) -> list[str]:
    libs = ["numpy"] if device == "cpu" else []
    try:
        import torch  # noqa: F401

        libs.append("torch")
    except ImportError:
        pass
    if device == "cpu":
        try:
            import jax  # noqa: F401

            libs.append("jax")
        except ImportError:
            pass
    return libs


# -- timing ------------------------------------------------------------------------------------


def _sync(device: str) -> Callable[[], None]:
    if device == "cpu":
        return lambda: None
    import torch

    return torch.cuda.synchronize


def per_call(fns: Sequence[Callable[[], Any]], device: str = "cpu", calls: int | None = None,
             repeats: int = 7, sample_time: float = 0.02) -> list[float]:
    """Median seconds per call of each of ``fns``: each sample runs a function ``calls``
    times in a row (by default as many as fill ``sample_time``, 20 to 500) and then
    synchronizes the device; a round takes one sample of each function, in turn."""
    sync = _sync(device)
    counts = []
    for fn in fns:
        fn()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        once = max(time.perf_counter() - start, 1e-7)
        counts.append(calls or max(20, min(500, int(sample_time / once))))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, count, mine in zip(fns, counts, samples, strict=True):
            sync()
            start = time.perf_counter()
            for _ in range(count):
                fn()
            sync()
            mine.append((time.perf_counter() - start) / count)
    return [statistics.median(s) for s in samples]


def run(device: str = "cpu", ops: Sequence[str] = OPS, dtypes: Sequence[str] = DTYPES,
        shapes: Sequence[tuple[int, ...]] = SHAPES, repeats: int = 7, seed: int = 0,
        calls: int | None = None) -> list[Timing]:
    """Check every contender on every case, then time them all in rounds; see the module
    docstring."""
    if device == "cuda" and calls is None:
        calls = 300
    out: list[Timing] = []
    timed: list[tuple[Timing, Callable[[], Any]]] = []
    for shape in shapes:
        x32, target = _inputs(tuple(shape), seed)
        for dtype in dtypes:
            for op in ops:
                for library in _libraries(device):
                    rows, ready = _case(op, dtype, tuple(shape), library, device, x32, target)
                    out.extend(rows)
                    timed.extend(ready)
    seconds = per_call([f for _, f in timed], device, calls, repeats)
    for (row, _), sec in zip(timed, seconds, strict=True):
        row.us = sec * 1e6
    return out


def _case(op: str, dtype: str, shape: tuple[int, ...], library: str, device: str,
          x32: np.ndarray, target: np.ndarray
          ) -> tuple[list[Timing], list[tuple[Timing, Callable[[], Any]]]]:
    """The rows of one case, and the checked contenders to time (a row and its call)."""
    from .registry import NoBackendError

    x = _native(x32, dtype, library, device)
    if library == "numpy":
        t: Any = np.asarray(target)
    elif library == "jax":
        import jax.numpy as jnp

        t = jnp.asarray(target)
    else:
        import torch

        t = torch.from_numpy(np.asarray(target)).to(device)
    expected = _reference(op, _float64(x), np.asarray(target))
    contenders: list[tuple[str, Callable[[Any, Any], Any] | None]] = [
        ("default", _softmaxkit(op, None)),
        *((f"sk:{b}", _softmaxkit(op, b)) for b in _backends(op, device, dtype)),
    ]
    if library == "torch":
        contenders.append(("torch", _torch_peer(op)))
    elif library == "jax":
        contenders.append(("jax", _jax_peer(op)))
        contenders = [(name, fn if fn is None else _waiting(fn)) for name, fn in contenders]
    elif dtype == "float32":
        contenders.append(("scipy", _scipy_peer(op)))
    rows: list[Timing] = []
    timed: list[tuple[Timing, Callable[[], Any]]] = []
    nbytes = x32.size * 4  # the largest result: float32 at most, the input's shape
    for name, fn in contenders:
        row = Timing(op, dtype, shape, library, name)
        rows.append(row)
        if fn is None:
            row.note = "not installed or no such function"
            continue
        try:
            _poison(x, nbytes)
            got = fn(x, t)
            if device == "cuda":
                _sync(device)()
        except NoBackendError as exc:
            row.note = "declines: " + str(exc).splitlines()[0][:70]
            continue
        except Exception as exc:  # a peer without this dtype
            row.note = f"{type(exc).__name__}: {str(exc)[:70]}"
            continue
        wrong = _check(got, expected, _float64(x), dtype)
        if wrong:
            row.note = wrong + "; not timed"
            continue
        if name == "default":
            row.note = "on " + _ran_on(fn, x, t)
        timed.append((row, functools.partial(fn, x, t)))
    return rows, timed


def _ran_on(fn: Callable[[Any, Any], Any], x: Any, t: Any) -> str:
    from .registry import backend_opts

    with backend_opts(trace=True) as trace:
        fn(x, t)
    return ", ".join(dict.fromkeys(r.backend for r in trace))


# -- tables ------------------------------------------------------------------------------------


def table(timings: Sequence[Timing], full: bool = True) -> str:
    """The timings as text: microseconds per call and the ratio to the peer of the same input
    (torch for torch tensors, SciPy for numpy arrays, JAX for JAX arrays).  ``full=False``
    keeps the default dispatch and the peers only."""
    head = (f"{'op':<16}{'dtype':<10}{'shape':<10}{'input':<7}{'contender':<18}"
            f"{'us/call':>9}{'/ peer':>8}  note")
    lines = [head, "-" * len(head)]
    cases: dict[tuple, list[Timing]] = {}
    for r in timings:
        cases.setdefault((r.op, r.dtype, r.shape, r.library), []).append(r)
    for (op, dtype, shape, library), group in cases.items():
        peer = next((r for r in group if r.contender in ("torch", "scipy", "jax")
                     and not math.isnan(r.us)), None)
        for r in group:
            if not full and r.contender.startswith("sk:"):
                continue
            us = "" if math.isnan(r.us) else f"{r.us:.1f}"
            ratio = ("" if peer is None or r is peer or math.isnan(r.us)
                     else f"{r.us / peer.us:.2f}x")
            name = op if op != "cross_entropy" else "cross_ent+grad"
            lines.append(f"{name:<16}{dtype:<10}{'x'.join(map(str, shape)):<10}{library:<7}"
                         f"{r.contender:<18}{us:>9}{ratio:>8}  {r.note}")
    lines.append("us/call: median wall clock per call (CUDA: a synchronize ends each sample); "
                 "/ peer: the time over the peer's on the same input (below 1: faster).")
    return "\n".join(lines)
