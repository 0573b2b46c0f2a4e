"""What tools/forward_tiles.py and tools/backward_tiles.py share: check every configuration of
a head dimension against float64 on a small problem, then time each beside the peers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from softmaxkit.testing import materialized as ref

BOUND = 3e-2  # bfloat16 against float64 (gpu_check's bound)


def run(dims: Sequence[int], calls: Callable[..., tuple[dict, tuple]],
        reference: Callable[[tuple, bool], Any], flops: Callable[[int, bool], float],
        shape: tuple[int, int, int]) -> int:
    """For each head dim and causality: ``calls(d, b, h, length, causal, seed)`` (name -> a
    call, and the problem's tensors) on B1 H2 L300, each call's result (one array or a tuple)
    against ``reference(tensors, causal)`` (the float64 result, likewise) after NaN-filled
    allocations; then on ``shape`` (B, H, L), the median of ``triton.testing.do_bench`` of
    each, printed as TFLOP/s (``flops(d, causal)`` a call) with the small problem's relative
    Frobenius error.  1 where an error exceeds :data:`BOUND`, else 0."""
    import triton.testing

    b, h, length = shape
    failed = False
    for d in dims:
        for causal in (False, True):
            small, tensors = calls(d, 1, 2, 300, causal, seed=d)
            want = reference(tensors, causal)
            want = want if isinstance(want, tuple) else (want,)
            errors = {}
            for name, fn in small.items():
                junk = [torch.full(a.shape, math.nan, device="cuda") for a in tensors]
                del junk  # the caching allocator hands these blocks to the results
                got = fn()
                got = got if isinstance(got, tuple) else (got,)
                errors[name] = max(ref.rel_frobenius(g.double().cpu().numpy(), np.asarray(w))
                                   for g, w in zip(got, want, strict=True))
            failed |= any(e > BOUND for e in errors.values())
            timed, _ = calls(d, b, h, length, causal, seed=d + 1)
            row = []
            for name, fn in timed.items():
                ms = float(triton.testing.do_bench(fn, warmup=10, rep=100,
                                                   return_mode="median"))
                row.append(f"{name} {flops(d, causal) / ms / 1e9:.0f} ({errors[name]:.1e})")
            print(f"D{d} {'causal' if causal else 'plain '}: " + "; ".join(row), flush=True)
    return 1 if failed else 0
