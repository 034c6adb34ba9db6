"""Byte-level BPE, read from a GGUF file's `tokenizer.ggml.*` metadata (`tokenizer.ggml.model == "gpt2"`).

encode: split out special tokens -> pre-tokenize with the regexes the file's `tokenizer.ggml.pre` names
-> UTF-8 bytes of each piece as printable characters (GPT-2's byte table) -> merge adjacent symbols,
lowest merge rank first -> token ids. decode: ids -> bytes -> UTF-8 text. docs/tokenizer.md walks through it.

References: GPT-2 `encoder.py` (bytes_to_unicode, BPE by rank); llama.cpp `src/llama-vocab.cpp`
(the regexes per pre-tokenizer name, special-token partition, token types); HF `tokenizers`
(ByteLevel, Digits), the test oracle.
"""

from __future__ import annotations

import codecs
import functools
import heapq
import operator
from collections.abc import Iterable, Iterator

import numpy as np
import regex

from .errors import TokenError, TokenizerError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TOKEN_TYPES = frozenset({0, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE})
# Tokens matched as whole strings before pre-tokenization, as in llama.cpp's tokenizer_st_partition.
# User-defined tokens are split out always (so are HF's non-special added tokens); control and unknown
# tokens only when the caller allows special tokens.
SPECIAL_TYPES = frozenset({CONTROL, UNKNOWN, USER_DEFINED})
ALWAYS_SPLIT_TYPES = frozenset({USER_DEFINED})

# GPT-2's pre-tokenizer regex as llama.cpp writes it. HF's ByteLevel adds a final `|\s+`; it changes
# nothing here, because _split_isolated keeps unmatched text as its own piece, which is exactly the
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


class Tokenizer:
    """Byte-level BPE: text <-> token ids with the vocabulary, merges and pre-tokenizer of a model file."""

    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], pre: str = "default",
                 bos_id: int | None = None, eos_id: int | None = None, add_bos: bool = False,
                 add_eos: bool = False):
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                                 f"expected one of {sorted(PRE_TOKENIZERS)}")
        if len(token_types) != len(tokens):
            raise TokenizerError(f"{len(token_types)} token types for {len(tokens)} tokens")
        for name, value in (("bos", bos_id), ("eos", eos_id)):
            if value is not None and not 0 <= value < len(tokens):
                raise TokenizerError(f"{name} token id {value} is outside the vocabulary [0, {len(tokens)})")
        for name, flag, value in (("bos", add_bos, bos_id), ("eos", add_eos, eos_id)):
            if flag and value is None:
                raise TokenizerError(f"add_{name}_token is true but the file has no {name}_token_id")
        self.tokens = tokens
        self.token_types = token_types
        self.pre = pre
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        # later duplicates win, as in llama.cpp's token_to_id
        self._ids = {text: i for i, text in enumerate(tokens)}
        self._ranks = _merge_ranks(merges, self._ids)
        self._pre_regexes = tuple(regex.compile(r) for r in PRE_TOKENIZERS[pre])
        self._bytes = [_token_bytes(text, kind) for text, kind in zip(tokens, token_types)]
        self._special_all = _special_regex(tokens, token_types, SPECIAL_TYPES)
        self._special_always = _special_regex(tokens, token_types, ALWAYS_SPLIT_TYPES)
        self._word_ids = functools.lru_cache(maxsize=BPE_CACHE_WORDS)(self._bpe_word)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> "Tokenizer":
        """Build from GGUF metadata: key -> value, strings as str, arrays as lists or numpy arrays."""
        model = _get(metadata, "tokenizer.ggml.model", str)
        if model != "gpt2":
            raise TokenizerError(f"tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
                                 "kvref reads byte-level BPE ('gpt2')")
        tokens = _string_list(metadata, "tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("tokenizer.ggml.tokens is empty")
        if "tokenizer.ggml.token_type" in metadata:
            token_types = _token_types(metadata["tokenizer.ggml.token_type"], len(tokens))
        else:
            token_types = [NORMAL] * len(tokens)
        return cls(
            tokens, token_types, _string_list(metadata, "tokenizer.ggml.merges"),
            pre=_get(metadata, "tokenizer.ggml.pre", str, "default"),
            bos_id=_get(metadata, "tokenizer.ggml.bos_token_id", int, None),
            eos_id=_get(metadata, "tokenizer.ggml.eos_token_id", int, None),
            add_bos=_get(metadata, "tokenizer.ggml.add_bos_token", bool, False),
            add_eos=_get(metadata, "tokenizer.ggml.add_eos_token", bool, False))

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_text(self, token_id: int) -> str:
        """The token as the vocabulary stores it: byte characters ("Ġthe"), control tokens as written."""
        return self.tokens[self._check_id(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for in decoded text (possibly part of a UTF-8 character)."""
        return self._bytes[self._check_id(token_id)]

    def encode(self, text: str, special: bool = False, add_special: bool = False) -> list[int]:
        """Token ids of `text`.

        special: control-token text such as "<|im_start|>" becomes its single id; otherwise it is
        tokenized as ordinary text (user-defined tokens are matched either way, as in llama.cpp).
        add_special: prepend BOS / append EOS where the file's add_bos_token / add_eos_token ask for it.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        ids = [self.bos_id] if add_special and self.add_bos else []
        for part in self._split_special(text, special):
            if isinstance(part, int):
                ids.append(part)
                continue
            for word in self._pre_tokenize(part):
                ids.extend(self._word_ids(word))
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; bytes that do not form UTF-8 become U+FFFD, as HF's ByteLevel decoder does."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def decode_stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield text as the ids arrive (e.g. from kvref.generate), never half a UTF-8 character."""
        decoder = StreamDecoder(self)
        for token_id in ids:
            piece = decoder.push(token_id)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail

    def _check_id(self, token_id) -> int:
        try:
            index = operator.index(token_id)
        except TypeError:
            raise TokenError(f"token id {token_id!r} is not an integer") from None
        if isinstance(token_id, (bool, np.bool_)) or not 0 <= index < len(self.tokens):
            raise TokenError(f"token id {token_id!r} is outside the vocabulary [0, {len(self.tokens)})")
        return index

    def _split_special(self, text: str, special: bool) -> list[str | int]:
        """Text pieces and special-token ids, in order. At each position the longest special token wins."""
        pattern = self._special_all if special else self._special_always
        if pattern is None:
            return [text] if text else []
        return [self._ids[piece] if matched else piece for piece, matched in _pieces(pattern, text)]

    def _pre_tokenize(self, text: str) -> list[str]:
        pieces = [text]
        for pattern in self._pre_regexes:
            pieces = [p for piece in pieces for p in _split_isolated(pattern, piece)]
        return pieces

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        """Ids of one pre-tokenized piece (called through the _word_ids cache)."""
        try:
            raw = word.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text has a lone surrogate {word[e.start]!r}, which is not UTF-8") from None
        symbols = _merge_by_rank(list(raw.decode("latin-1").translate(_LATIN1_TO_BYTE_CHAR)), self._ranks)
        try:
            return tuple(self._ids[s] for s in symbols)
        except KeyError as e:
            # Merges only produce vocabulary tokens, so a single byte is missing. HF and llama.cpp drop
            # it silently; kvref refuses rather than encode different text than it was given.
            byte = CHAR_TO_BYTE[e.args[0]]
            raise TokenizerError(f"cannot encode {word!r}: byte {byte:#04x} has no token in this "
                                 "vocabulary") from None


class StreamDecoder:
    """Token ids in, one at a time; text out, holding back the bytes of an incomplete UTF-8 character.

    The concatenation of every push() and the final flush() equals Tokenizer.decode of the same ids.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        # Python's incremental UTF-8 decoder buffers an incomplete tail and replaces invalid bytes
        # exactly as a one-shot decode does, which makes the concatenation equal decode()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text completed by this token ("" while a character is still incomplete)."""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """At the end of the ids: U+FFFD for bytes of a character that never completed, else ""."""
        return self._utf8.decode(b"", final=True)


def _merge_by_rank(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge adjacent symbols, lowest rank first and leftmost first among equal ranks (the order of
    HF tokenizers and llama.cpp). A heap of candidate pairs keeps long pieces (whitespace runs) fast."""
    n = len(symbols)
    nxt = [*range(1, n), -1] if n else []
    prev = list(range(-1, n - 1))
    heap = []

    def push_pair(left):
        right = nxt[left]
        if right != -1:
            rank = ranks.get((symbols[left], symbols[right]))
            if rank is not None:
                heapq.heappush(heap, (rank, left, symbols[left], symbols[right]))

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


def _split_isolated(pattern, text: str) -> list[str]:
    """Matches and the text between them, each as its own piece (llama.cpp's unicode_regex_split,
    HF's Split behavior "isolated")."""
    return [piece for piece, _ in _pieces(pattern, text)]


def _pieces(pattern, text: str) -> list[tuple[str, bool]]:
    """(piece, is_match) for every match of `pattern` and every stretch of text between them, in order."""
    pieces, start = [], 0
    for match in pattern.finditer(text):
        if match.start() > start:
            pieces.append((text[start:match.start()], False))
        pieces.append((match.group(), True))
        start = match.end()
    if start < len(text):
        pieces.append((text[start:], False))
    return pieces


def _merge_ranks(merges: list[str], ids: dict[str, int]) -> dict[tuple[str, str], int]:
    """"left right" strings -> {(left, right): rank}; rank = position in the list."""
    ranks = {}
    for rank, merge in enumerate(merges):
        # split at the first space after the first character, as llama.cpp does
        cut = merge.find(" ", 1)
        left, right = (merge[:cut], merge[cut + 1:]) if cut != -1 else (merge, "")
        if not right or left not in ids or right not in ids or left + right not in ids:
            raise TokenizerError(f"merge {rank} {merge!r} is not 'left right' with both sides and their "
                                 "concatenation in the vocabulary")
        ranks.setdefault((left, right), rank)
    return ranks


def _token_bytes(text: str, token_type: int) -> bytes:
    """What a token decodes to: special tokens are plain text; the others are byte characters. A token
    with a character outside the byte table decodes as its own UTF-8, as in HF's ByteLevel decoder."""
    if token_type in SPECIAL_TYPES:
        return text.encode("utf-8")
    try:
        return bytes([CHAR_TO_BYTE[c] for c in text])
    except KeyError:
        return text.encode("utf-8")


def _special_regex(tokens: list[str], token_types: list[int], types: frozenset):
    """One alternation of the special tokens of these types, longest first so it wins at a position."""
    texts = sorted({t for t, kind in zip(tokens, token_types) if kind in types and t}, key=len, reverse=True)
    return regex.compile("|".join(regex.escape(t) for t in texts)) if texts else None


def _get(metadata: dict, key: str, kind: type, default=...):
    """A scalar metadata value of the expected kind (numpy scalars accepted)."""
    if key not in metadata:
        if default is ...:
            raise TokenizerError(f"GGUF metadata has no {key}")
        return default
    value = metadata[key]
    if kind is bool and isinstance(value, (bool, np.bool_)):
        return bool(value)
    if kind is int and isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    if kind is str and isinstance(value, str):
        return str(value)
    raise TokenizerError(f"{key} should be of type {kind.__name__}, got {value!r}")


def _string_list(metadata: dict, key: str) -> list[str]:
    if key not in metadata:
        raise TokenizerError(f"GGUF metadata has no {key}")
    values = metadata[key]
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, np.ndarray)):
        raise TokenizerError(f"{key} should be an array of strings, got {type(values).__name__}")
    strings = [str(v) for v in values if isinstance(v, str)]
    if len(strings) != len(values):
        raise TokenizerError(f"{key} should hold only strings")
    return strings


def _token_types(values, n_tokens: int) -> list[int]:
    types = np.asarray(values)
    if types.shape != (n_tokens,) or types.dtype.kind not in "iu":
        raise TokenizerError(f"tokenizer.ggml.token_type should be {n_tokens} integers (one per token), "
                             f"got shape {types.shape} of {types.dtype}")
    unknown = set(np.unique(types).tolist()) - TOKEN_TYPES
    if unknown:
        raise TokenizerError(f"tokenizer.ggml.token_type has unknown values {sorted(unknown)}; "
                             f"expected {sorted(TOKEN_TYPES)}")
    return types.tolist()
