"""Attention's reduced precisions for float32 inputs: TF32 rounding, the split of a float32
value into two TF32 parts, a float64 emulation of each precision's products, and the error
bound of spec/semantics.md, "Precision" (numpy only, materialized: small shapes).

The bound is what the conformance kit and the GPU tests hold a ``precision="tf32"`` or
``"tf32x3"`` result to, elementwise, against the float64 definition on the represented
inputs; ``precision="float32"`` keeps the table of "Attention" (``ATTENTION_TOLERANCES``).
"""

from __future__ import annotations

import math

import numpy as np

from . import materialized as ref

TF32_UNIT = 2.0**-11
"""Unit roundoff of TF32 (10 explicit mantissa bits, rounded to nearest)."""

SUM_UNIT = 2.0**-23
"""The error of one float32 addition as the bound counts it: one unit in the last place, since
tensor cores may truncate their float32 sums rather than round them."""

PRODUCT_ERROR = {"tf32": 2 * TF32_UNIT + TF32_UNIT**2, "tf32x3": 3 * 2.0**-22}
"""Relative error of one product of two float32 numbers at each precision: both rounded to
TF32 (``(1 + 2^-11)^2 - 1``), or both split in two TF32 parts, ``a_small b_small`` left out
and each part's own remainder below ``2^-22`` of the value."""


def tf32(x: np.ndarray) -> np.ndarray:
    """``x`` (float32) rounded to TF32 as ``cvt.rna.tf32.f32`` does: to the nearest value with
    10 explicit mantissa bits, ties away from zero; infinities and NaN unchanged.  A float32
    array with the 13 low mantissa bits 0."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), rounded, x)


def split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(big, small)``: ``big = tf32(x)``, ``small = tf32(x - big)`` (the difference is exact
    in float32), so ``|x - big - small| <= 2^-22 |x|``."""
    x = np.asarray(x, dtype=np.float32)
    big = tf32(x)
    return big, tf32(x - big)


def product(a: np.ndarray, b: np.ndarray, precision: str) -> np.ndarray:
    """``a @ b`` of float32 matrices in float64, with the operands as the precision takes them:
    rounded to TF32 (``"tf32"``), split with three of the four products (``"tf32x3"``), or
    as given (``"float32"``)."""
    if precision == "float32":
        return np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    if precision == "tf32":
        return tf32(a).astype(np.float64) @ tf32(b).astype(np.float64)
    (ab, as_), (bb, bs) = ((p.astype(np.float64) for p in split(m)) for m in (a, b))
    return as_ @ bb + ab @ bs + ab @ bb


def emulated_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, *, precision: str, scale: float | None = None,
    causal: str | None = None, window: tuple[int, int] | None = None,
    mask: np.ndarray | None = None, softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(out, natural-log lse) of float32 q, k, v with every product taken as ``precision``
    takes it (:func:`product`: the scores ``q k^T`` and ``P V`` with ``P`` the float32
    probabilities) and everything else in float64: the error the precision alone makes."""
    q, k, v = (np.asarray(a, dtype=np.float32) for a in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    g = q.shape[-3] // k.shape[-3]
    ke, ve = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    raw = scale * product(q, np.swapaxes(ke, -1, -2), precision)
    s = softcap * np.tanh(raw / softcap) if softcap else raw
    ok = ref.allowed_mask(q.shape[-2], k.shape[-2], causal, window)
    if mask is not None:
        ok = ok & mask
    s = np.where(np.broadcast_to(ok, s.shape), s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    empty = m == -np.inf
    shift = np.where(empty, 0.0, m)
    p = np.exp(s - shift)
    total = np.where(empty, 1.0, p.sum(axis=-1, keepdims=True))
    out = np.where(empty, 0.0, product((p / total).astype(np.float32), ve, precision))
    lse = np.where(empty, -np.inf, shift + np.log(total))[..., 0]
    return out, lse


def attention_bound(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, *, precision: str, scale: float | None = None,
    causal: str | None = None, window: tuple[int, int] | None = None,
    mask: np.ndarray | None = None, softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Elementwise bounds ``(out_bound, lse_bound)`` on the error of a ``precision``
    (``"tf32"`` or ``"tf32x3"``) result against the float64 definition on the represented
    float32 inputs (spec "Precision").

    For query row i with allowed keys ``A_i`` (``N_i`` of them), ``e`` the precision's
    :data:`PRODUCT_ERROR` and ``a_ij = |scale| sum_d |q_id| |k_jd|``:

    - score error ``E_i = max_{j in A_i} (e + D u) a_ij`` (``u`` = :data:`SUM_UNIT`; a
      soft cap, whose slope is at most 1, does not enlarge it);
    - float32 arithmetic ``F_i = 2 u max_{j in A_i} |s_ij| + (N_i + 8) u`` (the score scaled
      to log2 units, the exponentials, the sums);
    - ``|lse^_i - lse_i| <= E_i + F_i + u |lse_i|``;
    - ``|out^_ic - out_ic| <= (expm1(2 E_i + 2 F_i) + e) sum_j p_ij |v_jc|``.

    Rows with no allowed key get 0 (their results are exact: ``out = 0``, ``lse = -inf``).
    """
    e = PRODUCT_ERROR[precision]
    u = SUM_UNIT
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = q.shape[-3] // k.shape[-3]
    ke, ve = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    out, lse = ref.attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                             softcap=softcap)
    raw, s = ref._scores(q, ke, scale, causal, window, mask, softcap)
    allowed = s > -np.inf
    a = abs(scale) * (np.abs(q) @ np.swapaxes(np.abs(ke), -1, -2))
    score = np.max(np.where(allowed, (e + d * u) * a, 0.0), axis=-1)
    big = np.max(np.where(allowed, np.abs(s), 0.0), axis=-1)
    n = allowed.sum(axis=-1)
    arith = 2 * u * big + (n + 8) * u
    empty = lse == -np.inf
    lse_bound = np.where(empty, 0.0, score + arith + u * np.abs(np.where(empty, 0.0, lse)))
    p = np.where(allowed, np.exp(s - np.where(empty, 0.0, lse)[..., None]), 0.0)
    weight = p @ np.abs(ve)
    out_bound = (np.expm1(2 * score + 2 * arith) + e)[..., None] * weight
    return np.where(empty[..., None], 0.0, out_bound), lse_bound
