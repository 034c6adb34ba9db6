"""Tokenizer: one API over the model types (byte-level BPE, SentencePiece-style BPE).

encode: split out special tokens -> each stretch of text between them goes to the model type's
encoder (kvref.text.bytelevel, kvref.text.sentencepiece) -> ids. decode: each token's
bytes, joined, as UTF-8. The readers build a Tokenizer from a GGUF file's metadata
(kvref.text.gguf) or a Hugging Face tokenizer.json (kvref.text.hf). docs/tokenizer.md
walks through it.
"""

from __future__ import annotations

import array
import codecs
import operator
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import regex

from ..errors import TokenError, TokenizerError
from . import gguf, hf
from .pieces import pieces
from .vocab import ALWAYS_SPLIT_TYPES, SPECIAL_TYPES, TokenTexts, packed, texts_of_types


class Tokenizer:
    """Text <-> token ids with a model file's vocabulary and model type.

    model: the model type's encoder, with .ids (token text -> id, of every token encoding looks up),
    .encode(text, first), .token_bytes(text, token_type), .strip_leading_space and .pre (the
    pre-tokenizer's name, None for SentencePiece-style models). eos_ids: every id that ends
    generation; eos_id is always one. .tokens: the token texts by id (a TokenTexts, read as a list);
    .token_types: their types, a byte each.
    """

    def __init__(self, tokens: list[str], token_types: list[int], model, bos_id: int | None = None,
                 eos_id: int | None = None, add_bos: bool = False, add_eos: bool = False,
                 eos_ids: Iterable[int] = ()):
        if len(token_types) != len(tokens):
            raise TokenizerError(f"{len(token_types)} token types for {len(tokens)} tokens")
        for name, value in (("bos", bos_id), ("eos", eos_id), *(("end-of-generation", i) for i in eos_ids)):
            if value is not None and not 0 <= value < len(tokens):
                raise TokenizerError(f"{name} token id {value} is outside the vocabulary [0, {len(tokens)})")
        for name, flag, value in (("bos", add_bos, bos_id), ("eos", add_eos, eos_id)):
            if flag and value is None:
                raise TokenizerError(f"add_{name}_token is true but the file has no {name}_token_id")
        self.tokens = TokenTexts(tokens)
        try:
            self.token_types = array.array("B", token_types)  # [V] a byte each
        except (OverflowError, TypeError):
            raise TokenizerError("token types should be llama.cpp's token type numbers, 0..6") from None
        self.model = model
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = frozenset({*eos_ids, *([] if eos_id is None else [eos_id])})
        self.add_bos = add_bos
        self.add_eos = add_eos
        # every token's bytes in one bytes object (~2 MB fewer for a vocabulary of 50,000)
        self._bytes, self._bytes_ends = packed([model.token_bytes(t, kind) for t, kind in zip(tokens, token_types)])
        self._special_all = _special_regex(texts_of_types(tokens, token_types, SPECIAL_TYPES))
        self._special_always = _special_regex(texts_of_types(tokens, token_types, ALWAYS_SPLIT_TYPES))

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> "Tokenizer":
        """Build from GGUF metadata: key -> value, strings as str, arrays as lists or numpy arrays."""
        return cls(**gguf.tokenizer_parts(metadata))

    @classmethod
    def from_hf_directory(cls, directory) -> "Tokenizer | None":
        """Build from a Hugging Face checkpoint directory's tokenizer.json, tokenizer_config.json and
        generation_config.json; None when it has no tokenizer.json."""
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            return None
        return cls(**hf.tokenizer_parts(directory))

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def pre(self) -> str | None:
        """The pre-tokenizer's name for byte-level BPE (tokenizer.ggml.pre); None for SentencePiece."""
        return self.model.pre

    def token_text(self, token_id: int) -> str:
        """The token as the vocabulary stores it ("Ġthe", "▁the", "<0x0A>"), control tokens as written."""
        return self.tokens[self._check_id(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for in decoded text (possibly part of a UTF-8 character)."""
        i = self._check_id(token_id)
        return self._bytes[self._bytes_ends[i]:self._bytes_ends[i + 1]]

    def encode(self, text: str, special: bool = False, add_special: bool = False) -> list[int]:
        """Token ids of `text`.

        special: control-token text such as "<|im_start|>" becomes its single id; otherwise it is
        tokenized as ordinary text (user-defined tokens are matched either way, as in llama.cpp).
        add_special: prepend BOS / append EOS where the file's add_bos_token / add_eos_token ask for it.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        ids = [self.bos_id] if add_special and self.add_bos else []
        for index, part in enumerate(self._split_special(text, special)):
            if isinstance(part, int):
                ids.append(part)
            else:
                ids.extend(self.model.encode(part, first=index == 0))
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, decoded from the start of a text (a SentencePiece model that prepends a space
        drops it again); bytes that do not form UTF-8 become U+FFFD, as HF's decoders do."""
        return "".join(self.decode_stream(ids))

    def decode_stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield text as the ids arrive (e.g. from kvref.generate), never half a UTF-8 character."""
        if (isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable)
                or (isinstance(ids, np.ndarray) and ids.ndim != 1)):
            raise TokenError(f"decode takes an iterable of token ids, got {type(ids).__name__}")
        return self._decode_stream(ids)

    def _decode_stream(self, ids):
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
        if isinstance(token_id, (bool, np.bool_)) or not 0 <= index < self.vocab_size:
            raise TokenError(f"token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})")
        return index

    def _split_special(self, text: str, special: bool) -> list[str | int]:
        """Text pieces and special-token ids, in order. At each position the longest special token wins."""
        pattern = self._special_all if special else self._special_always
        if pattern is None:
            return [text] if text else []
        return [self.model.ids[piece] if matched else piece for piece, matched in pieces(pattern, text)]


class StreamDecoder:
    """Token ids in, one at a time; text out, holding back the bytes of an incomplete UTF-8 character.

    The concatenation of every push() and the final flush() equals Tokenizer.decode of the same ids.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        # Python's incremental UTF-8 decoder buffers an incomplete tail and replaces invalid bytes
        # exactly as a one-shot decode does, which makes the concatenation equal decode()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # the space a SentencePiece model prepended when encoding, still to be dropped
        self._strip_space = tokenizer.model.strip_leading_space

    def push(self, token_id: int) -> str:
        """The text completed by this token ("" while a character is still incomplete)."""
        data = self.tokenizer.token_bytes(token_id)
        if self._strip_space and data:
            self._strip_space = False
            data = data[1:] if data.startswith(b" ") else data
        return self._utf8.decode(data)

    def flush(self) -> str:
        """At the end of the ids: U+FFFD for bytes of a character that never completed, else ""."""
        return self._utf8.decode(b"", final=True)


def _special_regex(texts: set[str]):
    """One alternation of these special tokens' texts, longest first so it wins at a position."""
    texts = sorted(texts - {""}, key=len, reverse=True)
    return regex.compile("|".join(regex.escape(t) for t in texts)) if texts else None
