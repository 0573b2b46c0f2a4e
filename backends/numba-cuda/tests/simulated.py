"""The numba-cuda kernels under Numba's CUDA simulator, as one process printing JSON lines.

Run by ``test_cuda_simulator.py`` in subprocesses with ``NUMBA_ENABLE_CUDASIM=1`` (numba reads
the variable once, when it is first imported, so the simulator cannot be switched on inside a
pytest process that has already imported numba)::

    NUMBA_ENABLE_CUDASIM=1 python simulated.py kit float32,float64
    NUMBA_ENABLE_CUDASIM=1 python simulated.py plans

``kit`` runs the conformance kit on the numpy target; ``plans`` forces each row strategy
(warp per row, block per row, several tiles per row) on random rows with special values and
compares every operation with the reference backend, which computes in float64 here.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

ROW_OPS = ("softmax", "log_softmax", "logsumexp", "cross_entropy", "softmax_vjp",
           "log_softmax_vjp")
SUMMARY_OPS = ("summarize", "merge", "merge_attention")
PLAN_OPS = ROW_OPS + ("cross_entropy_hard", "summarize")
STAGED_OPS = ("softmax", "log_softmax", "cross_entropy", "cross_entropy_hard")
PERSIST_OPS = ("softmax", "log_softmax")
PLANS = {"32,1": (304, ("float32", "bfloat16"), PLAN_OPS),
         "32,4": (302, ("float64", "float32"), PLAN_OPS),
         "32,1,staged": (304, ("float32", "bfloat16"), STAGED_OPS),
         "32,1,staged,ring2": (304, ("float32", "bfloat16"), STAGED_OPS),
         "staged-800": (800, ("float32",), STAGED_OPS),
         "staged-1608": (1608, ("bfloat16", "float16"), STAGED_OPS),
         "staged-2200": (2200, ("float32",), STAGED_OPS),
         "32,1,staged,fold0": (304, ("float32",), STAGED_OPS),
         "staged-800,cluster": (800, ("float32",), STAGED_OPS),
         "staged-1608,cluster": (1608, ("bfloat16",), STAGED_OPS),
         "staged-800,persist": (800, ("float32",), PERSIST_OPS),
         "staged-1608,persist": (1608, ("bfloat16", "float16"), PERSIST_OPS),
         "staged-1024,persist": (1024, ("float32",), PERSIST_OPS),
         "staged-2048,persist": (2048, ("bfloat16", "float16", "float32"), PERSIST_OPS),
         "staged-2048,persist,held0": (2048, ("float32",), PERSIST_OPS),
         "staged-4096,persist": (4096, ("bfloat16",), PERSIST_OPS),
         "staged-1024,persist,ahead1": (1024, ("float32",), PERSIST_OPS),
         "staged-2048,persist,ahead16": (2048, ("bfloat16", "float32"), PERSIST_OPS),
         "staged-4096,persist,parts4": (4096, ("float32",), PERSIST_OPS),
         "staged-1024,persist,stagger1,rows5": (1024, ("float32",), PERSIST_OPS),
         "staged-2048,persist,held2": (2048, ("float32",), PERSIST_OPS),
         "staged-4096,persist,held2": (4096, ("bfloat16",), PERSIST_OPS)}
"""Forced "threads,slots" -> (row length, dtypes, operations): rows split across 2-3 blocks
of one warp, in 16-byte words and, for float32 rows of 302 elements, element by element; the
same with split rows staged in shared memory, one stage per block or two (a persistent grid
copying ahead), and with the sum of exponentials in a pass of its own (``fold0``).
"staged-N": the default plans on rows of N
elements, which the register plan splits: staged in shared memory, one block per row (200 and
201 words) or two blocks (550 words); with ``cluster``, rows of one chunk take the cluster
kernels as a cluster of one block (``SOFTMAXKIT_NUMBA_CUDA_CLUSTER=all``), the only cluster
the simulator can run: the exchange through the cluster's shared memory and its barriers run,
on the block itself; with ``persist``, the persistent grid of clusters
(``SOFTMAXKIT_NUMBA_CUDA_PERSIST=all``) as two clusters of one block, each walking three of
the six rows (refilling its stage with the next row's words as it writes; rows of 1024
and 2048 elements fill the chunk, so calls without ``where`` take the whole-chunk fold;
float32 rows of 2048 elements and bfloat16 rows of 4096 are two chunks, two clusters a row
exchanging through device memory, where the simulator's one-block-at-a-time schedule takes
the fallback that summarizes the other half from device memory); ``aheadN``: N copy groups
of the whole-chunk rows read back before the summary exchange (the default is none; 16: all);
``parts4``: float32 rows of 4096 elements (four chunks) as four clusters a row
(``SOFTMAXKIT_NUMBA_CUDA_ROW_CLUSTERS=4``), the first summarizing the three others;
``stagger1,rows5``: five rows over two clusters, the second (one row fewer) starting late
(``SOFTMAXKIT_NUMBA_CUDA_STAGGER=1``); ``heldN``: rows of two chunks as one chunk twice as
long, N words a thread kept in registers (``SOFTMAXKIT_NUMBA_CUDA_HELD=N``; float32 keeps 4
by default, so its rows of 2048 elements are one cluster unless ``held0``).  Every input has
an ascending row (its maximum rises in every copy group) and a row whose first quarter is
-inf (copy groups that land while the maximum is -inf).
(Short rows, a group of threads each, are the simulator's default plan in the kit.)"""


def emit(**record: object) -> None:
    print("RESULT " + json.dumps(record), flush=True)


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
             cot: np.ndarray) -> list:
    import softmaxkit as sk

    n = x.shape[-1]
    if op in ("softmax", "log_softmax"):
        fn = getattr(sk, op)
        return [fn(x, axis=-1, where=where, backend=backend),
                fn(x, axis=-1, masked="nan", backend=backend)]
    if op == "logsumexp":
        return list(sk.logsumexp(x, axis=-1, return_sign=True, where=where, backend=backend))
    if op == "summarize":
        s = sk.summarize(x, axis=-1, where=where, backend=backend)
        return [s.max, s.mass]
    if op.startswith("cross_entropy"):
        xf = np.where(np.isfinite(x.astype(np.float64)), x, 0).astype(x.dtype)
        allowed = where | (np.arange(n) == target[:, None])
        with sk.backend_opts(prioritize=backend):
            if op == "cross_entropy":  # smoothed, masked, with gradient
                return list(sk.cross_entropy(
                    xf, target, reduction="none", ignore_index=-1, label_smoothing=0.1,
                    where=allowed, return_grad=True, backend=backend))
            # plain targets: the gradient written from the kept exponentials, and the
            # loss alone (the last block of a row writes it)
            loss, grad = sk.cross_entropy(xf, target, reduction="none", ignore_index=-1,
                                          return_grad=True, backend=backend)
            alone = sk.cross_entropy(x, target, reduction="none", ignore_index=-1,
                                     backend=backend)
            return [loss, grad, alone]
    primal = (sk.softmax if op == "softmax_vjp" else sk.log_softmax)(
        x, axis=-1, where=where, backend="reference")
    fn = getattr(sk, op)
    with sk.backend_opts(prioritize=backend):
        return [fn(primal, cot, axis=-1, where=where)]


def plans() -> None:
    rng = np.random.default_rng(7)
    for forced, (n, dtypes, ops) in PLANS.items():
        options = forced.split(",")[1 if forced.startswith("staged-") else 2:]
        if forced.startswith("staged-"):
            os.environ.pop("SOFTMAXKIT_NUMBA_CUDA_PLAN", None)
        else:
            os.environ["SOFTMAXKIT_NUMBA_CUDA_PLAN"] = ",".join(forced.split(",")[:2])
        staged = forced.startswith("staged-") or "staged" in options
        os.environ["SOFTMAXKIT_NUMBA_CUDA_STAGED"] = "1" if staged else "0"
        os.environ["SOFTMAXKIT_NUMBA_CUDA_STAGE_RING"] = "2" if "ring2" in options else "1"
        os.environ["SOFTMAXKIT_NUMBA_CUDA_STAGE_FOLD"] = "0" if "fold0" in options else "1"
        os.environ["SOFTMAXKIT_NUMBA_CUDA_CLUSTER"] = "all" if "cluster" in options else "1"
        os.environ["SOFTMAXKIT_NUMBA_CUDA_PERSIST"] = "all" if "persist" in options else "1"
        for prefix, name in (("ahead", "STAGE_AHEAD"), ("parts", "ROW_CLUSTERS"),
                             ("stagger", "STAGGER"), ("held", "HELD")):
            value = [o[len(prefix):] for o in options if o.startswith(prefix)]
            if value:
                os.environ[f"SOFTMAXKIT_NUMBA_CUDA_{name}"] = value[0]
            else:
                os.environ.pop(f"SOFTMAXKIT_NUMBA_CUDA_{name}", None)
        for dtype in dtypes:
            x, where = _inputs(rng, dtype, n)
            if "rows5" in options:
                x, where = x[:5], where[:5]
            target = rng.integers(0, n, size=len(x))
            target[0] = -1
            cot = rng.normal(size=x.shape).astype(x.dtype)
            for op in ops:
                rid = f"plan[{forced}]-{op}[{dtype}]"
                try:
                    outs = {b: _outputs(op, b, x, where, target, cot)
                            for b in ("numba-cuda", "reference")}
                    for got, expected in zip(outs["numba-cuda"], outs["reference"], strict=True):
                        _compare(got, expected, dtype)
                    emit(id=rid, status="passed", message="")
                except Exception:
                    emit(id=rid, status="failed", message=traceback.format_exc()[-1520:])
    for name in ("PLAN", "STAGED", "STAGE_RING", "STAGE_FOLD", "CLUSTER", "PERSIST",
                 "STAGE_AHEAD", "ROW_CLUSTERS", "STAGGER", "HELD"):
        os.environ.pop(f"SOFTMAXKIT_NUMBA_CUDA_{name}", None)


def main() -> None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("run with NUMBA_ENABLE_CUDASIM=1")
    # the simulator's block manager polls its threads: switching often keeps it from
    # starving them (about 30% faster here)
    sys.setswitchinterval(0.0005)
    if sys.argv[1] == "kit":
        kit(sys.argv[2].split(","))
    else:
        plans()


if __name__ == "__main__":
    main()
