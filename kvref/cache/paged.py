"""The paged cache: a sequence's block table into a BlockPool (pool.py) shared by many sequences, vLLM style.

A block holds `block_size` consecutive positions of one sequence, in every layer. The pool owns all
blocks; a sequence (PagedCache) owns only its *block table*, the list of block ids that hold its
positions in order: position p lives in block table[p // block_size] at offset p % block_size.

    pool.store.k[layer]   [num_blocks, block_size, Hkv, D]      (scales alongside for int8)

    sequence A  table [3, 0, 5]   positions 0..15 -> block 3, 16..31 -> block 0, 32..37 -> block 5
    sequence B  table [3, 0, 7]   a fork of A: blocks 3 and 0 are shared (refcount 2)

Blocks are reference counted by the pool. `fork()` shares every block of the parent; the first write
into a shared block copies it (copy-on-write), so a fork costs nothing until the two sequences differ.

An execution's `begin` allocates every block it will write (fresh blocks, and a copy of a shared or
indexed last block, which stays referenced by the sequence until the commit) before any work, so a
full pool fails at once; its abort cancels that allocation, so the pool is exactly as before (except
that a prefix key of an evicted block is dropped for good: the execution may have overwritten it).
While an execution is open its sequence holds one reference more than its table shows (the block it
copied); `pool.check` is for pools with no open execution. The sequences of one pool share its lock:
two threads may run executions on two sequences of one pool, never two on one sequence.

Prefix reuse (BlockPool(prefix_reuse=True)): a full block whose token ids are known is inserted into
the pool's prefix index (prefix.py) under the key of its token prefix, and `prefill_reuse(ids)` lets a
new sequence adopt the blocks of the longest indexed prefix of ids instead of computing them. A
sequence keeps the keys of its own full blocks (its chain), so a commit keys only the blocks it
filled. Token ids reach the layout with each commit (`cache.sequence.token_ids`).

kivi4 K: the pool keeps one (scale, zero) per channel for each group of g positions of a block
(`store.k_scales` [L, num_blocks, block_size / g, Hkv, 2, D]), so block_size must be a multiple of g
and a group never straddles two blocks; each sequence keeps the K of its unfilled last group in
float16 (its own KiviResidual, copied by a fork). Full blocks are wholly quantized, so prefix reuse
shares them as they are; an adopted prefix ends on a group boundary.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import CacheError, CacheFullError, TokenError
from ..limits import MAX_POOL_BLOCKS
from . import prefix
from .base import KVCache
from .pool import DEFAULT_BLOCK_SIZE, BlockPool, blocks_for
from .quant import KIVI_NO_ROWS, KiviResidual, SlotStore
from .registry import LayoutOptions, flag, handle, option, register
from .storage import Storage


@dataclass(frozen=True)
class PagedOptions(LayoutOptions):
    block_size: int | None = option(file_high="max_seq_len")  # positions per block; None: DEFAULT_BLOCK_SIZE
    num_blocks: int | None = option(file_high=MAX_POOL_BLOCKS)  # None: enough for one max_seq_len sequence
    prefix_reuse: bool | None = flag()  # index full blocks by their token prefix (prefill_reuse); None: False
    pool: BlockPool | None = handle()  # an existing pool to add a sequence to, instead of a new pool

    def positions(self):
        return None if self.num_blocks is None else self.num_blocks * (self.block_size or DEFAULT_BLOCK_SIZE)


@register
class PagedCache(KVCache):
    """One sequence in a BlockPool: a block table, a length, and (for prefix reuse) its blocks' keys."""

    layout = "paged"
    Options = PagedOptions
    keeps_groups = True

    @classmethod
    def create(cls, shape, codecs, options):
        if options.pool is not None:
            return cls._in_pool(shape, codecs, options)
        block_size, num_blocks = options.block_size or DEFAULT_BLOCK_SIZE, options.num_blocks
        if num_blocks is None:
            num_blocks = blocks_for(shape.max_seq_len, block_size)  # one max_seq_len sequence
            shape.check_budget(num_blocks * block_size, codecs, "the default cache", cls)
        pool = BlockPool(shape.n_layers, shape.n_kv_heads, shape.head_dim, num_blocks=num_blocks,
                         block_size=block_size, k_dtype=codecs.k.name, v_dtype=codecs.v.name,
                         group_size=codecs.group_size, rope_theta=shape.rope_theta, latent_dim=shape.latent_dim,
                         max_positions=shape.max_seq_len,
                         prefix_reuse=bool(options.prefix_reuse), model_fingerprint=shape.model)
        return pool.new_cache()

    @classmethod
    def position_bytes(cls, shape, codecs):
        return codecs.bytes_per_position(shape.n_layers, shape.n_kv_heads)  # a block slot in every layer

    @classmethod
    def _in_pool(cls, shape, codecs, options):
        # a sequence added to an existing pool: everything but the pool comes from it
        pool = options.pool
        if not isinstance(pool, BlockPool):
            raise CacheError(f"pool= takes a BlockPool (cache.pool of a paged cache); got {type(pool).__name__}")
        extra = [name for name in PagedOptions.names() if name != "pool" and getattr(options, name) is not None]
        if extra:
            raise CacheError(f"{', '.join(extra)} come from the pool when pool= is given")
        if pool.model_fingerprint != shape.model:
            raise CacheError("this pool was made for another model; its K/V would be wrong for this one")
        if codecs.request is not None:
            have = (pool.k_codec.name, pool.v_codec.name, pool.k_codec.group_size or pool.v_codec.group_size)
            wanted = (*codecs.request[:2], codecs.request[2] or have[2])
            if wanted != have:
                raise CacheError(f"the pool stores K/V as {have[0]}/{have[1]} (group {have[2]}); "
                                 f"asked for {wanted[0]}/{wanted[1]} (group {wanted[2]})")
        return pool.new_cache()

    def __init__(self, pool: BlockPool):
        super().__init__(pool.n_layers, pool.n_kv_heads, pool.head_dim, pool.k_codec.name,
                         v_dtype=pool.v_codec.name, group_size=pool.k_codec.group_size or pool.v_codec.group_size,
                         rope_theta=pool.rope_theta, latent_dim=pool.latent_dim, lock=pool.lock)
        self.pool = pool
        self.sequence.model = pool.model_fingerprint
        self._table: list[int] = []
        self._length = 0
        self._chain: list[bytes] = []  # prefix keys of this sequence's full blocks (when ids are known)
        self.residual = (KiviResidual(pool.n_layers, self.k_codec.group_size, pool.n_kv_heads, pool.head_dim)
                         if pool.store.per_channel_k else None)

    # ---- accounting ----------------------------------------------------------------------------------

    @property
    def store(self) -> SlotStore:
        """Where this sequence's K/V live: its pool's slot store, shared with the pool's other sequences."""
        return self.pool.store

    @property
    def block_table(self) -> tuple:
        return tuple(self._table)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        """Positions this sequence could hold now: its own room plus every free block of the pool."""
        if self._freed:
            return 0
        bs = self.pool.block_size
        room = max(0, (len(self._table) + self.pool.blocks_free - self._cow_needed()) * bs - self._length)
        cap = self._length + room
        return cap if self.pool.max_positions is None else min(cap, self.pool.max_positions)

    @property
    def blocks_used(self) -> int:
        """Blocks in this sequence's table (shared ones included)."""
        return len(self._table)

    @property
    def blocks_shared(self) -> int:
        return sum(1 for b in self._table if self.pool.refcount[b] > 1)

    @property
    def blocks_free(self) -> int:
        return self.pool.blocks_free

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of the blocks in this sequence's table (a shared block counts for each sharer)."""
        return len(self._table) * self.pool.block_nbytes

    def stats(self) -> dict:
        return {**super().stats(), "block_size": self.pool.block_size, "blocks_used": len(self._table),
                "blocks_shared": self.blocks_shared, "pool_blocks_used": self.pool.blocks_used,
                "pool_blocks_free": self.pool.blocks_free, "pool_num_blocks": self.pool.num_blocks}

    def _cow_needed(self) -> int:
        """1 if the next write lands in a partly filled last block that is shared or indexed by a prefix
        key: it is copied first, so the others (and the index) keep seeing it as it is."""
        if self._length % self.pool.block_size:
            last = self._table[-1]
            if self.pool.refcount[last] > 1 or last in self.pool.prefix_index:
                return 1
        return 0

    def blocks_needed(self, n_new: int) -> int:
        """Free blocks an execution of n_new positions takes from the pool (copy-on-write included)."""
        if n_new <= 0:
            return 0
        fresh = blocks_for(self._length + n_new, self.pool.block_size) - len(self._table)
        return fresh + self._cow_needed()

    # ---- one execution -------------------------------------------------------------------------------

    def _reserve(self, n_new):
        # Writes land only in blocks that are ours alone and unindexed; _release undoes this exactly
        pool, bs = self.pool, self.pool.block_size
        if pool.max_positions is not None and self._length + n_new > pool.max_positions:
            raise CacheFullError(f"cannot append {n_new} positions: the sequence holds {self._length} of at "
                                 f"most {pool.max_positions} (max_seq_len)")
        need = self.blocks_needed(n_new)
        if need > pool.blocks_free:
            cow = " including a copy of its shared last block" if self._cow_needed() else ""
            raise CacheFullError(
                f"cannot append {n_new} positions: the sequence holds {self._length} positions in "
                f"{len(self._table)} blocks of {bs} and needs {need} more{cow}; the pool has "
                f"{pool.blocks_free} free of {pool.num_blocks}")
        before, cow = list(self._table), None
        taken = pool.allocate(need)
        fresh = list(taken.blocks)
        if self._cow_needed():  # copy-on-write: the block stays as its sharers and the index see it
            cow = self._table[-1]  # still referenced by this sequence until the commit
            pool.store.copy_slots(fresh[0], cow)
            self._table[-1] = fresh.pop(0)
        self._table += fresh
        return n_new, before, cow, taken

    def _write(self, reservation, layer, k, v):
        bs, end = self.pool.block_size, self._length + reservation[0]
        new = np.arange(self._length, end)
        table = np.asarray(self._table, dtype=np.int64)
        if self.residual is not None:
            slots, groups = self._kivi_index(table)
            self.residual.write(self.pool.store, layer, self._length, k, v, slots, groups)
            return (*self.residual.read(self.pool.store, layer, end, slots, groups), np.arange(end))
        self.pool.store.write(layer, (table[new // bs], new % bs), k, v)  # each position into its block slot
        k_all, v_all = self.pool.store.decode_raw(self._gather(layer, end))
        return k_all, v_all, np.arange(end)

    def _commit(self, reservation):
        n_new, _, cow, _ = reservation
        if cow is not None:
            self.pool.release([cow])  # the copy replaces it in this sequence's table for good
        self._length += n_new
        self._index_full_blocks()
        if self.residual is not None:
            self.residual.commit()

    def _release(self, reservation):
        _, before, _, taken = reservation
        if self.residual is not None:
            self.residual.abort()
        self.pool.cancel(taken)
        self._table = before

    def _storage(self):
        return Storage(self.pool.store, np.asarray(self._table, dtype=np.int64), self.pool.block_size,
                       k_residual=None if self.residual is None else self.residual.rows)

    # ---- prefix reuse --------------------------------------------------------------------------------

    def prefill_reuse(self, token_ids) -> int:
        """Adopt indexed blocks for the longest known prefix of token_ids; return the positions reused.

        Only for an empty sequence in a pool made with prefix_reuse=True. At least one position is
        always left to compute, so the caller's forward(token_ids[n:]) has logits to return; if every
        block is indexed, the last block is adopted short of its last position (its next write
        copies or unindexes it). The caller then runs model.forward(token_ids[n:], cache).
        """
        with self._lock:
            self._check_idle()
            return self._adopt_prefix(token_ids)

    def _adopt_prefix(self, token_ids):
        pool, bs = self.pool, self.pool.block_size
        if not pool.prefix_reuse:
            raise CacheError("prefix reuse is off for this pool; make it with "
                             "model.new_cache(layout='paged', prefix_reuse=True)")
        if self._length:
            raise CacheError(f"prefix reuse needs an empty sequence; this one holds {self._length} positions")
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise TokenError(f"token ids must be a non-empty 1-D sequence of integers; got {token_ids!r}")
        found = pool.prefix_index.match(ids)  # [(key, block)]
        n = min(len(found) * bs, len(ids) - 1)
        if self.residual is not None:  # a kivi4 K residual holds no adopted position: start on a group
            n -= n % self.k_codec.group_size
        if n <= 0:
            return 0
        self._table = [b for _, b in found[:blocks_for(n, bs)]]
        pool.share(self._table)
        self._length = n
        self.sequence.replace(ids[:n])
        self._chain = [key for key, _ in found[: n // bs]]
        pool.reused_positions += n
        return n

    def _index_full_blocks(self):
        # key every full block whose ids are known (after a commit, or a load)
        if not self.pool.prefix_reuse or self.sequence.n_token_ids is None:
            self._chain = []
            return
        bs, index = self.pool.block_size, self.pool.prefix_index
        for i in range(len(self._chain), self._length // bs):
            previous = self._chain[-1] if self._chain else index.root
            self._chain.append(index.insert(previous, self.sequence.ids(i * bs, (i + 1) * bs), self._table[i]))

    # ---- reading -------------------------------------------------------------------------------------

    def _gather(self, layer, end):
        # the first `end` positions of `layer` in position order, stored form: (k, ks, v, vs) [end, ...]
        table = np.asarray(self._table[: blocks_for(end, self.pool.block_size)], dtype=np.int64)
        raw = self.pool.store.read_raw(layer, table)  # [blocks, block_size, ...] each
        # blocks x block_size rows, counted: a latent cache's V has no elements, so -1 could not be inferred
        return tuple(None if a is None else a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])[:end] for a in raw)

    def _kivi_index(self, table):
        # (slots, groups): position p -> its block slot; K group i -> the group slot of its block
        bs, g = self.pool.block_size, self.k_codec.group_size
        return (lambda p: (table[p // bs], p % bs)), (lambda i: (table[i * g // bs], i * g % bs // g))

    def read(self, layer):
        if self.residual is not None:
            slots, groups = self._kivi_index(np.asarray(self._table, dtype=np.int64))
            return self.residual.read(self.pool.store, layer, self._length, slots, groups)
        return self.pool.store.decode_raw(self._gather(layer, self._length))

    def read_raw(self, layer):
        if self.residual is not None:
            raise CacheError(KIVI_NO_ROWS)
        return self._gather(layer, self._length)

    # ---- operations ----------------------------------------------------------------------------------

    def _truncate(self, n):
        keep = blocks_for(n, self.pool.block_size)
        self.pool.release(self._table[keep:])
        del self._table[keep:]
        del self._chain[n // self.pool.block_size:]
        self._length = n

    def _fork(self):
        child = PagedCache(self.pool)
        child._table = list(self._table)
        self.pool.share(self._table)
        child._length = self._length
        child._chain = list(self._chain)
        if self.residual is not None:
            child.residual = self.residual.copy()
        return child

    def _shift(self, n, keep):
        # Positions before block keep // block_size stay where they are; from that block on, the kept
        # rows are written (keys rotated back by n) into fresh blocks, then the old blocks are released.
        pool, bs = self.pool, self.pool.block_size
        first, new_length = keep // bs, self._length - n
        need = blocks_for(new_length, bs) - first
        if need > pool.blocks_free:
            raise CacheFullError(f"shift rewrites {need} blocks; the pool has {pool.blocks_free} free of "
                                 f"{pool.num_blocks}")
        fresh = list(pool.allocate(need).blocks)
        table = np.asarray(self._table, dtype=np.int64)
        src = np.concatenate([np.arange(first * bs, keep), np.arange(keep + n, self._length)])
        moved = src >= keep + n
        dst = np.arange(first * bs, new_length) - first * bs
        dst_index = (np.asarray(fresh, dtype=np.int64)[dst // bs], dst % bs)
        for layer in range(self.n_layers):
            k, ks, v, vs = pool.store.read_raw(layer, (table[src // bs], src % bs))  # copies
            k[moved] = self._rerotate(k[moved], n, layer).astype(k.dtype)
            pool.store.write_raw(layer, dst_index, (k, ks, v, vs))
        pool.release(self._table[first:])
        self._table = self._table[:first] + fresh
        self._chain = self._chain[:first]
        self._length = new_length

    def _free(self):
        self.pool.release(self._table)
        self._table = []
        self._chain = []

    def layout_options(self):
        return {"block_size": self.pool.block_size, "num_blocks": self.pool.num_blocks,
                "prefix_reuse": self.pool.prefix_reuse}

    def _load_rows(self, positions, next_position, raw_layers):
        n, bs = len(positions), self.pool.block_size
        need = blocks_for(n, bs)
        if need > self.pool.blocks_free:
            raise CacheFullError(f"loading {n} positions needs {need} blocks of {bs}; the pool has "
                                 f"{self.pool.blocks_free} free of {self.pool.num_blocks}")
        self._table = list(self.pool.allocate(need).blocks)
        p = np.arange(n)
        index = (np.asarray(self._table, dtype=np.int64)[p // bs], p % bs)
        for layer, raw in enumerate(raw_layers):
            self.pool.store.write_raw(layer, index, raw)
        self._length = n
        self._index_full_blocks()  # the loaded sequence's ids, when the file had them


def __getattr__(name):
    if name == "block_key":  # moved with the prefix index
        warnings.warn("kvref.cache.paged.block_key is deprecated: it is kvref.cache.prefix.block_key",
                      DeprecationWarning, stacklevel=2)
        return prefix.block_key
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
