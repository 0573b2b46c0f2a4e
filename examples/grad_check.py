"""Gradients of softmaxkit's operators on one device and backend, against torch's autograd.

For each backend (forced with ``backend=``, so the forward and the backward both run on it),
each dtype (float32, bfloat16) and each differentiable operation, the gradient of a random
linear functional is compared with torch's own autograd of the equivalent torch code: both
are measured against torch's float64 gradient, and softmaxkit's error must be at most twice
torch's own error in that dtype, or within the spec's tolerance for the dtype.  An operation
the backend does not serve is reported as such, not failed.  With ``--graphs`` (CUDA only)
each operation's forward and backward is also captured in a CUDA graph, replayed on fresh
data copied into the captured inputs (and class labels: fresh ones, all ignored, and one
outside ``[0, C)``, which must give a NaN loss and a NaN gradient row, spec "cross_entropy"),
and each replay compared with float64 references; the cross-entropy cases also run under
``torch.compile(mode="reduce-overhead", fullgraph=True)`` (Inductor's CUDA graphs) on the same
fresh data.  A capture or replay that fails counts as a failure.

Examples
--------
::

    python examples/grad_check.py --device cuda --backends cupy numba-cuda reference --graphs
    python examples/grad_check.py --device cpu --backends numba-cpu reference

Exits with status 1 if any served operation fails.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import softmaxkit as sk
from softmaxkit.testing.tolerance import TOLERANCES

f64 = torch.float64


def _torch_attention(q, k, v, causal="bottom_right", window=(-1, -1)):
    g = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    lq, lk = q.shape[-2], k.shape[-2]
    i = torch.arange(lq, device=q.device)[:, None] + (0 if causal == "top_left" else lk - lq)
    j = torch.arange(lk, device=q.device)[None, :]
    allowed = j <= i
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1)
    return torch.nan_to_num(p, nan=0.0) @ v


def _torch_merge(outs, lses):
    lse = torch.logsumexp(lses, dim=0)
    return (torch.exp(lses - lse)[..., None] * outs).sum(0), lse


IGNORE = -100
LABELS: dict[str, torch.Tensor] = {}
"""Operation name -> the class labels its two functions read (the cross-entropy cases): a
tensor the capture check refills in place, as a training loop refills a captured batch."""


def cases(device: str) -> dict[str, tuple[Callable, Callable, list[torch.Tensor]]]:
    """Operation name -> (softmaxkit function of (backend, *inputs), torch function, inputs)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(shape, generator=g, dtype=f64) * scale).to(device)

    target = torch.randint(0, 1000, (64,), generator=g).to(device)
    target[3] = IGNORE
    ce = dict(ignore_index=IGNORE, label_smoothing=0.1)
    ce_sum = dict(ignore_index=IGNORE, reduction="sum")
    ce_none = dict(ignore_index=IGNORE, reduction="none", label_smoothing=0.2)
    for op in ("cross_entropy", "cross_entropy-sum", "cross_entropy-none"):
        LABELS[op] = target
    return {
        "softmax": (lambda b, x: sk.softmax(x, -1, backend=b),
                    lambda x: torch.softmax(x, -1), [r(64, 1000, scale=3)]),
        "log_softmax": (lambda b, x: sk.log_softmax(x, -1, backend=b),
                        lambda x: torch.log_softmax(x, -1), [r(64, 1000, scale=3)]),
        "logsumexp": (lambda b, x: sk.logsumexp(x, -1, backend=b),
                      lambda x: torch.logsumexp(x, -1), [r(64, 1000, scale=3)]),
        "cross_entropy": (lambda b, x: sk.cross_entropy(x, target, backend=b, **ce),
                          lambda x: F.cross_entropy(x, target, **ce), [r(64, 1000, scale=3)]),
        "cross_entropy-sum": (lambda b, x: sk.cross_entropy(x, target, backend=b, **ce_sum),
                              lambda x: F.cross_entropy(x, target, **ce_sum),
                              [r(64, 1000, scale=3)]),
        "cross_entropy-none": (lambda b, x: sk.cross_entropy(x, target, backend=b, **ce_none),
                               lambda x: F.cross_entropy(x, target, **ce_none),
                               [r(64, 1000, scale=3)]),
        "attention": (
            lambda b, q, k, v: sk.attention(q, k, v, causal=True, backend=b),
            lambda q, k, v: _torch_attention(q, k, v),
            [r(2, 8, 96, 64), r(2, 2, 128, 64), r(2, 2, 128, 64)],
        ),
        "attention-window-top-left": (
            lambda b, q, k, v: sk.attention(q, k, v, causal="top_left", window=(32, 0),
                                            backend=b),
            lambda q, k, v: _torch_attention(q, k, v, "top_left", (32, 0)),
            [r(1, 4, 128, 64), r(1, 4, 128, 64), r(1, 4, 128, 64)],
        ),
        "merge_attention": (
            lambda b, o, s: sk.merge_attention_states(o, s, backend=b)[0],
            lambda o, s: _torch_merge(o, s)[0], [r(3, 256, 64), r(3, 256)],
        ),
    }


def check(fn: Callable, ref: Callable, inputs: Sequence[torch.Tensor], dtype: torch.dtype,
          backend: str) -> tuple[bool, float, float]:
    """(passed, softmaxkit's max error, torch's max error) of the gradients in ``dtype``."""
    grads, cot = {}, None
    for name, f, dt in (("ref", ref, f64), ("torch", ref, dtype),
                        ("sk", lambda *a: fn(backend, *a), dtype)):
        xs = [x.detach().to(dt).requires_grad_() for x in inputs]
        y = f(*xs)
        if cot is None:
            cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(1),
                              dtype=f64).to(y.device)
        grads[name] = torch.autograd.grad(y, xs, cot.to(y.dtype))
    rtol, atol = TOLERANCES["float32" if dtype == torch.float32 else "bfloat16"]
    ok, worst, worst_torch = True, 0.0, 0.0
    for ref_g, mine, theirs in zip(grads["ref"], grads["sk"], grads["torch"], strict=True):
        err = (mine.double() - ref_g).abs().max().item()
        torch_err = (theirs.double() - ref_g).abs().max().item()
        bound = max(2 * torch_err, 4 * (rtol * ref_g.abs().max().item() + atol))
        ok &= math.isfinite(err) and err <= bound
        worst, worst_torch = max(worst, err), max(worst_torch, torch_err)
    return ok, worst, worst_torch


def _bound(ref: torch.Tensor, torch_err: float, dtype: torch.dtype) -> float:
    """The error allowed against a float64 reference: as :func:`check`'s."""
    rtol, atol = TOLERANCES["float32" if dtype == torch.float32 else "bfloat16"]
    finite = ref[torch.isfinite(ref)]
    top = finite.abs().max().item() if finite.numel() else 0.0
    return max(2 * torch_err, 4 * (rtol * top + atol))


def _worse(a: float, b: float) -> float:
    """The larger error, NaN (a value where the reference has none) above everything."""
    return b if b != b or b > a else a


def _max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.double() - ref).abs().max().item() if ref.numel() else 0.0


def _rounds(op: str, inputs: Sequence[torch.Tensor], dtype: torch.dtype) -> list[tuple]:
    """Fresh data for the replays: (name, inputs, labels or None, rows expected NaN)."""
    g = torch.Generator().manual_seed(7)
    device = inputs[0].device

    def fresh():
        return [(torch.randn(x.shape, generator=g, dtype=f64) * x.std().item()).to(device)
                .to(dtype).to(f64) for x in inputs]

    labels = LABELS.get(op)
    if labels is None:
        return [("fresh data", fresh(), None, []), ("fresh data again", fresh(), None, [])]
    n_classes = inputs[0].shape[-1]

    def draw():
        t = torch.randint(0, n_classes, labels.shape, generator=g)
        t[torch.rand(labels.shape, generator=g) < 0.25] = IGNORE
        return t.to(device)

    bad = draw()
    bad[5] = n_classes  # outside [0, C), not ignored: NaN loss row, NaN gradient row
    return [("fresh data and labels", fresh(), draw(), []),
            ("every label ignored", fresh(), torch.full_like(labels, IGNORE), []),
            ("a label outside [0, C)", fresh(), bad, [5])]


def capture(fn: Callable, ref: Callable, inputs: Sequence[torch.Tensor], dtype: torch.dtype,
            backend: str, op: str) -> tuple[bool, str]:
    """Capture forward + backward in a CUDA graph, replay it on fresh data copied into the
    captured inputs (and labels), and compare every replay with float64 references.

    Returns (passed, a line of what was checked).  The functional ``sum(fn(...))`` is
    differentiated, so a vector output (reduction="none") gets the cotangent 1.
    """
    labels = LABELS.get(op)
    kept = None if labels is None else labels.clone()
    xs = [x.detach().to(dtype).requires_grad_() for x in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (kernels compiled, memory pools settled)
        for _ in range(2):
            torch.autograd.grad(fn(backend, *xs).float().sum(), xs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = fn(backend, *xs)
            grads = torch.autograd.grad(out.float().sum(), xs)
    except Exception as exc:  # report, do not hide: capture is a property being checked
        return False, f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"

    def replay() -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
        graph.replay()
        torch.cuda.synchronize()
        return out, grads

    try:
        return check_replays(op, ref, inputs, dtype, xs, replay)
    finally:
        if kept is not None:
            labels.copy_(kept)


def compiled(fn: Callable, ref: Callable, inputs: Sequence[torch.Tensor], dtype: torch.dtype,
             backend: str, op: str, compile_kw: dict[str, Any] | None = None
             ) -> tuple[bool, str]:
    """The forward under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (Inductor's
    CUDA graphs, for the forward and the compiled backward), run on fresh data copied into
    the same input tensors and compared with float64 references as :func:`capture` does.

    Fails when Inductor skipped its CUDA graphs (it counts the skips).  ``compile_kw``
    replaces the mode (the test suite compiles with ``{"backend": "eager"}`` on the CPU).
    """
    from torch._dynamo.utils import counters

    labels = LABELS.get(op)
    kept = None if labels is None else labels.clone()
    xs = [x.detach().to(dtype).requires_grad_() for x in inputs]
    torch._dynamo.reset()
    step = torch.compile(lambda *a: fn(backend, *a), fullgraph=True,
                         **(compile_kw or {"mode": "reduce-overhead"}))
    skips = counters["inductor"]["cudagraph_skips"]

    def replay() -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
        out = step(*xs)
        grads = torch.autograd.grad(out.float().sum(), xs)
        # copies: the next replay writes into the graph's outputs
        return out.detach().clone(), [g.clone() for g in grads]

    try:
        for _ in range(3):  # warm-up: Inductor records its graphs on the first calls
            replay()
        ok, notes = check_replays(op, ref, inputs, dtype, xs, replay)
    except Exception as exc:
        return False, f"compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    finally:
        if kept is not None:
            labels.copy_(kept)
    skipped = counters["inductor"]["cudagraph_skips"] - skips
    if skipped:
        return False, f"Inductor skipped CUDA graphs ({skipped}x); {notes}"
    return ok, notes


def check_replays(op: str, ref: Callable, inputs: Sequence[torch.Tensor], dtype: torch.dtype,
                  xs: Sequence[torch.Tensor], replay: Callable) -> tuple[bool, str]:
    """Copy each round of fresh data into ``xs`` (and the op's labels), call ``replay`` for
    the step's (output, gradients), and compare them with float64 references.

    ``replay`` is a CUDA graph's replay in :func:`capture`; the test suite passes an eager
    step, so the comparisons run on any machine.
    """
    labels = LABELS.get(op)
    notes, ok = [], True
    for name, fresh, new_labels, nan_rows in _rounds(op, inputs, dtype):
        with torch.no_grad():
            for x, new in zip(xs, fresh, strict=True):
                x.copy_(new.to(dtype))
            if new_labels is not None:
                labels.copy_(new_labels)
        out, grads = replay()
        good, note = _compare_replay(ref, fresh, out, grads, dtype, labels, new_labels,
                                     nan_rows)
        ok &= good
        notes.append(f"{name}: {note}")
    return ok, "; ".join(notes)


def _compare_replay(ref: Callable, fresh: list[torch.Tensor], out: torch.Tensor,
                    grads: Sequence[torch.Tensor], dtype: torch.dtype,
                    labels: torch.Tensor | None, new_labels: torch.Tensor | None,
                    nan_rows: list[int]) -> tuple[bool, str]:
    """One replay's output and gradients against float64 (and torch's error in ``dtype``)."""
    if new_labels is not None and bool((new_labels == IGNORE).all()):
        # softmaxkit's mean over no counted row is 0 with gradient 0 (torch's is NaN)
        ok = bool((out == 0).all()) and all(bool((g == 0).all()) for g in grads)
        return ok, "0 / 0 as the spec says" if ok else "NOT 0 / 0"
    if nan_rows:
        # the reference sees a valid label there (the count of the mean is the same), and the
        # other rows must match it; torch itself must not see the bad label (device assert)
        with torch.no_grad():
            labels.copy_(_replace_rows(new_labels, nan_rows))
    refs = {}
    for name, dt in (("f64", f64), ("torch", dtype)):
        xs = [x.to(dt).requires_grad_() for x in fresh]
        y = ref(*xs)
        refs[name] = (y.detach(), torch.autograd.grad(y.float().sum() if dt != f64
                                                      else y.sum(), xs))
    if nan_rows:
        with torch.no_grad():
            labels.copy_(new_labels)
    (ref_out, ref_grads), (t_out, t_grads) = refs["f64"], refs["torch"]
    keep = torch.ones(grads[0].shape[0], dtype=torch.bool, device=out.device)
    if nan_rows:
        keep[nan_rows] = False
        nan_ok = bool(torch.isnan(grads[0][nan_rows]).all())
        nan_ok &= bool(torch.isnan(out[nan_rows]).all()) if out.ndim else bool(torch.isnan(out))
        worst = 0.0
        ok = nan_ok
        for g, r, t in zip(grads, ref_grads, t_grads, strict=True):
            err, terr = _max_err(g[keep], r[keep]), _max_err(t[keep], r[keep])
            ok &= math.isfinite(err) and err <= _bound(r[keep], terr, dtype)
            worst = _worse(worst, err)
        if out.ndim:
            err = _max_err(out[keep], ref_out[keep])
            ok &= err <= _bound(ref_out[keep], _max_err(t_out[keep], ref_out[keep]), dtype)
        return ok, (f"NaN row{'s' if len(nan_rows) > 1 else ''} "
                    f"{'as the spec says' if nan_ok else 'MISSING'}, other rows "
                    f"grad err {worst:.1e}{'' if ok else ' FAIL'}")
    ok, worst = True, 0.0
    pairs = [(out, ref_out, t_out), *zip(grads, ref_grads, t_grads, strict=True)]
    for got, r, t in pairs:
        err = _max_err(got, r)
        ok &= math.isfinite(err) and err <= _bound(r, _max_err(t, r), dtype)
        worst = _worse(worst, err)
    return ok, f"err {worst:.1e}{'' if ok else ' FAIL'}"


def _replace_rows(labels: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``labels`` with ``rows`` set to class 0: what the reference sees for a bad label."""
    out = labels.clone()
    out[rows] = 0
    return out



def _replay(check: Callable[..., tuple[bool, str]], served: Sequence[tuple[str, str, str]],
            all_cases: dict[str, Any]) -> int:
    """Run ``check`` (:func:`capture` or :func:`compiled`) on every served case, print a line
    each, and return the number that failed (an exception counts as a failure)."""
    failed = 0
    for backend, dtype_name, op in served:
        fn, ref, inputs = all_cases[op]
        try:
            ok, result = check(fn, ref, inputs, getattr(torch, dtype_name), backend, op)
        except Exception as exc:
            ok, result = False, (f"error: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:100]}")
        failed += not ok
        print(f"{backend:<11} {dtype_name:<9} {op:<26} {'ok' if ok else 'FAIL':<8} "
              f"{result}", flush=True)
    return failed

def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backends", nargs="+", default=None)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--ops", nargs="+", default=None)
    p.add_argument("--graphs", action="store_true", help="also check CUDA-graph capture")
    a = p.parse_args(argv)
    backends = a.backends or (["cupy", "numba-cuda", "reference"] if a.device == "cuda"
                              else ["numba-cpu", "reference"])
    all_cases = {op: c for op, c in cases(a.device).items() if not a.ops or op in a.ops}
    failed, served = 0, []
    print(f"{'backend':<11} {'dtype':<9} {'operation':<26} {'result':<8} "
          f"{'sk err':>10} {'torch err':>10}")
    for backend in backends:
        for dtype_name in a.dtypes:
            dtype = getattr(torch, dtype_name)
            for op, (fn, ref, inputs) in all_cases.items():
                try:
                    ok, err, terr = check(fn, ref, inputs, dtype, backend)
                except sk.NoBackendError as exc:
                    reason = str(exc).splitlines()[0][:70]
                    print(f"{backend:<11} {dtype_name:<9} {op:<26} {'n/a':<8} ({reason})")
                    continue
                failed += not ok
                served.append((backend, dtype_name, op))
                print(f"{backend:<11} {dtype_name:<9} {op:<26} {'ok' if ok else 'FAIL':<8} "
                      f"{err:>10.2e} {terr:>10.2e}", flush=True)
    if a.graphs and a.device.startswith("cuda"):
        # after every gradient check: a failed capture may leave the device unusable
        print("\nCUDA-graph capture of forward + backward, replayed on fresh data against "
              "float64")
        failed += _replay(capture, served, all_cases)
        print("\ntorch.compile(mode='reduce-overhead', fullgraph=True) of cross_entropy, "
              "replayed on fresh data against float64")
        failed += _replay(compiled, [s for s in served if s[2].startswith("cross_entropy")],
                          all_cases)
    print("all served operations passed" if not failed else f"{failed} FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
