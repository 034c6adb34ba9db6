"""What every model type shares: cutting text at regex matches, and merging adjacent symbols by rank."""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np


def pieces(pattern, text: str) -> list[tuple[str, bool]]:
    """(piece, is_match) for every match of `pattern` and every stretch of text between them, in order."""
    found, start = [], 0
    for match in pattern.finditer(text):
        if match.start() > start:
            found.append((text[start:match.start()], False))
        found.append((match.group(), True))
        start = match.end()
    if start < len(text):
        found.append((text[start:], False))
    return found


def split_isolated(patterns, text: str) -> list[str]:
    """Cut `text` at the matches of each pattern in turn, each match and each stretch between matches a
    piece of its own (llama.cpp's unicode_regex_split, HF's Split behavior "Isolated")."""
    words = [text] if text else []
    for pattern in patterns:
        words = [piece for word in words for piece, _ in pieces(pattern, word)]
    return words


# symbols from which merge_adjacent merges by rounds (every pair of one rank at once, in NumPy) instead
# of by a heap. The heap costs microseconds per merge and more as it outgrows the CPU caches (1 MiB of
# one letter: ~10 s); a round costs ~0.1 ms however many pairs it merges. Below this length varied
# text (few merges per round) is merged faster by the heap (docs/benchmarks.md, "Long words").
LONG_PIECE = 2**16
FEW_PAIRS = 64  # pairs ranked one by one below this count, through np.unique above it


def merge_adjacent(symbols: list[str], rank: Callable[[str, str], float | None]) -> list[str]:
    """Merge adjacent symbols, the pair of lowest rank(left, right) first and the leftmost first among
    equal ranks, until no adjacent pair has a rank (None). Byte-level BPE ranks a pair by its position
    in the merges, SentencePiece by minus the score of the merged piece; the order of HF tokenizers and
    of llama.cpp's llm_tokenizer_bpe_session and llm_tokenizer_spm_session. A word is merged by a heap
    of candidate pairs, a long one (a whitespace run, a whole SentencePiece fragment) by rounds; both
    give the same symbols."""
    if len(symbols) < LONG_PIECE:
        return merge_by_heap(symbols, rank)
    return _Rounds(symbols, rank).merge()


def merge_by_heap(symbols: list[str], rank: Callable[[str, str], float | None]) -> list[str]:
    """merge_adjacent by a heap of candidate pairs: pop the lowest (rank, left position), skip it if
    either side has been merged into something else since it was pushed, merge, push the two new pairs.
    O(n log n)."""
    n = len(symbols)
    nxt = [*range(1, n), -1] if n else []
    prev = list(range(-1, n - 1))
    heap = []

    def push_pair(left):
        right = nxt[left]
        if right != -1:
            r = rank(symbols[left], symbols[right])
            if r is not None:
                heapq.heappush(heap, (r, left, symbols[left], symbols[right]))

    for i in range(n - 1):
        push_pair(i)
    while heap:
        _, left, a, b = heapq.heappop(heap)
        right = nxt[left]
        # a pair is stale once either side has been merged into something else since it was pushed
        if right == -1 or symbols[left] != a or symbols[right] != b:
            continue
        symbols[left], symbols[right] = a + b, None
        nxt[left] = nxt[right]
        if nxt[right] != -1:
            prev[nxt[right]] = left
        if prev[left] != -1:
            push_pair(prev[left])
        push_pair(left)
    return [s for s in symbols if s is not None]


class _Rounds:
    """merge_adjacent of a long piece by rounds: take the lowest rank r of any current pair, merge its
    pairs left to right (of two that overlap, the left one), rank the pairs the merges formed, repeat.

    This is the heap's order as long as no merge forms a pair of rank <= r: the heap would take that
    pair next, the round would not. Merges learned in order never do (a merged symbol's pairs were
    learned after it); a round that would is undone, and merge_by_heap goes on from there.

    Each position holds a symbol, by number (`names[number]` is its text); a merge puts the pair's
    symbol at the left position and retires the right one, so the live positions in order are the
    sequence. Every pair formed is filed under its rank with its key, the numbers of its two symbols
    (left << 32 | right): a filed pair is still there if the key at its position is, because the symbol
    at a position only ever grows.
    """

    def __init__(self, symbols: list[str], rank):
        self.rank = rank
        self.index: dict[str, int] = {}
        self.names: list[str] = []
        self.sym = np.array([self._number(s) for s in symbols], dtype=np.int64)  # [n] symbol numbers
        n = len(symbols)
        self.alive = np.ones(n, dtype=bool)
        self.nxt = np.arange(1, n + 1, dtype=np.int64)  # [n] next live position, -1 at the end
        self.nxt[-1] = -1
        self.prev = np.arange(-1, n - 1, dtype=np.int64)  # [n] previous live position, -1 at the start
        self.pairs: dict[int, tuple[float, int]] = {}  # key -> (rank, number of the merged symbol); inf: none
        self.filed: dict[float, list] = {}  # rank -> chunks of (left positions, keys, merged symbols)
        self.pending: list[float] = []  # heap of the ranks in `filed`
        left = np.arange(n - 1)
        self._file(left, *self._ranked(self._keys(left, left + 1)))

    def merge(self) -> list[str]:
        while self.pending:
            r = heapq.heappop(self.pending)
            if not self._round(r):
                return merge_by_heap(self._symbols(), self.rank)
        return self._symbols()

    def _round(self, r: float) -> bool:
        """Merge the pairs filed under rank r that are still there, left to right; False (and nothing
        merged) if a merge would form a pair of rank <= r."""
        p, merged = self._mergeable(r)  # [m] merging positions and what they become
        q = self.nxt[p]  # [m] positions that retire
        after = self.nxt[q]  # [m] positions right of each merge, -1 at the end
        has_after = after >= 0
        after_before = self.sym[after[has_after]]  # their symbols before this round
        undo = self.sym[p].copy()
        self.sym[p], self.alive[q], self.nxt[p] = merged, False, after
        self.prev[after[has_after]] = p[has_after]
        # the pairs the merges form: with the left neighbour, and with the right one as it was when the
        # merge happened (a right neighbour that merges too forms the final pair as the left of its own)
        before = self.prev[p]
        has_before = before >= 0
        left_pairs = self._ranked(self._keys(before[has_before], p[has_before]))  # (keys, ranks, merged)
        right_pairs = self._ranked((self.sym[p[has_after]] << 32) | after_before)
        if (left_pairs[1] <= r).any() or (right_pairs[1] <= r).any():
            self.sym[p], self.alive[q], self.nxt[p] = undo, True, q
            self.prev[after[has_after]] = q[has_after]
            return False
        self._file(before[has_before], *left_pairs)
        alone = (after != np.append(p[1:], -1))[has_after]  # a right neighbour that merges is the next p
        self._file(p[has_after][alone], *(part[alone] for part in right_pairs))
        return True

    def _mergeable(self, r: float):
        """(left positions [m], merged symbols [m]) of the pairs filed under rank r that are still there,
        left to right; of a chain of overlapping ones (each one's left symbol the previous one's right),
        every other from the first, as the heap takes them."""
        chunks = self.filed.pop(r)
        left, keys, merged = chunks[0] if len(chunks) == 1 else map(np.concatenate, zip(*chunks))
        right = self.nxt[left]
        there = self.alive[left] & (right >= 0)
        there[there] = self._keys(left[there], right[there]) == keys[there]
        order = np.argsort(left[there], kind="stable")
        left, merged = left[there][order], merged[there][order]
        chained = np.zeros(len(left), dtype=bool)
        chained[1:] = left[1:] == self.nxt[left[:-1]]
        steps = np.arange(len(left))
        take = (steps - np.maximum.accumulate(np.where(chained, 0, steps))) % 2 == 0
        return left[take], merged[take]

    def _file(self, left, keys, ranks, merged):
        """File the pairs at positions `left` under their ranks (pairs without one are dropped)."""
        ranked = np.flatnonzero(ranks < np.inf)
        ranked = ranked[np.argsort(ranks[ranked], kind="stable")]
        ranks = ranks[ranked]
        starts = np.flatnonzero(ranks[1:] != ranks[:-1]) + 1
        for start, end in zip([0, *starts.tolist()], [*starts.tolist(), len(ranks)]):
            if start == end:
                break
            r, chunk = float(ranks[start]), ranked[start:end]
            if r not in self.filed:
                self.filed[r] = []
                heapq.heappush(self.pending, r)
            self.filed[r].append((left[chunk], keys[chunk], merged[chunk]))

    def _ranked(self, keys):
        """(keys, ranks, numbers of the merged symbols) of pairs given by key; rank inf for no merge."""
        if len(keys) < FEW_PAIRS:
            table = np.array([self._pair(key) for key in keys.tolist()], dtype=np.float64).reshape(-1, 2)
            return keys, table[:, 0], table[:, 1].astype(np.int64)
        distinct, inverse = np.unique(keys, return_inverse=True)
        table = np.array([self._pair(key) for key in distinct.tolist()], dtype=np.float64).reshape(-1, 2)
        return keys, table[inverse, 0], table[inverse, 1].astype(np.int64)

    def _pair(self, key: int) -> tuple[float, int]:
        if key not in self.pairs:
            a, b = self.names[key >> 32], self.names[key & 0xFFFFFFFF]
            r = self.rank(a, b)
            self.pairs[key] = (np.inf, -1) if r is None else (r, self._number(a + b))
        return self.pairs[key]

    def _keys(self, left, right):
        return (self.sym[left] << 32) | self.sym[right]

    def _number(self, symbol: str) -> int:
        if symbol not in self.index:
            self.index[symbol] = len(self.names)
            self.names.append(symbol)
        return self.index[symbol]

    def _symbols(self) -> list[str]:
        return [self.names[i] for i in self.sym[self.alive].tolist()]
