"""Row layout: the reduced axes moved last and merged, so every kernel sees ``[..., N]``.

Backends implement each row operation along the last axis only.  The frontend moves the
reduced axes to the end (a view in every library that has strides), merges them into one when
there are several, hands the backend that array, and undoes the move on the way out.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class RowLayout:
    """How an array of ``shape`` is viewed as rows along ``axes``."""

    shape: tuple[int, ...]
    axes: tuple[int, ...]

    @classmethod
    @functools.lru_cache(maxsize=1024)
    def of(cls, shape: tuple[int, ...], axes: tuple[int, ...]) -> RowLayout:
        """The layout of ``shape`` along ``axes``, made once per pair (its views cached)."""
        return cls(shape, axes)

    @cached_property
    def _last(self) -> bool:
        # the common case: one reduced axis, already last; the rows are the array itself
        return len(self.shape) > 0 and self.axes == (len(self.shape) - 1,)

    @cached_property
    def kept(self) -> tuple[int, ...]:
        """The axes that are not reduced, in order."""
        return tuple(i for i in range(len(self.shape)) if i not in self.axes)

    @cached_property
    def permutation(self) -> tuple[int, ...]:
        """The permutation that moves the reduced axes last."""
        return self.kept + self.axes

    @cached_property
    def row_length(self) -> int:
        """N, the number of positions in one row."""
        return math.prod(self.shape[i] for i in self.axes)

    @cached_property
    def batch_shape(self) -> tuple[int, ...]:
        """The shape of the kept axes (the shape of a reduction without keepdims)."""
        return tuple(self.shape[i] for i in self.kept)

    @property
    def keepdims_shape(self) -> tuple[int, ...]:
        """The shape of a reduction with keepdims."""
        return tuple(1 if i in self.axes else n for i, n in enumerate(self.shape))

    @cached_property
    def _identity(self) -> bool:
        return self.permutation == tuple(range(len(self.shape)))

    def to_rows(self, xp: Any, x: Any) -> Any:
        """View ``x`` (of ``self.shape``) as ``[*batch_shape, N]``."""
        if x is None or self._last:
            return x
        if len(self.shape) == 0:
            return xp.reshape(x, (1,))
        if not self._identity:
            x = xp.permute_dims(x, self.permutation)
        if len(self.axes) != 1:
            x = xp.reshape(x, self.batch_shape + (self.row_length,))
        return x

    def from_rows(self, xp: Any, y: Any) -> Any:
        """Undo :meth:`to_rows` for an elementwise result of shape ``[*batch_shape, N]``."""
        if self._last:
            return y
        if len(self.shape) == 0:
            return xp.reshape(y, ())
        if len(self.axes) != 1:
            y = xp.reshape(y, tuple(self.shape[i] for i in self.permutation))
        if not self._identity:
            inverse = [0] * len(self.shape)
            for position, axis in enumerate(self.permutation):
                inverse[axis] = position
            y = xp.permute_dims(y, tuple(inverse))
        return y

    def reduced(self, xp: Any, y: Any, keepdims: bool) -> Any:
        """Shape a row reduction of shape ``batch_shape`` as the caller asked."""
        return xp.reshape(y, self.keepdims_shape) if keepdims else y
