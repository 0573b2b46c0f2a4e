"""Row views handed to the kernels: the same elements as the frontend's array, by stride."""

from __future__ import annotations

import numpy as np
import pytest
from softmaxkit_cupy.interop import as_rows, element_strides, pointer, row_pointer

torch = pytest.importorskip("torch")
import array_api_compat.torch as xp  # noqa: E402


def _elements(view, ld: int, rows: int, n: int) -> np.ndarray:
    """Read [rows, n] through the row stride the kernel would use."""
    flat = torch.as_strided(view, (rows, n), (ld, 1))
    return flat.numpy()


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a,
        lambda a: a[:, 1:3, :],               # sliced middle axis: rows still evenly nested
        lambda a: a[:, :, :5],                # sliced last axis: row stride > n
        lambda a: a.transpose(0, 1),          # permuted leading axes: copied
        lambda a: a[..., ::2],                # non-unit last stride: copied
        lambda a: a[:1].expand(4, 3, 10),     # broadcast leading axis
        lambda a: a[:, :1].expand(4, 3, 10),  # broadcast middle axis
        lambda a: a[0, 0],                    # one row
    ],
)
def test_as_rows_reads_the_same_elements(make) -> None:
    base = torch.arange(4 * 3 * 10, dtype=torch.float32).reshape(4, 3, 10)
    a = make(base)
    view, ld = as_rows(xp, a)
    n = a.shape[-1]
    rows = int(np.prod(a.shape[:-1]))
    assert tuple(view.shape) == (rows, n)
    assert element_strides(view)[-1] == 1 or n <= 1
    expected = a.reshape(rows, n).numpy()
    np.testing.assert_array_equal(_elements(view, ld, rows, n), expected)


@pytest.mark.parametrize(
    "make",
    [lambda a: a, lambda a: a[:, 1:3, :], lambda a: a[:, :, :5], lambda a: a.transpose(0, 1),
     lambda a: a[:1].expand(4, 3, 10), lambda a: a[0, 0]],
)
def test_row_pointer_addresses_the_same_elements(make) -> None:
    base = torch.arange(4 * 3 * 10, dtype=torch.float32).reshape(4, 3, 10)
    a = make(base)
    address, ld, keep = row_pointer(xp, a)
    n, rows = a.shape[-1], int(np.prod(a.shape[:-1]))
    if a.is_contiguous():
        assert keep is a and address == a.data_ptr() and ld == n  # no view made
    assert address == pointer(keep)
    offset = (address - keep.untyped_storage().data_ptr()) // 4
    flat = torch.as_strided(keep, (rows, n), (ld, 1), offset)
    np.testing.assert_array_equal(flat.numpy(), a.reshape(rows, n).numpy())


def test_broadcast_mask_keeps_a_zero_row_stride() -> None:
    row = torch.tensor([True, False, True, True])
    view, ld = as_rows(xp, row.expand(6, 4))
    assert ld == 0
    assert _elements(view, ld, 6, 4).tolist() == [[True, False, True, True]] * 6
