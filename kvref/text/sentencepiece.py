"""SentencePiece-style BPE (Llama 2, Mistral, TinyLlama, Gemma): spaces as "▁", merges over Unicode
characters, bytes only as a fallback.

A stretch of text between special tokens gets "▁" prepended (when the model says so), every space
becomes "▁", and the characters are merged pairwise: from a GGUF file (`tokenizer.ggml.model =
llama`) the pair whose concatenation is the vocabulary token of highest *score* goes first
(llama.cpp's llm_tokenizer_spm_session: any vocabulary token may be formed); from a tokenizer.json
the pair of lowest *rank* in its merges (HF's BPE, which is what HF converts SentencePiece models
to). Ties: leftmost first, in both. A final symbol that is no token is spelled with the byte
tokens `<0xNN>` of its UTF-8 bytes (byte fallback), else it is the unknown token.

Decoding: "▁" -> space, a byte token -> its byte, control and user-defined tokens as written; when
the model prepends "▁", the text decoded from the start drops its first space (llama.cpp's
token_to_piece lstrip, HF's Metaspace / Strip decoders).
"""

from __future__ import annotations

import array
import functools
import unicodedata

import numpy as np

from ..errors import TokenizerError
from .pieces import merge_adjacent
from .vocab import BYTE, NORMAL, SPECIAL_TYPES, UNUSED, MergeRanks, texts_of_types, token_ids

SPACE = "\u2581"  # "▁", SentencePiece's visible space
# when a stretch of text between special tokens gets SPACE prepended:
#   "every"  each one (llama.cpp's add_space_prefix; HF's Prepend normalizer)
#   "always" each one that does not start with a space (HF's Metaspace, prepend_scheme "always")
#   "first"  the one at the start of the input, unless it starts with a space (Metaspace "first")
#   "never"  none (Gemma)
SPACE_PREFIXES = ("every", "always", "first", "never")
WORD_CACHE = 1 << 14  # distinct words (Metaspace split=True) or fragments whose ids are remembered


class SentencePieceBPE:
    """Text -> ids over characters with "▁" for spaces. Exactly one of `scores` (one per token: merge
    by the score of the merged piece) or `merges` (pairs, merge by rank) is given. split_words: cut
    before each "▁" first (HF's Metaspace split=True). unk_id: the token of a character whose bytes
    have no byte tokens; fuse_unk: consecutive unknown characters are one unknown token (HF). By
    merges and without ignore_merges, .ids holds only what encoding looks up (MergeRanks.narrow: the
    special tokens, which the Tokenizer splits out, among them); by scores any token can be formed."""

    def __init__(self, tokens: list[str], token_types: list[int], *, scores=None, merges=None,
                 space_prefix: str = "every", split_words: bool = False, nfc: bool = False,
                 unk_id: int | None = None, fuse_unk: bool = False, ignore_merges: bool = False):
        if (scores is None) == (merges is None):
            raise TokenizerError("a SentencePiece-style model merges by scores or by merges: give one")
        if space_prefix not in SPACE_PREFIXES:
            raise TokenizerError(f"space prefix {space_prefix!r} should be one of {SPACE_PREFIXES}")
        self.ids = token_ids(tokens)
        self.pre = None
        self.space_prefix = space_prefix
        self.strip_leading_space = space_prefix != "never"
        self._split_words = split_words
        self._nfc = nfc
        self._unk_id = unk_id
        self._fuse_unk = fuse_unk
        self._ignore_merges = ignore_merges
        self._byte_ids = _byte_ids(tokens, token_types)
        if scores is not None:
            self._rank = self._score_rank(scores)
        else:
            ranks = MergeRanks(merges, self.ids, len(tokens))
            if not ignore_merges:  # else a word may be any token whole
                self.ids = ranks.narrow(tokens, texts_of_types(tokens, token_types, SPECIAL_TYPES))
            self._rank = ranks.rank
        self._word_ids = functools.lru_cache(maxsize=WORD_CACHE)(self._encode_word)

    def encode(self, text: str, first: bool) -> list[int]:
        """Ids of a stretch of text between special tokens; `first`: it starts the input."""
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        text = self._with_prefix(text.replace(" ", SPACE), first)
        return [i for word in self._words(text) for i in self._word_ids(word)]

    def token_bytes(self, text: str, token_type: int) -> bytes:
        if token_type == BYTE:
            return bytes([int(text[3:5], 16)])
        if token_type in (NORMAL, UNUSED):
            return text.replace(SPACE, " ").encode("utf-8")
        return text.encode("utf-8")  # control, user-defined and unknown tokens: as written (llama.cpp)

    def _with_prefix(self, text: str, first: bool) -> str:
        if self.space_prefix == "every" or (
                not text.startswith(SPACE) and (self.space_prefix == "always" or self.space_prefix == "first" and first)):
            return SPACE + text
        return text

    def _words(self, text: str) -> list[str]:
        if not self._split_words:
            return [text] if text else []
        # Metaspace split: each word starts at a "▁" (HF's MergedWithNext)
        starts = [0, *(i for i, c in enumerate(text) if c == SPACE and i > 0)]
        return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]

    def _score_rank(self, scores):
        """llama.cpp's SPM order: a pair ranks by minus the score of the token it forms, if any."""
        # a float64 array: 8 bytes a token, not a float object and a list slot (32); the same values
        ids, scores = self.ids, array.array("d", np.asarray(scores, dtype=np.float64).tobytes())

        def rank(a, b):
            merged = ids.get(a + b)
            return None if merged is None else -scores[merged]
        return rank

    def _encode_word(self, word: str) -> tuple[int, ...]:
        try:
            word.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text has a lone surrogate {word[e.start]!r}, which is not UTF-8") from None
        if self._ignore_merges and word in self.ids:
            return (self.ids[word],)
        ids = []
        for symbol in merge_adjacent(list(word), self._rank):
            if symbol in self.ids:
                ids.append(self.ids[symbol])
            else:
                ids.extend(self._fallback(symbol, ids))
        return tuple(ids)

    def _fallback(self, symbol: str, done: list[int]) -> list[int]:
        """A symbol that is no token: its byte tokens, else the unknown token."""
        raw = symbol.encode("utf-8")
        if all(b in self._byte_ids for b in raw):
            return [self._byte_ids[b] for b in raw]
        if self._unk_id is None:
            raise TokenizerError(f"cannot encode {symbol!r}: it is no token, its bytes have no byte tokens "
                                 "and the vocabulary has no unknown token")
        if self._fuse_unk and done and done[-1] == self._unk_id:
            return []
        return [self._unk_id]


def _byte_ids(tokens: list[str], token_types: list[int]) -> dict[int, int]:
    """byte -> id of its `<0xNN>` token (token type BYTE)."""
    byte_ids = {}
    for i, (text, kind) in enumerate(zip(tokens, token_types)):
        if kind == BYTE:
            if len(text) != 6 or not text.startswith("<0x") or not text.endswith(">"):
                raise TokenizerError(f"byte token {i} {text!r} should be written <0xNN>")
            try:
                byte_ids.setdefault(int(text[3:5], 16), i)
            except ValueError:
                raise TokenizerError(f"byte token {i} {text!r} should be written <0xNN>") from None
    return byte_ids
