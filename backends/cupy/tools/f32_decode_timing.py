"""Time float32 decoding on the split-KV kernels (kernels/attention_f32.cu,
``sk_attn_decode_f32`` and ``sk_attn_decode_f32_paged``, asked for with ``config=`` until
``configs.F32_DECODE_SERVED``) beside the default dispatch and numba-cuda.

One query a sequence against a long cache, grouped heads (B8 Hq32 Hk8 Lk8192 by default), eager
calls, the median of ``triton.testing.do_bench``: the bytes of K and V read a second, and that
over a device copy's bandwidth.  Before timing, each result is compared with the float64
definition on the same inputs (relative Frobenius error; the run fails above 1e-5).

Usage: ``python backends/cupy/tools/f32_decode_timing.py [D ...] [--tiles WxS ...]`` (from the
repository root; head dim 128 by default); ``--tiles 8x2 4x4`` also times tiles of 8 warps and
2 stages, and of 4 warps and 4 stages, at each head dim.
"""

from __future__ import annotations

import sys

import torch

B, HQ, HK, LK, PAGE = 8, 32, 8, 8192, 16


def calls(d: int, tiles: list[tuple[int, int]]) -> tuple[dict, torch.Tensor, int]:
    """The calls to time at head dim ``d`` on fresh inputs (with the split-KV kernel on each
    (warps, stages) of ``tiles`` too), their float64 result and the bytes of K and V each
    reads."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy import attention_f32, paged
    from softmaxkit_cupy.configs import F32_DECODE_CONFIGS, F32DecodeConfig, f32_decode_width

    import softmaxkit as sk

    g = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(B, HQ, 1, d, device="cuda", generator=g)
    k, v = (torch.randn(B, HK, LK, d, device="cuda", generator=g) for _ in "kv")
    k_pages, v_pages, table = bench.paged(k, v, PAGE, seed=d)
    lens = torch.full((B,), LK, dtype=torch.int32, device="cuda")
    config = F32_DECODE_CONFIGS[f32_decode_width(d, d)]
    opts = dict(scale=d ** -0.5, causal=None, window=(-1, -1), softcap=None, return_lse=False)
    found = {
        f"split-KV {config.name()}": lambda: attention_f32.attention(
            xp, q=q, k=k, v=v, mask=None, config=config, **opts)[0],
        "paged split-KV": lambda: paged.paged_attention(
            xp, q=q, k_pages=k_pages, v_pages=v_pages, block_table=table, seqlens=lens,
            config=config, **opts)[0],
        "sk.attention (default)": lambda: sk.attention(q, k, v),
        "sk.paged_attention (default)": lambda: sk.paged_attention(
            q, k_pages, v_pages, table, lens),
        "sk.attention on numba-cuda": lambda: sk.attention(q, k, v, backend="numba-cuda"),
    }
    for warps, stages in tiles:
        tile = F32DecodeConfig(d, warps=warps, stages=stages)
        found[f"split-KV {tile.name()}"] = lambda tile=tile: attention_f32.attention(
            xp, q=q, k=k, v=v, mask=None, config=tile, **opts)[0]
    return found, bench.reference(q, k, v), 2 * k.numel() * k.element_size()


def main(dims: list[int], tiles: list[tuple[int, int]]) -> int:
    import triton.testing

    copy = bench.copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}; B{B} Hq{HQ} Hk{HK} Lq1 Lk{LK}, pages of {PAGE}; "
          f"device copy {copy / 1e9:.0f} GB/s")
    failed = False
    for d in dims:
        found, want, nbytes = calls(d, tiles)
        for name, fn in found.items():
            try:
                err = bench.relerr(fn(), want)
            except Exception as e:  # a tile that does not fit: say so, time the rest
                print(f"D{d} {name:40s} {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            failed = failed or err > 1e-5
            t = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
            print(f"D{d} {name:40s} {t * 1e6:8.0f} us  {nbytes / t / 1e9:6.0f} GB/s  "
                  f"{100 * nbytes / t / copy:5.1f}% of copy  err {err:.1e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, "benchmarks")
    import decode as bench  # the decode benchmark's reference, pools and copy bandwidth

    args = sys.argv[1:]
    cut = args.index("--tiles") if "--tiles" in args else len(args)
    tiles = [tuple(int(x) for x in a.split("x")) for a in args[cut + 1:]]
    sys.exit(main([int(a) for a in args[:cut]] or [128], tiles))
