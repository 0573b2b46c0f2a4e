"""How much of ``precision="tf32x3"``'s error the tensor cores' truncated sums make, emulated.

A TF32 ``mma.sync`` adds its eight products (exact) to the accumulator and keeps the float32
sum rounded toward zero, not to nearest.  This script follows kernels/attention_tf32.cu's
order of work at tf32x3 (three products a k-step of 8, small ones first; S = Q K^T from a
zeroed accumulator, P V added to the output's across all key tiles) on one head of float32
normal inputs, L 1024, D 64, 32-key tiles, with each k-step's sum exact and then rounded
to float32 either way, and prints the output's relative Frobenius error against float64:

- rounded to nearest, P V added in place;
- truncated, P V added in place (the kernel as served);
- truncated, each key tile's P V summed from zero and added to the output in float32
  (``Tf32Config(staged=True)``, as CUTLASS's 3xTF32 main loops stage their sums).

The softmax itself is taken in float64 with the final row maximum (no online rescaling), so
only the products' sums differ between the three.

Usage: ``python backends/cupy/tools/tf32_truncation.py`` (numpy only; no GPU).
"""

from __future__ import annotations

import numpy as np

from softmaxkit.testing.precision import split

L, D, BN = 1024, 64, 32


def toward_zero(x: np.ndarray) -> np.ndarray:
    """float64 ``x`` rounded to float32 toward zero."""
    f = x.astype(np.float32)
    return np.where(np.abs(f.astype(np.float64)) > np.abs(x), np.nextafter(f, np.float32(0)), f)


def nearest(x: np.ndarray) -> np.ndarray:
    """float64 ``x`` rounded to float32 to nearest."""
    return x.astype(np.float32)


def step(c: np.ndarray, a: np.ndarray, b: np.ndarray, rounding) -> np.ndarray:
    """One product of a k-step: ``c + a @ b``, summed exactly, then rounded to float32."""
    return rounding(c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64))


def three(c: np.ndarray, a: np.ndarray, b: np.ndarray, rounding) -> np.ndarray:
    """``c + a @ b`` at tf32x3: small products first, each its own rounded sum."""
    (ab, as_), (bb, bs) = split(a), split(b)
    c = step(c, as_, bb, rounding)
    c = step(c, ab, bs, rounding)
    return step(c, ab, bb, rounding)


def error(rounding, staged: bool, seed: int = 0) -> float:
    """The output's relative Frobenius error against float64 attention."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((L, D)).astype(np.float32) for _ in range(3))
    scale = D**-0.5
    s = np.zeros((L, L), np.float32)
    for j in range(0, D, 8):
        s = three(s, q[:, j:j + 8], k[:, j:j + 8].T, rounding)
    s = s.astype(np.float64) * scale
    p = np.exp(s - s.max(axis=1, keepdims=True)).astype(np.float32)
    total = p.astype(np.float64).sum(axis=1, keepdims=True)
    o = np.zeros((L, D), np.float32)
    for t0 in range(0, L, BN):
        acc = np.zeros((L, D), np.float32) if staged else o
        for j in range(t0, t0 + BN, 8):
            acc = three(acc, p[:, j:j + 8], v[j:j + 8], rounding)
        o = nearest(o.astype(np.float64) + acc) if staged else acc
    s64 = (q.astype(np.float64) @ k.astype(np.float64).T) * scale
    p64 = np.exp(s64 - s64.max(axis=1, keepdims=True))
    want = (p64 / p64.sum(axis=1, keepdims=True)) @ v.astype(np.float64)
    got = o.astype(np.float64) / total
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main() -> int:
    for label, rounding, staged in (("rounded to nearest, in place", nearest, False),
                                    ("truncated, in place", toward_zero, False),
                                    ("truncated, staged per key tile", toward_zero, True)):
        print(f"{label:32s} relative Frobenius error {error(rounding, staged):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
