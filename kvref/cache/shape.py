"""What a cache needs to know of its model, as plain values (kvref.cache never imports the model),
the memory budget, and the plain formulas (K and V of every layer). What a position of a cache takes
each layout declares itself (KVCache.position_bytes), and the budget counts by it.

Model.new_cache describes the model with a CacheShape and hands it to kvref.cache.make; a saved
file is checked against one (kvref/cache/fileformat.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CacheError
from ..limits import DEFAULT_CACHE_BUDGET
from .quant import ELEMENT_BYTES, SCALE_DTYPE, Codecs, dtype_name, kv_codecs


def cache_bytes(n_layers: int, n_tokens: int, n_kv_heads: int | None = None, head_dim: int | None = None,
                dtype="float16", *, group_size=None, kv_lora_rank=None, qk_rope_head_dim=None, layer_windows=None):
    """Bytes of the K/V of n_tokens positions, exactly, by the formula of the model's family:

        2 (K and V) x layers x tokens x kv heads x head_dim x bytes per element      (the articles')
        layers x tokens x (kv_lora_rank + qk_rope_head_dim) x bytes per element      (MLA: one latent key, no V)

    group_size: int8's float32 scales too, one per group_size elements of every stored vector.
    layer_windows (one None or W per layer): a sliding-window layer holds only min(tokens, W) positions.
    """
    name = dtype_name(dtype)
    if kv_lora_rank is not None:  # MLA: per layer and position one vector of R + Dr values
        vectors, width = 1, kv_lora_rank + qk_rope_head_dim
    else:
        vectors, width = 2 * n_kv_heads, head_dim
    scales = width // group_size * SCALE_DTYPE.itemsize if group_size is not None and name == "int8" else 0
    if layer_windows is None:
        positions = n_layers * n_tokens
    elif len(layer_windows) != n_layers:
        raise CacheError(f"layer_windows gives {len(layer_windows)} layers; n_layers={n_layers}")
    else:
        positions = sum(n_tokens if w is None else min(n_tokens, w) for w in layer_windows)
    return positions * vectors * (width * ELEMENT_BYTES[name] + scales)


def bytes_per_position(n_layers, n_kv_heads, head_dim, k_dtype, v_dtype=None, group_size=None,
                       latent_dim=None) -> int:
    """Bytes one position occupies in every layer: K and V vectors per kv head, plus int8 scales (latent_dim:
    a latent cache's one key of head_dim values and no V)."""
    codecs = Codecs(*kv_codecs(k_dtype, v_dtype, head_dim, group_size, latent_dim))
    return codecs.bytes_per_position(n_layers, n_kv_heads)


@dataclass(frozen=True)
class CacheShape:
    """The model facts a cache layout is made from.

    n_layers, n_kv_heads, head_dim   the K/V of one position: [L, Hkv, D]
    max_seq_len     positions the model reads; no cache holds more
    vocab_size      V: a saved file's token ids and last logits are checked against it
    layer_windows   per layer None (attends to every position) or its window W; None: no window layers
    rope_theta      the RoPE base every cached key was rotated with, or a tuple of one per layer where some
                    layer's keys are not rotated (None there: a NoPE layer, SmolLM3); None: a shift is refused
    model           the model's fingerprint (Model.fingerprint()), recorded in the cache's sequence
                    and its saved files; None for a cache not made for a model
    latent_dim      MLA (kv_lora_rank R): K is a latent key of head_dim = R + qk_rope_head_dim values with
                    n_kv_heads 1, V is not stored (it is K's first R values); None: K and V per kv head
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_seq_len: int
    vocab_size: int | None = None
    layer_windows: tuple | None = None
    rope_theta: float | tuple | None = None
    model: dict | None = None
    latent_dim: int | None = None

    @property
    def has_windows(self) -> bool:
        """Whether some layer attends over a sliding window (Gemma 3)."""
        return any(w is not None for w in self.layer_windows or ())

    def check_budget(self, positions: int, codecs: Codecs, what: str = "a cache", layout=None) -> None:
        """CacheError if a cache of `positions` positions would take more than
        kvref.limits.DEFAULT_CACHE_BUDGET bytes: what bounds the caches whose size the model (its
        max_seq_len, from the model file) or a saved cache file chooses, never the caller. A position
        takes what `layout` (a layout class) declares, layout.position_bytes(self, codecs); without one,
        its K and V in every layer."""
        if layout is None:
            per_position = codecs.bytes_per_position(self.n_layers, self.n_kv_heads)
        else:
            per_position = layout.position_bytes(self, codecs)
        if positions * per_position > DEFAULT_CACHE_BUDGET:
            raise CacheError(
                f"{what} of {positions:,} positions would take {positions * per_position / 2**30:.1f} GiB of "
                f"{codecs.k.name}/{codecs.v.name} K/V, more than the {DEFAULT_CACHE_BUDGET / 2**30:g} GiB a cache "
                "sized by a file may take (kvref.limits.DEFAULT_CACHE_BUDGET); pass capacity= (or num_blocks=) "
                "for the positions you need")
