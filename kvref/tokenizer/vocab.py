"""The vocabulary's words: token types, the text -> id map, merge ranks."""

from __future__ import annotations

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


def merge_ranks(merges: Iterable[tuple[str, str]], ids: dict[str, int],
                tokens: list[str]) -> dict[tuple[str, str], int]:
    """(left, right) pairs -> {(left, right): rank}; rank = position in the list. A merge must join two
    vocabulary tokens into a third, or BPE would produce ids that mean nothing. The pairs hold the
    vocabulary's own strings (tokens[id]), not the merge's copies: ~50,000 merges would otherwise keep
    ~100,000 more strings alive."""
    ranks = {}
    for rank, (left, right) in enumerate(merges):
        if not left or not right or left not in ids or right not in ids or left + right not in ids:
            raise TokenizerError(f"merge {rank} {left!r} + {right!r} should join two vocabulary tokens "
                                 "into a third")
        ranks.setdefault((tokens[ids[left]], tokens[ids[right]]), rank)
    return ranks
