"""Small vocabularies trained with HF `tokenizers`, written where each oracle reads them: a
tokenizer.json directory (HF tokenizers, kvref.text.hf) or a GGUF file (transformers' GGUF
converter, llama.cpp, kvref.text.gguf). Test-only."""

import json

from kvref.formats.gguf import ValueType as V
from kvref.text import BYTE, CONTROL, NORMAL, UNKNOWN
from tests.conftest import require
from tests.gguf_writer import gguf_bytes

# text with what the tokenizers treat specially: spaces and their runs, newlines, tabs, digits,
# contractions, accents (composed and not), scripts, emoji, code
CORPUS_WORDS = ["The quick brown fox", "jumps over the lazy dog.", "12345", "2024", "3.14", "naïve", "café",
                "cafe\u0301", "Ångström", "Привет мир", "中文", "日本語", "한국어", "مرحبا", "😀", "don't",
                "I'LL", "def f(x):\n    return x ** 2\n", "  ", "\n\n", "\t", "hello   world"]
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
SPECIALS = ["<unk>", "<s>", "</s>"]


def corpus(rng, n=300):
    return [" ".join(rng.choice(CORPUS_WORDS, 8)) for _ in range(n)]


def trained_model(hf, corpus_lines, vocab_size, special_tokens=()) -> dict:
    """Train `hf` in place; its tokenizer.json model (vocab, merges as pairs)."""
    tokenizers = require("tokenizers")
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                             show_progress=False)
    hf.train_from_iterator(corpus_lines, trainer)
    return json.loads(hf.to_str())["model"]


def sentencepiece_bpe(rng, vocab_size=420):
    """A Llama 2-style vocabulary: <unk> <s> </s>, the 256 byte tokens, then merged pieces with "▁"
    for spaces. Returns (HF tokenizer with Llama 2's tokenizer.json pipeline, tokens)."""
    tokenizers = require("tokenizers")
    n, d = tokenizers.normalizers, tokenizers.decoders
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.normalizer = n.Sequence([n.Prepend("▁"), n.Replace(" ", "▁")])
    model = trained_model(hf, corpus(rng), vocab_size, SPECIALS + BYTE_TOKENS)
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    # rebuilt so the byte tokens are vocabulary tokens, not added tokens matched in text
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(model["vocab"], [tuple(m) for m in model["merges"]],
                                                    unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.normalizer = n.Sequence([n.Prepend("▁"), n.Replace(" ", "▁")])
    hf.decoder = d.Sequence([d.Replace("▁", " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0)])
    hf.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return hf, tokens


def sentencepiece_types(tokens):
    return [UNKNOWN if t == "<unk>" else CONTROL if t in SPECIALS else BYTE if t in BYTE_TOKENS else NORMAL
            for t in tokens]


def sentencepiece_gguf(path, tokens, architecture="llama", add_space_prefix=None):
    """The vocabulary as a llama.cpp SentencePiece GGUF (scores falling with the id, as sentencepiece
    writes them); enough architecture keys for transformers to read the file."""
    arch = {f"{architecture}.{k}": (V.UINT32, v) for k, v in (
        ("context_length", 128), ("embedding_length", 8), ("block_count", 1), ("feed_forward_length", 16),
        ("attention.head_count", 2))}
    metadata = {"general.architecture": (V.STRING, architecture), **arch,
                "tokenizer.ggml.model": (V.STRING, "llama"),
                "tokenizer.ggml.tokens": (V.ARRAY, (V.STRING, tokens)),
                "tokenizer.ggml.scores": (V.ARRAY, (V.FLOAT32, [-float(i) for i in range(len(tokens))])),
                "tokenizer.ggml.token_type": (V.ARRAY, (V.INT32, sentencepiece_types(tokens))),
                "tokenizer.ggml.bos_token_id": (V.UINT32, 1), "tokenizer.ggml.eos_token_id": (V.UINT32, 2),
                "tokenizer.ggml.unknown_token_id": (V.UINT32, 0)}
    if add_space_prefix is not None:
        metadata["tokenizer.ggml.add_space_prefix"] = (V.BOOL, add_space_prefix)
    path.write_bytes(gguf_bytes(metadata, {}))
    return path
