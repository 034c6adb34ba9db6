"""Hugging Face checkpoints: config.json and tensor names -> ModelConfig and Weights.

    config_from_hf(config_json)                      a config.json dict -> ModelConfig
    weights_from_hf(config_json, tensors, dtype)     {HF tensor name: array} -> (ModelConfig, Weights)

Families read: `model_type` llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3 and smollm3, the
mixtures of experts qwen3_moe, mixtral and gpt_oss, and deepseek_v2 and deepseek_v3 (multi-head latent
attention, mixtures from first_k_dense_replace on; docs/architectures.md has the tables of fields).
What a checkpoint stores differently from what the decoder reads is converted here, once, so the
decoder never needs to know where a model came from:

  - RoPE pairs. Every HF checkpoint rotates the pairs (x[i], x[i + D/2]) (`rotate_half`); the
    decoder, like Llama GGUF files, rotates adjacent pairs (x[2i], x[2i+1]). Each head's Q and K
    rows (and their biases and QK-norm gains) are reordered so that row 2i holds HF row i and row
    2i+1 holds HF row i + D/2: the same rotations of the same numbers, and a dot product of q and k
    is unchanged by reordering both alike. V and the output projection keep their order, so the
    attention output is HF's. The cached K are in the reordered layout.
  - Gemma's RMSNorm multiplies by (1 + w) and its checkpoints store w: the gains become 1 + w.
  - Phi-3 fuses Q, K and V into one qkv_proj and gate and up into one gate_up_proj: they are split
    into the decoder's separate projections (rows [Q | K | V] and [gate | up]).
  - LongRoPE (Phi-3): ("longrope", short, long, original) in rope_scaling, and its attention factor m
    folded into attention_scale as m**2 / sqrt(D): transformers multiplies cos and sin by m, so q and k
    both carry it. Which factor set rotates is chosen once by max_seq_len (ModelConfig.layer_rope), as
    llama.cpp chooses by its context size; transformers instead picks per call, by the highest
    position of that call, so below original_max_position_embeddings it rotates with the short set
    even when max_position_embeddings is larger (kvref then uses the long one; see docs/architectures.md).
  - gpt-oss's experts multiply from the left with gate and up interleaved (gpt_oss_experts): split
    and transposed to out x in stacks.
  - Experts. A checkpoint stores one matrix per expert (`mlp.experts.{j}.gate_proj.weight`; Mixtral's
    `block_sparse_moe.experts.{j}.w1.weight`); they are stacked into the [X, Fx, E] tensors of
    LayerWeights, the layout GGUF files store.
  - DeepSeek rotates adjacent pairs already (V2's complex multiply, V3's rope_interleave); a V3
    checkpoint with rope_interleave false rotates half-split pairs, and the rotated rows of each query
    head and of the shared key are reordered as above.

Anything this module does not compute exactly (RoPE types other than default, linear, llama3,
longrope and yarn; partial rotary; scaling that differs between layer types; biases on the output or MLP
projections, logit soft-capping outside Gemma, sliding windows on some Qwen and SmolLM3 layers) is
refused with a ConfigError naming the field, never ignored.
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

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "smollm3", "qwen3_moe", "mixtral",
            "deepseek_v2", "deepseek_v3", "gpt_oss")
GEMMAS = ("gemma2", "gemma3_text")
# the sliding-window pattern of Gemma config.json files without layer_types: every n-th layer global
GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3_text": 6}
# a mixture's tensors in each MoE layer: (its MLP module, and the names of expert j's gate, up and down projections)
EXPERT_TENSORS = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                  "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                  "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                  "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
# (family, scoring_func, topk_method) -> the ModelConfig router fields, as DeepSeek's reference code routes;
# a grouped router (expert_group_score) takes n_group and topk_group as its groups. The first of a family: its default
DEEPSEEK_ROUTERS = {
    ("deepseek_v2", "softmax", "greedy"): {},
    ("deepseek_v2", "softmax", "group_limited_greedy"): {"expert_group_score": "max"},
    ("deepseek_v3", "sigmoid", "noaux_tc"): {"router_score": "sigmoid", "expert_selection_bias": True,
                                             "expert_group_score": "top2_sum"},
}
LATENT_FAMILIES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention


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
    latent = _latent_fields(hf, family, n_layers, n_heads)
    if latent:  # a query head is qk_nope + qk_rope wide (HF's head_dim names the rotated part only)
        head_dim = latent.pop("head_dim")
    gemma = family in GEMMAS
    thetas, scaling, rope_attention_factor = _rope(hf, family, head_dim)
    gpt_oss = family == "gpt_oss"
    windows = _layer_windows(hf, family, n_layers)
    attention_scale = _float(hf, "query_pre_attn_scalar", head_dim) ** -0.5 if gemma else None
    if rope_attention_factor != 1.0:  # LongRoPE's m on q and k: m**2 on every score
        attention_scale = rope_attention_factor ** 2 / head_dim ** 0.5
    if latent:
        attention_scale = _latent_score_scale(hf, head_dim)
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads,
        n_kv_heads=_int(hf, "num_key_value_heads", "n_kv_heads", n_heads), d_ff=_int(hf, "intermediate_size", "d_ff"),
        vocab_size=_int(hf, "vocab_size", "vocab_size"), max_seq_len=_int(hf, "max_position_embeddings", "max_seq_len"),
        head_dim=head_dim, rope_theta=thetas["full_attention"], norm_eps=_float(hf, "rms_norm_eps", 1e-6),
        tie_embeddings=_bool(hf, "tie_word_embeddings", gemma),
        qkv_bias=family == "qwen2" or _bool(hf, "attention_bias", False),
        qk_norm=family in ("qwen3", "gemma3_text", "qwen3_moe"),
        sandwich_norms=gemma,
        embedding_scale=float(np.float32(d_model ** 0.5)) if gemma else 1.0,
        activation="gelu_tanh" if gemma else "swiglu_oai" if gpt_oss else "silu",
        attention_scale=attention_scale,
        layer_windows=windows,
        rope_local_theta=thetas["sliding_attention"] if windows is not None and family == "gemma3_text" else None,
        rope_scaling=scaling,
        attn_softcap=_softcap(hf, "attn_logit_softcapping") if gemma else None,
        final_softcap=_softcap(hf, "final_logit_softcapping") if gemma else None,
        nope_layers=_nope_layers(hf, n_layers) if family == "smollm3" else (),
        attention_sinks=gpt_oss,
        attention_out_bias=gpt_oss and _bool(hf, "attention_bias", False),
        **_experts(hf, family, n_layers),
        **latent,
    )


def _experts(hf, family, n_layers):
    # the ModelConfig fields of a mixture of experts ({} for a dense family)
    if family not in EXPERT_TENSORS and family != "gpt_oss":
        return {}
    if family in LATENT_FAMILIES:
        return _deepseek_experts(hf, family, n_layers)
    name = "num_experts" if "num_experts" in hf else "num_local_experts"  # older Qwen3-MoE configs: num_experts
    fields = {"n_experts": _int(hf, name, "n_experts"), "n_experts_used": _int(hf, "num_experts_per_tok", "n_experts")}
    if family == "mixtral":  # every layer: experts intermediate_size wide, the chosen scores renormalised
        return {**fields, "expert_d_ff": _int(hf, "intermediate_size", "d_ff"), "norm_topk_prob": True}
    if family == "gpt_oss":  # softmax over the k best logits: the renormalised top-k of the softmax; biases
        return {**fields, "expert_d_ff": _int(hf, "intermediate_size", "d_ff"), "norm_topk_prob": True,
                "router_bias": True, "expert_bias": True}
    if hf.get("mlp_only_layers", []) != [] or hf.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"this qwen3_moe checkpoint has dense layers (mlp_only_layers={hf.get('mlp_only_layers')!r}, "
                          f"decoder_sparse_step={hf.get('decoder_sparse_step')!r}), which kvref does not compute yet; "
                          "it reads a mixture in every layer")
    return {**fields, "expert_d_ff": _int(hf, "moe_intermediate_size", "d_ff"),
            "norm_topk_prob": _bool(hf, "norm_topk_prob", False)}


def _deepseek_experts(hf, family, n_layers):
    # DeepSeek-V2/V3: every layer from first_k_dense_replace on is a mixture beside one shared MLP
    # (n_shared_experts experts wide); {} when no layer is (no routed experts, or every layer dense)
    dense = bounded_int(hf.get("first_k_dense_replace", 0), "config.json first_k_dense_replace", 0,
                        CONFIG_CEILINGS["n_layers"])
    if hf.get("n_routed_experts") in (None, 0) or dense >= n_layers:
        return {}
    freq = hf.get("moe_layer_freq", 1)
    if freq != 1 or isinstance(freq, bool):
        raise ConfigError(f"this {family} checkpoint has moe_layer_freq={hf['moe_layer_freq']!r}, which kvref does "
                          "not compute; it reads a mixture in every layer from first_k_dense_replace on (1)")
    scoring, method = hf.get("scoring_func"), hf.get("topk_method")
    default = next(key for key in DEEPSEEK_ROUTERS if key[0] == family)  # for what config.json does not name
    router = (family, default[1] if scoring is None else scoring, default[2] if method is None else method)
    if router not in DEEPSEEK_ROUTERS:
        raise ConfigError(f"{family}: scoring_func={scoring!r} with topk_method={method!r} is not a router kvref "
                          f"computes; expected one of {[key[1:] for key in DEEPSEEK_ROUTERS if key[0] == family]}")
    fields = dict(DEEPSEEK_ROUTERS[router])
    if "expert_group_score" in fields:
        fields.update(n_expert_groups=_int(hf, "n_group", "n_experts"),
                      n_expert_groups_used=_int(hf, "topk_group", "n_experts"))
    Fx = _int(hf, "moe_intermediate_size", "d_ff")
    shared = hf.get("n_shared_experts")  # None: no shared expert (DeepSeek's reference code)
    return {**fields, "n_experts": _int(hf, "n_routed_experts", "n_experts"),
            "n_experts_used": _int(hf, "num_experts_per_tok", "n_experts"), "expert_d_ff": Fx,
            "first_dense_layers": dense, "norm_topk_prob": _bool(hf, "norm_topk_prob", False),
            "routed_scaling_factor": _float(hf, "routed_scaling_factor", 1.0),
            "shared_expert_d_ff": 0 if shared in (None, 0) else _int(hf, "n_shared_experts", "n_experts") * Fx}


def _latent_fields(hf, family, n_layers, n_heads) -> dict:
    # DeepSeek-V2/V3 -> the ModelConfig MLA fields (and head_dim); {} for the other families
    if family not in LATENT_FAMILIES:
        return {}
    if _int(hf, "num_key_value_heads", "n_kv_heads", n_heads) != n_heads:
        raise ConfigError(f"{family}: num_key_value_heads must equal num_attention_heads ({n_heads}): every head "
                          "expands the latent to its own K and V")
    nope, rope = _int(hf, "qk_nope_head_dim", "head_dim"), _int(hf, "qk_rope_head_dim", "head_dim")
    q_lora = hf.get("q_lora_rank")
    return {"head_dim": nope + rope, "kv_lora_rank": _int(hf, "kv_lora_rank", "head_dim"),
            "q_lora_rank": None if q_lora is None else _int(hf, "q_lora_rank", "head_dim"),
            "qk_rope_head_dim": rope, "v_head_dim": _int(hf, "v_head_dim", "head_dim")}


def weights_from_hf(hf: dict, tensors, dtype="float32"):
    """(ModelConfig, Weights) from a config.json dict and {HF tensor name: array}, converted to `dtype`.

    Every tensor the config implies must be present with its shape; ShapeError names a missing or
    misshapen one.
    """
    config = config_from_hf(hf)
    c = config
    gemma = hf["model_type"] in GEMMAS
    fused = hf["model_type"] == "phi3"  # qkv_proj and gate_up_proj
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

    def experts(name, shape):
        # [X, *shape]: expert j's matrix, the tensor name.format(j), at j
        return np.stack([get(name.format(j), shape) for j in range(c.n_experts)])

    def attention(attn):
        # one layer's attention projections: K/V heads (Phi-3: from one fused qkv_proj), or the latent ones (MLA)
        if c.latent:
            return latent_attention(attn)
        if fused:  # Phi-3: rows [Q | K | V] of qkv_proj
            wq, wk, wv = np.split(get(attn + "qkv_proj.weight", (c.q_dim + 2 * c.kv_dim, E)),
                                  [c.q_dim, c.q_dim + c.kv_dim])
        else:
            wq, wk, wv = (get(attn + f"{x}_proj.weight", (n, E)) for x, n in (("q", c.q_dim), ("k", c.kv_dim),
                                                                             ("v", c.kv_dim)))
        return dict(wq=pairs_adjacent(wq, c.n_heads), wk=pairs_adjacent(wk, c.n_kv_heads),
                    wv=np.ascontiguousarray(wv), wo=get(attn + "o_proj.weight", (E, c.q_dim)))

    def latent_attention(attn):
        R, Dr, Dv, Q = c.kv_lora_rank, c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank
        rotated = rope_rows_adjacent if half_split else (lambda a, heads, width: a)
        low_rank_q = {} if Q is None else dict(wq_a=get(attn + "q_a_proj.weight", (Q, E)),
                                               q_a_norm=get(attn + "q_a_layernorm.weight", (Q,)))
        wq = get(attn + ("q_proj.weight" if Q is None else "q_b_proj.weight"), (c.q_dim, E if Q is None else Q))
        return dict(**low_rank_q, wq=rotated(wq, c.n_heads, c.head_dim), wk=None, wv=None,
                    wkv_a=rotated(get(attn + "kv_a_proj_with_mqa.weight", (R + Dr, E)), 1, R + Dr),
                    kv_a_norm=get(attn + "kv_a_layernorm.weight", (R,)),
                    wkv_b=get(attn + "kv_b_proj.weight", (c.n_heads * (c.qk_nope_head_dim + Dv), R)),
                    wo=get(attn + "o_proj.weight", (E, c.n_heads * Dv)))

    def rope_rows_adjacent(a, heads, width):
        # rows [heads * width, K], the last Dr of each head rotated in half-split pairs -> adjacent pairs
        Dr = c.qk_rope_head_dim
        by_head = np.array(a).reshape(heads, width, -1)  # a copy: [heads, width, K]
        by_head[:, width - Dr:] = half_split_to_adjacent(by_head[:, width - Dr:].reshape(heads * Dr, -1), heads,
                                                         Dr).reshape(heads, Dr, -1)
        return by_head.reshape(a.shape)

    half_split = c.latent and hf["model_type"] == "deepseek_v3" and not _bool(hf, "rope_interleave", True)
    E, F, Fx, Fs = c.d_model, c.d_ff, c.experts_d_ff, c.shared_expert_d_ff
    layers = []
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        post_attention = norm(p + "post_attention_layernorm.weight", E)
        lw = LayerWeights(
            attn_norm=norm(p + "input_layernorm.weight", E),
            **attention(attn),
            # Gemma names its pre-MLP norm pre_feedforward_layernorm; its post_attention_layernorm is
            # the sandwich norm on the attention output. Llama's post_attention_layernorm is the pre-MLP norm.
            ffn_norm=norm(p + "pre_feedforward_layernorm.weight", E) if gemma else post_attention,
            w_gate=None, w_up=None, w_down=None,
        )
        if c.moe_layer(i) and hf["model_type"] == "gpt_oss":
            gpt_oss_experts(lw, get, p + "mlp.", c)
        elif c.moe_layer(i):
            module, (gate, up, down) = EXPERT_TENSORS[hf["model_type"]]
            lw.router = get(f"{p}{module}.gate.weight", (c.n_experts, E))
            lw.experts_gate = experts(f"{p}{module}.experts.{{}}.{gate}.weight", (Fx, E))
            lw.experts_up = experts(f"{p}{module}.experts.{{}}.{up}.weight", (Fx, E))
            lw.experts_down = experts(f"{p}{module}.experts.{{}}.{down}.weight", (E, Fx))
            if c.expert_selection_bias:
                lw.expert_selection_bias = get(f"{p}{module}.gate.e_score_correction_bias", (c.n_experts,))
            if c.shared_expert_d_ff:
                lw.shared_gate, lw.shared_up, lw.shared_down = (
                    get(f"{p}{module}.shared_experts.{x}_proj.weight", shape)
                    for x, shape in (("gate", (Fs, E)), ("up", (Fs, E)), ("down", (E, Fs))))
        else:
            if fused:  # Phi-3: rows [gate | up] of gate_up_proj
                w_gate, w_up = np.split(get(p + "mlp.gate_up_proj.weight", (2 * F, E)), 2)
            else:
                w_gate, w_up = get(p + "mlp.gate_proj.weight", (F, E)), get(p + "mlp.up_proj.weight", (F, E))
            lw.w_gate, lw.w_up = np.ascontiguousarray(w_gate), np.ascontiguousarray(w_up)
            lw.w_down = get(p + "mlp.down_proj.weight", (E, F))
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
        if c.attention_sinks:
            lw.sinks = get(attn + "sinks", (c.n_heads,))  # one per query head: no RoPE pair order to change
        if c.attention_out_bias:
            lw.bo = get(attn + "o_proj.bias", (E,))
        layers.append(lw)
    embeddings = get("model.embed_tokens.weight", (c.vocab_size, E))
    output = embeddings if c.tie_embeddings else get("lm_head.weight", (c.vocab_size, E))
    return config, Weights(embeddings, layers, norm("model.norm.weight", E), output)


def gpt_oss_experts(lw, get, mlp, c):
    # gpt-oss's MoE tensors -> the decoder's: its router (mlp.router, with a bias), and its experts as two
    # stacks that multiply from the left (x @ W): gate_up_proj [X, E, 2 Fx], gate in the even columns and up
    # in the odd ones, and down_proj [X, Fx, E], each with a bias. Split and transposed once, here, to the
    # [X, Fx, E] and [X, E, Fx] stacks (out x in) every other family's experts are.
    X, E, Fx = c.n_experts, c.d_model, c.experts_d_ff
    lw.router, lw.router_bias = get(mlp + "router.weight", (X, E)), get(mlp + "router.bias", (X,))
    gate_up = get(mlp + "experts.gate_up_proj", (X, E, 2 * Fx))
    gate_up_bias = get(mlp + "experts.gate_up_proj_bias", (X, 2 * Fx))
    lw.experts_gate = np.ascontiguousarray(gate_up[:, :, 0::2].transpose(0, 2, 1))  # [X, Fx, E]
    lw.experts_up = np.ascontiguousarray(gate_up[:, :, 1::2].transpose(0, 2, 1))  # [X, Fx, E]
    lw.experts_gate_bias = np.ascontiguousarray(gate_up_bias[:, 0::2])  # [X, Fx]
    lw.experts_up_bias = np.ascontiguousarray(gate_up_bias[:, 1::2])  # [X, Fx]
    lw.experts_down = np.ascontiguousarray(get(mlp + "experts.down_proj", (X, Fx, E)).transpose(0, 2, 1))  # [X, E, Fx]
    lw.experts_down_bias = get(mlp + "experts.down_proj_bias", (X, E))


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
    gemma = family in GEMMAS
    unsupported = {
        "mlp_bias": hf.get("mlp_bias", False),
        "attention_bias (on the output projection too)": family in ("llama", "smollm3", "gemma2")
        and hf.get("attention_bias", False),
        "attention_bias (on the latent projections)": family in LATENT_FAMILIES and hf.get("attention_bias", False),
        "final_logit_softcapping": not gemma and hf.get("final_logit_softcapping"),
        "attn_logit_softcapping": not gemma and hf.get("attn_logit_softcapping"),
        "use_bidirectional_attention": hf.get("use_bidirectional_attention", False),
        "use_sliding_window (Qwen, SmolLM3)": family in ("qwen2", "qwen3", "qwen3_moe", "smollm3")
        and hf.get("use_sliding_window", False),
    }
    if family == "gpt_oss":  # its experts' clamped SwiGLU has these constants built into swiglu_oai
        for name, value in (("swiglu_alpha", spec_ops.SWIGLU_OAI_ALPHA), ("swiglu_limit", spec_ops.SWIGLU_OAI_LIMIT)):
            unsupported[f"{name}={hf.get(name)!r} (expected {value})"] = hf.get(name, value) != value
    act = hf.get("hidden_activation" if gemma else "hidden_act")
    expected = "gelu_pytorch_tanh" if gemma else "silu"
    unsupported[f"activation {act!r} (expected {expected!r})"] = act not in (None, expected)
    bad = [name for name, value in unsupported.items() if value]
    if bad:
        raise ConfigError(f"this {family} checkpoint uses {', '.join(bad)}, which kvref does not compute yet")


def _softcap(hf, name):
    # a Gemma soft cap: None (absent or null) or a positive number
    return None if hf.get(name) is None else _float(hf, name, None)


def _nope_layers(hf, n_layers):
    # SmolLM3: no_rope_layers holds 1 for a layer that rotates and 0 for a NoPE one; without it, every
    # no_rope_layer_interval-th layer is NoPE (transformers' and llama.cpp's rule)
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = _int(hf, "no_rope_layer_interval", "n_layers", 4)
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(flags, list) or len(flags) != n_layers or any(f not in (0, 1) or isinstance(f, float)
                                                                    for f in flags):
        raise ConfigError(f"no_rope_layers {flags!r} must hold 0 (NoPE) or 1 (RoPE) for each of {n_layers} layers")
    return tuple(i for i, rotates in enumerate(flags) if not rotates)


def _rope(hf, family, head_dim):
    # -> ({"full_attention": base, "sliding_attention": base}, scaling or None, LongRoPE's attention factor
    # or 1.0); transformers 5 writes rope_parameters (per layer type for Gemma 3), earlier versions
    # rope_theta, rope_local_base_freq and rope_scaling
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
        rotary = p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if rotary != 1.0:
            raise ConfigError(f"partial_rotary_factor={rotary!r} (RoPE on part of each head, as Phi-4-mini) is not "
                              "computed by kvref yet; it rotates whole heads (1.0)")
        scalings.add(_rope_scaling(hf, p, kind, head_dim))
    if len(scalings) > 1:
        raise ConfigError(f"RoPE scaling that differs between layer types ({per_type}) is not computed by kvref yet")
    scaling, factor = scalings.pop()
    return thetas, scaling, factor


def _rope_scaling(hf, p, kind, head_dim):
    # a rope_parameters entry -> (ModelConfig.rope_scaling, LongRoPE's attention factor or 1.0)
    kind_of = _rope_type(p)
    if kind_of in ("longrope", "su"):  # "su": Phi-3's first name for it
        return _longrope(hf, p, kind, head_dim)
    return _plain_rope_scaling(p, kind, kind_of), 1.0


def _rope_type(p):
    # transformers' key, or "type", which released config.json files older than it say
    return p.get("rope_type", p.get("type", "default"))


def _longrope(hf, p, kind, head_dim):
    # -> (("longrope", short, long, original), attention factor), as transformers computes them: the
    # factor defaults to max_position_embeddings / original (Phi-3), the attention factor to
    # sqrt(1 + ln(factor) / ln(original)) when that exceeds 1
    sets = []
    for name in ("short_factor", "long_factor"):
        f = p.get(name)
        if not isinstance(f, list) or len(f) != head_dim // 2:
            raise ConfigError(f"RoPE {name} ({kind}) must list {head_dim // 2} numbers (one per frequency), got {f!r}")
        sets.append(tuple(bounded_float(v, f"config.json RoPE {name} ({kind})") for v in f))
    original = _int(p, "original_max_position_embeddings", "max_seq_len",
                    hf.get("original_max_position_embeddings"))
    factor = p.get("factor")
    factor = _int(hf, "max_position_embeddings", "max_seq_len") / original if factor is None else \
        _float_field(p, kind, "factor")
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else float(np.sqrt(1 + np.log(factor) / np.log(original)))
    else:
        attention_factor = _float_field(p, kind, "attention_factor")
    return ("longrope", *sets, original), attention_factor


def _plain_rope_scaling(p, kind, kind_of):
    # a rope_parameters entry of any other type -> ModelConfig.rope_scaling
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
                      "RoPE and the linear, llama3, longrope and yarn scalings")


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


def _latent_score_scale(hf, head_dim):
    # DeepSeek's score scale (transformers' yarn_apply_mscale): with a RoPE scaling and mscale_all_dim,
    # 1/sqrt(D) times YaRN's rule for the scaling's factor with mscale_all_dim as its coefficient, squared;
    # else None (1/sqrt(D)). YaRN's own attention factor (rope_scaling[5]) is another matter: it multiplies
    # only the rotated parts of q and k (kvref.spec.decoder.latent_rope_scale).
    p = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if _rope_type(p) == "default" or not p.get("mscale_all_dim"):
        return None
    m = spec_ops.yarn_mscale(bounded_float(p.get("factor"), "config.json RoPE factor (with mscale_all_dim)"),
                             bounded_float(p["mscale_all_dim"], "config.json RoPE mscale_all_dim"))
    return m * m / head_dim ** 0.5


def _float_field(p, kind, name):
    if name not in p:
        raise ConfigError(f"RoPE parameters {p!r} ({kind}) are incomplete: {name} is missing")
    return bounded_float(p[name], f"config.json RoPE {name} ({kind})")


def _layer_windows(hf, family, n_layers):
    # per layer: None (global) or the sliding window W
    window = None if hf.get("sliding_window") is None else _int(hf, "sliding_window", "max_seq_len")
    if family in ("mistral", "mixtral", "phi3"):  # transformers windows every layer of these (llama.cpp runs Phi-3 without)
        return None if window is None else (window,) * n_layers
    if family not in (*GEMMAS, "gpt_oss"):
        return None
    kinds = hf.get("layer_types")
    if kinds is None:  # older config.json files: every pattern-th layer is global (gpt-oss: every other)
        name = "sliding_window_pattern" if "sliding_window_pattern" in hf else "_sliding_window_pattern"
        pattern = _int(hf, name, "n_layers", {**GEMMA_GLOBAL_EVERY, "gpt_oss": 2}[family])
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    if (not isinstance(kinds, list) or len(kinds) != n_layers
            or any(k not in ("full_attention", "sliding_attention") for k in kinds)):
        raise ConfigError(f"layer_types {kinds!r} must name full_attention or sliding_attention for each of "
                          f"{n_layers} layers")
    if window is None and "sliding_attention" in kinds:
        raise ConfigError("config.json has sliding_attention layers but no sliding_window")
    return tuple(window if k == "sliding_attention" else None for k in kinds)
