"""The host's cost of eager attention calls: where a call's GPU work is short, as at L1024.

Each row is a loop of eager calls as a training step makes them (median of 7 loops of
``--calls`` calls, wall clock, the device synchronized around each loop, softmaxkit's and
torch's loops in turn: ``softmaxkit.callcost.per_call``), side by side in one process with
torch's ``scaled_dot_product_attention`` on the same tensors (its default backend choice):

* the forward without grad (inference) and the forward + backward through autograd;
* ``floor``: a Python ``torch.autograd.Function`` whose forward is one copy and whose backward
  passes its cotangent on, the least any operator written in Python costs through autograd on
  this machine.

Before timing, softmaxkit's output and gradients are checked against torch's in float64 on the
same data (a failed check exits with 1).

Run: ``python benchmarks/attention_calls.py`` (CUDA, bfloat16 B2 H16 L1024 causal, head dims 64
and 128; ``--dtype float32`` for float32 inputs); ``--device cpu`` runs it small and in
float32, as a check of the script.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

import softmaxkit as sk
from softmaxkit import callcost

sdpa = torch.nn.functional.scaled_dot_product_attention


class Floor(torch.autograd.Function):
    """One copy forward, the cotangent passed on backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def per_call(fns: list[Callable[[], object]], calls: int, device: str) -> list[float]:
    """Median microseconds of one call of each of ``fns`` (:func:`softmaxkit.callcost.per_call`:
    loops of ``calls`` calls, each function's loop in turn)."""
    return [t * 1e6 for t in callcost.per_call(fns, device, calls)]


def check(q, k, v, dout) -> float:
    """The largest relative difference of softmaxkit's output and gradients from torch's in
    float64 on the same (rounded) inputs."""
    def both(fn, dtype):
        leaves = [a.detach().to(dtype).requires_grad_() for a in (q, k, v)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, dout.to(dtype)))

    got = both(lambda q, k, v: sk.attention(q, k, v, causal=True), q.dtype)
    want = both(lambda q, k, v: sdpa(q, k, v, is_causal=True), torch.float64)
    return max(float((a.detach().double() - b.detach()).norm() / b.detach().norm())
               for a, b in zip(got, want, strict=True))


def calls(q, k, v, dout) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Row name -> (softmaxkit's call, torch's call) on these tensors (q, k, v made leaves)."""
    leaves = [a.requires_grad_() for a in (q, k, v)]
    qd, kd, vd = (a.detach() for a in leaves)
    return {
        "forward, no grad": (lambda: sk.attention(qd, kd, vd, causal=True),
                             lambda: sdpa(qd, kd, vd, is_causal=True)),
        "forward + backward": (
            lambda: torch.autograd.grad(sk.attention(*leaves, causal=True), leaves, dout),
            lambda: torch.autograd.grad(sdpa(*leaves, is_causal=True), leaves, dout)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        default="bfloat16", help="on CUDA (the CPU check runs float32)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    b, h, length = (2, 16, args.length) if cuda else (1, 2, min(args.length, 64))
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{name}, torch {torch.__version__}; {str(dtype)[6:]} B{b} H{h} L{length} causal, "
          "eager, median us a call")
    x = torch.randn(1024, device=args.device, requires_grad=True)
    failed = False
    for d in args.dims:
        g = torch.Generator(device=args.device).manual_seed(d)
        q, k, v, dout = (torch.randn(b, h, length, d, device=args.device, generator=g)
                         .to(dtype) for _ in range(4))
        err = check(q, k, v, dout)
        if err > bound:
            print(f"D{d}: FAIL, relative error {err:.2e} > {bound:.0e}")
            failed = True
            continue
        rows = calls(q, k, v, dout)
        for label, (ours, theirs) in rows.items():
            mine, peer = per_call([ours, theirs], args.calls, args.device)
            print(f"  D{d:<4d}{label:20s} softmaxkit {mine:8.1f}  torch {peer:8.1f}  "
                  f"({peer / mine:4.2f}x)   error {err:.1e}")
    floor, = per_call([lambda: torch.autograd.grad(Floor.apply(x), x, torch.ones_like(x))],
                      args.calls, args.device)
    print(f"  floor: a Python autograd.Function, one copy, forward + backward {floor:8.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
