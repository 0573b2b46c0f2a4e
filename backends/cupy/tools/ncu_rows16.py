"""Launch one sweep_rows16.py variant for a profiler: one warm-up launch, then one to profile.

Usage (on the GPU machine): ``ncu --clock-control none --kernel-name regex:sk_rows16
--launch-skip 1 --launch-count 1 python backends/cupy/tools/ncu_rows16.py --variant LABEL
[--shape 256x524288] [--dtype bfloat16] [--op softmax]``; LABEL is a variant label of the
shape in sweep_rows16.SWEEP.  Prints the clusters that fit at once for each staged variant.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True)
    parser.add_argument("--shape", default="256x524288")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--op", default="softmax")
    opts = parser.parse_args()
    import sweep_rows16 as sw
    import torch

    shape = tuple(int(d) for d in opts.shape.split("x"))
    found = [v for v in sw.SWEEP[shape] if v.label == opts.variant]
    if not found:
        raise SystemExit(f"no variant {opts.variant!r} at {opts.shape}")
    v = found[0]
    x = torch.randn(*shape, device="cuda").to(getattr(torch, opts.dtype))
    out = torch.full_like(x, float("nan"))
    for _ in range(2):
        sw.launch(v, opts.op, x, None, out)
    torch.cuda.synchronize()
    if v.staged:
        print(f"{v.label}: {sw.clusters_that_fit(v, opts.op, opts.dtype)} clusters fit at once")
    print(f"{v.label}: output finite {bool(torch.isfinite(out).all())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
