"""Packed variable-length attention on CUDA, forward and backward, beside torch's varlen call.

A batch of sequences of random lengths (16 sequences of 1 to 4096 tokens by default, the same
lengths for queries and keys), 16 heads, eager calls as a user makes them, side by side in
one process with ``triton.testing.do_bench`` (median):

* ``sk.varlen_attention`` and ``sk.varlen_attention_vjp`` through the default dispatch
  (``ran on`` names the backend and kernel of each);
* ``torch.nn.attention.varlen.varlen_attn`` on the same packed tensors, its backward timed as
  ``torch.autograd.grad`` of its output less its forward (16-bit only: torch has no float32
  varlen call);
* ``sk.attention`` and ``sk.attention_vjp`` through the default dispatch on the padded batch
  (every sequence zero-padded to the longest, [B, H, longest, D]);
* with ``--compare BACKEND``, the packed calls on that backend alone (e.g. the one that served
  them before).

``vs torch`` and ``vs padded`` are the peer's time over softmaxkit's packed call (above 1:
the packed call is faster); the bars (issue "Attention on the GPU without cliffs") are 0.8x
torch, forward and backward, and, without a torch peer (float32), 0.8x the padded batch and
above 1x whenever padding exceeds 25% of it.  TFLOP/s count
the allowed (query, key) pairs of every sequence: 4 D flops a pair forward, 10 D backward.
Before timing, each case is checked against float64 on a small packed batch with a sequence
without queries and one without keys (the exit status is 1 when an error exceeds its bound).

Run on a GPU::

    python benchmarks/varlen.py
    python benchmarks/varlen.py --dims 64 128 256 --dtypes bfloat16 float16 --out varlen.md
    python benchmarks/varlen.py --dtypes float32 --compare numba-cuda
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

BOUNDS = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-4}
"""Largest relative error (Frobenius norm) against float64 per dtype."""


def timed(fn: Any) -> float:
    """Median milliseconds of eager calls of ``fn``."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=100, return_mode="median"))


def relerr(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| in float64."""
    import torch

    got, want = torch.as_tensor(got).double().cpu(), torch.as_tensor(want).double().cpu()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


def check(dtype_name: str, d: int, causal: bool, device: str = "cuda") -> float:
    """The worst relative error of out, dq, dk, dv against float64 on a small packed batch
    (on ``device``: ``"cpu"`` checks the check)."""
    import numpy as np
    import torch

    import softmaxkit as sk
    from softmaxkit.testing.varlen_cases import (
        packed_arrays,
        packed_reference,
        packed_vjp_reference,
    )

    dtype = getattr(torch, dtype_name)
    q, k, v, cu_q, cu_k = packed_arrays(d, (70, 0, 300, 129), (130, 9, 300, 700), 4, 2, d, d)
    tq, tk, tv = (torch.as_tensor(a, device=device).to(dtype) for a in (q, k, v))
    q64, k64, v64 = (a.double().cpu().numpy() for a in (tq, tk, tv))
    dout = torch.as_tensor(np.random.default_rng(d).normal(size=(q.shape[0], 4, d)),
                           device=device).to(dtype)
    mq, mk = (torch.as_tensor(a, device=device) for a in (cu_q, cu_k))
    opts = {"causal": "bottom_right" if causal else False}
    out, lse = sk.varlen_attention(tq, tk, tv, mq, mk, return_lse=True, **opts)
    grads = sk.varlen_attention_vjp(tq, tk, tv, out, lse, dout, mq, mk, **opts)
    ref = {"scale": d ** -0.5, "causal": "bottom_right" if causal else None}
    want_out, _ = packed_reference(q64, k64, v64, cu_q, cu_k, **ref)
    want = packed_vjp_reference(q64, k64, v64, dout.double().cpu().numpy(), cu_q, cu_k, **ref)
    return max(relerr(g, w) for g, w in zip((out, *grads), (want_out, *want), strict=True))


def torch_varlen(q: Any, k: Any, v: Any, cu: Any, longest: int, causal: bool) -> Any:
    """torch's varlen call on the packed batch, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None

    def call() -> Any:
        try:
            return varlen_attn(q, k, v, cu, cu, longest, longest, is_causal=causal)
        except TypeError:  # releases that spell causal as a window
            return varlen_attn(q, k, v, cu, cu, longest, longest,
                               window_size=(-1, 0) if causal else (-1, -1))

    try:
        call()
    except Exception as exc:  # noqa: BLE001  (the peer is reported, not required)
        print(f"torch varlen: {type(exc).__name__}: {exc}")
        return None
    return call


def padded_calls(q: Any, k: Any, v: Any, dout: Any, lens: list[int], causal: bool
                 ) -> tuple[Any, Any]:
    """(forward, backward) of ``sk.attention`` on the batch padded to its longest sequence
    (the rows past a sequence's length zero)."""
    import torch

    import softmaxkit as sk

    longest, heads, d = max(lens), q.shape[1], q.shape[2]
    starts = [0, *torch.cumsum(torch.tensor(lens), 0).tolist()]

    def padded(a: Any) -> Any:
        out = a.new_zeros((len(lens), heads, longest, d))
        for b, n in enumerate(lens):
            out[b, :, :n] = a[starts[b]:starts[b] + n].transpose(0, 1)
        return out

    qp, kp, vp, gp = (padded(a) for a in (q, k, v, dout))
    op, lp = sk.attention(qp, kp, vp, causal=causal, return_lse=True)
    return (lambda: sk.attention(qp, kp, vp, causal=causal, return_lse=True),
            lambda: sk.attention_vjp(qp, kp, vp, op, lp, gp, causal=causal))


def run(dtype_name: str, d: int, causal: bool, lens: list[int], heads: int,
        compare: str | None = None) -> tuple[str, bool]:
    """The table's row for one case, and whether its check passed."""
    import numpy as np
    import torch

    import softmaxkit as sk

    err = check(dtype_name, d, causal)
    ok = err <= BOUNDS[dtype_name]
    dtype = getattr(torch, dtype_name)
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lens)]), device="cuda",
                         dtype=torch.int32)
    total = int(sum(lens))
    g = torch.Generator(device="cuda").manual_seed(d)
    q, k, v, dout = (torch.randn(total, heads, d, device="cuda", dtype=dtype, generator=g)
                     for _ in range(4))
    opts = {"causal": causal}
    fwd = lambda: sk.varlen_attention(q, k, v, cu, cu, return_lse=True, **opts)  # noqa: E731
    out, lse = fwd()
    bwd = lambda: sk.varlen_attention_vjp(q, k, v, out, lse, dout, cu, cu, **opts)  # noqa: E731
    ran = []
    for fn in (fwd, bwd):
        with sk.backend_opts(trace=True) as trace:
            fn()
        ran.append(", ".join(dict.fromkeys(f"{r.backend} {r.kernel or ''}".strip()
                                           for r in trace)))
    t_fwd, t_bwd = timed(fwd), timed(bwd)
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lens) * heads
    cells = [f"{t_fwd:.3f}", f"{4 * d * pairs / t_fwd / 1e9:.0f}"]
    peer = torch_varlen(q, k, v, cu, max(lens), causal)
    peer_fwd = peer_bwd = None
    if peer is not None:
        leaves = [a.clone().requires_grad_() for a in (q, k, v)]
        grad_peer = torch_varlen(*leaves, cu, max(lens), causal)
        peer_fwd = timed(peer)
        peer_bwd = timed(lambda: torch.autograd.grad(grad_peer(), leaves, dout)) - timed(
            grad_peer)
    pad_fwd, pad_bwd = (timed(fn) for fn in padded_calls(q, k, v, dout, lens, causal))
    cells += [f"{peer_fwd / t_fwd:.2f}x" if peer_fwd else "-", f"{pad_fwd / t_fwd:.2f}x"]
    cells += [f"{t_bwd:.3f}", f"{10 * d * pairs / t_bwd / 1e9:.0f}",
              f"{peer_bwd / t_bwd:.2f}x" if peer_bwd else "-", f"{pad_bwd / t_bwd:.2f}x"]
    if compare is not None:  # the packed calls on that backend alone
        on = dict(opts, backend=compare)
        out_c, lse_c = sk.varlen_attention(q, k, v, cu, cu, return_lse=True, **on)
        t_on = (timed(lambda: sk.varlen_attention(q, k, v, cu, cu, **on)),
                timed(lambda: sk.varlen_attention_vjp(q, k, v, out_c, lse_c, dout, cu, cu, **on)))
        cells += [f"{t:.3f}" for t in t_on]
    row = (f"| {dtype_name} | {d} | {'causal' if causal else 'plain'} | {ran[0]} | {ran[1]} | "
           f"{err:.1e} | " + " | ".join(cells) + " |")
    return row, ok


def main(argv: list[str] | None = None) -> int:
    """Run the varlen benchmark and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=sorted(BOUNDS))
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--longest", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--compare", help="also time the packed calls on this backend alone")
    parser.add_argument("--out", help="also write the markdown table to this file")
    opts = parser.parse_args(argv)

    import numpy as np
    import torch

    import softmaxkit as sk

    lens = [int(n) for n in
            np.random.default_rng(5).integers(1, opts.longest + 1, size=opts.sequences)]
    padding = 1 - sum(lens) / (len(lens) * max(lens))
    extra = ([f"fwd ms on {opts.compare}", f"bwd ms on {opts.compare}"] if opts.compare
             else [])
    head = ["dtype", "D", "feature", "forward ran on", "backward ran on", "relerr", "fwd ms",
            "TFLOP/s", "vs torch", "vs padded", "bwd ms", "TFLOP/s", "vs torch", "vs padded",
            *extra]
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, softmaxkit "
             f"{sk.__version__}; {opts.sequences} sequences ({sum(lens)} tokens, longest "
             f"{max(lens)}: padding {padding:.0%} of the padded batch), H{opts.heads}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    failed = False
    for dtype in opts.dtypes:
        for d in opts.dims:
            for causal in (False, True):
                row, ok = run(dtype, d, causal, lens, opts.heads, opts.compare)
                failed = failed or not ok
                lines.append(row)
                print(row, flush=True)
    print("\n".join(lines))
    if opts.out:
        with open(opts.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if failed:
        print("FAILED: an error above its bound")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
