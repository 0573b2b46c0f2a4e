"""Boolean attention masks packed to bits on a CUDA device (skipped without one), against
numpy's packing of the same mask, for full, broadcast and strided views."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (conftest.py)
DEVICE = "cuda"

VIEWS = {
    "full": lambda m: m,
    "heads broadcast": lambda m: m[:, :1].expand(-1, 3, -1, -1),
    "key padding": lambda m: m[:, :1, :1].expand(-1, 3, 5, -1),
    "every other key": lambda m: m,  # made from the keys at stride 2
    "queries contiguous": lambda m: m.transpose(2, 3).contiguous().transpose(2, 3),
}


@pytest.mark.parametrize("lk", [1, 31, 32, 70, 129])
@pytest.mark.parametrize("view", list(VIEWS))
def test_mask_bits_match_numpy_packing(view: str, lk: int) -> None:
    torch = pytest.importorskip("torch")
    from softmaxkit_cupy.mask_bits import mask_bits

    rng = np.random.default_rng(lk)
    base = torch.as_tensor(rng.random((2, 3, 5, 2 * lk)) < 0.5, device=DEVICE)
    mask = VIEWS[view](base[..., ::2] if view == "every other key" else base[..., :lk])
    want = mask.cpu().numpy()
    bits, strides = mask_bits(mask)
    words = -(-lk // 32)
    assert tuple(bits.shape[-1:]) == (words,)
    packed = np.zeros(want.shape[:3] + (words * 32,), dtype=bool)
    packed[..., :lk] = want
    expected = np.packbits(packed, axis=-1, bitorder="little").view("<u4")
    got = bits.cpu().numpy().view("<u4")
    # read the bits the way the kernels do: word (b * sb + h * sh + i * sq + j // 32)
    flat = got.reshape(-1)
    b, h, i = np.meshgrid(*(np.arange(n) for n in want.shape[:3]), indexing="ij")
    base_index = b * strides[0] + h * strides[1] + i * strides[2]
    read = flat[base_index[..., None] + np.arange(words)]
    np.testing.assert_array_equal(read, expected, err_msg=view)
    if view == "key padding":  # the broadcast dims stay broadcast
        assert tuple(bits.shape) == (2, 1, 1, words) and strides[1:] == (0, 0)
