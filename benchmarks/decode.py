"""Decoding on CUDA: the bytes of K and V read per second, beside a device copy and torch.

One query per sequence against a long KV cache, grouped heads (B64 Hq32 Hk8 Lk32768 by
default), eager calls as a user makes them, side by side in one process with
``triton.testing.do_bench`` (median):

* ``sk.attention`` through the default dispatch (``ran on`` names the backend and kernel);
* ``sk.paged_attention`` on the same keys and values in shuffled pages of ``--page-size``,
  with its metadata check (the default: one boolean read back, a synchronization) and without
  (``check_metadata=False``);
* ``torch.nn.functional.scaled_dot_product_attention`` under its flash, cuDNN and
  memory-efficient backends (each where it runs the case: float32 on the last alone); where
  none runs grouped heads (``enable_gqa``: float32), the efficient backend is timed on K and
  V repeated to Hq heads, as a user of it must: in the call (``repeat``) and kept so
  (``cache of Hq heads``, which reads Hq / Hk times the bytes);
* with ``--compare BACKEND``, both softmaxkit calls on that backend alone;
* a device-to-device copy of 1 GiB, whose bytes (read + written) over its time is the copy
  bandwidth the others are compared with.

A decode's bytes are those of K and V (q and the output are a thousandth of them), so
``GB/s`` is ``2 B Hk Lk D itemsize / time`` and ``of copy`` that over the copy's bandwidth
(issue "Hopper attention": at least 95% for bfloat16 at D = 128).  Before timing, each
softmaxkit result is checked against float64 on the benchmark's own inputs (the exit status
is 1 when one exceeds its dtype's bound).

Run on a GPU::

    python benchmarks/decode.py
    python benchmarks/decode.py --dims 64 128 256 --dtypes bfloat16 float16 --out decode.md
    python benchmarks/decode.py --dtypes float32 --batch 8 --keys 8192 --compare numba-cuda
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

BOUNDS = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-5}
"""Largest relative error (Frobenius norm) of an output against float64 per dtype."""


def timed(fn: Any) -> float:
    """Median seconds of eager calls of ``fn``."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median")) / 1e3


def copy_bandwidth() -> float:
    """Bytes read + written per second by a device-to-device copy of 1 GiB."""
    import torch

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    return 2 * a.numel() / timed(lambda: b.copy_(a))


def reference(q: Any, k: Any, v: Any) -> Any:
    """Grouped-head attention of ``q`` [B, Hq, Lq, D] in float64, by its definition (a few
    sequences at a time: float64 copies of the whole cache would be four times its size)."""
    import torch

    b, hq, lq, d = q.shape
    hk = k.shape[1]
    outs = []
    for i in range(0, b, 4):
        rows = q[i:i + 4].double().reshape(-1, hk, hq // hk * lq, d)
        s = rows @ k[i:i + 4].double().transpose(-1, -2) * d ** -0.5
        outs.append((torch.softmax(s, dim=-1) @ v[i:i + 4].double()).reshape(-1, hq, lq, d))
    return torch.cat(outs)


def relerr(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| in float64."""
    import torch

    got = got.double()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


def paged(k: Any, v: Any, page_size: int, seed: int) -> tuple[Any, Any, Any]:
    """``k``, ``v`` [B, Hk, Lk, D] as page pools [P, Hk, page_size, D] in a shuffled order and
    the block table [B, Lk / page_size] that finds them."""
    import torch

    b, hk, lk, d = k.shape
    per = lk // page_size
    order = torch.randperm(b * per, generator=torch.Generator().manual_seed(seed))
    table = order.to(device=k.device, dtype=torch.int32).reshape(b, per)

    def pool(a: Any) -> Any:
        pages = a.reshape(b, hk, per, page_size, d).permute(0, 2, 1, 3, 4)
        out = torch.empty_like(pages.reshape(b * per, hk, page_size, d))
        out[table.reshape(-1).long()] = pages.reshape(b * per, hk, page_size, d)
        return out

    return pool(k), pool(v), table


def run(dtype_name: str, d: int, sizes: tuple[int, int, int, int], page_size: int,
        copy: float, compare: str | None = None) -> tuple[list[str], bool]:
    """Rows of the table for one dtype and head dim, and whether every check passed."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import softmaxkit as sk

    b, hq, hk, lk = sizes
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, hk, lk, d, device="cuda", dtype=dtype, generator=g)
            for _ in range(2))
    k_pages, v_pages, table = paged(k, v, page_size, seed=d)
    lens = torch.full((b,), lk, dtype=torch.int32, device="cuda")
    nbytes = 2 * k.numel() * k.element_size()
    want = reference(q, k, v)
    calls = {
        "sk.attention": lambda: sk.attention(q, k, v),
        f"sk.paged_attention (pages of {page_size})":
            lambda: sk.paged_attention(q, k_pages, v_pages, table, lens),
        "sk.paged_attention, check_metadata=False":
            lambda: sk.paged_attention(q, k_pages, v_pages, table, lens, check_metadata=False),
    }
    if compare is not None:  # the same calls on that backend alone
        calls[f"sk.attention on {compare}"] = lambda: sk.attention(q, k, v, backend=compare)
        calls[f"sk.paged_attention on {compare}"] = lambda: sk.paged_attention(
            q, k_pages, v_pages, table, lens, backend=compare)
    lines, ok = [], True
    for name, fn in calls.items():
        with sk.backend_opts(trace=True) as trace:
            err = relerr(fn(), want)
        ran = ", ".join(dict.fromkeys(f"{r.backend} {r.kernel or ''}".strip() for r in trace))
        ok = ok and err <= BOUNDS[dtype_name]
        t = timed(fn)
        lines.append(f"| {dtype_name} | {d} | {name} | {ran} | {err:.1e} | {t * 1e6:.0f} | "
                     f"{nbytes / t / 1e9:.0f} | {100 * nbytes / t / copy:.1f}% |")
    torch_ran = False  # a backend ran the grouped heads: no repeated-K, V peer is needed
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        def peer(backend: Any = backend) -> Any:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        label = f"torch SDPA {backend.name.split('_')[0].lower()}"
        peers = {label: peer}
        try:
            peer()
        except RuntimeError:  # the backend does not run this case
            lines.append(f"| {dtype_name} | {d} | {label} | - | - | - | - | - |")
            if backend != SDPBackend.EFFICIENT_ATTENTION or hq == hk or torch_ran:
                continue
            try:
                peers = repeated_peers(q, k, v, label)
            except torch.OutOfMemoryError:
                lines.append(f"| {dtype_name} | {d} | {label} on repeated K, V | out of memory "
                             "| - | - | - | - |")
                continue
        else:
            torch_ran = True
        for name, fn in peers.items():
            try:
                err = relerr(fn(), want)
            except torch.OutOfMemoryError:  # K and V repeated to Hq heads do not fit
                lines.append(f"| {dtype_name} | {d} | {name} | out of memory | - | - | - | - |")
                continue
            t = timed(fn)
            lines.append(f"| {dtype_name} | {d} | {name} | | {err:.1e} | {t * 1e6:.0f} | "
                         f"{nbytes / t / 1e9:.0f} | {100 * nbytes / t / copy:.1f}% |")
    return lines, ok


def repeated_peers(q: Any, k: Any, v: Any, label: str) -> dict[str, Any]:
    """torch's memory-efficient SDPA on K and V repeated to q's heads: repeated in the call,
    and kept so (a cache of Hq heads)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    kr, vr = (a.repeat_interleave(group, dim=1) for a in (k, v))

    def repeat() -> Any:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                                  v.repeat_interleave(group, dim=1))

    def kept() -> Any:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, kr, vr)

    return {f"{label}, K V repeated in the call": repeat,
            f"{label}, a cache of Hq heads": kept}


def main(argv: list[str] | None = None) -> int:
    """Run the decode benchmark and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", nargs="+", type=int, default=[128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=sorted(BOUNDS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HK"))
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--compare", help="also time the calls on this backend alone")
    parser.add_argument("--out", help="also write the markdown table to this file")
    opts = parser.parse_args(argv)
    if opts.keys % opts.page_size:
        parser.error("--keys must be a multiple of --page-size")

    import torch

    import softmaxkit as sk

    copy = copy_bandwidth()
    hq, hk = opts.heads
    sizes = (opts.batch, hq, hk, opts.keys)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, softmaxkit "
             f"{sk.__version__}; B{opts.batch} Hq{hq} Hk{hk} Lq1 Lk{opts.keys}; device copy "
             f"{copy / 1e9:.0f} GB/s (1 GiB, read + write)", "",
             "| dtype | D | call | ran on | relerr | us | GB/s (K + V) | of copy |",
             "|---|---|---|---|---|---|---|---|"]
    failed = False
    for dtype in opts.dtypes:
        for d in opts.dims:
            rows, ok = run(dtype, d, sizes, opts.page_size, copy, opts.compare)
            failed = failed or not ok
            lines += rows
            print("\n".join(rows), flush=True)
            torch.cuda.empty_cache()
    print("\n".join(lines))
    if opts.out:
        with open(opts.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if failed:
        print("FAILED: an error above its bound")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
