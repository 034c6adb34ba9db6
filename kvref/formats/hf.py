"""Hugging Face checkpoints: config.json and tensor names -> ModelConfig and Weights.

    config_from_hf(config_json)                      a config.json dict -> ModelConfig
    weights_from_hf(config_json, tensors, dtype)     {HF tensor name: array} -> (ModelConfig, Weights)

Families read: `model_type` llama, mistral, qwen2, qwen3 and gemma3_text (docs/architectures.md has
the table of fields). What a checkpoint stores differently from what the decoder reads is converted
here, once, so the decoder never needs to know where a model came from:

  - RoPE pairs. Every HF checkpoint rotates the pairs (x[i], x[i + D/2]) (`rotate_half`); the
    decoder, like Llama GGUF files, rotates adjacent pairs (x[2i], x[2i+1]). Each head's Q and K
    rows (and their biases and QK-norm gains) are reordered so that row 2i holds HF row i and row
    2i+1 holds HF row i + D/2: the same rotations of the same numbers, and a dot product of q and k
    is unchanged by reordering both alike. V and the output projection keep their order, so the
    attention output is HF's. The cached K are in the reordered layout.
  - Gemma's RMSNorm multiplies by (1 + w) and its checkpoints store w: the gains become 1 + w.

Anything this module does not compute exactly (RoPE types other than default, linear, llama3 and yarn;
scaling that differs between layer types; biases on the output or MLP
projections, logit soft-capping, sliding windows on some Qwen layers) is refused with a ConfigError
naming the field, never ignored.
"""

from __future__ import annotations

import functools

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, ShapeError
from ..limits import CONFIG_CEILINGS, bounded_float, bounded_int, check_layer_count
from ..spec import ops as spec_ops
from ..weights import LayerWeights, Weights
from .architectures import half_split_to_adjacent

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of an HF config.json (as a dict); ConfigError for anything not computed exactly,
    and for any value of the wrong type."""
    if not isinstance(hf, dict):
        raise ConfigError(f"config.json must hold a JSON object, not {type(hf).__name__}")
    try:
        return _config_from_hf(hf)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"config.json has a value of the wrong type or range: {exc!r}") from None


def _config_from_hf(hf: dict) -> ModelConfig:
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(f"model_type {family!r} is not supported; kvref reads {FAMILIES}")
    n_layers, n_heads = _int(hf, "num_hidden_layers", "n_layers"), _int(hf, "num_attention_heads", "n_heads")
    d_model = _int(hf, "hidden_size", "d_model")
    head_dim = _int(hf, "head_dim", "head_dim", max(d_model // n_heads, 1)) if hf.get("head_dim") is not None \
        else max(d_model // n_heads, 1)
    _refuse(hf, family)
    gemma = family == "gemma3_text"
    thetas, scaling = _rope(hf, family)
    windows = _layer_windows(hf, family, n_layers)
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads,
        n_kv_heads=_int(hf, "num_key_value_heads", "n_kv_heads", n_heads), d_ff=_int(hf, "intermediate_size", "d_ff"),
        vocab_size=_int(hf, "vocab_size", "vocab_size"), max_seq_len=_int(hf, "max_position_embeddings", "max_seq_len"),
        head_dim=head_dim, rope_theta=thetas["full_attention"], norm_eps=_float(hf, "rms_norm_eps", 1e-6),
        tie_embeddings=_bool(hf, "tie_word_embeddings", gemma),
        qkv_bias=family == "qwen2" or _bool(hf, "attention_bias", False),
        qk_norm=family in ("qwen3", "gemma3_text"),
        sandwich_norms=gemma,
        embedding_scale=float(np.float32(d_model ** 0.5)) if gemma else 1.0,
        activation="gelu_tanh" if gemma else "silu",
        attention_scale=_float(hf, "query_pre_attn_scalar", head_dim) ** -0.5 if gemma else None,
        layer_windows=windows,
        rope_local_theta=thetas["sliding_attention"] if windows is not None and gemma else None,
        rope_scaling=scaling,
    )


def weights_from_hf(hf: dict, tensors, dtype="float32"):
    """(ModelConfig, Weights) from a config.json dict and {HF tensor name: array}, converted to `dtype`.

    Every tensor the config implies must be present with its shape; ShapeError names a missing or
    misshapen one.
    """
    config = config_from_hf(hf)
    c = config
    gemma = hf["model_type"] == "gemma3_text"
    check_layer_count(c.n_layers, tensors.keys(), "model.layers.", "config.json num_hidden_layers",
                      ShapeError)

    def get(name, shape):
        if name not in tensors:
            raise ShapeError(f"the checkpoint has no tensor {name!r}")
        a = np.asarray(tensors[name])
        if a.shape != shape:
            raise ShapeError(f"tensor {name!r} has shape {a.shape}; the config implies {shape}")
        return a.astype(dtype)

    def norm(name, size):
        g = get(name, (size,))
        return (g.astype(np.float64) + 1).astype(dtype) if gemma else g  # Gemma stores w of (1 + w)

    def pairs_adjacent(a, heads):
        # [heads * D, ...] in HF's half-split pair order -> the adjacent-pair order the decoder rotates
        return half_split_to_adjacent(a, heads, c.head_dim)

    E, F = c.d_model, c.d_ff
    layers = []
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        post_attention = norm(p + "post_attention_layernorm.weight", E)
        lw = LayerWeights(
            attn_norm=norm(p + "input_layernorm.weight", E),
            wq=pairs_adjacent(get(attn + "q_proj.weight", (c.q_dim, E)), c.n_heads),
            wk=pairs_adjacent(get(attn + "k_proj.weight", (c.kv_dim, E)), c.n_kv_heads),
            wv=get(attn + "v_proj.weight", (c.kv_dim, E)),
            wo=get(attn + "o_proj.weight", (E, c.q_dim)),
            # Gemma names its pre-MLP norm pre_feedforward_layernorm; its post_attention_layernorm is
            # the sandwich norm on the attention output. Llama's post_attention_layernorm is the pre-MLP norm.
            ffn_norm=norm(p + "pre_feedforward_layernorm.weight", E) if gemma else post_attention,
            w_gate=get(p + "mlp.gate_proj.weight", (F, E)),
            w_up=get(p + "mlp.up_proj.weight", (F, E)),
            w_down=get(p + "mlp.down_proj.weight", (E, F)),
        )
        if c.qkv_bias:
            lw.bq = pairs_adjacent(get(attn + "q_proj.bias", (c.q_dim,)), c.n_heads)
            lw.bk = pairs_adjacent(get(attn + "k_proj.bias", (c.kv_dim,)), c.n_kv_heads)
            lw.bv = get(attn + "v_proj.bias", (c.kv_dim,))
        if c.qk_norm:
            lw.q_norm = pairs_adjacent(norm(attn + "q_norm.weight", c.head_dim), 1)
            lw.k_norm = pairs_adjacent(norm(attn + "k_norm.weight", c.head_dim), 1)
        if c.sandwich_norms:
            lw.post_attn_norm = post_attention
            lw.post_ffn_norm = norm(p + "post_feedforward_layernorm.weight", E)
        layers.append(lw)
    embeddings = get("model.embed_tokens.weight", (c.vocab_size, E))
    output = embeddings if c.tie_embeddings else get("lm_head.weight", (c.vocab_size, E))
    return config, Weights(embeddings, layers, norm("model.norm.weight", E), output)


def _int(hf, name, field, default=None):
    # an integer of config.json, bounded like the ModelConfig field it becomes (kvref.limits)
    return bounded_int(hf.get(name, default), f"config.json {name}", 1, CONFIG_CEILINGS[field])


def _float(hf, name, default):
    return bounded_float(hf.get(name, default), f"config.json {name}")


def _bool(hf, name, default):
    value = hf.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"config.json {name}={value!r} must be true or false")
    return value


def _refuse(hf, family):
    # fields whose computation the decoder does not have: refused by name, never ignored
    unsupported = {
        "mlp_bias": hf.get("mlp_bias", False),
        "attention_bias (on the output projection too)": family == "llama" and hf.get("attention_bias", False),
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
        "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
        "use_bidirectional_attention": hf.get("use_bidirectional_attention", False),
        "use_sliding_window (Qwen)": family in ("qwen2", "qwen3") and hf.get("use_sliding_window", False),
    }
    act = hf.get("hidden_activation" if family == "gemma3_text" else "hidden_act")
    expected = "gelu_pytorch_tanh" if family == "gemma3_text" else "silu"
    unsupported[f"activation {act!r} (expected {expected!r})"] = act not in (None, expected)
    bad = [name for name, value in unsupported.items() if value]
    if bad:
        raise ConfigError(f"this {family} checkpoint uses {', '.join(bad)}, which kvref does not compute yet")


def _rope(hf, family):
    # -> ({"full_attention": base, "sliding_attention": base}, scaling or None); transformers 5 writes
    # rope_parameters (per layer type for Gemma 3), earlier versions rope_theta, rope_local_base_freq
    # and rope_scaling
    params = hf.get("rope_parameters")
    if params is None:
        params = {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
        if family == "gemma3_text":
            params = {"full_attention": params,
                      "sliding_attention": {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}}
    per_type = params if "full_attention" in params else {"full_attention": params, "sliding_attention": params}
    thetas, scalings = {}, set()
    for kind in ("full_attention", "sliding_attention"):
        p = per_type.get(kind, per_type["full_attention"])
        thetas[kind] = bounded_float(p.get("rope_theta", 10000.0), f"config.json rope_theta ({kind})")
        scalings.add(_rope_scaling(p, kind))
    if len(scalings) > 1:
        raise ConfigError(f"RoPE scaling that differs between layer types ({per_type}) is not computed by kvref yet")
    return thetas, scalings.pop()


def _rope_scaling(p, kind):
    # a rope_parameters entry -> ModelConfig.rope_scaling
    kind_of = p.get("rope_type", p.get("type", "default"))
    number = functools.partial(_float_field, p, kind)
    if kind_of == "default":
        return None
    if kind_of == "linear":
        return ("linear", number("factor"))
    if kind_of == "llama3":
        return ("llama3", number("factor"), number("low_freq_factor"), number("high_freq_factor"),
                _int(p, "original_max_position_embeddings", "max_seq_len"))
    if kind_of == "yarn":
        return _yarn(p, number)
    raise ConfigError(f"RoPE type {kind_of!r} ({kind}) is not computed by kvref yet; it computes the default "
                      "RoPE and the linear, llama3 and yarn scalings")


def _yarn(p, number):
    # transformers' reading of YaRN parameters (_compute_yarn_parameters): beta_fast and beta_slow default
    # to 32 and 1 (also when 0 or null), truncate to true; an absent attention_factor follows from factor,
    # and from mscale and mscale_all_dim when both are given (DeepSeek)
    factor = number("factor")

    def optional(name, default):
        return number(name) if p.get(name) else default

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = spec_ops.yarn_attention_factor(factor, optional("mscale", None),
                                                          optional("mscale_all_dim", None))
    else:
        attention_factor = number("attention_factor")
    truncate = p.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"config.json RoPE truncate={truncate!r} must be true or false")
    return ("yarn", factor, optional("beta_fast", 32.0), optional("beta_slow", 1.0),
            _int(p, "original_max_position_embeddings", "max_seq_len"), attention_factor, truncate)


def _float_field(p, kind, name):
    if name not in p:
        raise ConfigError(f"RoPE parameters {p!r} ({kind}) are incomplete: {name} is missing")
    return bounded_float(p[name], f"config.json RoPE {name} ({kind})")


def _layer_windows(hf, family, n_layers):
    # per layer: None (global) or the sliding window W
    window = None if hf.get("sliding_window") is None else _int(hf, "sliding_window", "max_seq_len")
    if family == "mistral":
        return None if window is None else (window,) * n_layers
    if family not in ("gemma3_text", "gpt_oss"):
        return None
    kinds = hf.get("layer_types")
    if kinds is None:  # older config.json files: every pattern-th layer is global (gpt-oss: every other)
        name = "sliding_window_pattern" if "sliding_window_pattern" in hf else "_sliding_window_pattern"
        pattern = _int(hf, name, "n_layers", 6 if family == "gemma3_text" else 2)
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    if (not isinstance(kinds, list) or len(kinds) != n_layers
            or any(k not in ("full_attention", "sliding_attention") for k in kinds)):
        raise ConfigError(f"layer_types {kinds!r} must name full_attention or sliding_attention for each of "
                          f"{n_layers} layers")
    if window is None and "sliding_attention" in kinds:
        raise ConfigError("config.json has sliding_attention layers but no sliding_window")
    return tuple(window if k == "sliding_attention" else None for k in kinds)
