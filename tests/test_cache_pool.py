"""The block pool's allocator and its prefix index, driven directly (no model): kvref/cache/pool.py, prefix.py.

The stateful test holds sequences as lists of blocks whose token ids it remembers, and checks after
any sequence of allocate / cancel / share / release / insert / match that the pool's invariants hold,
that the index never hands out a block holding other tokens than the query's, and that eviction takes
only unreferenced cached blocks, least recently released first.
"""

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvref.cache import BlockPool, PrefixIndex, Reservation
from kvref.errors import CacheError, CacheFullError

BS = 2  # positions per block
IDS = st.lists(st.integers(0, 3), min_size=BS, max_size=4 * BS)  # few token values: prefixes repeat often


def new_pool(num_blocks, prefix_reuse=True):
    return BlockPool(1, 1, 2, num_blocks=num_blocks, block_size=BS, prefix_reuse=prefix_reuse)


def chunks(ids):
    return [tuple(ids[i:i + BS]) for i in range(0, len(ids) - len(ids) % BS, BS)]


def prefixes(ids):
    # what each full block's K/V depend on: every token up to the block's end
    return [tuple(ids[:i + BS]) for i in range(0, len(ids) - len(ids) % BS, BS)]


class PoolMachine(RuleBasedStateMachine):
    """Sequences are (blocks, token ids); `held[b]` is the token prefix block b holds since it was last allocated."""

    @initialize(num_blocks=st.integers(1, 10))
    def make_pool(self, num_blocks):
        self.pool = new_pool(num_blocks)
        self.seqs = []  # [(blocks, ids)]; a sequence's ids fill its blocks (full blocks only)
        self.held = {}  # block -> the token prefix (through its last position) of the sequence that allocated it
        self.freed = {}  # block -> when its last reference went (the eviction order's clock)
        self.clock = 0

    def refcounts(self):
        expected = np.zeros(self.pool.num_blocks, dtype=np.int64)
        for blocks, _ in self.seqs:
            np.add.at(expected, np.asarray(blocks, dtype=np.int64), 1)
        return expected

    def index(self, blocks, ids):
        key = self.pool.prefix_index.root
        for b, chunk in zip(blocks, chunks(ids)):
            key = self.pool.prefix_index.insert(key, chunk, b)

    @rule(ids=IDS, indexed=st.booleans())
    def allocate(self, ids, indexed):
        ids = ids[: len(ids) - len(ids) % BS]
        n = len(ids) // BS
        cached_before = {b: self.freed[b] for b in self.pool.prefix_index.evictable}
        plain_before = set(self.pool.free_list) - set(cached_before)
        refcount_before = self.pool.refcount.copy()
        try:
            reservation = self.pool.allocate(n)
        except CacheFullError:
            assert n > self.pool.blocks_free
            return
        blocks = list(reservation.blocks)
        assert len(blocks) == n and all(refcount_before[b] == 0 for b in blocks)
        evicted = [b for b in blocks if b in cached_before]
        if evicted:
            event("allocate evicted cached blocks")
            assert plain_before <= set(blocks), "a cached block went while an unindexed one was free"
            oldest = sorted(cached_before, key=cached_before.get)[:len(evicted)]
            assert evicted == oldest, "eviction is not least recently released first"
            assert not set(evicted) & set(self.pool.prefix_keys)
        for b, prefix in zip(blocks, prefixes(ids)):
            self.held[b] = prefix
        self.seqs.append((blocks, ids))
        if indexed:
            self.index(blocks, ids)

    @rule(n=st.integers(0, 4))
    def allocate_then_cancel(self, n):
        free, keys = self.pool.free_list, self.pool.prefix_keys
        if n > self.pool.blocks_free:
            return
        reservation = self.pool.allocate(n)
        self.pool.cancel(reservation)
        if keys == self.pool.prefix_keys:
            assert self.pool.free_list == free
        else:  # cached blocks were evicted: they come back unindexed, and nothing else changed
            event("cancel after an eviction")
            assert sorted(self.pool.free_list) == sorted(free)
            assert self.pool.prefix_keys.items() <= keys.items()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def share(self, data):
        blocks, ids = data.draw(st.sampled_from(self.seqs))
        self.pool.share(blocks)
        self.seqs.append((list(blocks), ids))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.seqs) - 1))
        blocks, _ = self.seqs.pop(i)
        self.pool.release(blocks)
        remaining = self.refcounts()
        for b in blocks:
            if remaining[b] == 0:
                self.freed[b] = self.clock
                self.clock += 1

    @rule(ids=IDS)
    def match_and_adopt(self, ids):
        found = self.pool.prefix_index.match(ids)
        blocks = [b for _, b in found]
        for b, prefix in zip(blocks, prefixes(ids)):
            assert self.held[b] == prefix, f"block {b} holds the prefix {self.held[b]}, the query's is {prefix}"
        if blocks:
            event("match found blocks")
            self.pool.share(blocks)
            self.seqs.append((blocks, ids[:len(blocks) * BS]))

    @invariant()
    def pool_invariants_hold_and_refcounts_equal_the_sequences(self):
        self.pool.check()
        assert np.array_equal(self.pool.refcount, self.refcounts())
        assert self.pool.blocks_free == int((self.refcounts() == 0).sum())

    def teardown(self):
        if hasattr(self, "pool"):
            for blocks, _ in self.seqs:
                self.pool.release(blocks)
            assert self.pool.blocks_free == self.pool.num_blocks and not self.pool.refcount.any()


TestPoolMachine = PoolMachine.TestCase


@given(sequences=st.lists(IDS, min_size=1, max_size=6), query=IDS)
def test_the_index_never_returns_a_block_whose_token_prefix_differs_from_the_query(sequences, query):
    index, held, next_block = PrefixIndex(BS), {}, 0
    for ids in sequences:
        key = index.root
        for chunk, prefix in zip(chunks(ids), prefixes(ids)):
            held[next_block] = prefix
            key = index.insert(key, chunk, next_block)
            next_block += 1
    found = index.match(query)
    for (_, b), prefix in zip(found, prefixes(query)):
        assert held[b] == prefix
    # the match is the longest: the query's next block is not indexed after this prefix
    known = {p for ids in sequences for p in prefixes(ids)}
    if len(found) < len(query) // BS:
        assert tuple(query[:(len(found) + 1) * BS]) not in known


def test_allocate_takes_unindexed_blocks_first_then_evicts_the_least_recently_released():
    pool = new_pool(4)
    a = pool.allocate(2)
    pool.prefix_index.insert(pool.prefix_index.root, (1, 1), a.blocks[0])
    pool.prefix_index.insert(pool.prefix_index.root, (2, 2), a.blocks[1])
    pool.release([a.blocks[1]])
    pool.release([a.blocks[0]])  # released last: evicted last
    assert pool.blocks_cached == 2 and pool.free_list == (2, 3, 1, 0)
    b = pool.allocate(3)
    assert b.blocks == (2, 3, 1) and pool.prefix_keys.keys() == {0}
    pool.cancel(b)  # exact, except that block 1's key is gone: it returns unindexed, at its last freeing
    assert pool.free_list == (2, 3, 1, 0) and pool.blocks_cached == 1
    pool.check()


def test_allocate_refuses_more_than_the_free_blocks_and_changes_nothing():
    pool = new_pool(3)
    pool.allocate(2)
    free = pool.free_list
    with pytest.raises(CacheFullError, match="the pool has 1 free blocks of 3; 2 needed"):
        pool.allocate(2)
    assert pool.free_list == free and isinstance(pool.allocate(1), Reservation)


def test_a_shared_evictable_block_leaves_the_eviction_order_until_released_again():
    pool = new_pool(2)
    a = pool.allocate(1)
    pool.prefix_index.insert(pool.prefix_index.root, (5, 6), a.blocks[0])
    pool.release(a.blocks)
    assert pool.prefix_index.evictable == a.blocks
    [(_, block)] = pool.prefix_index.match([5, 6, 7])
    pool.share([block])
    assert pool.prefix_index.evictable == () and pool.blocks_free == 1
    assert pool.allocate(1).blocks == (1,) and pool.blocks_free == 0
    pool.release([block])
    assert pool.prefix_index.evictable == (block,)
    pool.check()


def test_the_moved_names_still_import_from_the_paged_module():
    import kvref.cache.paged as paged
    from kvref.cache import prefix

    assert paged.BlockPool is BlockPool
    with pytest.warns(DeprecationWarning, match="kvref.cache.prefix.block_key"):
        assert paged.block_key is prefix.block_key


def test_a_wrong_allocator_call_is_a_cache_error_and_changes_nothing():
    pool = new_pool(4)
    a = pool.allocate(2)
    state = (pool.refcount.copy(), pool.free_list)
    for call, message in [(lambda: pool.allocate(-1), "number of blocks >= 0"),
                          (lambda: pool.allocate(1.0), "number of blocks >= 0"),
                          (lambda: pool.release([a.blocks[0], 3]), r"cannot release blocks \[3\]"),
                          (lambda: pool.release([a.blocks[0], a.blocks[0]]), "distinct integer ids"),
                          (lambda: pool.share([a.blocks[0], 2]), r"cannot share blocks \[2\]: they are free"),
                          (lambda: pool.share([4]), r"in \[0, 4\)"),
                          (lambda: pool.share([-1]), r"in \[0, 4\)"),
                          (lambda: pool.share([0.5]), "integer ids")]:
        with pytest.raises(CacheError, match=message):
            call()
        assert np.array_equal(pool.refcount, state[0]) and pool.free_list == state[1]
    pool.share(a.blocks)
    with pytest.raises(CacheError, match="shared or freed since"):
        pool.cancel(a)
    pool.release(a.blocks)
    pool.cancel(a)
    with pytest.raises(CacheError, match="shared or freed since"):
        pool.cancel(a)  # twice
    assert pool.blocks_free == 4
    pool.check()
