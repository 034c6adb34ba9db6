"""The fuzz targets: each takes arbitrary bytes, hands them to one reader of untrusted input the way a
user's program would, and must either succeed or raise a KVRefError. Anything else escaping, a hang
or a memory blow-up is a finding (tests/fuzz/run.py checks all three).

    gguf          the bytes are a GGUF file: GGUFFile, then kvref.load (config, tensors, tokenizer,
                  chat template, generation defaults) on the spec or (for half of the inputs) the native
                  backend, then a default cache, a forward and a chat prompt
    safetensors   the bytes are model.safetensors beside a fixed config.json, or (when they start
                  with "{") config.json beside a fixed model.safetensors: kvref.load of the directory
    cache         the bytes are a saved KV cache without its last 32 bytes (the sha256, appended here,
                  so that mutations reach the header and arrays instead of stopping at the checksum):
                  Model.load_cache into a fixed model, then a forward on the loaded cache
    tokenizer     byte 0 picks the options, the rest is text (UTF-8, invalid bytes replaced) and, read
                  as int32s, token ids: encode, decode, decode(encode(text)) == text, streaming decode
    chat          the bytes are a chat template (UTF-8, invalid bytes replaced), rendered for a fixed
                  conversation
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

import kvref
from kvref.errors import KVRefError
from kvref.text.chat import render_chat

HERE = Path(__file__).parent
CORPUS = HERE / "corpus"
# the fixed model of the cache target (its corpus files were saved from it: tests/fuzz/make_corpus.py)
CACHE_CONFIG = kvref.ModelConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, vocab_size=64,
                                 max_seq_len=64)
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2 + 2?"}]


@functools.lru_cache(maxsize=None)
def scratch() -> Path:
    """One scratch directory per process for the files the targets write (removed by run.py)."""
    return Path(tempfile.mkdtemp(prefix="kvref-fuzz-"))


def _write(name: str, data: bytes) -> Path:
    path = scratch() / name
    path.write_bytes(data)
    return path


def gguf(data: bytes) -> None:
    # half of the inputs (by their hash, so a replay takes the same path) on the native backend
    backend = "auto" if hashlib.sha256(data).digest()[0] & 1 else "numpy"
    model = kvref.load(_write("model.gguf", data), backend=backend)
    cache = model.new_cache()
    model.forward([0], cache)
    if model.tokenizer is not None and model.chat_template:
        model.text.chat_ids(CONVERSATION)


def safetensors(data: bytes) -> None:
    directory = scratch() / "checkpoint"
    directory.mkdir(exist_ok=True)
    config, weights = (data, _fixed("safetensors", "model.safetensors")) if data[:1] == b"{" else (
        _fixed("safetensors", "config.json"), data)
    (directory / "config.json").write_bytes(config)
    (directory / "model.safetensors").write_bytes(weights)
    model = kvref.load(directory, backend="numpy")
    model.forward([0], model.new_cache())


def cache(data: bytes) -> None:
    path = _write("cache.kvc", data + hashlib.sha256(data).digest())
    loaded = _cache_model().load_cache(path)
    try:
        if loaded.capabilities.append(1):
            _cache_model().forward([1], loaded)
    finally:
        loaded.free()


def tokenizer(data: bytes) -> None:
    tok = _tokenizer()
    flags, body = (data[0], data[1:]) if data else (0, b"")
    text = body.decode("utf-8", errors="replace")
    ids = tok.encode(text, special=bool(flags & 1), add_special=bool(flags & 2))
    if not flags & 3:  # plain text: byte-level BPE gives it back exactly
        assert tok.decode(ids) == text, f"decode(encode({text!r})) != the text"
    assert "".join(tok.decode_stream(ids)) == tok.decode(ids)
    raw = np.frombuffer(body[:len(body) // 4 * 4], dtype="<u4").astype(np.int64)
    tok.decode((raw % (tok.vocab_size + 2)).tolist())  # mostly ids of the vocabulary; a few past it: TokenError


def chat(data: bytes) -> None:
    text = render_chat(data.decode("utf-8", errors="replace"), CONVERSATION, bos_token="<s>", eos_token="</s>")
    assert isinstance(text, str)


TARGETS = {"gguf": gguf, "safetensors": safetensors, "cache": cache, "tokenizer": tokenizer, "chat": chat}


@functools.lru_cache(maxsize=None)
def _cache_model():
    return kvref.Model.random(CACHE_CONFIG, seed=3, backend="numpy")


@functools.lru_cache(maxsize=None)
def _tokenizer():
    return kvref.load(CORPUS / "gguf" / "tiny.gguf", backend="numpy").tokenizer


@functools.lru_cache(maxsize=None)
def _fixed(target: str, name: str) -> bytes:
    return (CORPUS / target / name).read_bytes()


def run_one(target: str, data: bytes) -> KVRefError | None:
    """One input: returns the KVRefError of a clean refusal (None: accepted); anything else propagates."""
    try:
        TARGETS[target](data)
    except KVRefError as exc:
        return exc
    finally:
        _clear_scratch()
    return None


def _clear_scratch():
    for path in scratch().iterdir():
        if path.is_dir():
            for inner in path.iterdir():
                inner.unlink()
        else:
            path.unlink()


def remove_scratch():
    _clear_scratch()
    for path in scratch().iterdir():
        path.rmdir()
    os.rmdir(scratch())
