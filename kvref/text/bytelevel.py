"""Byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen): regex pre-tokenization, UTF-8 bytes as printable
characters, merges by rank.

A word (one piece of the pre-tokenizer's split) is encoded to UTF-8, each byte written as one
character of GPT-2's byte table, then adjacent symbols merged lowest rank first. References: GPT-2
`encoder.py` (bytes_to_unicode, BPE by rank); llama.cpp `src/llama-vocab.cpp` (the regexes per
`tokenizer.ggml.pre`); HF `tokenizers` (ByteLevel, Split, Digits), the test oracle.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Collection, Iterable

import regex

from ..errors import TokenizerError
from .pieces import merge_adjacent, split_isolated
from .vocab import SPECIAL_TYPES, MergeRanks, token_ids

# GPT-2's pre-tokenizer regex as llama.cpp writes it. HF's ByteLevel adds a final `|\s+`; it changes
# nothing here, because split_isolated keeps unmatched text as its own piece, which is exactly the
# single whitespace character that alternative would match.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

# tokenizer.ggml.pre -> regexes applied one after the other, each splitting every piece the previous
# one produced (llama.cpp's llm_tokenizer_bpe constructor). Absent key -> "default", as llama.cpp does.
PRE_TOKENIZERS = {
    # SmolLM, StarCoder: every digit alone, then GPT-2 on the rest (HF: Digits(individual) + ByteLevel)
    "smollm": (r"\p{N}", GPT2_REGEX),
    "gpt-2": (GPT2_REGEX,),
    # Llama 3: case-insensitive contractions, a letter run with at most one leading non-letter,
    # digits in groups of up to three, punctuation with its trailing newlines, newline runs
    "llama-bpe": (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    # Qwen 2, 2.5, 3: Llama 3's regex with every digit alone
    "qwen2": (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    # llama.cpp's fallback for files that name no pre-tokenizer
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"),
}

BPE_CACHE_WORDS = 1 << 16  # distinct pre-tokenized pieces whose ids are remembered


def _bytes_to_unicode() -> list[str]:
    """GPT-2's table, byte -> character: printable Latin-1 bytes stand for themselves, the other 68
    bytes (controls, space, 0x7F-0xA0, soft hyphen) take U+0100.. in byte order, so every token is
    visible text without spaces and `merges` can be written as "left right"."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = [], 0x100
    for byte in range(256):
        if byte in printable:
            table.append(chr(byte))
        else:
            table.append(chr(shifted))
            shifted += 1
    return table


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {char: byte for byte, char in enumerate(BYTE_TO_CHAR)}
# str.translate table from Latin-1 characters (= raw bytes) to the byte characters above
_LATIN1_TO_BYTE_CHAR = {byte: char for byte, char in enumerate(BYTE_TO_CHAR)}


class ByteLevelBPE:
    """Text -> ids by byte-level BPE. split_patterns: the pre-tokenizer, regexes applied in turn;
    pre: its name (tokenizer.ggml.pre, or "tokenizer.json"); nfc: NFC-normalize text first (HF's
    normalizer; llama.cpp normalizes nothing); ignore_merges: a word that is a token whole is that
    token (Llama 3's tokenizer.json, llama.cpp's llama-bpe); specials: the special tokens' texts, which
    the Tokenizer splits out and looks up in .ids. Without ignore_merges, .ids holds only what
    encoding looks up (MergeRanks.narrow)."""

    strip_leading_space = False

    def __init__(self, tokens: list[str], merges: Iterable[tuple[str, str]], split_patterns, pre: str,
                 nfc: bool = False, ignore_merges: bool = False, specials: Collection[str] = ()):
        self.ids = token_ids(tokens)
        self.pre = pre
        self._ranks = MergeRanks(merges, self.ids, len(tokens))
        if not ignore_merges:  # else a word may be any token whole
            self.ids = self._ranks.narrow(tokens, specials)
        self._patterns = tuple(_compile(p) for p in split_patterns)
        self._nfc = nfc
        self._ignore_merges = ignore_merges
        self._word_ids = functools.lru_cache(maxsize=BPE_CACHE_WORDS)(self._bpe_word)

    def encode(self, text: str, first: bool) -> list[int]:
        """Ids of a stretch of text between special tokens (`first`: it starts the input; byte-level
        BPE does not care)."""
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        return [i for word in split_isolated(self._patterns, text) for i in self._word_ids(word)]

    def token_bytes(self, text: str, token_type: int) -> bytes:
        """What a token decodes to: special tokens are plain text; the others are byte characters. A
        token with a character outside the byte table decodes as its own UTF-8, as in HF's ByteLevel
        decoder."""
        # ASCII text is its own bytes either way: printable ASCII characters stand for themselves in the
        # table, and a text with another one is outside it
        if token_type in SPECIAL_TYPES or text.isascii():
            return text.encode("utf-8")
        try:
            return bytes([CHAR_TO_BYTE[c] for c in text])
        except KeyError:
            return text.encode("utf-8")

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        """Ids of one pre-tokenized piece (called through the _word_ids cache)."""
        try:
            raw = word.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text has a lone surrogate {word[e.start]!r}, which is not UTF-8") from None
        chars = raw.decode("latin-1").translate(_LATIN1_TO_BYTE_CHAR)
        if self._ignore_merges and chars in self.ids:
            return (self.ids[chars],)
        symbols = merge_adjacent(list(chars), self._ranks.rank)
        try:
            return tuple(self.ids[s] for s in symbols)
        except KeyError as e:
            # Merges only produce vocabulary tokens, so a single byte is missing. HF and llama.cpp drop
            # it silently; kvref refuses rather than encode different text than it was given.
            byte = CHAR_TO_BYTE[e.args[0]]
            raise TokenizerError(f"cannot encode {word!r}: byte {byte:#04x} has no token in this "
                                 "vocabulary") from None


def _compile(pattern: str):
    try:
        return regex.compile(pattern)
    except regex.error as exc:
        raise TokenizerError(f"the pre-tokenizer's split pattern {pattern!r} is not a valid regex: {exc}") from None
