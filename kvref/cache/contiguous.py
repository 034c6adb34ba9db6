"""The plain cache: one preallocated [capacity, Hkv, D] array per layer for K and one for V.

Position p of the sequence lives in row p. Every other layout is checked against this one.

    k[layer]   row:  0    1    2    3    4    5   ...  capacity-1
                    [p0] [p1] [p2] [p3] [  ] [  ] ... [  ]      length = 4, next_position = 4

With kv_dtype "bfloat16" or "int8" the rows hold the encoded form (kvref/cache/quant.py) and
`k_scales`/`v_scales` hold int8 scales row for row; a read decodes. With kivi4 K, `k_scales` holds
one (scale, zero) per channel for each group of g rows, and the K of the rows past length // g * g
stays in float16 in `residual` (kvref/cache/quant.py, KiviResidual).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..errors import CacheError, CacheFullError, ContextOverflowError
from .base import KVCache
from .quant import KIVI_NO_ROWS, KiviResidual, SlotStore
from .registry import LayoutOptions, option, register
from .storage import Storage


@dataclass(frozen=True)
class ContiguousOptions(LayoutOptions):
    capacity: int | None = option()  # positions; None: the model's max_seq_len

    def positions(self):
        return self.capacity

    def loaded(self, shape):
        # a capacity larger than max_seq_len (saved by an older kvref) is lowered to what the model allows
        return self if self.capacity is None else replace(self, capacity=min(self.capacity, shape.max_seq_len))

    def capacity_for(self, shape, codecs, layout) -> int:
        """The positions to allocate: the capacity asked for, at most max_seq_len, or max_seq_len
        within the memory budget (by the bytes of a position in `layout`) when none was."""
        if self.capacity is None:
            shape.check_budget(shape.max_seq_len, codecs, "the default cache", layout)
            return shape.max_seq_len
        if self.capacity > shape.max_seq_len:
            raise ContextOverflowError(f"capacity={self.capacity} exceeds the model's max_seq_len={shape.max_seq_len}")
        return int(self.capacity)


@register
class ContiguousCache(KVCache):
    layout = "contiguous"
    Options = ContiguousOptions
    keeps_groups = True

    @classmethod
    def create(cls, shape, codecs, options):
        return cls(shape.n_layers, shape.n_kv_heads, shape.head_dim, options.capacity_for(shape, codecs, cls),
                   codecs.k.name, v_dtype=codecs.v.name, group_size=codecs.group_size, rope_theta=shape.rope_theta,
                   latent_dim=shape.latent_dim)

    @classmethod
    def position_bytes(cls, shape, codecs):
        return codecs.bytes_per_position(shape.n_layers, shape.n_kv_heads)  # a row in every layer

    def __init__(self, n_layers, n_kv_heads, head_dim, capacity, dtype="float32", *, v_dtype=None,
                 group_size=None, rope_theta=None, latent_dim=None):
        super().__init__(n_layers, n_kv_heads, head_dim, dtype, v_dtype=v_dtype, group_size=group_size,
                         rope_theta=rope_theta, latent_dim=latent_dim)
        self._capacity = int(capacity)
        self.store = SlotStore(n_layers, (self._capacity,), n_kv_heads, head_dim, self.k_codec, self.v_codec)
        self.k = self.store.k  # [L, capacity, Hkv, D] stored form
        self.v = self.store.v  # [L, capacity, Hkv, D]
        self._length = 0
        self.residual = (KiviResidual(n_layers, self.k_codec.group_size, n_kv_heads, head_dim)
                         if self.store.per_channel_k else None)

    @property
    def length(self) -> int:
        return self._length

    next_position = length  # position p lives in row p: one property, read once per step by the model and begin

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def allocated_nbytes(self) -> int:
        """Bytes reserved for the full capacity (the OS commits pages only as rows are written)."""
        return self.store.allocated_nbytes

    def _reserve(self, n_new):
        free = self._capacity - self._length
        if n_new > free:
            raise CacheFullError(f"cannot append {n_new} positions: the cache holds {self._length} of "
                                 f"{self._capacity} ({free} free)")
        return n_new  # rows length..length+n_new-1 are beyond the length: nothing stored changes

    def _write(self, n_new, layer, k, v):
        end = self._length + n_new
        if self.residual is not None:  # position p in row p, group i in group slot i
            self.residual.write(self.store, layer, self._length, k, v, _same, _same)
            return (*self.residual.read(self.store, layer, end, _same, _same), np.arange(end))
        self.store.write(layer, slice(self._length, end), k, v)
        k_all, v_all = self.store.read(layer, slice(0, end))  # float types: views, no copy
        return k_all, v_all, np.arange(end)

    def _commit(self, n_new):
        self._length += n_new
        if self.residual is not None:
            self.residual.commit()

    def _release(self, n_new):
        if self.residual is not None:
            self.residual.abort()

    def _storage(self):
        # position p in row p; kivi4 K's unfilled group beside it
        return Storage(self.store, k_residual=None if self.residual is None else self.residual.rows)

    def read(self, layer):
        if self.residual is not None:
            return self.residual.read(self.store, layer, self._length, _same, _same)
        return self.store.read(layer, slice(0, self._length))

    def read_raw(self, layer):
        if self.residual is not None:
            raise CacheError(KIVI_NO_ROWS)
        return self.store.read_raw(layer, slice(0, self._length))

    def _truncate(self, n):
        self._length = n  # rows past n become unreachable

    def _fork(self):
        child = ContiguousCache(self.n_layers, self.n_kv_heads, self.head_dim, self._capacity, self.k_dtype,
                                v_dtype=self.v_dtype, group_size=self.group_size, rope_theta=self.rope_theta,
                                latent_dim=self.latent_dim)
        rows = slice(0, self._length)
        for name, a in self.store.arrays():
            getattr(child.store, name)[:, rows] = a[:, rows]  # stored bytes, never re-encoded
        child._length = self._length
        if self.residual is not None:
            child.residual = self.residual.copy()
        return child

    def _shift(self, n, keep):
        # rows keep+n..length-1 move to keep..length-n-1; their keys turn back by n positions
        moved, dest = slice(keep + n, self._length), slice(keep, self._length - n)
        for layer in range(self.n_layers):
            k, ks, v, vs = (None if a is None else a.copy() for a in self.store.read_raw(layer, moved))
            self.store.write_raw(layer, dest, (self._rerotate(k, n, layer).astype(k.dtype), ks, v, vs))
        self._length -= n

    def _free(self):
        self.store = self.k = self.v = None

    def _load_rows(self, positions, next_position, raw_layers):
        n = len(positions)
        self._check_rows_fit(n)
        for layer, raw in enumerate(raw_layers):
            self.store.write_raw(layer, slice(0, n), raw)
        self._length = n

    def layout_options(self):
        return {"capacity": self._capacity}


def _same(index):
    # contiguous: position p lives in slot p, group i in group slot i
    return index
