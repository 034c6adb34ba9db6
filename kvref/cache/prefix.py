"""The prefix index: which blocks of a pool hold which token prefixes, and which of them to evict first.

A full block whose token ids are known gets a key,

    key(block i) = sha256(key(block i-1) + token ids of block i as int64)      key(-1) = ROOT_KEY

so equal keys mean equal token prefixes, and in one pool of one model equal K/V. `match(ids)` walks
the keys of ids block by block while the index holds them; a new sequence adopts those blocks
instead of computing them. A block keeps its key while nobody references it (a system prompt stays
reusable after the request that computed it finished): such a block is *evictable*, and when the pool
has no other free block it evicts them least recently used first, dropping their keys.

The pool and its sequences use the index through these calls only, so another index (a radix tree
over the token ids, SGLang's RadixCache) could take the hash chain's place:

    root                           the key of the empty prefix
    match(ids)                     [(key, block)] of the longest indexed whole-block prefix of ids
    insert(previous, ids, block)   index a full block of ids after the prefix `previous`; its key
    block in index                 whether a block holds an indexed prefix (a write must copy it first)
    unpin(block), pin(block)       the block's last reference went, or one came back: eviction order
    evict(n)                       unindex and return n evictable blocks, least recently used first
"""

from __future__ import annotations

import itertools

import numpy as np

from ..digest import sha256

ROOT_KEY = b"kvref prefix v1"  # the key "before" block 0


def block_key(previous: bytes, token_ids) -> bytes:
    """The prefix key of a full block: sha256(previous block's key + the block's token ids as int64)."""
    return sha256(previous + np.asarray(token_ids, dtype="<i8").tobytes()).digest()


class PrefixIndex:
    """A hash chain of full blocks of block_size positions (see the module docstring)."""

    root = ROOT_KEY

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}  # prefix key -> block
        self._key_of: dict[int, bytes] = {}  # block -> prefix key
        self._evictable: dict[int, None] = {}  # indexed blocks nobody references; order = eviction order

    def __contains__(self, block) -> bool:
        return block in self._key_of

    def match(self, token_ids) -> list:
        """[(key, block)] of the longest prefix of token_ids that indexed blocks hold, one pair per block."""
        bs, key, found = self.block_size, self.root, []
        for i in range(len(token_ids) // bs):
            key = block_key(key, token_ids[i * bs:(i + 1) * bs])
            block = self._block_of.get(key)
            if block is None:
                break
            found.append((key, block))
        return found

    def insert(self, previous: bytes, token_ids, block: int) -> bytes:
        """Index `block` as holding the full block token_ids after the prefix `previous` (root, or a key
        from match or insert); return the longer prefix's key. A prefix already held keeps its block,
        and a block holds one prefix at most: equal K/V computed twice are indexed once."""
        key = block_key(previous, token_ids)
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key
        return key

    def unpin(self, block: int) -> None:
        """Nobody references the indexed `block` any more: it is evicted after those unpinned before it."""
        self._evictable[block] = None

    def pin(self, block: int) -> None:
        """An evictable block is referenced again (adopted by a sequence): it leaves the eviction order."""
        del self._evictable[block]

    def evict(self, n: int) -> list:
        """Unindex and return the first n evictable blocks (least recently used first)."""
        blocks = list(itertools.islice(self._evictable, n))
        for b in blocks:
            del self._evictable[b]
            del self._block_of[self._key_of.pop(b)]
        return blocks

    @property
    def evictable(self) -> tuple:
        """The indexed blocks nobody references, in eviction order."""
        return tuple(self._evictable)

    @property
    def n_evictable(self) -> int:
        return len(self._evictable)

    def keys(self) -> dict:
        """{block: prefix key} of every indexed block (a copy)."""
        return dict(self._key_of)

    def check(self) -> None:
        """Assert the index's invariants (tests): keys and blocks map one to one; evictable blocks are indexed."""
        assert len(self._key_of) == len(self._block_of), "prefix index: keys and blocks differ in number"
        for key, b in self._block_of.items():
            assert self._key_of.get(b) == key, f"prefix index: block {b} and its key disagree"
        assert all(b in self._key_of for b in self._evictable), "prefix index: an evictable block is not indexed"
