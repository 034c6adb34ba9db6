"""The parts of a Tokenizer from a GGUF file's `tokenizer.ggml.*` metadata, as llama.cpp reads it.

`tokenizer.ggml.model`: "gpt2" is byte-level BPE with the pre-tokenizer `tokenizer.ggml.pre`
names; "llama" is SentencePiece: token scores, `<0xNN>` byte tokens, a space prefix when
`tokenizer.ggml.add_space_prefix` says so (default: yes). What the file leaves out, kvref assumes as
llama.cpp's llama_vocab::load does: pre "default", BOS added for "llama" and "llama-bpe" files.
"""

from __future__ import annotations

import numpy as np

from ..errors import TokenizerError
from .bytelevel import PRE_TOKENIZERS, ByteLevelBPE
from .sentencepiece import SentencePieceBPE
from .vocab import CONTROL, NORMAL, SPECIAL_TYPES, TOKEN_TYPES, texts_of_types

MODELS = ("gpt2", "llama")
# Control tokens that end a turn although the file does not name them: llama.cpp finds them by their
# text (llama_vocab::load, "special_eog_ids"), so a chat stops at Gemma's <end_of_turn> as it does there.
END_OF_TURN_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                               "<|endoftext|>", "<|end_of_text|>", "<EOT>"})


def tokenizer_parts(metadata: dict) -> dict:
    """Tokenizer's constructor arguments."""
    model = _get(metadata, "tokenizer.ggml.model", str)
    if model not in MODELS:
        raise TokenizerError(f"tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
                             f"kvref reads {MODELS} (byte-level BPE, SentencePiece)")
    tokens = _string_list(metadata, "tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("tokenizer.ggml.tokens is empty")
    if "tokenizer.ggml.token_type" in metadata:
        token_types = _token_types(metadata["tokenizer.ggml.token_type"], len(tokens))
    else:
        token_types = [NORMAL] * len(tokens)
    pre = _get(metadata, "tokenizer.ggml.pre", str, "default")
    if model == "gpt2":
        encoder = _byte_level(metadata, tokens, texts_of_types(tokens, token_types, SPECIAL_TYPES), pre)
    else:
        encoder = SentencePieceBPE(
            tokens, token_types, scores=_scores(metadata, len(tokens)),
            space_prefix="every" if _get(metadata, "tokenizer.ggml.add_space_prefix", bool, True) else "never",
            unk_id=_token_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens)))
    eos_id = _get(metadata, "tokenizer.ggml.eos_token_id", int, None)
    return dict(
        tokens=tokens, token_types=token_types, model=encoder,
        bos_id=_get(metadata, "tokenizer.ggml.bos_token_id", int, None), eos_id=eos_id,
        add_bos=_get(metadata, "tokenizer.ggml.add_bos_token", bool, model == "llama" or pre == "llama-bpe"),
        add_eos=_get(metadata, "tokenizer.ggml.add_eos_token", bool, False),
        eos_ids=_end_of_generation_ids(metadata, tokens, token_types))


def _byte_level(metadata: dict, tokens: list[str], specials: set[str], pre: str) -> ByteLevelBPE:
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                             f"expected one of {sorted(PRE_TOKENIZERS)}")
    # a generator: each split pair lives only until MergeRanks has read it
    merges = (merge_pair(m) for m in _string_list(metadata, "tokenizer.ggml.merges"))
    # llama.cpp takes a word that is a token whole for Llama 3 (its tokenizer.json's ignore_merges)
    return ByteLevelBPE(tokens, merges, PRE_TOKENIZERS[pre], pre, ignore_merges=pre == "llama-bpe", specials=specials)


def merge_pair(merge: str) -> tuple[str, str]:
    """"left right" -> (left, right), cut at the first space after the first character, as llama.cpp does."""
    cut = merge.find(" ", 1)
    return (merge[:cut], merge[cut + 1:]) if cut != -1 else (merge, "")


def _end_of_generation_ids(metadata: dict, tokens: list[str], token_types: list[int]) -> set[int]:
    """EOT and EOM ids the file names, and control tokens with an end-of-turn text."""
    named = (_token_id(metadata, f"tokenizer.ggml.{key}_token_id", len(tokens)) for key in ("eot", "eom"))
    by_text = (i for i, (text, kind) in enumerate(zip(tokens, token_types))
               if kind == CONTROL and text in END_OF_TURN_TEXTS)
    return {i for i in (*named, *by_text) if i is not None}


def _token_id(metadata: dict, key: str, n_tokens: int) -> int | None:
    value = _get(metadata, key, int, None)
    if value is not None and not 0 <= value < n_tokens:
        raise TokenizerError(f"{key} = {value} is outside the vocabulary [0, {n_tokens})")
    return value


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
    token_types = types.tolist()
    unknown = set(token_types) - TOKEN_TYPES  # not np.unique, which imports numpy.ma (~1.3 MiB resident)
    if unknown:
        raise TokenizerError(f"tokenizer.ggml.token_type has unknown values {sorted(unknown)}; "
                             f"expected {sorted(TOKEN_TYPES)}")
    return token_types


def _scores(metadata: dict, n_tokens: int) -> np.ndarray:
    if "tokenizer.ggml.scores" not in metadata:
        raise TokenizerError("GGUF metadata has no tokenizer.ggml.scores (a SentencePiece model merges by them)")
    scores = np.asarray(metadata["tokenizer.ggml.scores"])
    if scores.shape != (n_tokens,) or scores.dtype.kind not in "iuf" or not np.isfinite(scores).all():
        raise TokenizerError(f"tokenizer.ggml.scores should be {n_tokens} finite numbers (one per token), "
                             f"got shape {scores.shape} of {scores.dtype}")
    return scores
