"""Model: config + weights + kernel set, with the checks that guard the public entry points."""

from __future__ import annotations

import numpy as np

from . import backends
from .cache import ContiguousCache, KVCache, dtype_name
from .config import ModelConfig
from .chat import render_chat
from .errors import CacheError, ContextOverflowError, DTypeError, TokenError, TokenizerError
from .weights import Weights, random_weights

MODEL_DTYPES = ("float32", "float64")


class Model:
    """A decoder-only transformer ready to run: `forward` is prefill and decode alike."""

    def __init__(self, config: ModelConfig, weights: Weights, dtype="float32", backend="auto",
                 tokenizer=None, chat_template: str | None = None, threads: int | None = None):
        self.config = config
        self.weights = weights
        self.dtype = model_dtype(dtype)
        self.backend = backends.resolve(backend, self.dtype)
        self.ops = backends.kernels(self.backend, threads)
        self._forward = backends.forward_impl(self.backend, config, weights)  # fused C forward or the decoder
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, dtype="float32", backend="auto",
               threads: int | None = None) -> "Model":
        """Deterministic random weights (see kvref.weights.random_weights)."""
        dtype = model_dtype(dtype)
        return cls(config, random_weights(config, seed, dtype), dtype, backend, threads=threads)

    def new_cache(self, layout="contiguous", kv_dtype=None, capacity=None) -> KVCache:
        """An empty KV cache for this model; K/V are stored in the model dtype unless kv_dtype says otherwise."""
        if layout != "contiguous":
            raise CacheError(f"cache layout {layout!r} is not available; expected 'contiguous'")
        capacity = self.config.max_seq_len if capacity is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity <= 0:
            raise CacheError(f"capacity={capacity!r} must be a positive integer")
        if capacity > self.config.max_seq_len:
            raise ContextOverflowError(
                f"capacity={capacity} exceeds the model's max_seq_len={self.config.max_seq_len}")
        kv_dtype = self.dtype if kv_dtype is None else dtype_name(kv_dtype)
        if kv_dtype not in backends.KV_DTYPES[self.backend]:
            raise CacheError(f"kv_dtype {kv_dtype!r} is not supported by the {self.backend!r} backend; "
                             f"expected one of {backends.KV_DTYPES[self.backend]}")
        c = self.config
        return ContiguousCache(c.n_layers, c.n_kv_heads, c.head_dim, int(capacity), kv_dtype)

    def forward(self, token_ids, cache: KVCache | None = None, all_logits: bool = False):
        """Run the new tokens at positions cache.next_position.. and append their K/V to `cache`.

        One call with many tokens is a prefill; one call with a single token is a decode step; both
        are this same code. `cache=None` recomputes from position 0 with a cache thrown away after.
        Returns the last position's logits [V], or every new position's [T, V] with all_logits.
        On any error the cache is left exactly as it was.
        """
        ids = self.check_tokens(token_ids)
        if cache is None:
            self.check_context(0, len(ids))
            cache = self.new_cache(capacity=len(ids))
        else:
            self.check_cache(cache)
            self.check_context(cache.next_position, len(ids))
        logits = self._forward(self.ops, self.config, self.weights, ids, cache, all_logits)
        return logits if all_logits else logits[0]

    def chat_ids(self, messages, add_generation_prompt=True) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template (special tokens as ids)."""
        tok = self.tokenizer
        if tok is None or not self.chat_template:
            raise TokenizerError("this model has no tokenizer or chat template (tokenizer.chat_template)")
        text = render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=_token_text(tok, tok.bos_id), eos_token=_token_text(tok, tok.eos_id))
        return tok.encode(text, special=True)

    def check_tokens(self, token_ids) -> np.ndarray:
        """Token ids as a non-empty 1-D int64 array, every id in [0, vocab_size)."""
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise TokenError(f"token ids must be a non-empty 1-D sequence; got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise TokenError(f"token ids must be integers; got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise TokenError(
                f"token id {int(ids[i])} at index {i} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids.astype(np.int64)

    def check_context(self, start: int, n_new: int) -> None:
        if start + n_new > self.config.max_seq_len:
            raise ContextOverflowError(
                f"positions {start}..{start + n_new - 1} exceed max_seq_len={self.config.max_seq_len} "
                f"({start} already used + {n_new} new)")

    def check_cache(self, cache) -> None:
        c = self.config
        if not isinstance(cache, KVCache):
            raise CacheError(f"expected a KVCache from model.new_cache(); got {type(cache).__name__}")
        got = (cache.n_layers, cache.n_kv_heads, cache.head_dim)
        if got != (c.n_layers, c.n_kv_heads, c.head_dim):
            raise CacheError(
                f"cache shape (layers, kv heads, head_dim) = {got} does not match the model's "
                f"{(c.n_layers, c.n_kv_heads, c.head_dim)}")


def model_dtype(dtype) -> str:
    name = dtype_name(dtype)
    if name not in MODEL_DTYPES:
        raise DTypeError(f"model dtype {name!r} is not supported; expected one of {MODEL_DTYPES}")
    return name


def _token_text(tokenizer, token_id) -> str:
    return "" if token_id is None else tokenizer.token_text(token_id)
