"""ModelConfig: every architecture number of a decoder-only Llama-family model, in one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int  # transformer blocks
    d_model: int  # E: width of the residual stream
    n_heads: int  # H: query heads
    n_kv_heads: int  # Hkv: key/value heads; H == Hkv is MHA, 1 < Hkv < H is GQA, Hkv == 1 is MQA
    d_ff: int  # F: hidden width of the SwiGLU MLP
    vocab_size: int  # V
    max_seq_len: int  # positions the model was trained for; no execution goes past it
    head_dim: int | None = None  # D: defaults to d_model // n_heads (some models decouple the two)
    rope_theta: float = 10000.0  # RoPE base: pair i rotates by position * theta**(-2i/D)
    norm_eps: float = 1e-5  # RMSNorm epsilon, added to the mean square before the root
    tie_embeddings: bool = False  # the LM head reuses the token embedding matrix

    def __post_init__(self):
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "max_seq_len"):
            _require_positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "give head_dim explicitly")
            # frozen dataclass: the derived default is set once, here, and never changes
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        _require_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs of dimensions")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}: "
                "each kv head serves a whole group of query heads")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name}={value!r} must be a positive number")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"tie_embeddings={self.tie_embeddings!r} must be True or False")

    @property
    def group_size(self) -> int:
        """Query heads sharing one kv head (H / Hkv)."""
        return self.n_heads // self.n_kv_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _require_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
