"""ModelConfig: every architecture number of a decoder-only model, in one place.

A family (Llama, Qwen 2, Qwen 3, Mistral, Gemma 3, gpt-oss) is a set of these fields, read by the one
decoder where they apply; the defaults are Llama's. docs/architectures.md has the table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError
from .limits import CONFIG_CEILINGS, MAX_CONTEXT, bounded_int

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
# the fields that make the families other than Llama; at their defaults a config is Llama's
FAMILY_FIELDS = ("qkv_bias", "qk_norm", "sandwich_norms", "embedding_scale", "activation", "attention_scale",
                 "layer_windows", "rope_local_theta", "rope_scaling", "attention_sinks", "attention_out_bias")


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
    # -- fields that make the other families (defaults: Llama) ------------------------------------
    qkv_bias: bool = False  # Qwen 2/2.5: the Q, K and V projections add a bias
    qk_norm: bool = False  # Qwen 3, Gemma 3: RMSNorm of each head's q and k (gain [D]) before RoPE
    sandwich_norms: bool = False  # Gemma 3: RMSNorm also on the attention and MLP outputs, before the residual add
    embedding_scale: float = 1.0  # Gemma 3: sqrt(d_model); embeddings are multiplied by it
    activation: str = "silu"  # the MLP gate: "silu" (SwiGLU: Llama, Qwen, Mistral), "gelu_tanh" (GeGLU: Gemma) or
    #                           "swiglu_oai" (gpt-oss: clamped, gate x sigmoid(1.702 gate) x (up + 1); spec.ops.swiglu_oai)
    attention_scale: float | None = None  # scores x this; None: 1/sqrt(head_dim); Gemma 3: query_pre_attn_scalar**-0.5
    layer_windows: tuple | None = None  # per layer: None (attends to every position) or W (the last W
    #                                     positions, itself included); Gemma 3: 512 on 5 layers of 6, Mistral v0.1: 4096
    rope_local_theta: float | None = None  # RoPE base on windowed layers (Gemma 3: 10,000 there, rope_theta elsewhere)
    rope_scaling: tuple | None = None  # RoPE frequency scaling (spec.ops.rope_frequencies): ("linear", factor),
    #   ("llama3", factor, low_freq_factor, high_freq_factor, original_max_positions) from HF configs, or
    #   ("factors", (f_0 .. f_{D/2-1})): one divisor per frequency, as Llama 3.1+ GGUF files store them
    #   (rope_freqs.weight, what llama3 scaling computes), or ("yarn", factor, beta_fast, beta_slow,
    #   original_max_positions, attention_factor, truncate) (gpt-oss, DeepSeek): attention_factor scales
    #   both q and k after rotation, so scores by its square (score_scale)
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per query head joins each softmax (no value)
    attention_out_bias: bool = False  # gpt-oss: the attention output projection adds a bias

    def __post_init__(self):
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "max_seq_len"):
            # frozen: NumPy integers become the same Python int once, here
            object.__setattr__(self, name, bounded_int(getattr(self, name), name, 1, CONFIG_CEILINGS[name]))
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "give head_dim explicitly")
            # frozen dataclass: the derived default is set once, here, and never changes
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        object.__setattr__(self, "head_dim", bounded_int(self.head_dim, "head_dim", 1, CONFIG_CEILINGS["head_dim"]))
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
        for name in ("tie_embeddings", "qkv_bias", "qk_norm", "sandwich_norms", "attention_sinks", "attention_out_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        for name in ("embedding_scale", "attention_scale", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
                                      or value == float("inf")):
                raise ConfigError(f"{name}={value!r} must be a positive finite number")
        if self.embedding_scale is None:
            raise ConfigError("embedding_scale must be a number (1.0: embeddings as stored)")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation={self.activation!r} is unknown; expected one of {ACTIVATIONS}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, self.head_dim)
        if self.layer_windows is not None:
            windows = self.layer_windows
            if (not isinstance(windows, tuple) or len(windows) != self.n_layers
                    or any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or not 0 < w <= MAX_CONTEXT)
                           for w in windows)):
                raise ConfigError(f"layer_windows={windows!r} must be a tuple of {self.n_layers} entries, each None "
                                  f"(global) or a window of 1..{MAX_CONTEXT} positions")

    def family_fields(self) -> dict:
        """The FAMILY_FIELDS this config sets to something other than Llama's value."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return {name: getattr(self, name) for name in FAMILY_FIELDS if getattr(self, name) != defaults[name]}

    def window(self, layer: int) -> int | None:
        """The attention window of `layer` (None: every position)."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of `layer`: rope_local_theta on windowed layers when given, else rope_theta."""
        if self.rope_local_theta is not None and self.window(layer) is not None:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def score_scale(self) -> float | None:
        """What attention scores are multiplied by: attention_scale (None: 1/sqrt(head_dim)), times the
        square of YaRN's attention factor, which HF multiplies into the cos and sin that rotate q and k;
        multiplying the scores instead leaves the cached K as rotation alone made it."""
        if self.rope_scaling is None or self.rope_scaling[0] != "yarn" or self.rope_scaling[5] == 1.0:
            return self.attention_scale
        base = self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale
        return base * self.rope_scaling[5] ** 2

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


def _check_rope_scaling(scaling, head_dim):
    shapes = {"linear": 2, "llama3": 5, "factors": 2, "yarn": 7}
    kind = scaling[0] if isinstance(scaling, tuple) and scaling else None
    numbers = scaling[1:] if kind in shapes else ()
    if kind == "yarn" and len(scaling) == 7:  # the last is the truncate flag
        numbers = scaling[1:6] if isinstance(scaling[6], bool) else (0,)
    if kind == "factors":
        numbers = scaling[1] if len(scaling) == 2 and isinstance(scaling[1], tuple) else (0,)
        if len(numbers) != head_dim // 2:
            numbers = (0,)
    if (kind not in shapes or len(scaling) != shapes[kind]
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf") for v in numbers)
            or (kind == "llama3" and not scaling[2] < scaling[3])):
        raise ConfigError(f"rope_scaling={scaling!r} must be ('linear', factor), ('llama3', factor, "
                          "low_freq_factor, high_freq_factor, original_max_positions), ('factors', (one per "
                          f"frequency: {head_dim // 2})) or ('yarn', factor, beta_fast, beta_slow, "
                          "original_max_positions, attention_factor, truncate: True or False), positive numbers "
                          "with low_freq_factor < high_freq_factor")

