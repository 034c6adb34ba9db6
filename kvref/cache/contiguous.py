"""The plain cache: one preallocated [capacity, Hkv, D] array per layer for K and one for V.

Position p of the sequence lives in row p. Every other layout is checked against this one.
"""

from __future__ import annotations

import numpy as np

from ..errors import CacheError
from .base import KVCache


class ContiguousCache(KVCache):
    def __init__(self, n_layers, n_kv_heads, head_dim, capacity, dtype="float32"):
        super().__init__(n_layers, n_kv_heads, head_dim, dtype)
        if self.dtype_name not in ("float64", "float32", "float16"):
            raise CacheError(
                f"the contiguous cache stores float64, float32 or float16, not {self.dtype_name}")
        self._capacity = int(capacity)
        shape = (n_layers, self._capacity, n_kv_heads, head_dim)
        # zeros, not empty: untouched pages are never materialised, and nothing reads rows >= length
        self.k = np.zeros(shape, dtype=self.dtype_name)  # [L, capacity, Hkv, D]
        self.v = np.zeros(shape, dtype=self.dtype_name)  # [L, capacity, Hkv, D]
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def allocated_nbytes(self) -> int:
        """Bytes reserved for the full capacity (the OS commits pages only as rows are written)."""
        return self.k.nbytes + self.v.nbytes

    def update(self, layer, k, v):
        self._check_kv(layer, k, v)
        start, end = self._length, self._length + k.shape[0]
        if end > self._capacity:
            self.next_positions(k.shape[0])  # raises CacheFullError with the numbers
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer, :end], self.v[layer, :end], np.arange(end)

    def advance(self, n_new):
        self.next_positions(n_new)
        self._length += n_new

    def truncate(self, n: int) -> None:
        """Forget every position >= n (roll back rejected tokens). Rows past n become unreachable."""
        if not 0 <= n <= self._length:
            raise CacheError(f"cannot truncate to {n}: the cache holds {self._length} positions")
        self._length = n

    def can_truncate(self, n: int) -> bool:
        return 0 <= n <= self._length

    def fork(self) -> "ContiguousCache":
        """An independent copy holding the same positions (the plain layout shares nothing)."""
        child = ContiguousCache(self.n_layers, self.n_kv_heads, self.head_dim, self._capacity, self.dtype_name)
        child.k[:, : self._length] = self.k[:, : self._length]
        child.v[:, : self._length] = self.v[:, : self._length]
        child._length = self._length
        return child

    def keys(self, layer: int) -> np.ndarray:
        # -> [length, Hkv, D], read-only view of what is stored
        return _readonly(self.k[layer, : self._length])

    def values(self, layer: int) -> np.ndarray:
        # -> [length, Hkv, D]
        return _readonly(self.v[layer, : self._length])


def _readonly(a):
    view = a.view()
    view.flags.writeable = False
    return view



