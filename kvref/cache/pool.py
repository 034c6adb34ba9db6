"""The block pool: num_blocks blocks of block_size positions for every layer, shared by many sequences.

    pool.store.k[layer]   [num_blocks, block_size, Hkv, D]      (scales alongside for int8)
    pool.refcount         [num_blocks]  how many block-table entries point at each block

A sequence (PagedCache, paged.py) owns a block table into the pool. The pool hands blocks out and
counts their references through a small allocator:

    allocate(n)     n free blocks, one reference each: a Reservation
    cancel(r)       undo an allocate exactly: each block returns to its place in the free list
    share(blocks)   one more reference to each block (a fork, an adopted prefix)
    release(blocks) one reference less; a block nobody references is free again

A free block holding no indexed prefix is on the free list, in the order it was freed; one holding
an indexed prefix stays in the prefix index (prefix.py) as evictable, reusable until evicted.
`allocate` takes free-list blocks oldest freed first, then evicts what the index gives up first
(least recently used), so a cached prefix goes only when the pool has no other free block. A
cancelled allocation is exact except that an evicted block's key is gone for good (the execution
may have overwritten it): that block comes back to the free list, at the place of its last freeing.
The sequences of one pool share its lock: every change of the pool holds it.
"""

from __future__ import annotations

import heapq
import itertools
import operator
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import CacheError, CacheFullError
from .prefix import PrefixIndex
from .quant import KIVI, SlotStore, kv_codecs
from .registry import layout_class

DEFAULT_BLOCK_SIZE = 16


def blocks_for(n_positions: int, block_size: int) -> int:
    return -(-n_positions // block_size)


@dataclass(frozen=True)
class Reservation:
    """The blocks one `allocate` took, each with one reference; `pool.cancel` undoes it exactly."""

    blocks: tuple


class BlockPool:
    """num_blocks blocks of block_size positions for every layer, with refcounts, a free list and a prefix index."""

    def __init__(self, n_layers, n_kv_heads, head_dim, *, num_blocks, block_size=DEFAULT_BLOCK_SIZE,
                 k_dtype="float32", v_dtype=None, group_size=None, rope_theta=None, latent_dim=None, max_positions=None,
                 prefix_reuse=False, model_fingerprint=None):
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise CacheError(f"{name}={value!r} must be a positive integer")
        if not isinstance(prefix_reuse, bool):
            raise CacheError(f"prefix_reuse={prefix_reuse!r} must be True or False")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.block_size, self.num_blocks = int(block_size), int(num_blocks)
        self.latent_dim = latent_dim  # MLA: K is the latent key, V its first latent_dim values (not stored)
        self.k_codec, self.v_codec = kv_codecs(k_dtype, v_dtype, head_dim, group_size, latent_dim)
        if self.k_codec.name == KIVI and self.block_size % self.k_codec.group_size:
            raise CacheError(f"block_size={self.block_size} must be a multiple of the kivi4 group of "
                             f"{self.k_codec.group_size} positions, so that a K group never straddles two blocks")
        self.rope_theta = rope_theta
        self.max_positions = max_positions  # the model's max_seq_len: no sequence grows past it
        self.prefix_reuse = prefix_reuse
        self.model_fingerprint = model_fingerprint
        self.store = SlotStore(n_layers, (self.num_blocks, self.block_size), n_kv_heads, head_dim,
                               self.k_codec, self.v_codec)
        self.refcount = np.zeros(self.num_blocks, dtype=np.int64)  # [num_blocks] table entries pointing at each block
        self.prefix_index = PrefixIndex(self.block_size)  # stays empty unless prefix_reuse
        self._free = dict.fromkeys(range(self.num_blocks))  # unindexed free blocks; insertion order = reuse order
        # when each block was last freed: a cancelled allocation puts its blocks back in this order,
        # whatever else happened meanwhile
        self._freed_at = list(range(self.num_blocks))
        self._clock = self.num_blocks
        self.reused_positions = 0  # positions served from the prefix index so far (accounting)
        self.lock = threading.RLock()  # every change of the pool or of one of its sequences holds it

    # ---- accounting ----------------------------------------------------------------------------------

    @property
    def blocks_free(self) -> int:
        """Blocks nobody references: the free list and the evictable cached prefixes."""
        return len(self._free) + self.prefix_index.n_evictable

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - self.blocks_free

    @property
    def blocks_cached(self) -> int:
        """Free blocks that still hold an indexed prefix (reusable until evicted)."""
        return self.prefix_index.n_evictable

    @property
    def free_list(self) -> tuple:
        """The free blocks in the order allocate hands them out: unindexed ones oldest freed first, then
        the evictable cached ones in eviction order."""
        return tuple(self._free) + self.prefix_index.evictable

    @property
    def prefix_keys(self) -> dict:
        """{block: prefix key} of every indexed block (a copy)."""
        return self.prefix_index.keys()

    @property
    def block_nbytes(self) -> int:
        return self.block_size * self.n_layers * self.n_kv_heads * (
            self.k_codec.bytes_per_vector() + self.v_codec.bytes_per_vector())

    @property
    def used_nbytes(self) -> int:
        """Bytes of the blocks in use (shared blocks counted once)."""
        return self.blocks_used * self.block_nbytes

    @property
    def allocated_nbytes(self) -> int:
        return self.store.allocated_nbytes

    def new_cache(self):
        """An empty sequence in this pool: the paged layout's cache (found through the layout registry,
        since the sequence sits above its pool)."""
        return layout_class("paged")(self)

    def check(self, caches=()) -> None:
        """Assert the pool's invariants (tests): a block is free exactly when nobody references it, and
        then either on the free list or evictable in the prefix index; refcounts equal the table entries
        of `caches` if given."""
        self.prefix_index.check()
        evictable = set(self.prefix_index.evictable)
        for b in range(self.num_blocks):
            free = b in self._free or b in evictable
            assert free == (self.refcount[b] == 0), f"block {b}: refcount {self.refcount[b]}"
            assert not (b in self._free and b in self.prefix_index), f"block {b}: indexed but on the free list"
        if caches:
            expected = np.zeros(self.num_blocks, dtype=np.int64)
            for c in caches:
                if not c.freed:
                    np.add.at(expected, np.asarray(c.block_table, dtype=np.int64), 1)
            assert np.array_equal(expected, self.refcount), "refcounts differ from the block tables"

    # ---- the allocator -------------------------------------------------------------------------------

    def allocate(self, n: int) -> Reservation:
        """Take n free blocks, one reference each: free-list blocks oldest freed first, then the prefix
        index's evictable blocks in its eviction order (their keys are dropped)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise CacheError(f"allocate takes a number of blocks >= 0; got {n!r}")
        if n > self.blocks_free:
            raise CacheFullError(f"the pool has {self.blocks_free} free blocks of {self.num_blocks}; {n} needed")
        blocks = list(itertools.islice(self._free, n))
        for b in blocks:
            del self._free[b]
        blocks += self.prefix_index.evict(n - len(blocks))
        self.refcount[blocks] = 1
        return Reservation(tuple(blocks))

    def cancel(self, reservation: Reservation) -> None:
        """Undo `allocate` exactly: each block returns to its place in the free list."""
        blocks = self._checked(reservation.blocks)
        if any(self.refcount[b] != 1 for b in blocks):
            raise CacheError(f"cannot cancel the reservation of blocks {blocks}: they are shared or freed "
                             f"since (refcounts {[int(self.refcount[b]) for b in blocks]}, 1 each expected)")
        self.refcount[blocks] = 0
        self._free = dict.fromkeys(heapq.merge(sorted(blocks, key=self._freed_at.__getitem__), self._free,
                                               key=self._freed_at.__getitem__))

    def share(self, blocks) -> None:
        """One more reference to each block (distinct ids); a free one must hold an indexed prefix (anything
        else in it is stale) and leaves the eviction order."""
        blocks = self._checked(blocks)
        stale = [b for b in blocks if self.refcount[b] == 0 and b not in self.prefix_index]
        if stale:
            raise CacheError(f"cannot share blocks {stale}: they are free and hold no indexed prefix")
        for b in blocks:
            if self.refcount[b] == 0:
                self.prefix_index.pin(b)
            self.refcount[b] += 1

    def release(self, blocks) -> None:
        """One reference less to each block; a block nobody references is free again, at the end of the
        free list, or (holding an indexed prefix) last in the eviction order."""
        blocks = self._checked(blocks)
        if any(self.refcount[b] == 0 for b in blocks):
            raise CacheError(f"cannot release blocks {[b for b in blocks if self.refcount[b] == 0]}: nobody "
                             f"references them")
        for b in blocks:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._freed_at[b] = self._clock
                self._clock += 1
                if b in self.prefix_index:
                    self.prefix_index.unpin(b)
                else:
                    self._free[b] = None

    def _checked(self, blocks) -> list:
        # block ids from a caller: distinct integers in range, or nothing happens
        try:
            ids = [operator.index(b) for b in blocks]
        except TypeError:
            ids = None
        if ids is None or len(set(ids)) != len(ids) or not all(0 <= b < self.num_blocks for b in ids):
            raise CacheError(f"blocks must be distinct integer ids in [0, {self.num_blocks}); got {list(blocks)}")
        return ids
