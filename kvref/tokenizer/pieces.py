"""What every model type shares: cutting text at regex matches, and merging adjacent symbols by rank."""

from __future__ import annotations

import heapq
from collections.abc import Callable


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


def merge_adjacent(symbols: list[str], rank: Callable[[str, str], float | None]) -> list[str]:
    """Merge adjacent symbols, the pair of lowest rank(left, right) first and the leftmost first among
    equal ranks, until no adjacent pair has a rank (None). Byte-level BPE ranks a pair by its position
    in the merges, SentencePiece by minus the score of the merged piece; the order of HF tokenizers and
    of llama.cpp's llm_tokenizer_bpe_session and llm_tokenizer_spm_session. A heap of candidate pairs
    keeps long pieces (whitespace runs, a whole SentencePiece fragment) O(n log n)."""
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
