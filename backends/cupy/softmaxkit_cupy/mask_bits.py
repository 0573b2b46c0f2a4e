"""Boolean attention masks packed to bits for the attention kernels (kernels/mask_bits.cu).

The kernels test a score against one bit of a 32-key word they load once per row and tile
(kernels/exclusion.cuh); the mask a call brings, a boolean view of ``[B, Hq, Lq, Lk]`` with
stride 0 along broadcast dims, is packed first, one launch, keeping those dims broadcast (a
key-padding mask ``[B, 1, 1, Lk]`` packs to ``B`` rows of ``ceil(Lk / 32)`` words).
"""

from __future__ import annotations

from typing import Any

from . import compiler, interop
from .configs import MASK_BITS_NAME as _NAME

_BLOCK = 256
_MAX_BLOCKS = 4096

MASK_BITS_PARAMS = "QQ" + "q" * 4 + "iiii" + "q"
"""The packing kernel's parameters: the addresses of the mask and the bits; the mask's
strides along B, H, Lq (0 where broadcast) and Lk; hm, lqm, lk, words; the words in all."""


def mask_bits(mask: Any) -> tuple[Any, tuple[int, int, int]]:
    """Pack the boolean ``mask`` ``[B, H, Lq, Lk]`` (any strides) to bits.

    Parameters
    ----------
    mask : cupy.ndarray or torch.Tensor
        Boolean, 4-D, on the device of the call; True where the query may attend to the key.

    Returns
    -------
    bits : array
        int32 words ``[Bm, Hm, Lqm, ceil(Lk / 32)]`` beside ``mask`` (from the caller's
        allocator), where a dim the mask broadcasts (stride 0, or size 1) has size 1; bit
        ``j % 32`` of word ``j // 32`` is ``mask[..., j]``, bits past Lk are 0.
    strides : tuple of int
        The strides of ``bits`` in words along B, H and Lq, 0 along the broadcast dims, as the
        kernels index it (the key's word is ``j // 32``).
    """
    b, h, lq, lk = (int(s) for s in mask.shape)
    sb, sh, sq, sk = interop.element_strides(mask)
    bm, hm, lqm = (1 if n == 1 or s == 0 else n for n, s in ((b, sb), (h, sh), (lq, sq)))
    words = max(1, -(-lk // 32))
    bits = interop.empty(mask, (bm, hm, lqm, words), "int32")
    total = bm * hm * lqm * words
    if lk and total:
        kernel = compiler.function("mask_bits.cu", (_NAME,), _NAME)
        blocks = min(-(-total * 32 // _BLOCK), _MAX_BLOCKS)
        interop.launch(kernel, mask, blocks, _BLOCK, MASK_BITS_PARAMS, (
            interop.pointer(mask), interop.pointer(bits),
            *(s if n > 1 else 0 for n, s in ((bm, sb), (hm, sh), (lqm, sq))), sk, hm, lqm, lk,
            words, total))
    strides = (hm * lqm * words if bm > 1 else 0, lqm * words if hm > 1 else 0,
               words if lqm > 1 else 0)
    return bits, strides
