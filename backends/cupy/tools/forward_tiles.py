"""Time the 16-bit attention forward's tile configurations beside torch's flash and cuDNN.

For each head dimension asked for (default 32, 96 and 192), bfloat16 B4 H32 L4096, causal and
not: the cupy adapter's ``attention`` as served (``served``), on the mma.sync kernel's declared
tiles (``mma.sync``, where the Hopper kernel serves the call, at its width or zero-padded), and
zero-padded to the next Hopper tiles above the served width (``hopper@256``, on compute
capability 9.0) and on each ``configs.SM90_ALTERNATIVES`` entry of that head dimension
(``hopper@192``), beside torch's ``scaled_dot_product_attention`` under its flash and cuDNN
backends, each the median of ``triton.testing.do_bench``; TFLOP/s count 4 B H L^2 D (two
products), halved for causal.
Before timing, every configuration's output on a small problem of the same head dimension (on
memory that held NaN) is compared with the float64 materialized definition
(``softmaxkit.testing.materialized``); a relative Frobenius error over bfloat16's bound fails
the run.

Usage: ``python backends/cupy/tools/forward_tiles.py [D ...]`` (from the repository root).
"""

from __future__ import annotations

import sys

import torch

from softmaxkit.testing import materialized as ref

B, H, L = 4, 32, 4096


def calls(d: int, b: int, h: int, length: int, causal: bool, seed: int) -> tuple[dict, tuple]:
    """Name -> a call giving the output of one problem, and the problem's tensors."""
    import array_api_compat.torch as xp
    from softmaxkit_cupy import interop
    from softmaxkit_cupy.attention import attention
    from softmaxkit_cupy.configs import (
        SM90_ALTERNATIVES,
        SM90_CAPABILITY,
        SM90_CONFIGS,
        attention_config,
    )
    from softmaxkit_cupy.head_dims import served_head_dim, sm90_width
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, length, d, device="cuda", generator=gen).to(torch.bfloat16)
               for _ in range(3))
    kw = dict(scale=d ** -0.5, causal="bottom_right" if causal else None, window=(-1, -1),
              mask=None, softcap=None, return_lse=False)
    capability = interop.capability(torch.cuda.current_device())
    width = served_head_dim(d, d)
    hopper = capability == SM90_CAPABILITY
    on_hopper = hopper and sm90_width(d, d, SM90_CONFIGS) is not None  # the served call
    wider = next((w for w in sorted(SM90_CONFIGS) if w > width), None)
    named = ({"served": None}
             | ({"mma.sync": attention_config(width, masked=False)} if on_hopper else {})
             | ({f"hopper@{wider}": SM90_CONFIGS[wider]} if hopper and wider else {})
             | ({f"hopper@{d}": c for c in SM90_ALTERNATIVES if c.head_dim == d}
                if hopper else {}))
    result = {n: (lambda c=c: attention(xp, q=q, k=k, v=v, config=c, **kw)[0])
              for n, c in named.items()}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def peer(backend: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=causal)
        try:
            peer()
        except RuntimeError:
            continue
        result[name] = peer
    return result, (q, k, v)


def main() -> int:
    from tile_timing import run

    dims = [int(a) for a in sys.argv[1:]] or [32, 96, 192]
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; bfloat16 "
          f"B{B} H{H} L{L}, forward, TFLOP/s (relative error on B1 H2 L300)", flush=True)
    return run(dims, calls,
               lambda t, causal: ref.attention(*(a.double().cpu().numpy() for a in t),
                                               causal="bottom_right" if causal else None)[0],
               lambda d, causal: 4 * B * H * L * L * d / (2 if causal else 1), (B, H, L))


if __name__ == "__main__":
    raise SystemExit(main())
