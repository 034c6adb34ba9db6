"""The vocabulary's words: token types, the token texts, the text -> id map, merge ranks."""

from __future__ import annotations

import array
import itertools
from collections.abc import Collection, Iterable, Iterator, Sequence

import numpy as np

from ..errors import TokenizerError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type); a tokenizer.json maps onto them
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TOKEN_TYPES = frozenset({0, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE})
# Tokens matched as whole strings before anything else, as in llama.cpp's tokenizer_st_partition.
# User-defined tokens are split out always (so are HF's non-special added tokens); control and unknown
# tokens only when the caller allows special tokens.
SPECIAL_TYPES = frozenset({CONTROL, UNKNOWN, USER_DEFINED})
ALWAYS_SPLIT_TYPES = frozenset({USER_DEFINED})


def packed(pieces: list[bytes]) -> tuple[bytes, array.array]:
    """Byte strings as one bytes object and where each ends: piece i is at [ends[i], ends[i + 1]). One
    object instead of one per piece (~40 bytes each); the ends 4 bytes each below 4 GiB."""
    joined = b"".join(pieces)
    ends = itertools.accumulate(map(len, pieces), initial=0)  # [n + 1]
    return joined, array.array("I" if len(joined) < 2**32 else "q", ends)


class TokenTexts(Sequence):
    """The token texts by id, as the list of str they come from reads them (len, [i], iteration), held
    as one bytes object: token i's UTF-8 at [ends[i], ends[i + 1]). ~9 bytes a token beside its text,
    against ~60-100 for a str object and a list slot: 128,256 tokens take ~2 MB instead of ~9."""

    def __init__(self, tokens: list[str]):
        # surrogatepass: a tokenizer.json may hold a lone surrogate, which comes back as it was
        self._utf8, self._ends = packed([t.encode("utf-8", "surrogatepass") for t in tokens])
        self._n = len(tokens)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> str:
        if not -self._n <= i < self._n:
            raise IndexError(f"token id {i} is outside the vocabulary [0, {self._n})")
        if i < 0:
            i += self._n
        return self._utf8[self._ends[i]:self._ends[i + 1]].decode("utf-8", "surrogatepass")

    def __iter__(self) -> Iterator[str]:
        return map(self.__getitem__, range(self._n))


def texts_of_types(tokens: Sequence[str], token_types: Sequence[int], types: Collection[int]) -> set[str]:
    """The texts of the tokens whose type is one of `types` (each text read only for those)."""
    wanted = np.zeros(256, dtype=bool)  # [type] one of `types`
    wanted[list(types)] = True
    return {tokens[i] for i in np.flatnonzero(wanted[np.asarray(token_types, dtype=np.uint8)]).tolist()}


def token_ids(tokens: list[str]) -> dict[str, int]:
    """Token text -> id; later duplicates win, as in llama.cpp's token_to_id."""
    return {text: i for i, text in enumerate(tokens)}


class MergeRanks:
    """The merges of a BPE vocabulary, in list order: rank(left, right) is the position of the first
    merge joining left and right, None when no merge joins them. A merge must join two vocabulary
    tokens into a third, or BPE would produce ids that mean nothing.

    Stored per merged token, in int32 arrays indexed by its id: the rank and the length of the left
    part (which tells the merge from other splits of the same text) of the first merge making it. A
    token that merges of other splits make too chains them, three int32 each (left length, rank, next):
    a vocabulary converted from tiktoken's lists every split of a token into two tokens (Llama 3: 280,147
    merges for 128,000 tokens), ~150,000 such merges that a dict of (left, right) string pairs would
    hold at ~290 bytes each. ~50,000 merges take ~0.6 MB this way, against ~6.5 MB as a dict of pairs.
    """

    def __init__(self, merges: Iterable[tuple[str, str]], ids: dict[str, int], n_tokens: int):
        self._ids = ids
        self._rank = array.array("i", [0]) * n_tokens
        self._left = array.array("i", [0]) * n_tokens  # 0: no merge makes this token (a left part is never empty)
        self._later = array.array("i", [-1]) * n_tokens  # the token's first chained split, -1: none
        # the chained splits: left length, rank, the next split of the same token (-1: none)
        self._later_left, self._later_rank, self._later_next = array.array("i"), array.array("i"), array.array("i")
        for rank, (left, right) in enumerate(merges):
            if not left or not right or left not in ids or right not in ids or left + right not in ids:
                raise TokenizerError(f"merge {rank} {left!r} + {right!r} should join two vocabulary tokens "
                                     "into a third")
            merged = ids[left + right]
            if self._left[merged] == 0:
                self._rank[merged], self._left[merged] = rank, len(left)
            elif self._left[merged] != len(left) and self._later_split(merged, len(left)) is None:
                self._later_left.append(len(left))
                self._later_rank.append(rank)
                self._later_next.append(self._later[merged])
                self._later[merged] = len(self._later_left) - 1

    def rank(self, left: str, right: str) -> int | None:
        merged = self._ids.get(left + right)
        if merged is None:
            return None
        if self._left[merged] == len(left):
            return self._rank[merged]
        return self._later_split(merged, len(left))

    def narrow(self, tokens: list[str], keep: Collection[str]) -> dict[str, int]:
        """The entries of the text -> id map this was built with (from `tokens`) that BPE by these
        merges looks up, and `keep`; rank() reads that map from now on. A word starts as single
        characters, and only a merge makes a longer symbol: any other token (llama.cpp's [PAD]
        fillers, a file's unused ids) is looked up by nothing, and each leaves out ~150 bytes of str,
        int and dict entry. A merge's token is the id the map gives its text (a later duplicate)."""
        ids = self._ids
        made = np.flatnonzero(np.frombuffer(self._left, dtype=np.int32))  # ids of tokens merges make
        single = np.flatnonzero(np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens)) == 1)
        self._ids = {tokens[i]: i for i in made.tolist()}
        self._ids.update((text, ids[text]) for text in (*(tokens[i] for i in single.tolist()), *keep))
        return self._ids

    def _later_split(self, merged: int, left_length: int) -> int | None:
        split = self._later[merged]
        while split != -1:
            if self._later_left[split] == left_length:
                return self._later_rank[split]
            split = self._later_next[split]
        return None
