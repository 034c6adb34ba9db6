"""The vocabulary's words: token types, the text -> id map, merge ranks."""

from __future__ import annotations

import array
from collections.abc import Iterable

from ..errors import TokenizerError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type); a tokenizer.json maps onto them
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TOKEN_TYPES = frozenset({0, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE})
# Tokens matched as whole strings before anything else, as in llama.cpp's tokenizer_st_partition.
# User-defined tokens are split out always (so are HF's non-special added tokens); control and unknown
# tokens only when the caller allows special tokens.
SPECIAL_TYPES = frozenset({CONTROL, UNKNOWN, USER_DEFINED})
ALWAYS_SPLIT_TYPES = frozenset({USER_DEFINED})


def token_ids(tokens: list[str]) -> dict[str, int]:
    """Token text -> id; later duplicates win, as in llama.cpp's token_to_id."""
    return {text: i for i, text in enumerate(tokens)}


class MergeRanks:
    """The merges of a BPE vocabulary, in list order: rank(left, right) is the position of the first
    merge joining left and right, None when no merge joins them. A merge must join two vocabulary
    tokens into a third, or BPE would produce ids that mean nothing.

    Stored per merged token, in two int32 arrays indexed by its id: the rank, and the length of the
    left part (which tells the merge from other splits of the same text); a token that merges of two
    different splits produce keeps the later splits in a dict. ~50,000 merges take ~0.4 MB this way,
    against ~6.5 MB as a dict of (left, right) string pairs and rank ints.
    """

    def __init__(self, merges: Iterable[tuple[str, str]], ids: dict[str, int], n_tokens: int):
        self._ids = ids
        self._rank = array.array("i", [0]) * n_tokens
        self._left = array.array("i", [0]) * n_tokens  # 0: no merge makes this token (a left part is never empty)
        self._other = {}
        for rank, (left, right) in enumerate(merges):
            if not left or not right or left not in ids or right not in ids or left + right not in ids:
                raise TokenizerError(f"merge {rank} {left!r} + {right!r} should join two vocabulary tokens "
                                     "into a third")
            merged = ids[left + right]
            if self._left[merged] == 0:
                self._rank[merged], self._left[merged] = rank, len(left)
            elif self._left[merged] != len(left):
                self._other.setdefault((left, right), rank)

    def rank(self, left: str, right: str) -> int | None:
        merged = self._ids.get(left + right)
        if merged is None:
            return None
        if self._left[merged] == len(left):
            return self._rank[merged]
        return self._other.get((left, right))
