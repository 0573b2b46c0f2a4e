"""The operations a backend can serve, and the call a kernel receives.

A kernel is a plain function called with keyword arguments only: ``xp`` (the caller's array
namespace, through array-api-compat) followed by the operation's parameters listed in
:data:`OPERATIONS`.  The frontend has already validated every argument, applied the dtype and
policy rules of spec/semantics.md and moved the reduced axis last, so a kernel always works
along the last axis of ``[..., N]`` arrays.  docs/backends.md describes each parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OPERATIONS: dict[str, tuple[str, ...]] = {
    # row operations; x is [..., N]; where is None or a boolean [..., N] (False excludes)
    "softmax": ("x", "where", "masked", "out_dtype"),
    "log_softmax": ("x", "where", "masked", "out_dtype"),
    "logsumexp": ("x", "b", "where", "return_sign", "out_dtype"),
    # cross_entropy: index None | integer [...] (a value outside [0, N) that is not
    #   ignore_index gives that row a NaN loss and a NaN gradient row; the frontend has not
    #   necessarily checked the range, and a kernel must never read logits[index] there);
    #   grad_scale None (no gradient) | a Python float | a 0-d array of the accumulator dtype
    #   on the logits' device (1 / count for reduction="mean" with ignore_index, kept on the
    #   device): a kernel reads an array scale on the device, never on the host
    "cross_entropy": (
        "logits", "index", "probs", "where", "ignore_index", "label_smoothing",
        "grad_scale", "out_dtype",
    ),
    "softmax_vjp": ("probs", "cotangent", "where", "out_dtype"),
    "log_softmax_vjp": ("logprobs", "cotangent", "where", "out_dtype"),
    # online summaries (spec "Summaries"); rows flattened to R; acc = the accumulator dtype
    # summarize(x [R, N], where None | bool [R, N], values None | [R, N, Dv] in x's dtype)
    #   -> (max [R], mass [R], numerator None | [R, Dv]), all in acc of x's dtype;
    #   an empty row gives (-inf, 0, 0); excluded positions' values never leak in; an
    #   allowed NaN gives NaN fields, an allowed +inf gives (+inf, NaN, NaN)
    "summarize": ("x", "where", "values"),
    # merge(maxes [S, R], masses [S, R], numerators None | [S, R, Dv]), S >= 1, all in acc
    #   (or all in a 16-bit dtype a caller built them in: merged in float32, returned in it)
    #   -> (max [R], mass [R], numerator None | [R, Dv]); empty parts are the identity
    #   (factor exactly 1 where a part's max equals the result's); NaN maxima propagate
    "merge": ("maxes", "masses", "numerators"),
    # normalize(x [R, N], where None | bool [R, N], maxes [R], masses [R] in acc of x's dtype,
    #   log: bool, masked: "zero" | "nan", out_dtype) -> [R, N] in out_dtype: softmax
    #   (exp(x - max) / mass) or, with log, log_softmax ((x - max) - log(mass)) of x against a
    #   summary (max, mass) of a set of positions containing the row's allowed ones (the merged
    #   summary of all the chunks of a row); the summary classifies the row as the row
    #   operations do (NaN max: NaN row, +inf max: +inf row, -inf max: empty row); an allowed
    #   logit above max, or an allowed NaN under a max that is not NaN, is a ValueError
    "normalize": ("x", "where", "maxes", "masses", "log", "masked", "out_dtype"),
    # attention (spec "Attention"); leading dims broadcast and flattened into B by the frontend
    # q [B, Hq, Lq, D], k [B, Hk, Lk, D], v [B, Hk, Lk, Dv]: one dtype, Hq % Hk == 0;
    # scale: float; causal: None | "bottom_right" | "top_left";
    # window: (left, right) ints, -1 = unbounded, (-1, -1) = no window; aligned like causal
    #   ("bottom_right" unless causal == "top_left"); mask: None | bool broadcast (possibly a
    #   stride-0 view) to [B, Hq, Lq, Lk], True = attend; softcap: None | float > 0;
    # -> (out [B, Hq, Lq, Dv] in q's dtype, lse [B, Hq, Lq] in acc, natural log, or None
    #   when return_lse is False); a row with no allowed key: out 0, lse -inf
    # precision: "float32" | "tf32x3" | "tf32", the least precision of the products of float32
    #   inputs the caller accepts ("float32" for other dtypes); only kernels whose serves entry
    #   declares "precisions" receive it, the others compute exactly (spec "Precision")
    "attention": (
        "q", "k", "v", "scale", "causal", "window", "mask", "softcap", "return_lse",
        "precision",
    ),
    # out, dout [B, Hq, Lq, Dv] (q's dtype), lse [B, Hq, Lq] in acc, natural log, -inf = empty;
    #   dlse None | [B, Hq, Lq] in acc: the lse's own cotangent (natural log; 0 on the rows
    #   whose lse is -inf), entering as D = rowsum(dout * out) - dlse
    # -> (dq, dk, dv) shaped and typed like q, k, v (dk, dv summed over each GQA group)
    "attention_vjp": (
        "q", "k", "v", "out", "lse", "dout", "dlse", "scale", "causal", "window", "mask",
        "softcap", "precision",
    ),
    # outs [S, R, Dv], lses [S, R] in acc, natural log, -inf = empty part (never +inf)
    # -> (out [R, Dv] in outs' dtype, lse [R] in acc); all parts empty: (0, -inf)
    "merge_attention": ("outs", "lses"),
    # gradient of merge_attention; dout [R, Dv], dlse None | [R] (natural log)
    # -> (douts [S, R, Dv] in outs' dtype, dlses [S, R] in acc); empty parts get 0
    "merge_attention_vjp": ("outs", "lses", "dout", "dlse"),
    # paged_attention (spec "Paged attention"): decoding and chunked prefill over a paged KV
    # cache; q [B, Hq, Lq, D], k_pages [P, Hk, S, D], v_pages [P, Hk, S, Dv] (one dtype,
    # Hq % Hk == 0; S = page size); block_table int32 | int64 [B, max_pages] and seqlens
    # int32 | int64 [B], on q's device; the frontend has checked on the host that
    # 0 <= seqlens[b] <= max_pages * S and that the first ceil(seqlens[b] / S) entries of row b
    # lie in [0, P): a kernel must never read the other entries, nor a cache slot at a key
    # position >= seqlens[b]; key j of sequence b is slot j % S of page
    # block_table[b, j // S]; query i of sequence b sits on the diagonal
    # d = i + seqlens[b] - Lq (bottom-right, per sequence); causal: None | "bottom_right";
    # window (left, right) as for attention, around d; scale: float; softcap: None | float > 0
    # -> (out [B, Hq, Lq, Dv] in q's dtype, lse [B, Hq, Lq] in acc, natural log, or None
    #   when return_lse is False); a row with no allowed key: out 0, lse -inf
    "paged_attention": (
        "q", "k_pages", "v_pages", "block_table", "seqlens", "scale", "causal", "window",
        "softcap", "return_lse", "precision",
    ),
    # varlen_attention (spec "Packed variable-length attention"): sequences packed along the
    # token axis; q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, Dv]: one dtype, Hq % Hk == 0;
    # cu_seqlens_q, cu_seqlens_k: int64 [B + 1] on q's device, checked by the frontend (start
    #   at 0, never decrease, end at Tq / Tk; a kernel may read them to the host); sequence b
    #   is q[cu_q[b]:cu_q[b+1]] attending to k, v[cu_k[b]:cu_k[b+1]] and nothing else;
    # scale, causal, window, softcap as for attention, causal and window aligned within each
    #   sequence (Lq, Lk its own lengths); no mask
    # -> (out [Tq, Hq, Dv] in q's dtype, lse [Tq, Hq] in acc, natural log, or None when
    #   return_lse is False); a row with no allowed key (a sequence with no keys included):
    #   out 0, lse -inf
    "varlen_attention": (
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "scale", "causal", "window", "softcap",
        "return_lse", "precision",
    ),
    # out, dout [Tq, Hq, Dv] (q's dtype), lse [Tq, Hq] in acc, natural log, -inf = empty;
    #   dlse None | [Tq, Hq] in acc: the lse's cotangent, as for attention_vjp
    # -> (dq, dk, dv) shaped and typed like q, k, v (dk, dv summed over each GQA group)
    "varlen_attention_vjp": (
        "q", "k", "v", "out", "lse", "dout", "dlse", "cu_seqlens_q", "cu_seqlens_k", "scale",
        "causal", "window", "softcap", "precision",
    ),
}
"""Operation name -> the keyword parameters its kernel takes after ``xp``."""


@dataclass
class Call:
    """One call of an operation, as a backend's ``can_run`` / ``should_run`` hooks see it.

    Attributes
    ----------
    op
        The operation name, a key of :data:`OPERATIONS`.
    xp
        The caller's array namespace.
    device
        The device type: ``"cpu"``, ``"cuda"``, ... (see :func:`softmaxkit.registry.device_type`).
    dtype
        The name of the input's floating dtype (``"float32"``, ``"bfloat16"``, ...).
    args
        The keyword arguments the kernel will receive (after ``xp``).
    """

    op: str
    xp: Any
    device: str
    dtype: str
    args: dict[str, Any] = field(default_factory=dict)
