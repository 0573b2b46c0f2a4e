"""Compile the backend's hot kernels to PTX for sm_90 and report what the compiler made of
them, without a GPU: registers, spills and stack frame (``ptxas -v`` under the kernel's
register cap), local-memory accesses, and the width of the global loads and stores.

Needs numba-cuda's NVVM and NVRTC libraries (``pip install -r requirements/ptx.txt``) and
``ptxas`` on ``PATH`` (the CUDA toolkit)::

    python backends/numba-cuda/tools/ptx_report.py [--keep DIR] [--only TEXT]

A row kernel that keeps its chunk in registers shows ``local 0``; 16-byte words show as
``ld.global.nc.v4`` / ``st.global.v4``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

VALUES = {"float32": 4, "bfloat16": 8}
"""Values per 16-byte word (a staged kernel's register cap is given in values)."""
STORAGE = {"float32": "float32", "bfloat16": "int16", "float16": "float16", "float64": "float64"}


def kernels():
    """(name, kernel, signature, block, slots, kind) of the kernels the benchmarks run: the
    default plans of short, medium and long (split) rows of each dtype."""
    from softmaxkit_numba_cuda import (
        attention,
        cross_entropy_kernels,
        persistent,
        row_kernels,
        staged,
        staging,
        summary_kernels,
    )
    from softmaxkit_numba_cuda import rows as k
    from softmaxkit_numba_cuda.primitives import register_cap

    out = []
    for kind in ("float32", "bfloat16", "float64"):
        st = STORAGE[kind]
        acc = "float64" if kind == "float64" else "float32"
        short, medium, long = k.WORD_SLOTS[kind]
        block = k.SPLIT_THREADS[kind]
        for threads, slots, split in ((8, short, False), (block, medium, False),
                                      (block, long, True)):
            rows = 256 // threads if threads <= 32 else 1
            tag = f"{kind}-{threads}x{slots}{'-split' if split else ''}"
            for op in ("softmax", "log_softmax"):
                fn = row_kernels.normalize(op, kind, kind, True, threads, slots, rows, split,
                                          False)
                sig = (f"({st}[:, ::1], boolean[:, ::1], boolean, {st}[:, ::1], int64, int64, "
                       "int64, uint64[:, ::1])")
                out.append((f"{op}-{tag}", fn, sig, threads * rows, slots, kind))
            fn = row_kernels.reduce("logsumexp", kind, kind, True, threads, slots, rows, split,
                                   False)
            sig = (f"({st}[:, ::1], boolean[:, ::1], {st}[:, ::1], {st}[:, ::1], boolean, "
                   f"int64, int64, int64, {acc}[:, ::1], int32[::1])")
            out.append((f"logsumexp-{tag}", fn, sig, threads * rows, slots, kind))
            if kind != "float64":
                fn = cross_entropy_kernels.cross_entropy(kind, kind, True, threads, slots, rows,
                                                         split, False, True, False)
                sig = (f"({st}[:, ::1], boolean[:, ::1], int64[::1], {acc}[::1], "
                       f"{acc}[:, ::1], {st}[:, ::1], int64, int64, int64, {acc}[:, ::1], "
                       "int32[::1], uint64[:, ::1], float64, boolean, int64)")
                out.append((f"cross_entropy-{tag}", fn, sig, threads * rows, slots, kind))
    for kind in ("float32", "bfloat16"):
        st = STORAGE[kind]
        for threads, slots, cluster in ((256, 16, False), (256, 8, True), (256, 16, True),
                                        (256, 32, True)):
            tag = f"{kind}-{threads}x{slots}-{'cluster' if cluster else 'staged'}1"
            cap_slots = staging._fit(threads, slots)[1] // VALUES[kind]
            for op in ("softmax", "log_softmax"):
                fn = staged.normalize(op, kind, threads, slots, False, cluster)
                sig = (f"({st}[:, ::1], boolean[:, ::1], boolean, {st}[:, ::1], int64, int64, "
                       "int64, uint64[:, ::1])")
                out.append((f"{op}-{tag}", fn, sig, threads, cap_slots, kind))
            fn = staged.cross_entropy(kind, threads, slots, False, False, cluster)
            sig = (f"({st}[:, ::1], boolean[:, ::1], int64[::1], float32[::1], "
                   f"float32[:, ::1], {st}[:, ::1], int64, int64, int64, float32[:, ::1], "
                   "int32[::1], uint64[:, ::1], float64, boolean, int64)")
            out.append((f"cross_entropy-{tag}", fn, sig, threads, cap_slots, kind))
        for threads, slots in ((256, 16), (256, 32), (512, 16)):
            tag = f"{kind}-{threads}x{slots}-persist"
            cap_slots = staging._fit(threads, slots)[1] // VALUES[kind]
            for op in ("softmax", "log_softmax"):
                fn = persistent.persistent(op, kind, threads, slots, False)
                sig = (f"({st}[:, ::1], boolean[:, ::1], boolean, {st}[:, ::1], int64, int64, "
                       "int64, uint64[:, ::1], int64)")
                out.append((f"{op}-{tag}", fn, sig, threads, cap_slots, kind))
        if kind == "float64":
            continue
        # the lean kernels of 256 x 524288 (whole chunks; float32 rows of 64 KB chunks are
        # two clusters)
        threads = k.PERSIST_THREADS[kind]
        slots = 64 * 1024 // (16 * threads)
        cap_slots = staging._fit(threads, slots)[1] // VALUES[kind]
        parts = 2 if kind == "float32" else 1
        for op in ("softmax", "log_softmax"):
            fn = persistent.persistent(op, kind, threads, slots, False, True, 32 // parts,
                                   parts=parts)
            sig = (f"({st}[:, ::1], boolean[:, ::1], boolean, {st}[:, ::1], int64, int64, "
                   "int64, uint64[:, ::1], int64)")
            out.append((f"{op}-{kind}-{threads}x{slots}-lean", fn, sig, threads, cap_slots,
                        kind))
        # 4 (float32's default) or 8 words a thread kept in registers, the rest of a chunk
        # twice as long staged (two blocks a multiprocessor, twice the registers)
        for held in (4, 8):
            staged_slots = 2 * slots - held
            cap = 65536 // (threads * staging.blocks_per_sm(threads, staged_slots))
            for op in ("softmax", "log_softmax"):
                fn = persistent.persistent(op, kind, threads, staged_slots, False, True, held=held)
                sig = (f"({st}[:, ::1], boolean[:, ::1], boolean, {st}[:, ::1], int64, int64, "
                       "int64, uint64[:, ::1], int64)")
                out.append((f"{op}-{kind}-{threads}x{staged_slots}-lean-held{held}", fn, sig,
                            threads, 0, kind, cap))
    # the summary kernels and the merge gradient hold elements, not words: their caps given
    for kind in ("float32", "bfloat16", "float64"):
        st = STORAGE[kind]
        acc = "float64" if kind == "float64" else "float32"
        wide = kind == "float64"
        fn = summary_kernels.normalize(kind, kind, False, False, True)
        sig = (f"({st}[:, ::1], boolean[:, ::1], {acc}[::1], {acc}[::1], {st}[:, ::1], "
               "int32[::1], int64, int64)")
        out.append((f"summary-normalize-{kind}", fn, sig, summary_kernels.NORMALIZE_THREADS, 0,
                    kind, register_cap(summary_kernels.NORMALIZE_THREADS,
                                       summary_kernels.NORMALIZE_ITEMS, wide)))
        fn = summary_kernels.merge(kind)
        sig = (f"({st}[:, ::1], {st}[:, ::1], {st}[:, :, ::1], boolean, {st}[::1], {st}[::1], "
               f"{st}[:, ::1], int64, int64)")
        out.append((f"summary-merge-{kind}", fn, sig, 256, 0, kind, 64))
        fn = attention._vjp_kernel(kind, kind, True)
        sig = (f"({st}[:, :, ::1], {acc}[:, ::1], {st}[:, ::1], {acc}[::1], {st}[:, :, ::1], "
               f"{acc}[:, ::1], int64)")
        out.append((f"merge_attention_vjp-{kind}", fn, sig, attention.VJP_THREADS, 0, kind,
                    attention.VJP_REGISTERS))
    return out + attention_kernels()


def attention_kernels():
    """The float32 / float64 attention kernels (forward and backward, without mask and
    softcap) at the head dimensions of the benchmarks and the tile limits, each under its
    register cap (the seventh field)."""
    from softmaxkit_numba_cuda import attention_kernels as ak

    out = []
    for kind in ("float32", "float64"):
        for d, dv in ((32, 32), (64, 64), (128, 128), (192, 128), (256, 256)):
            tag = f"{kind}-{d}x{dv}"
            a4 = f"{kind}[:, :, :, ::1]"
            rm, cn = ak.tiles(ak.FORWARD_TILES, kind, d, dv)
            fn = ak.forward(kind, d, dv, rm, cn, False, False)
            sig = (f"({a4}, {a4}, {a4}, boolean[:, :, :, :], {a4}, {kind}[:, :, ::1], float64, "
                   "float64, int64, int64, int64, int64)")
            out.append((f"attention-{tag}-{rm}x{cn}", fn, sig, ak.THREADS, 0, kind,
                        ak.REGISTERS[kind]))
            rn, cm = ak.tiles(ak.BACKWARD_TILES, kind, d, dv)
            fn = ak.backward(kind, d, dv, rn, cm, False, False)
            sig = (f"({a4}, {a4}, {a4}, {a4}, boolean[:, :, :, :], {kind}[::1], {kind}[::1], "
                   f"{a4}, {a4}, {a4}, float64, float64, float64, int64, int64, int64)")
            out.append((f"attention_vjp-{tag}-{rn}x{cm}", fn, sig, ak.THREADS, 0, kind,
                        ak.REGISTERS[kind]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="write the PTX files to this folder")
    parser.add_argument("--only", help="names containing one of these comma-separated texts")
    args = parser.parse_args()
    import types

    import numba.cuda.dispatcher as dispatcher
    from numba import cuda

    # device functions are compiled for the current device's architecture: stand in sm_90
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))

    from softmaxkit_numba_cuda.primitives import register_cap
    from softmaxkit_numba_cuda.storage import VECTOR_WIDTH

    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    folder = args.keep or tempfile.mkdtemp()
    os.makedirs(folder, exist_ok=True)
    print(f"{'kernel':34s} {'cap':>4s} {'regs':>5s} {'spill':>6s} {'local':>6s} "
          f"{'ld.v4':>6s} {'st.v4':>6s} {'ld':>4s}")
    failed = False
    for name, fn, sig, block, slots, kind, *fixed in kernels():  # fixed: an explicit cap
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        ptx, _ = cuda.compile_ptx(fn.py_func, sig, cc=(9, 0))
        path = os.path.join(folder, f"{name}.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cap = fixed[0] if fixed else register_cap(block, slots * VECTOR_WIDTH[kind],
                                                  kind == "float64")
        done = subprocess.run([ptxas, "-arch=sm_90", "-v", f"-maxrregcount={cap}", path,
                               "-o", os.devnull], capture_output=True, text=True)
        regs = re.search(r"Used (\d+) registers", done.stderr)
        spill = re.search(r"(\d+) bytes spill stores", done.stderr)
        local = len(re.findall(r"\b(?:ld|st)\.local", ptx))
        print(f"{name:34s} {cap:4d} {regs.group(1) if regs else '?':>5s} "
              f"{spill.group(1) if spill else '?':>6s} {local:6d} "
              f"{ptx.count('ld.global.nc.v4'):6d} {ptx.count('st.global.v4'):6d} "
              f"{len(re.findall(r'ld.global', ptx)):4d}")
        failed |= done.returncode != 0 or local > 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
