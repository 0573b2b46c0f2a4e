"""The numba-cuda kernels under Numba's CUDA simulator, as one process printing JSON lines.

Run by ``test_cuda_simulator.py`` in subprocesses with ``NUMBA_ENABLE_CUDASIM=1`` (numba reads
the variable once, when it is first imported, so the simulator cannot be switched on inside a
pytest process that has already imported numba)::

    NUMBA_ENABLE_CUDASIM=1 python simulated.py kit float32,float64
    NUMBA_ENABLE_CUDASIM=1 python simulated.py plans
    NUMBA_ENABLE_CUDASIM=1 python simulated.py attention float32
    NUMBA_ENABLE_CUDASIM=1 python simulated.py attention-tiles
    NUMBA_ENABLE_CUDASIM=1 python simulated.py varlen

``kit`` runs the conformance kit on the numpy target; ``plans`` forces each row strategy
(warp per row, block per row, several tiles per row) through the adapters' ``settings`` on
random rows with special values and compares every operation with the reference backend.
``attention`` runs the kit's attention and attention_vjp cases of :data:`ATTENTION_CASES` at
the head dimensions of :data:`ATTENTION_HEAD_DIMS`; ``attention-tiles`` forces the smallest
tiles (16 query rows, 16 keys a block) on :data:`TILE_CASES`, so blocks walk several query
and key tiles, skip tiles outside causal and window bands and meet tails, and compares with
the float64 reference.  ``varlen`` runs packed variable-length attention and its gradient
through the frontend on :data:`VARLEN_CASES` (the padded batch and mask of ``varlen.py`` on
the attention kernels), poisoned with NaN where no result may read; the kit's varlen cases
take too long there (the GPU run of ``softmaxkit verify`` runs them).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

import numpy as np

ROW_OPS = ("softmax", "log_softmax", "logsumexp", "cross_entropy", "softmax_vjp",
           "log_softmax_vjp")
SUMMARY_OPS = ("summarize", "merge", "normalize", "merge_attention", "merge_attention_vjp")
PLAN_OPS = ROW_OPS + ("cross_entropy_hard", "summarize")
STAGED_OPS = ("softmax", "log_softmax", "cross_entropy", "cross_entropy_hard")
PERSIST_OPS = ("softmax", "log_softmax")
PLANS = {"32,1": (304, ("float32", "bfloat16"), PLAN_OPS),
         "32,4": (302, ("float64", "float32"), PLAN_OPS),
         "32,1,staged": (304, ("float32", "bfloat16"), STAGED_OPS),
         "staged-800": (800, ("float32",), STAGED_OPS),
         "staged-1608": (1608, ("bfloat16", "float16"), STAGED_OPS),
         "staged-2200": (2200, ("float32",), STAGED_OPS),
         "staged-800,cluster": (800, ("float32",), STAGED_OPS),
         "staged-1608,cluster": (1608, ("bfloat16",), STAGED_OPS),
         "staged-800,persist": (800, ("float32",), PERSIST_OPS),
         "staged-1608,persist": (1608, ("bfloat16", "float16"), PERSIST_OPS),
         "staged-1024,persist": (1024, ("float32",), PERSIST_OPS),
         "staged-2048,persist": (2048, ("bfloat16", "float16", "float32"), PERSIST_OPS),
         "staged-4096,persist": (4096, ("bfloat16",), PERSIST_OPS),
         "staged-1024,persist,rows5": (1024, ("float32",), PERSIST_OPS)}
"""Forced "threads,slots" -> (row length, dtypes, operations): rows split across 2-3 blocks
of one warp, in 16-byte words and, for float32 rows of 302 elements, element by element; the
same with split rows staged in shared memory.  "staged-N": the default plans on rows of N
elements, which the register plan splits: staged in shared memory, one block per row (200 and
201 words) or two blocks (550 words); with ``cluster``, rows of one chunk take the cluster
kernels as a cluster of one block (the setting ``cluster="all"``), the only cluster the
simulator can run: the exchange through the cluster's shared memory and its barriers run, on
the block itself; with ``persist``, the persistent grid of clusters (``persist="all"``) as
two clusters of one block, each walking three of the six rows (refilling its stage with the
next row's words as it writes; rows of 1024 and 2048 elements fill the chunk, so calls without
``where`` take the whole-chunk fold; float32 rows of 2048 elements are one chunk twice as long
with 4 words a thread kept in registers; bfloat16 rows of 4096 elements are two chunks, two
clusters a row exchanging through device memory, where the simulator's one-block-at-a-time
schedule takes the fallback that summarizes the other half from device memory); ``rows5``:
five rows over two clusters, the second (one row fewer) starting late.  Every input has an
ascending row (its maximum rises in every copy group) and a row whose first quarter is -inf
(copy groups that land while the maximum is -inf).
(Short rows, a group of threads each, are the simulator's default plan in the kit.)"""


ATTENTION_OPS = ("attention", "attention_vjp")
ATTENTION_HEAD_DIMS = ((16, 8), (16, 16), (24, 40))
"""(D, Dv) of the simulated attention cases: the kit takes a value dimension of its own from
the first pair and square heads from the second; (24, 40) has partial lane columns."""
ATTENTION_CASES = {
    "float32": ("attention_causal_alignments", "attention_grouped_query", "attention_masks",
                "attention_softcap", "attention_broadcast_and_empty", "attention_vjp"),
    "float64": ("attention_grouped_query", "attention_masks", "attention_vjp"),
}
"""The kit's attention cases the simulator runs in each dtype (its windows, random shapes,
long rows and head dimensions take too long there; the forced-tile cases below and the GPU
run of ``softmaxkit verify`` cover them): causal in both alignments with Lq above and below
Lk, GQA with Dv != D, masks with empty rows and a window, softcap, broadcast leading
dimensions with Lq or Lk of 0, and the gradient with all of these."""
TILE_CASES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "plain": ({}, ("float32", "float64")),
    "causal-top-left": ({"causal": "top_left"}, ("float32",)),
    "causal-window-gqa": ({"causal": "bottom_right", "window": (12, -1), "hq": 2, "hk": 1},
                          ("float32",)),
    "window": ({"window": (5, 3)}, ("float32",)),
    "mask-empty-row": ({"mask": True, "causal": "top_left", "nan_value_key": 7},
                       ("float32", "float64")),
    "softcap-dv": ({"softcap": 3.0, "dv": 24, "scale": 0.6}, ("float32",)),
    "lq-longer": ({"causal": "bottom_right", "lq": 24, "lk": 15}, ("float32",)),
}
"""Forced-tile attention cases: options over B=1, Hq=Hk=1, Lq=20, Lk=35, D=Dv=16 (mask: a
random one with query 5 fully excluded; ``nan_value_key``: a key every query excludes, its v
NaN in the backward: the kernel never reads an excluded pair, so the tile's padding rows past
Lq must not carry it into that key's dk either), and the dtypes each runs in."""


VARLEN_LENGTHS = ((2, 0, 4, 1, 3, 5), (0, 3, 6, 5, 2, 5))
"""Query and key lengths of the simulated varlen cases: a sequence with queries and no keys
(its queries and dout NaN), one with keys and no queries (its keys and values NaN; the
padding slots of the batch read token 0, which is theirs), then sequences whose queries sit
on their keys ``Lk - Lq`` = 2, 4, -1 and 0, none equal to the padded lengths' difference."""
VARLEN_CASES: dict[str, tuple[dict, tuple[int, int], str]] = {
    "causal-window-gqa": ({"causal": True, "window": (2, -1)}, (4, 2), "float64"),
    "top-left-softcap": ({"causal": "top_left", "softcap": 2.0, "scale": 1.0}, (3, 1),
                         "float32"),
}
"""Options, (Hq, Hk) and dtype of the simulated varlen cases (D = 16, Dv = 8)."""


def settings_of(forced: str):
    """The backend's settings for a key of :data:`PLANS`."""
    from softmaxkit_numba_cuda.settings import Settings

    parts = forced.split(",")
    plan = None if forced.startswith("staged-") else (int(parts[0]), int(parts[1]))
    return Settings(plan=plan, staged=forced.startswith("staged-") or "staged" in parts,
                    cluster="all" if "cluster" in parts else "",
                    persist="all" if "persist" in parts else "")


def emit(**record: object) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def checked(rid: str, run: Callable[[], object]) -> None:
    """Run one check and emit its result: failed with the end of the traceback if it raises,
    "ran nothing" if it returns a count of 0 (a kit case that checked nothing), else passed."""
    try:
        result = run()
    except Exception:
        emit(id=rid, status="failed", message=traceback.format_exc()[-1520:])
        return
    emit(id=rid, status="ran nothing" if result is not None and not result else "passed",
         message="")


def kit(dtypes: list[str]) -> None:
    from softmaxkit.testing import check_backend

    ops = ROW_OPS + SUMMARY_OPS
    for r in check_backend("numba-cuda", target="numpy", ops=ops, dtypes=dtypes):
        status = r.status
        if status == "failed" and r.case == "no_warnings" and r.message.startswith(
                "RuntimeWarning: tid="):
            # a simulated thread's overflow warning (logits at the dtype's largest): kernels
            # run on the host here; a GPU raises none, and the case's values run on the GPU
            status = "simulator warning"
        emit(id=f"{r.case}[{r.dtype}]", status=status, message=r.message[:500])


def _inputs(rng: np.random.Generator, dtype: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    import array_api_compat.numpy as xp

    from softmaxkit.dtypes import lookup

    x = rng.normal(scale=5.0, size=(6, n))
    x[0] = np.sort(x[0])
    x[1, 7] = np.nan
    x[2, 3] = np.inf
    x[3, :] = -np.inf
    x[4, ::2] = -np.inf
    x[4, :n // 4] = -np.inf
    where = rng.random((6, n)) < 0.8
    where[5, :] = False
    return x.astype(lookup(xp, dtype)), where


def _compare(got: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    from softmaxkit.testing.tolerance import TOLERANCES

    rtol, atol = TOLERANCES[dtype]
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert np.array_equal(np.isnan(got), np.isnan(expected)), "NaN at different positions"
    fin = np.isfinite(expected)
    assert np.array_equal(got[~fin & ~np.isnan(expected)], expected[~fin & ~np.isnan(expected)])
    # long rows of moderate logits: the tolerance grows with the row length
    np.testing.assert_allclose(got[fin], expected[fin], rtol=rtol * 16, atol=atol * 16)


def _outputs(op: str, backend: str, x: np.ndarray, where: np.ndarray, target: np.ndarray,
             cot: np.ndarray, settings: object) -> list:
    """``op``'s results on the rows of ``x``: through the frontend for the reference, through
    the backend's adapters with ``settings`` for numba-cuda."""
    import array_api_compat.numpy as xp
    from softmaxkit_numba_cuda import rows as adapters
    from softmaxkit_numba_cuda import summaries

    import softmaxkit as sk

    fast = backend == "numba-cuda"
    n = x.shape[-1]
    if op in ("softmax", "log_softmax"):
        if fast:
            fn = getattr(adapters, op)
            return [fn(xp=xp, x=x, where=where, masked="zero", out_dtype=x.dtype,
                       settings=settings),
                    fn(xp=xp, x=x, where=None, masked="nan", out_dtype=x.dtype,
                       settings=settings)]
        fn = getattr(sk, op)
        return [fn(x, axis=-1, where=where, backend=backend),
                fn(x, axis=-1, masked="nan", backend=backend)]
    if op == "logsumexp":
        if fast:
            return list(adapters.logsumexp(xp=xp, x=x, b=None, where=where, return_sign=True,
                                          out_dtype=x.dtype, settings=settings))
        return list(sk.logsumexp(x, axis=-1, return_sign=True, where=where, backend=backend))
    if op == "summarize":
        if fast:
            return list(summaries.summarize(xp=xp, x=x, where=where, values=None,
                                            settings=settings)[:2])
        s = sk.summarize(x, axis=-1, where=where, backend=backend)
        return [s.max, s.mass]
    if op.startswith("cross_entropy"):
        # both sides through their kernels (the contract of softmaxkit/ops.py): the targets
        # hold class indices outside [0, n), which the frontend would refuse on the host, and
        # the gradient's scale is a 0-d array, as the frontend passes for a mean
        from softmaxkit.dtypes import accumulator_dtype
        from softmaxkit.reference import rows as reference

        xf = np.where(np.isfinite(x.astype(np.float64)), x, 0).astype(x.dtype)
        allowed = where | (np.arange(n) == target[:, None])
        scale = np.asarray(0.5, dtype=accumulator_dtype(xp, x.dtype))
        kernel = adapters.cross_entropy if fast else reference.cross_entropy
        extra = {"settings": settings} if fast else {}

        def ce(logits, w, eps, grad):
            return kernel(
                xp=xp, logits=logits, index=target, probs=None, where=w, ignore_index=-1,
                label_smoothing=eps, grad_scale=scale if grad else None,
                out_dtype=logits.dtype, **extra)

        if op == "cross_entropy":  # smoothed, masked, with gradient
            return list(ce(xf, allowed, 0.1, True))
        # plain targets: the gradient written from the kept exponentials, and the loss alone
        # (the last block of a row writes it)
        return [*ce(xf, None, 0.0, True), ce(x, None, 0.0, False)[0]]
    primal = (sk.softmax if op == "softmax_vjp" else sk.log_softmax)(
        x, axis=-1, where=where, backend="reference")
    if fast:
        kw = {"probs" if op == "softmax_vjp" else "logprobs": primal}
        return [getattr(adapters, op)(xp=xp, cotangent=cot, where=where, out_dtype=x.dtype,
                                     settings=settings, **kw)]
    return [getattr(sk, op)(primal, cot, axis=-1, where=where, backend=backend)]


def plans() -> None:
    rng = np.random.default_rng(7)
    for forced, (n, dtypes, ops) in PLANS.items():
        settings = settings_of(forced)
        for dtype in dtypes:
            x, where = _inputs(rng, dtype, n)
            if "rows5" in forced:
                x, where = x[:5], where[:5]
            target = rng.integers(0, n, size=len(x))
            target[0] = -1  # ignore_index
            target[4] = n + 2  # outside [0, n) and not ignored: a NaN row
            target[len(target) - 1] = -3
            cot = rng.normal(size=x.shape).astype(x.dtype)
            for op in ops:
                checked(f"plan[{forced}]-{op}[{dtype}]",
                        lambda op=op, dtype=dtype, x=x, where=where, target=target, cot=cot,
                        settings=settings: _agree(op, dtype, x, where, target, cot, settings))


def _agree(op: str, dtype: str, x: np.ndarray, where: np.ndarray, target: np.ndarray,
           cot: np.ndarray, settings: object) -> None:
    """numba-cuda's outputs of ``op`` against the reference's."""
    outs = {b: _outputs(op, b, x, where, target, cot, settings)
            for b in ("numba-cuda", "reference")}
    for got, expected in zip(outs["numba-cuda"], outs["reference"], strict=True):
        _compare(got, expected, dtype)


def attention_kit(dtypes: list[str]) -> None:
    from softmaxkit.testing import cases

    for c in cases(target="numpy", ops=ATTENTION_OPS, dtypes=dtypes,
                   head_dims=ATTENTION_HEAD_DIMS):
        if c.name not in ATTENTION_CASES[c.dtype]:
            continue
        checked(f"{c.name}[{c.dtype}]", lambda c=c: c.run("numba-cuda"))


def _tile_case(name: str, opts: dict, dtype: str) -> None:
    import array_api_compat.numpy as xp
    from softmaxkit_numba_cuda import attention as adapters

    from softmaxkit.reference import attention as reference

    rng = np.random.default_rng(len(name))
    b, hq, hk = 1, opts.get("hq", 1), opts.get("hk", 1)
    lq, lk, d = opts.get("lq", 20), opts.get("lk", 35), 16
    dv = opts.get("dv", d)
    q, k, v = (rng.normal(size=s) for s in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, dv)))
    dout = rng.normal(size=(b, hq, lq, dv))
    mask = None
    if opts.get("mask"):
        mask = rng.random((b, hq, lq, lk)) < 0.6
        mask[:, :, 5] = False
        if "nan_value_key" in opts:
            mask[..., opts["nan_value_key"]] = False
    kw = {"scale": opts.get("scale", d ** -0.5), "causal": opts.get("causal"),
          "window": opts.get("window", (-1, -1)), "mask": mask, "softcap": opts.get("softcap")}
    e_out, e_lse = reference.attention(xp, q=q, k=k, v=v, return_lse=True, **kw)
    e_grads = reference.attention_vjp(xp, q=q, k=k, v=v, out=e_out, lse=e_lse, dout=dout,
                                      **kw)
    cast = [a.astype(dtype) for a in (q, k, v)]
    out, lse = adapters.attention(xp=xp, q=cast[0], k=cast[1], v=cast[2], return_lse=True,
                                  tiles=(1, 1), **kw)
    if "nan_value_key" in opts:
        cast[2][:, :, opts["nan_value_key"]] = np.nan
    grads = adapters.attention_vjp(xp=xp, q=cast[0], k=cast[1], v=cast[2],
                                   out=e_out.astype(dtype), lse=e_lse.astype(dtype),
                                   dout=dout.astype(dtype), tiles=(1, 1), **kw)
    bound = {"float32": 1e-5, "float64": 1e-12}[dtype]
    empty = e_lse == -np.inf
    assert np.array_equal(lse == -np.inf, empty), "rows with no allowed key differ"
    assert np.all(out[empty] == 0), "a row with no allowed key has nonzero out"
    if mask is not None:
        assert empty.any() and np.all(grads[0][empty] == 0), "an empty row has nonzero dq"
    np.testing.assert_allclose(lse[~empty], e_lse[~empty], rtol=0, atol=10 * bound)
    for what, got, want in (("out", out, e_out), *zip(("dq", "dk", "dv"), grads, e_grads,
                                                      strict=True)):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= bound, f"{what}: relative Frobenius error {err:.3g} > {bound}"


def attention_tiles() -> None:
    for name, (opts, dtypes) in TILE_CASES.items():
        for dtype in dtypes:
            checked(f"attention-tiles[{name}][{dtype}]",
                    lambda name=name, opts=opts, dtype=dtype: _tile_case(name, opts, dtype))


def _varlen_case(opts: dict, heads: tuple[int, int], dtype: str) -> None:
    import softmaxkit as sk
    from softmaxkit.testing.varlen_cases import packed_arrays

    q, k, v, cu_q, cu_k = packed_arrays(9, *VARLEN_LENGTHS, *heads, 16, 8, index_dtype="int32")
    dout = np.random.default_rng(10).normal(size=(q.shape[0], heads[0], 8))
    q[:cu_q[1]] = dout[:cu_q[1]] = np.nan
    k[cu_k[1]:cu_k[2]] = v[cu_k[1]:cu_k[2]] = np.nan
    e_out, e_lse = sk.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True,
                                       backend="reference", **opts)
    e_grads = sk.varlen_attention_vjp(q, k, v, e_out, e_lse, dout, cu_q, cu_k,
                                      backend="reference", **opts)
    cast = [a.astype(dtype) for a in (q, k, v, e_out, e_lse, dout)]
    out, lse = sk.varlen_attention(*cast[:3], cu_q, cu_k, return_lse=True,
                                   backend="numba-cuda", **opts)
    grads = sk.varlen_attention_vjp(*cast, cu_q, cu_k, backend="numba-cuda", **opts)
    # spec "Attention", Tolerances: out and lse, then each gradient
    bound, grad_bound = {"float32": (1e-5, 1e-4), "float64": (1e-12, 1e-10)}[dtype]
    empty = e_lse == -np.inf
    assert np.array_equal(lse == -np.inf, empty), "rows with no allowed key differ"
    np.testing.assert_allclose(lse[~empty], e_lse[~empty], rtol=0, atol=bound)
    checks = [("out", out, e_out, bound)]
    checks += [(what, got, want, grad_bound) for what, got, want in
               zip(("dq", "dk", "dv"), grads, e_grads, strict=True)]
    for what, got, want, tol in checks:
        assert np.isfinite(got).all(), f"{what}: NaN of a poisoned sequence leaked"
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= tol, f"{what}: relative Frobenius error {err:.3g} > {tol}"
    # the sequence without keys and the keys without queries: exactly 0
    assert not out[:cu_q[1]].any() and not grads[0][:cu_q[1]].any()
    assert not grads[1][cu_k[1]:cu_k[2]].any() and not grads[2][cu_k[1]:cu_k[2]].any()


def varlen() -> None:
    for name, (opts, heads, dtype) in VARLEN_CASES.items():
        checked(f"varlen[{name}][{dtype}]",
                lambda opts=opts, heads=heads, dtype=dtype: _varlen_case(opts, heads, dtype))


def _in_the_background() -> None:
    """Yield to the rest of the suite, on a two-core machine beside it: the simulator runs a
    thread per CUDA thread, and at its priority they starve its processes (a test spawning a
    pool took 131 s beside them, 3 s alone).  Python's own thread switch interval (5 ms) is
    kept: at 0.5 ms, each waiting thread woke ten times as often, and two runs beside a busy
    process took 63 s against 42 s while that process did 18% less."""
    if hasattr(os, "nice"):
        os.nice(19)


def main() -> None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("run with NUMBA_ENABLE_CUDASIM=1")
    _in_the_background()
    if sys.argv[1] == "kit":
        kit(sys.argv[2].split(","))
    elif sys.argv[1] == "attention":
        attention_kit(sys.argv[2].split(","))
    elif sys.argv[1] == "attention-tiles":
        attention_tiles()
    elif sys.argv[1] == "varlen":
        varlen()
    else:
        plans()


if __name__ == "__main__":
    main()
