"""Gradients of softmaxkit's operators on one device and backend, against torch's autograd.

For each backend (forced with ``backend=``, so the forward and the backward both run on it),
each dtype (float32, bfloat16) and each differentiable operation, the gradient of a random
linear functional is compared with torch's own autograd of the equivalent torch code: both
are measured against torch's float64 gradient, and softmaxkit's error must be at most twice
torch's own error in that dtype, or within the spec's tolerance for the dtype.  An operation
the backend does not serve is reported as such, not failed.  With ``--graphs`` (CUDA only)
each operation's forward and backward is also captured in a CUDA graph and replayed.

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


def cases(device: str) -> dict[str, tuple[Callable, Callable, list[torch.Tensor]]]:
    """Operation name -> (softmaxkit function of (backend, *inputs), torch function, inputs)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(shape, generator=g, dtype=f64) * scale).to(device)

    target = torch.randint(0, 1000, (64,), generator=g).to(device)
    target[3] = -100
    ce = dict(ignore_index=-100, label_smoothing=0.1)
    return {
        "softmax": (lambda b, x: sk.softmax(x, -1, backend=b),
                    lambda x: torch.softmax(x, -1), [r(64, 1000, scale=3)]),
        "log_softmax": (lambda b, x: sk.log_softmax(x, -1, backend=b),
                        lambda x: torch.log_softmax(x, -1), [r(64, 1000, scale=3)]),
        "logsumexp": (lambda b, x: sk.logsumexp(x, -1, backend=b),
                      lambda x: torch.logsumexp(x, -1), [r(64, 1000, scale=3)]),
        "cross_entropy": (lambda b, x: sk.cross_entropy(x, target, backend=b, **ce),
                          lambda x: F.cross_entropy(x, target, **ce), [r(64, 1000, scale=3)]),
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


def capture(fn: Callable, inputs: Sequence[torch.Tensor], dtype: torch.dtype,
            backend: str) -> str:
    """Capture forward + backward in a CUDA graph, replay, and compare with an eager step."""
    xs = [x.detach().to(dtype).requires_grad_() for x in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (kernels compiled, memory pools settled)
        for _ in range(2):
            eager = torch.autograd.grad(fn(backend, *xs).float().sum(), xs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = torch.autograd.grad(fn(backend, *xs).float().sum(), xs)
    except Exception as exc:  # report, do not hide: capture is a property being checked
        return f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    graph.replay()
    torch.cuda.synchronize()
    # atomics may reorder sums between runs: close, not bitwise
    same = all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3)
               for a, b in zip(eager, captured, strict=True))
    return "captured, replay matches eager" if same else "captured, replay DIFFERS from eager"


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
        print("\nCUDA-graph capture of forward + backward")
        for backend, dtype_name, op in served:
            fn, _, inputs = all_cases[op]
            try:
                result = capture(fn, inputs, getattr(torch, dtype_name), backend)
            except Exception as exc:
                result = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            print(f"{backend:<11} {dtype_name:<9} {op:<26} {result}", flush=True)
    print("all served operations passed" if not failed else f"{failed} FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
