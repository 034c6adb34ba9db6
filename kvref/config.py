"""ModelConfig: every architecture number of a decoder-only model, in one place.

A family (Llama, Qwen 2, Qwen 3, Mistral, Gemma 2, Gemma 3, Phi-3, SmolLM3, gpt-oss) is a set of these fields, read by the one
decoder where they apply; the defaults are Llama's. docs/architectures.md has the table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError
from .limits import CONFIG_CEILINGS, MAX_CONTEXT, bounded_int

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
ROUTER_SCORES = ("softmax", "sigmoid")  # how a router turns its logits into expert scores
EXPERT_GROUP_SCORES = ("top2_sum", "max")  # how grouped top-k scores a group of experts
# the fields that make the families other than Llama; at their defaults a config is Llama's
FAMILY_FIELDS = ("qkv_bias", "qk_norm", "sandwich_norms", "embedding_scale", "activation", "attention_scale",
                 "layer_windows", "rope_local_theta", "rope_scaling", "attn_softcap", "final_softcap", "nope_layers",
                 "attention_sinks", "attention_out_bias",
                 "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "mla_form")
# the fields of a mixture of experts (kvref.spec.decoder.moe): family fields too, at their defaults a dense MLP
MOE_FIELDS = ("n_experts", "n_experts_used", "expert_d_ff", "first_dense_layers", "router_score", "router_bias",
              "expert_selection_bias", "n_expert_groups", "n_expert_groups_used", "expert_group_score",
              "norm_topk_prob", "routed_scaling_factor", "shared_expert_d_ff", "expert_bias")
FAMILY_FIELDS = FAMILY_FIELDS + MOE_FIELDS
MLA_FORMS = ("absorbed", "naive")
# DeepSeek's q_a_layernorm and kv_a_layernorm keep RMSNorm's default epsilon whatever rms_norm_eps says
# (their reference code and transformers' build them without an eps argument)
LATENT_NORM_EPS = 1e-6


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
    #   (rope_freqs.weight, what llama3 scaling computes), or ("longrope", short_factors, long_factors,
    #   original_max_positions) (Phi-3): the long divisors when max_seq_len > original_max_positions, else
    #   the short ones, chosen once for the model as llama.cpp does (layer_rope), so a stored key is never
    #   rotated with another set; its attention factor is in attention_scale (squared: q and k both carry it),
    #   or ("yarn", factor, beta_fast, beta_slow, original_max_positions, attention_factor, truncate) (gpt-oss,
    #   DeepSeek): attention_factor scales both q and k after rotation, so scores by its square (score_scale)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap), before the mask and softmax
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    nope_layers: tuple = ()  # SmolLM3: the layers whose q and k are not rotated (NoPE; every 4th layer)
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per query head joins each softmax (no value)
    attention_out_bias: bool = False  # gpt-oss: the attention output projection adds a bias
    # -- a mixture of experts (Qwen3-MoE, Mixtral, DeepSeek, gpt-oss): the MLP of a MoE layer is n_experts_used
    #    of n_experts expert MLPs, chosen per position by a router, their outputs weighted and summed --------
    n_experts: int = 0  # X: routed experts per MoE layer; 0: every layer's MLP is dense (d_ff wide)
    n_experts_used: int = 0  # k: experts each position runs (num_experts_per_tok); 1 <= k <= X when X > 0
    expert_d_ff: int | None = None  # Fx: hidden width of each expert MLP; None: d_ff
    first_dense_layers: int = 0  # layers 0 .. this - 1 keep a dense MLP, d_ff wide (DeepSeek's first_k_dense_replace)
    router_score: str = "softmax"  # expert scores from the router logits: "softmax" over all experts (Qwen3-MoE,
    #                                Mixtral, DeepSeek-V2, gpt-oss) or an independent "sigmoid" per expert (DeepSeek-V3)
    router_bias: bool = False  # gpt-oss: the router adds a bias to its logits
    expert_selection_bias: bool = False  # DeepSeek-V3's e_score_correction_bias: added to the scores to choose
    #                                      experts only; the chosen experts are weighted by their unbiased scores
    n_expert_groups: int = 1  # grouped top-k (DeepSeek n_group): the X experts form this many equal groups, and
    n_expert_groups_used: int = 1  # ... each position chooses its experts from its best this-many groups (topk_group)
    expert_group_score: str = "top2_sum"  # a group's score: its two best scores summed (DeepSeek-V3) or its "max" (V2)
    norm_topk_prob: bool = False  # the k chosen scores are divided by their sum (Mixtral, gpt-oss; Qwen3-MoE as its
    #                               config says); else used as they are (DeepSeek-V2)
    routed_scaling_factor: float = 1.0  # the weights of the chosen experts are multiplied by this (DeepSeek)
    shared_expert_d_ff: int = 0  # width of a shared expert MLP every position runs beside its routed ones (DeepSeek:
    #                              n_shared_experts x the expert width, one MLP); 0: none
    expert_bias: bool = False  # gpt-oss: each expert's gate, up and down projections add a bias
    # -- multi-head latent attention (MLA: DeepSeek-V2/V3); kv_lora_rank None: ordinary K/V -------------
    kv_lora_rank: int | None = None  # R: width of the cached latent c_kv; the cache holds [c_kv ; k_rope]
    #   per layer and position (R + qk_rope_head_dim values), never per-head K/V. With it, head_dim is a
    #   query head's width, qk_nope_head_dim + qk_rope_head_dim, and n_kv_heads == n_heads (each head
    #   expands the latent to its own K and V)
    q_lora_rank: int | None = None  # the query's low-rank bottleneck (q_a, its norm, q_b); None: one wq
    qk_rope_head_dim: int | None = None  # Dr: the rotated part of each query head and the one shared key
    v_head_dim: int | None = None  # Dv: width of a value head (the attention output per head)
    mla_form: str = "absorbed"  # how attention reads the latent (decoder.latent_attention_block): "absorbed" (W_UK
    #   folded into the query, attention over the latent as MQA, W_UV after) or "naive" (expand per-head K/V)

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
        for name in ("embedding_scale", "attention_scale", "rope_local_theta", "attn_softcap", "final_softcap"):
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
        if (not isinstance(self.nope_layers, tuple) or len(set(self.nope_layers)) != len(self.nope_layers)
                or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers
                       for i in self.nope_layers)):
            raise ConfigError(f"nope_layers={self.nope_layers!r} must be a tuple of distinct layer indices in "
                              f"0..{self.n_layers - 1}")
        if self.kv_lora_rank is not None:
            _check_latent(self)
        elif any(v is not None for v in (self.q_lora_rank, self.qk_rope_head_dim, self.v_head_dim)):
            raise ConfigError("q_lora_rank, qk_rope_head_dim and v_head_dim describe multi-head latent attention; "
                              "they need kv_lora_rank")
        if self.layer_windows is not None:
            windows = self.layer_windows
            if (not isinstance(windows, tuple) or len(windows) != self.n_layers
                    or any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or not 0 < w <= MAX_CONTEXT)
                           for w in windows)):
                raise ConfigError(f"layer_windows={windows!r} must be a tuple of {self.n_layers} entries, each None "
                                  f"(global) or a window of 1..{MAX_CONTEXT} positions")
        self._check_experts()

    def _check_experts(self):
        # the mixture-of-experts fields: at their defaults a dense model; any router they describe is computable
        for name in ("router_bias", "expert_selection_bias", "norm_topk_prob", "expert_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        for name, values in (("router_score", ROUTER_SCORES), ("expert_group_score", EXPERT_GROUP_SCORES)):
            if getattr(self, name) not in values:
                raise ConfigError(f"{name}={getattr(self, name)!r} is unknown; expected one of {values}")
        most, widest = CONFIG_CEILINGS["n_experts"], CONFIG_CEILINGS["d_ff"]
        for name, low, high in (("n_experts", 0, most), ("n_experts_used", 0, most),
                                ("first_dense_layers", 0, self.n_layers), ("n_expert_groups", 1, most),
                                ("n_expert_groups_used", 1, most), ("shared_expert_d_ff", 0, widest)):
            object.__setattr__(self, name, bounded_int(getattr(self, name), name, low, high))
        if self.expert_d_ff is not None:
            object.__setattr__(self, "expert_d_ff", bounded_int(self.expert_d_ff, "expert_d_ff", 1, widest))
        value = self.routed_scaling_factor
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ConfigError(f"routed_scaling_factor={value!r} must be a positive finite number")
        X, k = self.n_experts, self.n_experts_used
        if (X == 0) != (k == 0) or k > X:
            raise ConfigError(f"n_experts_used={k} must be in 1..n_experts={X} (both 0 for a dense model)")
        groups, used = self.n_expert_groups, self.n_expert_groups_used
        if groups > 1 and (X % groups or used > groups or used * (X // groups) < k):
            raise ConfigError(f"n_expert_groups={groups} must divide n_experts={X}, and n_expert_groups_used={used} "
                              f"groups (at most n_expert_groups) must hold at least n_experts_used={k} experts")
        if groups == 1 and used != 1:
            raise ConfigError(f"n_expert_groups_used={used} needs n_expert_groups > 1")
        if groups > 1 and self.expert_group_score == "top2_sum" and X // groups < 2:
            raise ConfigError(f"expert_group_score='top2_sum' needs groups of at least 2 experts; n_experts={X} in "
                              f"{groups} groups")
        if X == 0 and self.family_fields().keys() & set(MOE_FIELDS):
            raise ConfigError(f"{sorted(self.family_fields().keys() & set(MOE_FIELDS))} describe a mixture of experts; "
                              "set n_experts and n_experts_used too")

    def family_fields(self) -> dict:
        """The FAMILY_FIELDS this config sets to something other than Llama's value."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return {name: getattr(self, name) for name in FAMILY_FIELDS if getattr(self, name) != defaults[name]}

    def moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (else dense, d_ff wide)."""
        return self.n_experts > 0 and layer >= self.first_dense_layers

    @property
    def experts_d_ff(self) -> int:
        """Fx: the hidden width of each routed expert."""
        return self.d_ff if self.expert_d_ff is None else self.expert_d_ff

    def window(self, layer: int) -> int | None:
        """The attention window of `layer` (None: every position)."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of `layer`: rope_local_theta on windowed layers when given, else rope_theta."""
        if self.rope_local_theta is not None and self.window(layer) is not None:
            return self.rope_local_theta
        return self.rope_theta

    def layer_rope(self, layer: int) -> tuple | None:
        """(base, scaling) that `layer` rotates q and k with, as kvref.spec.ops.rope takes them; None for a
        NoPE layer. LongRoPE's factor set is chosen here, once for the model, by max_seq_len."""
        if layer in self.nope_layers:
            return None
        scaling = self.rope_scaling
        if scaling is not None and scaling[0] == "longrope":
            _, short, long, original = scaling
            scaling = ("factors", long if self.max_seq_len > original else short)
        return self.layer_rope_theta(layer), scaling

    @property
    def latent(self) -> bool:
        """Whether attention is multi-head latent attention (the cache holds a latent, not K/V)."""
        return self.kv_lora_rank is not None

    @property
    def qk_nope_head_dim(self) -> int:
        """MLA: the part of a query (and expanded key) head that RoPE leaves alone."""
        return self.head_dim - self.qk_rope_head_dim

    def cache_geometry(self) -> tuple:
        """What the cache stores per layer and position: (kv heads, K width, V width, latent width or None).
        MLA: one latent key [c_kv ; k_rope] of R + Dr values and no V (its V is the key's first R values);
        else Hkv heads of K and V, head_dim each."""
        if self.latent:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0, self.kv_lora_rank
        return self.n_kv_heads, self.head_dim, self.head_dim, None

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
    shapes = {"linear": 2, "llama3": 5, "factors": 2, "longrope": 4, "yarn": 7}
    kind = scaling[0] if isinstance(scaling, tuple) and scaling else None
    numbers = scaling[1:] if kind in shapes else ()
    if kind in ("factors", "longrope") and len(scaling) == shapes[kind]:
        sets = scaling[1:3] if kind == "longrope" else scaling[1:2]
        numbers = (0,)
        if all(isinstance(f, tuple) and len(f) == head_dim // 2 for f in sets):
            numbers = tuple(f for factors in sets for f in factors) + scaling[3:]
    if kind == "yarn" and len(scaling) == 7:  # the last is the truncate flag
        numbers = scaling[1:6] if isinstance(scaling[6], bool) else (0,)
    if (kind not in shapes or len(scaling) != shapes[kind]
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf") for v in numbers)
            or (kind == "llama3" and not scaling[2] < scaling[3])):
        raise ConfigError(f"rope_scaling={scaling!r} must be ('linear', factor), ('llama3', factor, "
                          "low_freq_factor, high_freq_factor, original_max_positions), ('factors', (one per "
                          f"frequency: {head_dim // 2})) or ('longrope', (short: {head_dim // 2}), (long: "
                          f"{head_dim // 2}), original_max_positions) or ('yarn', factor, beta_fast, beta_slow, "
                          "original_max_positions, attention_factor, truncate: True or False), positive numbers with "
                          "low_freq_factor < high_freq_factor")


def _check_latent(c):
    # MLA: every width a positive integer, the rotated part even and inside a query head
    for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", *(("q_lora_rank",) if c.q_lora_rank else ())):
        object.__setattr__(c, name, bounded_int(getattr(c, name), name, 1, CONFIG_CEILINGS["head_dim"]))
    if c.qk_rope_head_dim % 2 or not c.qk_rope_head_dim < c.head_dim:
        raise ConfigError(f"qk_rope_head_dim={c.qk_rope_head_dim} must be even (RoPE rotates pairs) and less than "
                          f"head_dim={c.head_dim} (qk_nope_head_dim + qk_rope_head_dim)")
    if c.n_kv_heads != c.n_heads:
        raise ConfigError(f"with kv_lora_rank every head expands the latent to its own K and V: n_kv_heads="
                          f"{c.n_kv_heads} must equal n_heads={c.n_heads}")
    if c.mla_form not in MLA_FORMS:
        raise ConfigError(f"mla_form={c.mla_form!r} is unknown; expected one of {MLA_FORMS}")
    if c.qk_norm or c.qkv_bias or c.layer_windows is not None or c.rope_local_theta is not None:
        raise ConfigError("kv_lora_rank (MLA) does not combine with qk_norm, qkv_bias, layer_windows or "
                          "rope_local_theta in kvref: no checkpoint has them together")
