"""Compare 16-bit row-kernel variants on the H200: check each against float64, then time it.

Every variant (the current ``sk_rows`` / ``sk_rows_staged`` instantiations and the lean
``sk_rows16`` / ``sk_rows16_staged`` ones of kernels/rows16.cuh) is first run on the benchmark
shape and on ragged, masked rows with special rows (NaN, +inf, empty), rows with a large
maximum and ascending rows (maxima rising late) into NaN-poisoned outputs and held to the
spec's bounds against float64; only variants that pass are timed (CUDA graph replay of 10
calls, device time), beside torch and a device-to-device copy.

Usage: ``python backends/cupy/tools/sweep_rows16.py [--out DIR] [--dtypes bfloat16,float16]
[--shapes 256x524288] [--labels persist] [--reverse]`` (``--labels``: only variants whose label
holds one of the comma-separated words, without the declared kernel's layout comparison;
``--reverse``: time them in reverse order).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CT = {"bfloat16": "sk_bf16", "float16": "__half"}
OPS = {"softmax": 0, "log_softmax": 1}


@dataclass(frozen=True)
class Variant:
    """One kernel shape: ``staged`` block per row segment, else ``group`` threads per row."""

    label: str
    threads: int
    group: int
    k: int
    cluster: int = 1
    staged: bool = False
    lean: bool = True
    groups: int = 1
    mode: int = 0  # mode bits of rows16.cuh (1 st.cs, 2 ld.cs, 4 L2 prefetch, 8 ex cache)
    persist: int = 0  # sk_rows16_persist with this many clusters (-1: as many as fit)
    policy: int = 0  # cluster scheduling policy (0 default, 1 spread, 2 load balancing)

    def capacity(self) -> int:
        return (self.threads if self.staged else self.group) * self.k * 8 * self.cluster

    def name(self, op: str, dtype: str) -> str:
        t, o, cs = CT[dtype], OPS[op], self.mode
        if self.staged and self.lean:
            kind = "persist" if self.persist else "staged"
            return (f"sk_rows16_{kind}<{t}, {o}, {self.threads}, {self.k}, {self.cluster}, "
                    f"{self.groups}, {cs}>")
        if self.staged:
            return f"sk_rows_staged<{t}, {t}, {o}, {self.threads}, {self.k}, {self.cluster}>"
        if self.lean:
            return f"sk_rows16<{t}, {o}, {self.threads}, {self.group}, {self.k}, {cs}>"
        return f"sk_rows<{t}, {t}, {o}, {self.threads}, {self.group}, {self.k}>"

    def shared(self) -> int:
        return self.threads * self.k * 16 if self.staged else 0


def R(label: str, threads: int, group: int, k: int, **kw: object) -> Variant:
    return Variant(label, threads, group, k, **kw)


def S(label: str, threads: int, k: int, cluster: int = 1, **kw: object) -> Variant:
    return Variant(label, threads, threads, k, cluster, staged=True, **kw)


SWEEP: dict[tuple[int, int], list[Variant]] = {
    (32768, 4096): [
        R("general 128x4", 128, 128, 4, lean=False),
        R("lean 256x2 st.cs", 256, 256, 2, mode=1),
        R("lean 128x4 st.cs", 128, 128, 4, mode=1),
        R("lean 128x4", 128, 128, 4),
        R("lean 64x8 st.cs", 64, 64, 8, mode=1),
    ],
    (262144, 128): [
        R("general 256 g4x4", 256, 4, 4, lean=False),
        R("lean 256 g16x1 st.cs", 256, 16, 1, mode=1),
        R("lean 256 g8x2 st.cs", 256, 8, 2, mode=1),
        R("lean 128 g8x2 st.cs", 128, 8, 2, mode=1),
        R("lean 256 g4x4 st.cs", 256, 4, 4, mode=1),
    ],
    (4096, 32768): [
        S("lean 256x8 c2 g4", 256, 8, 2, groups=4),
        S("lean 256x8 c2 g4 st.cs", 256, 8, 2, groups=4, mode=1),
        S("lean 512x8 g4", 512, 8, groups=4),
        S("lean 1024x4 g4", 1024, 4, groups=4),
    ],
    (256, 524288): [
        S("persist 256x16 c16 g4 spread", 256, 16, 16, groups=4, persist=-1, policy=1),
        S("persist 256x16 c16 g4 ex-cache spread", 256, 16, 16, groups=4, persist=-1,
          policy=1, mode=8),
        S("persist 256x16 c16 g4 ex-cache", 256, 16, 16, groups=4, persist=-1, mode=8),
        S("persist 256x16 c16 g4 ex-cache load-balancing", 256, 16, 16, groups=4, persist=-1,
          policy=2, mode=8),
        S("persist 256x16 c16 g4 ex-cache load-balancing, 21 clusters", 256, 16, 16, groups=4,
          persist=21, policy=2, mode=8),
        S("persist 256x16 c16 g4", 256, 16, 16, groups=4, persist=-1),
        S("persist 256x16 c16 g4 load-balancing", 256, 16, 16, groups=4, persist=-1, policy=2),
        S("persist 256x16 c16 g4, 16 clusters", 256, 16, 16, groups=4, persist=16, policy=1),
        S("persist 256x16 c16 g2 spread", 256, 16, 16, groups=2, persist=-1, policy=1),
        S("persist 256x16 c16 g8 spread", 256, 16, 16, groups=8, persist=-1, policy=1),
        S("lean 256x16 c16 g4", 256, 16, 16, groups=4),
        S("lean 256x16 c16 g4 load-balancing", 256, 16, 16, groups=4, policy=2),
    ],
}
"""Variants per benchmark shape; the declared configuration (configs.ROW16_CONFIGS) is among
them (at 256 x 524288: the ex-cache load-balancing one), and main() also times it against
other buffer layouts."""


def _names(dtypes: list[str]) -> list[str]:
    return sorted({v.name(op, d) for vs in SWEEP.values() for v in vs for op in OPS
                   for d in dtypes})


def _build(names: tuple[str, ...]) -> tuple[int, float]:
    from softmaxkit_cupy import compiler

    t0 = time.perf_counter()
    compiler.module("rows.cu", names)
    return len(names), time.perf_counter() - t0


_KERNELS: dict[str, object] = {}
_READY: set[object] = set()
_FIT: dict[tuple[str, int], int] = {}
_POLICY = 15  # CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
_POLICIES: dict[object, int] = {}


def kernel(name: str) -> object:
    from softmaxkit_cupy import compiler

    found = _KERNELS.get(name)
    if found is None:
        found = compiler.function("rows.cu", (name,), name)
        _KERNELS[name] = found
    return found


def clusters_that_fit(v: Variant, op: str, dtype: str) -> int:
    """cuOccupancyMaxActiveClusters for ``v`` (0 if the driver does not answer), under its
    scheduling policy (the driver's answer depends on it: for the 16-block persistent kernel
    one sweep got 22 clusters under load balancing where spread got 21)."""
    from softmaxkit_cupy.configs import RowConfig
    from softmaxkit_cupy.rows import max_active_clusters

    name = v.name(op, dtype)
    if (name, v.policy) not in _FIT:
        config = RowConfig(v.threads, v.group, v.k, v.cluster, staged=True, lean=True,
                           groups=v.groups, mode=v.mode, persistent=bool(v.persist))
        _FIT[name, v.policy] = max_active_clusters(kernel(name), config)
    return _FIT[name, v.policy]


def launch(v: Variant, op: str, x: object, w: object, out: object, masked_nan: bool = False,
           clusters: int = 0):
    import cupy
    from softmaxkit_cupy import interop

    rows, n = x.shape
    vec_ok = int(n % 8 == 0)
    dname = "bfloat16" if str(x.dtype) == "torch.bfloat16" else "float16"
    fn = kernel(v.name(op, dname))
    if fn not in _READY:  # function attributes once, before any graph capture
        if v.shared() > 0:  # 48 KB dynamic plus the static arrays is already over the default
            fn.max_dynamic_shared_size_bytes = v.shared()
        if v.cluster > 8:  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            cupy.cuda.driver.funcSetAttribute(fn.kernel.ptr, 14, 1)
        _READY.add(fn)
    if v.staged and _POLICIES.get(fn, 0) != v.policy:  # set by the checks, before capture
        cupy.cuda.driver.funcSetAttribute(fn.kernel.ptr, _POLICY, v.policy)
        _POLICIES[fn] = v.policy
    grid = rows * v.cluster if v.staged else -(-rows // (v.threads // v.group))
    if v.persist:
        fit = clusters or (v.persist if v.persist > 0 else clusters_that_fit(v, op, dname))
        grid = min(rows, fit or rows) * v.cluster
    wp = 0 if w is None else w.data_ptr()
    args = (np.uint64(x.data_ptr()), np.int64(n), np.uint64(wp), np.int64(n if w is not None
                                                                               else 0),
            np.uint64(out.data_ptr()), np.int64(n), np.int64(rows), np.int32(n),
            np.int32(vec_ok), np.int32(masked_nan))
    with interop.launch_context(x):
        fn((grid,), (v.threads,), args, shared_mem=v.shared())


def excess(op: str, x: object, w: object, got: object,
           masked_nan: bool = False) -> tuple[float, float]:
    """The worst excess over the spec's bound (inf for a wrong special value), and the worst
    ratio of error to bound."""
    import torch

    from softmaxkit.dtypes import accumulator_name
    from softmaxkit.testing.tolerance import SLACK, TINY, UNIT_ROUNDOFF

    name = str(x.dtype).removeprefix("torch.")
    u, tiny, ua = UNIT_ROUNDOFF[name], TINY[name], UNIT_ROUNDOFF[accumulator_name(name)]
    x64 = x.double() if w is None else x.double().masked_fill(~w, -math.inf)
    n = x.shape[-1]
    empty = (x64 == -math.inf).all(-1, keepdim=True)
    if op == "softmax":
        ref = torch.softmax(x64, -1)
        ref = torch.where(empty, math.nan if masked_nan else 0.0, ref)
    else:
        ref = torch.log_softmax(x64, -1)
        # a row with +inf (and no NaN): NaN at the +inf positions, -inf elsewhere
        posinf = (x64 == math.inf).any(-1, keepdim=True) & ~torch.isnan(x64).any(-1, keepdim=True)
        ref = torch.where(posinf, torch.where(x64 == math.inf, math.nan, -math.inf), ref)
        ref = torch.where(empty, math.nan if masked_nan else -math.inf, ref)
    g = got.double()
    fin = torch.isfinite(ref)
    special_ok = bool(torch.equal(torch.isnan(g), torch.isnan(ref))) and bool(
        torch.equal(g[~fin & ~torch.isnan(ref)], ref[~fin & ~torch.isnan(ref)]))
    if not special_ok or bool(torch.isnan(g[fin]).any()):
        return math.inf, math.inf
    if op == "softmax":
        m = torch.where(empty, 0.0, x64.nan_to_num(nan=0.0, posinf=0.0).amax(-1, keepdim=True))
        d = (x64 - m).abs().nan_to_num(nan=0.0, posinf=0.0)
        bound = (2 * u + ua * (SLACK + n + 2 * d)) * ref.abs() + tiny
    else:
        bound = 2 * u * ref.abs() + ua * (SLACK + n + 2 * ref.abs())
    e = ((g - ref).abs() - bound)[fin]
    r = ((g - ref).abs() / bound)[fin]
    return (float(e.max()), float(r.max())) if e.numel() else (0.0, 0.0)


def check(v: Variant, op: str, dtype: object, shape: tuple[int, int]) -> list[str]:
    """Failures of ``v`` on the benchmark shape and on ragged, masked and special rows (the
    worst ratio of error to the spec's bound is printed)."""
    import torch

    bad = []
    worst = 0.0
    cap = v.capacity()
    cases = [("bench", shape, False, False)]
    few = 67 if cap <= 8192 else 9
    cases += [("ragged+mask", (few, cap - 5), True, True),
              ("aligned+mask", (few, cap - 8), True, True),
              ("aligned", (few, cap - 8), False, True),
              ("half", (few, cap // 2 + 3), False, False),
              ("offset", (few, cap // 2 + 8), False, False),
              ("ascending", (few, cap - 8), False, False)]
    for label, (rows, n), masked, special in cases:
        if n < 1:
            continue
        x = (torch.randn(rows, n, device="cuda") * 4).to(dtype)
        if label == "offset":  # a large maximum: beyond n / 4 in bfloat16, near it in float16
            big = torch.bfloat16 if dtype == torch.bfloat16 else None
            x = (torch.randn(rows, n, device="cuda") * 4000 + (2.5e5 if big else 3.0e4))
            x = x.clamp(-6e4, 6e4).to(dtype) if big is None else x.to(dtype)
        if label == "ascending":  # maxima that rise late in the row, spans 1 to 2^15
            ramp = torch.linspace(-0.5, 0.5, n, device="cuda")
            span = 2.0 ** (torch.arange(rows, device="cuda") % 16)
            x = ramp * span[:, None] + torch.randn(rows, n, device="cuda") * 0.25
            x[0] = torch.randn(n, device="cuda") * 4
            x[0, n - 1] = 60.0  # one late spike above noise
            x = x.to(dtype)
        w = None
        if masked:
            w = torch.rand(rows, n, device="cuda") > 0.2
            w[min(3, rows - 1)] = False  # an empty row
        if special and rows > 8:
            x[5, n // 3] = math.nan
            x[7, n // 2] = math.inf
            x[8, 0] = math.inf
            x[8, n - 1] = math.inf
            x[2] = -math.inf  # nothing above -inf
            if w is not None:
                w[5, n // 3] = True
                w[7, n // 2] = True
                w[8, 0] = True
                w[8, n - 1] = True
        # persistent kernels also with 2 clusters, so that each walks several rows
        for clusters in ((0, 2) if v.persist else (0,)):
            for masked_nan in ((False, True) if masked else (False,)):
                out = torch.full((rows, n), math.nan, device="cuda", dtype=dtype)
                launch(v, op, x, w, out, masked_nan, clusters)
                torch.cuda.synchronize()
                e, r = excess(op, x, w, out, masked_nan)
                worst = max(worst, r)
                if e > 0:
                    bad.append(f"{label} {rows}x{n} masked_nan={masked_nan} clusters="
                               f"{clusters or 'default'}: excess {e:.3g}")
    print(f"checked {op} {dtype} {v.label}: {len(cases)} cases, worst error / bound "
          f"{worst:.3g}", flush=True)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--shapes", default=None, help="e.g. 256x524288 (default: all)")
    parser.add_argument("--labels", default=None, help="e.g. persist,cache (default: all)")
    parser.add_argument("--reverse", action="store_true",
                        help="time the variants in reverse order (the first timed tends low)")
    opts = parser.parse_args()
    dtypes = opts.dtypes.split(",")
    if opts.labels:
        words = opts.labels.split(",")
        for shape, variants in SWEEP.items():
            SWEEP[shape] = [v for v in variants if any(w in v.label for w in words)]
    if opts.reverse:
        for shape, variants in SWEEP.items():
            SWEEP[shape] = variants[::-1]
    if opts.shapes:
        keep = {tuple(int(d) for d in s.split("x")) for s in opts.shapes.split(",")}
        for shape in list(SWEEP):
            if shape not in keep:
                del SWEEP[shape]
    import multiprocessing

    import torch
    from gpu_check import graph_seconds, timed

    t0 = time.perf_counter()
    names = _names(dtypes)
    workers = os.cpu_count() or 4
    chunks = [tuple((n,)) for n in names]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_build, chunks))
    print(f"built {len(names)} kernels in {time.perf_counter() - t0:.0f} s", flush=True)

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    copy_graph = 2 * a.numel() / graph_seconds(lambda a=a, b=b: b.copy_(a)) / 1e9
    copy_bw = 2 * a.numel() / timed(lambda a=a, b=b: b.copy_(a)) / 1e9  # as gpu_check.py
    print(f"copy (events, eager): {copy_bw:.0f} GB/s; (graph) {copy_graph:.0f} GB/s")
    del a, b
    lines = [f"copy {copy_bw:.0f} GB/s (events), {copy_graph:.0f} GB/s (graph)"]
    failures = []
    checked: dict[tuple[str, int], list[str]] = {}
    for dname in dtypes:
        dtype = getattr(torch, dname)
        for shape, variants in SWEEP.items():
            x = torch.randn(*shape, device="cuda").to(dtype)
            out = torch.empty_like(x)
            # a second output after a 3 MB gap: closer to the public call's placement
            gap0 = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
            out_g = torch.empty_like(x)
            nbytes = 2 * x.numel() * x.element_size()
            for op in OPS:
                peer = torch.softmax if op == "softmax" else torch.log_softmax
                tt = graph_seconds(lambda peer=peer, x=x: peer(x, -1))
                row = [f"{op} {dname} {shape[0]}x{shape[1]}: torch {nbytes / tt / 1e9:.0f}"]
                for v in variants:
                    key = (v.name(op, dname), v.persist)  # the policy cannot change results
                    try:
                        bad = checked[key] if key in checked else check(v, op, dtype, shape)
                    except Exception as exc:  # a launch failure is a result too
                        bad = [f"{type(exc).__name__}: {exc}"]
                    checked[key] = bad
                    if bad:
                        failures.append(f"{op} {dname} {v.label}: {bad}")
                        print(f"WRONG {op} {dname} {v.label}: {bad}", flush=True)
                        row.append(f"{v.label} WRONG")
                        continue
                    sec = graph_seconds(
                        lambda v=v, op=op, x=x, out=out: launch(v, op, x, None, out))
                    bw = nbytes / sec / 1e9
                    sec_g = graph_seconds(
                        lambda v=v, op=op, x=x, out_g=out_g: launch(v, op, x, None, out_g))
                    bw_g = nbytes / sec_g / 1e9
                    # a fresh output from the allocator on every call, as the public call
                    sec_f = graph_seconds(lambda v=v, op=op, x=x: launch(
                        v, op, x, None, torch.empty_like(x)))
                    bw_f = nbytes / sec_f / 1e9
                    label = v.label
                    if v.persist < 0:
                        label += f" ({clusters_that_fit(v, op, dname)} clusters)"
                    row.append(f"{label} {bw:.0f} ({100 * bw / copy_bw:.0f}%), "
                               f"gap {bw_g:.0f} ({100 * bw_g / copy_bw:.0f}%), "
                               f"fresh {bw_f:.0f} ({100 * bw_f / copy_bw:.0f}%)")
                    print(f"{op} {dname} {shape[0]}x{shape[1]} {label}: {bw:.0f} GB/s "
                          f"{100 * bw / copy_bw:.0f}% of copy; output after a 3 MB gap "
                          f"{bw_g:.0f} GB/s {100 * bw_g / copy_bw:.0f}%; fresh output "
                          f"{bw_f:.0f} GB/s {100 * bw_f / copy_bw:.0f}%", flush=True)
                if opts.labels:  # only the variants asked for
                    lines.append("; ".join(row))
                    continue
                # the declared kernel with other buffer layouts: the output right after the
                # input (as above), after a 3 MB gap, and the public call (a fresh output
                # from the allocator on every call, as gpu_check.py times it)
                import array_api_compat.torch as xpt
                from softmaxkit_cupy import rows as kr
                from softmaxkit_cupy.configs import ROW_ALTERNATIVES, row_config

                declared = row_config(shape[1], 2, lean=True)
                gap = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
                out2 = torch.empty_like(x)
                sec_gap = graph_seconds(lambda op=op, x=x, out2=out2, c=declared: kr.launch_rows(
                    op, xpt, x, None, out2, config=c))
                sec_pub = graph_seconds(lambda op=op, x=x, dtype=dtype: getattr(kr, op)(
                    xpt, x=x, where=None, masked="zero", out_dtype=dtype))
                bw_gap, bw_pub = nbytes / sec_gap / 1e9, nbytes / sec_pub / 1e9
                row.append(f"declared {declared.describe()}: after a 3 MB gap {bw_gap:.0f} "
                           f"({100 * bw_gap / copy_bw:.0f}%), public call {bw_pub:.0f} "
                           f"({100 * bw_pub / copy_bw:.0f}%)")
                print(row[-1], flush=True)
                # staged alternatives of the same capacity, called as the public call is
                # (a fresh output from the allocator each time, grid from rows.py)
                for c in ROW_ALTERNATIVES:
                    if (c.staged and c != declared
                            and c.capacity(2) == declared.capacity(2)):
                        sec_alt = graph_seconds(lambda op=op, x=x, c=c: kr.launch_rows(
                            op, xpt, x, None, torch.empty_like(x), config=c))
                        bw_alt = nbytes / sec_alt / 1e9
                        row.append(f"{c.describe()} as the public call: {bw_alt:.0f} "
                                   f"({100 * bw_alt / copy_bw:.0f}%)")
                        print(row[-1], flush=True)
                del gap, out2
                lines.append("; ".join(row))
            del x, out, gap0, out_g
    text = "\n".join(lines) + f"\nfailures: {len(failures)}\n" + "\n".join(failures)
    print("\n" + text)
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "sweep_rows16.txt").write_text(text + "\n")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
