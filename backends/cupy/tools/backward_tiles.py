"""Time the 16-bit attention backward's tile configurations beside torch's flash and cuDNN.

For each head dimension asked for (default 32 and 160), bfloat16 B4 H32 L4096, causal and
not: the cupy adapter's ``attention_vjp`` as served (``served``), on the mma.sync kernel's
declared tiles (``mma.sync``, where the Hopper kernel serves), zero-padded to the next
Hopper tiles above it (``hopper@128``, on compute capability 9.0), with each
``configs.BACKWARD_ALTERNATIVES`` entry of that head dimension (``4w/32``: warps / query
rows) and each ``configs.SM90_BACKWARD_ALTERNATIVES`` one (``hopper@32/1wg``: head dim and
warpgroups), from the
same forward's out and lse, and torch autograd's backward through
``scaled_dot_product_attention`` under its flash and cuDNN backends (the graph kept), each the
median of ``triton.testing.do_bench``; TFLOP/s count 10 B H L^2 D (five products), halved for
causal.  Before timing, every configuration's gradients on a small problem of the same head
dimension (on memory that held NaN) are compared with the float64 materialized definition
(``softmaxkit.testing.materialized``); the worst relative Frobenius error of dq, dk, dv over
bfloat16's bound fails the run.

Usage: ``python backends/cupy/tools/backward_tiles.py [D ...]`` (from the repository root).
"""

from __future__ import annotations

import sys

import torch

from softmaxkit.testing import materialized as ref

B, H, L = 4, 32, 4096


def calls(d: int, b: int, h: int, length: int, causal: bool, seed: int) -> dict:
    """Name -> a call giving (dq, dk, dv) of one problem, and the problem's tensors."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy import interop
    from softmaxkit_cupy.attention import attention, attention_vjp, backward_config_for
    from softmaxkit_cupy.configs import (
        BACKWARD_ALTERNATIVES,
        SM90_BACKWARD_ALTERNATIVES,
        SM90_BACKWARD_CONFIGS,
        SM90_CAPABILITY,
        Sm90BackwardConfig,
        backward_config,
    )
    from softmaxkit_cupy.head_dims import served_head_dim
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(b, h, length, d, device="cuda", generator=gen)
                     .to(torch.bfloat16) for _ in range(4))
    kw = dict(scale=d ** -0.5, causal="bottom_right" if causal else None, window=(-1, -1),
              mask=None, softcap=None)
    out, lse = attention(xp, q=q, k=k, v=v, return_lse=True, **kw)
    capability = interop.capability(torch.cuda.current_device())
    width = served_head_dim(d, d)
    served = backward_config_for(capability, width, masked=False)
    hopper = capability == SM90_CAPABILITY
    # on Hopper, the next Hopper tiles above the served width, the call zero-padded to them
    wider = next((w for w in sorted(SM90_BACKWARD_CONFIGS) if w > width), None)
    named = ({"served": None}
             | ({"mma.sync": backward_config(width)} if isinstance(served, Sm90BackwardConfig)
                else {})
             | ({f"hopper@{wider}": SM90_BACKWARD_CONFIGS[wider]} if hopper and wider else {})
             | {f"{c.warps}w/{c.block_m}": c for c in BACKWARD_ALTERNATIVES if c.head_dim == d}
             | {f"hopper@{d}/{c.warpgroups}wg": c for c in SM90_BACKWARD_ALTERNATIVES
                if c.head_dim == d and hopper})
    result = {n: (lambda c=c: attention_vjp(xp, q=q, k=k, v=v, out=out, lse=lse, dout=dout,
                                            config=c, **kw)) for n, c in named.items()}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        leaves = [a.detach().clone().requires_grad_() for a in (q, k, v)]
        try:
            with sdpa_kernel(backend):
                o = sdpa(*leaves, is_causal=causal)
        except RuntimeError:
            continue
        result[name] = (lambda o=o, leaves=leaves: torch.autograd.grad(o, leaves, dout,
                                                                       retain_graph=True))
    return result, (q, k, v, dout)


def main() -> int:
    from tile_timing import run

    dims = [int(a) for a in sys.argv[1:]] or [32, 160]
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; bfloat16 "
          f"B{B} H{H} L{L}, backward alone, TFLOP/s (relative error on B1 H2 L300)",
          flush=True)
    return run(dims, calls,
               lambda t, causal: ref.attention_vjp(*(a.double().cpu().numpy() for a in t),
                                                   causal="bottom_right" if causal else None),
               lambda d, causal: 10 * B * H * L * L * d / (2 if causal else 1), (B, H, L))


if __name__ == "__main__":
    raise SystemExit(main())
