"""Attention on CUDA beside torch's SDPA backends: every head dimension, dtype and feature, eager.

For each case (head dimensions D / Dv, dtype, feature) the script times eager calls as a user
makes them, side by side in one process with ``triton.testing.do_bench`` (median):

* ``sk.attention`` through the default dispatch (``ran on`` names the backend it chose), the
  forward alone and the forward plus the backward through torch autograd;
* ``torch.nn.functional.scaled_dot_product_attention`` on the same tensors under each of its
  backends (flash, efficient, cudnn), where the backend runs the case ("-" where it refuses).

Before a case is timed, softmaxkit's forward and gradients are checked against float64 on a
small problem of the same head dimensions, dtype and feature (fresh random data); a case
whose error exceeds its dtype's bound is reported as FAIL and the script exits with 1.

The bar of a row (issue "Attention on the GPU without cliffs"): softmaxkit >= 0.8x flash where
flash runs the case, else >= 1.0x efficient; cudnn is reported beside it.  ``ratio`` is the
peer's time over softmaxkit's (above 1: softmaxkit is faster).  TFLOP/s count the products of
the allowed (query, key) pairs only: 2 (D + Dv) per pair forward, 2.5 times that backward.
The backward alone is the forward + backward time less the forward's.

Features: ``plain``; ``causal`` (Lq = Lk, so both alignments and torch's ``is_causal`` agree);
``gqa`` (4 query heads a key head; torch's ``enable_gqa``); ``window`` ((256, 0) around the
diagonal; torch gets the band as a boolean mask); ``mask`` (a random boolean mask broadcast over
heads; torch gets the same mask); ``softcap`` (30; no SDPA backend has it); ``lse``
(``return_lse=True``; the peer is torch's plain call).

Run on a GPU (a few minutes, most of it compiling kernels)::

    python benchmarks/attention_grid.py --out grid.md
    python benchmarks/attention_grid.py --dtypes bfloat16 --dims 64 128 --features plain causal
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DIMS = ("32", "64", "80", "96", "128", "160", "192", "256", "192/128")
DTYPES = ("bfloat16", "float16", "float32")
FEATURES = ("plain", "causal", "gqa", "window", "mask", "softcap", "lse")
WINDOW = (256, 0)
SOFTCAP = 30.0
DEVICE = ["cuda"]
"""Where the tensors live (``--device cpu`` runs the grid small, as a check of the script)."""
BOUNDS = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 2e-5}
"""Largest relative error (Frobenius norm) of a result against float64 accepted per dtype."""


@dataclass(frozen=True)
class Case:
    """One row of the grid."""

    d: int
    dv: int
    dtype: str
    feature: str

    @property
    def label(self) -> str:
        dims = f"{self.d}" if self.d == self.dv else f"{self.d}/{self.dv}"
        return f"{dims:<8}{self.dtype:<10}{self.feature:<8}"


def _dims(text: str) -> tuple[int, int]:
    d, _, dv = text.partition("/")
    return int(d), int(dv or d)


def inputs(case: Case, b: int, h: int, length: int, seed: int, grad: bool = False) -> dict:
    """q, k, v, dout and the options of ``case`` at one size, on the GPU."""
    import torch

    g = torch.Generator(device=DEVICE[0]).manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    hk = h // 4 if case.feature == "gqa" else h

    def draw(heads: int, dim: int) -> Any:
        a = torch.randn(b, heads, length, dim, device=DEVICE[0], dtype=dtype, generator=g)
        return a.requires_grad_(grad)

    q, k, v = draw(h, case.d), draw(hk, case.d), draw(hk, case.dv)
    dout = torch.randn(b, h, length, case.dv, device=DEVICE[0], dtype=dtype, generator=g)
    mask = None
    if case.feature == "mask":
        mask = torch.rand(b, 1, length, length, device=DEVICE[0], generator=g) < 0.8
    elif case.feature == "window":
        i = torch.arange(length, device=DEVICE[0])
        rel = i[None, :] - i[:, None]
        mask = ((rel >= -WINDOW[0]) & (rel <= WINDOW[1]))[None, None]
    return {"q": q, "k": k, "v": v, "dout": dout, "mask": mask, "hk": hk}


def sk_kwargs(case: Case, t: dict) -> dict:
    """softmaxkit's options for ``case`` (the mask of ``mask``; ``window`` as a window)."""
    kw: dict[str, Any] = {"scale": case.d ** -0.5}
    if case.feature == "causal":
        kw["causal"] = "top_left"
    elif case.feature == "window":
        kw["window"] = WINDOW
    elif case.feature == "mask":
        kw["mask"] = t["mask"]
    elif case.feature == "softcap":
        kw["softcap"] = SOFTCAP
    elif case.feature == "lse":
        kw["return_lse"] = True
    return kw


def torch_kwargs(case: Case, t: dict) -> dict | None:
    """SDPA's arguments for ``case``, or None where no SDPA call computes it."""
    if case.feature == "softcap":
        return None
    kw: dict[str, Any] = {"scale": case.d ** -0.5}
    if case.feature == "causal":
        kw["is_causal"] = True
    elif case.feature in ("window", "mask"):
        kw["attn_mask"] = t["mask"]
    elif case.feature == "gqa":
        kw["enable_gqa"] = True
    return kw


def allowed_pairs(case: Case, length: int, mask: Any) -> Any:
    """The (query, key) pairs ``case`` allows at Lq = Lk = ``length``: booleans [L, L], or
    ``mask``'s shape where there is one."""
    import torch

    allowed = torch.ones(length, length, dtype=torch.bool, device=DEVICE[0])
    if case.feature == "causal":
        allowed = torch.tril(allowed)
    return allowed if mask is None else allowed & mask


def reference(case: Case, q: Any, k: Any, v: Any, mask: Any) -> Any:
    """Attention of float64 ``q``, ``k``, ``v`` under ``case``'s feature, by its definition."""
    import torch

    group = q.shape[1] // k.shape[1]
    k, v = (a.repeat_interleave(group, dim=1) for a in (k, v))
    s = (q @ k.transpose(-1, -2)) * case.d ** -0.5
    if case.feature == "softcap":
        s = SOFTCAP * torch.tanh(s / SOFTCAP)
    s = s.masked_fill(~allowed_pairs(case, q.shape[2], mask), -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no allowed key gives 0
    return p @ v


def relerr(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| in float64."""
    import torch

    got, want = got.detach().double(), want.detach()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


def check(case: Case, sk: Any) -> tuple[float, str]:
    """The worst relative error of softmaxkit's out, dq, dk, dv against float64 on a small
    problem of ``case`` (B1, 8 heads, L 384), and the backend that served the forward."""
    import torch

    t = inputs(case, 1, 8, 384, seed=1234, grad=True)
    with sk.backend_opts(trace=True) as trace:
        got = sk.attention(t["q"], t["k"], t["v"], **sk_kwargs(case, t))
    out = got[0] if isinstance(got, tuple) else got
    grads = torch.autograd.grad(out, (t["q"], t["k"], t["v"]), t["dout"])
    leaves = [t[n].detach().double().requires_grad_(True) for n in ("q", "k", "v")]
    want = reference(case, *leaves, t["mask"])
    wants = torch.autograd.grad(want, leaves, t["dout"].double())
    errors = [relerr(out, want)] + [relerr(g, w) for g, w in zip(grads, wants, strict=True)]
    return max(errors), ", ".join(dict.fromkeys(r.backend for r in trace))


def timed(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn`` (eager calls, ``triton.testing.do_bench`` on a GPU)."""
    if DEVICE[0] == "cpu":
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * sorted(times)[1]
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def run_case(case: Case, sk: Any, b: int, h: int, length: int) -> dict:
    """Times of softmaxkit and the SDPA backends on ``case``, forward and forward + backward."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    row: dict[str, Any] = {"case": case}
    row["error"], row["ran_on"] = check(case, sk)
    t = inputs(case, b, h, length, seed=0, grad=True)
    leaves = (t["q"], t["k"], t["v"])
    kw = sk_kwargs(case, t)
    allowed = allowed_pairs(case, length, t["mask"]).expand(b, 1, length, length)
    row["flops"] = 2.0 * (case.d + case.dv) * h * float(allowed.sum())

    def ours_fwd() -> Any:
        with torch.no_grad():
            return sk.attention(*leaves, **kw)

    def ours_both() -> Any:
        out = sk.attention(*leaves, **kw)
        out = out[0] if isinstance(out, tuple) else out
        return torch.autograd.grad(out, leaves, t["dout"])

    row["sk"] = (timed(ours_fwd), timed(ours_both))
    tkw = torch_kwargs(case, t)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION):
        name = backend.name.split("_")[0].lower()
        row[name] = None
        if tkw is None:
            continue

        def peer_fwd(backend: Any = backend) -> Any:
            with sdpa_kernel(backend), torch.no_grad():
                return F.scaled_dot_product_attention(*leaves, **tkw)

        def peer_both(backend: Any = backend) -> Any:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(*leaves, **tkw)
            return torch.autograd.grad(out, leaves, t["dout"])

        try:
            with warnings.catch_warnings():  # a refusal's reasons, as warnings
                warnings.simplefilter("ignore", UserWarning)
                peer_fwd()
                peer_both()
        except RuntimeError:  # the backend does not run this case
            continue
        row[name] = (timed(peer_fwd), timed(peer_both))
    return row


def verdict(row: dict, which: int) -> tuple[str, str]:
    """``(peer, met)`` of the bar for the forward (``which`` 0) or forward + backward (1)."""
    ours = row["sk"][which]
    if row["flash"] is not None:
        need, peer = 0.8, "flash"
    elif row["efficient"] is not None:
        need, peer = 1.0, "efficient"
    else:
        return "none", "-"
    ratio = row[peer][which] / ours
    return peer, ("met" if ratio >= need else "NOT met")


def render(rows: list[dict]) -> list[str]:
    """The grid as a markdown table."""
    head = ("| D | dtype | feature | ran on | relerr | sk fwd ms | TFLOP/s | flash | efficient |"
            " cudnn | bar fwd | sk fwd+bwd ms | TFLOP/s | flash | efficient | cudnn |"
            " bar fwd+bwd | sk bwd ms | TFLOP/s | flash | cudnn |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        c = row["case"]
        dims = f"{c.d}" if c.d == c.dv else f"{c.d}/{c.dv}"
        cells = [dims, c.dtype, c.feature, row["ran_on"], f"{row['error']:.1e}"]
        for which, factor in ((0, 1.0), (1, 3.5)):
            ours = row["sk"][which]
            cells += [f"{ours:.3f}", f"{factor * row['flops'] / ours / 1e9:.3g}"]
            for peer in ("flash", "efficient", "cudnn"):
                p = row[peer]
                cells.append("-" if p is None else f"{p[which] / ours:.2f}x")
            peer, met = verdict(row, which)
            cells.append(f"{met} ({peer})" if peer != "none" else "no peer")
        ours = backward(row["sk"])
        cells += [f"{ours:.3f}", f"{2.5 * row['flops'] / ours / 1e9:.3g}"]
        for peer in ("flash", "cudnn"):
            p = row[peer]
            cells.append("-" if p is None else f"{backward(p) / ours:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def backward(times: tuple[float, float]) -> float:
    """The backward's milliseconds: forward + backward less the forward, each a median of its
    own timing (the backward alone, as a training step pays it)."""
    return times[1] - times[0]


def main(argv: list[str] | None = None) -> int:
    """Run the grid and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", nargs="+", default=list(DIMS),
                        help="head dims D or D/Dv (default: %(default)s)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--features", nargs="+", default=list(FEATURES), choices=FEATURES)
    parser.add_argument("--feature-dims", nargs="+", default=["64", "128"],
                        help="head dims the features other than plain and causal run at")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--length", type=int, default=4096,
                        help="Lq = Lk of 16-bit cases (float32: a quarter of it)")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--device", default="cuda", help="cuda; cpu checks the script only")
    opts = parser.parse_args(argv)

    import torch

    import softmaxkit as sk

    DEVICE[0] = opts.device
    cases = [Case(*_dims(dims), dtype, feature)
             for dtype in opts.dtypes for feature in opts.features for dims in opts.dims
             if feature in ("plain", "causal") or dims in opts.feature_dims]
    name = torch.cuda.get_device_name() if opts.device == "cuda" else opts.device
    print(f"{name}, torch {torch.__version__}, "
          f"softmaxkit {sk.__version__}; B{opts.batch} H{opts.heads}, "
          f"L {opts.length} (float32: {opts.length // 4}); {len(cases)} cases", flush=True)
    rows, failed = [], []
    for case in cases:
        start = time.perf_counter()
        length = opts.length // 4 if case.dtype == "float32" else opts.length
        try:
            row = run_case(case, sk, opts.batch, opts.heads, length)
        except Exception as exc:  # a case that cannot run is a finding, not the end of the run
            print(f"{case.label} ERROR {type(exc).__name__}: {exc}", flush=True)
            failed.append(case)
            continue
        if row["error"] > BOUNDS[case.dtype]:
            failed.append(case)
        rows.append(row)
        if opts.out:  # after every row: a run stopped early keeps what it measured
            with open(opts.out, "w") as f:
                f.write("\n".join(render(rows)) + "\n")
        fwd, both = row["sk"]
        peers = " ".join(f"{n} {'-' if row[n] is None else f'{row[n][0]:.3f}/{row[n][1]:.3f}'}"
                         for n in ("flash", "efficient", "cudnn"))
        print(f"{case.label} on {row['ran_on']:<11} err {row['error']:.1e} "
              f"sk {fwd:.3f}/{both:.3f} ms  {peers}  ({time.perf_counter() - start:.0f} s)",
              flush=True)
        if opts.device == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(render(rows)))
    if failed:
        print("FAILED: " + ", ".join(c.label.strip() for c in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
