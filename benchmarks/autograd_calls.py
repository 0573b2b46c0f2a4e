"""Per-call cost of a differentiable call: forward and backward through torch autograd.

For small inputs a training step's cost is the host's: each row below is one call of the
operation on tensors that require grad and ``torch.autograd.grad`` of its result, timed as
a loop of calls (median of 7 repeats of ``--calls`` calls, wall clock, softmaxkit's and
torch's loops in turn: ``softmaxkit.callcost.per_call``), next to torch's own operation.
Each softmaxkit call's value and gradient are first checked against torch in float64 on the
same data (a failed check exits with 1).

Run: ``python benchmarks/autograd_calls.py`` (CPU, about ten seconds), or
``--device cuda`` (on a GPU the host's time per call, with the device synchronized at the
end of each loop).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

import softmaxkit as sk
from softmaxkit import callcost


def cases(device: str) -> dict[str, tuple[Callable[..., Any], Callable[..., Any] | None, tuple]]:
    """Name -> (softmaxkit function, torch's function or None, inputs requiring grad first)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, 1024, device=device, generator=g)
    labels = torch.randint(0, 1024, (64,), device=device, generator=g)
    q, k, v = (torch.randn(1, 2, 16, 8, device=device, generator=g) for _ in range(3))
    return {
        "softmax (64, 1024)": (lambda x: sk.softmax(x, axis=-1).square().sum(),
                               lambda x: torch.softmax(x, -1).square().sum(), (x,)),
        "logsumexp (64, 1024)": (lambda x: sk.logsumexp(x, axis=-1).sum(),
                                 lambda x: torch.logsumexp(x, -1).sum(), (x,)),
        "cross_entropy (64, 1024)": (
            lambda x: sk.cross_entropy(x, labels),
            lambda x: torch.nn.functional.cross_entropy(x, labels), (x,)),
        "attention (1, 2, 16, 8), causal": (
            lambda q, k, v: sk.attention(q, k, v, causal=True).square().sum(),
            lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True).square().sum(), (q, k, v)),
    }


def gradients(fn: Callable[..., Any], inputs: tuple) -> tuple:
    """The value of ``fn`` and its gradients with respect to ``inputs`` (fresh leaves)."""
    leaves = tuple(a.detach().requires_grad_() for a in inputs)
    value = fn(*leaves)
    return (value.detach(), *torch.autograd.grad(value, leaves))


def check(ours: Callable[..., Any], theirs: Callable[..., Any], inputs: tuple,
          dtype: torch.dtype) -> float:
    """The largest relative difference of softmaxkit's value and gradients at ``dtype``
    from torch's in float64."""
    got = gradients(ours, tuple(a.to(dtype) for a in inputs))
    want = gradients(theirs, tuple(a.double() for a in inputs))
    return max(float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))
               for a, b in zip(got, want, strict=True))


def per_call(fns: list[Callable[..., Any]], inputs: tuple, calls: int,
             device: str) -> list[float]:
    """Median microseconds of one forward and backward of each of ``fns`` on leaves of
    ``inputs`` (:func:`softmaxkit.callcost.per_call`: loops of ``calls``, each in turn)."""
    leaves = tuple(a.detach().requires_grad_() for a in inputs)
    steps = [lambda fn=fn: torch.autograd.grad(fn(*leaves), leaves) for fn in fns]
    return [t * 1e6 for t in callcost.per_call(steps, device, calls)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(f"{args.device}, torch {torch.__version__}, softmaxkit {sk.__version__}: "
          "forward + backward per call, float32, median us (ratio to torch)")
    failed = False
    for name, (ours, theirs, inputs) in cases(args.device).items():
        err = check(ours, theirs, inputs, torch.float32)
        ok = err <= 1e-5
        failed |= not ok
        mine, peer = per_call([ours, theirs], inputs, args.calls, args.device)
        print(f"  {name:34s} {mine:8.1f} us   torch {peer:7.1f} us ({mine / peer:4.1f}x)   "
              f"error {err:.1e}{'' if ok else '  FAIL'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
