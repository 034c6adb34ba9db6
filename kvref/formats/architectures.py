"""The architectures of a GGUF file: metadata keys -> ModelConfig, tensor names -> Weights.

`general.architecture` names the family, and its keys are prefixed with that name (`llama.block_count`,
`qwen3.attention.head_count`, ...):

    llama    Llama, SmolLM, Mistral,     llama.cpp's converter permutes each head's Q/K rows so that RoPE
             Mixtral (with experts)      rotates adjacent pairs (x[2i], x[2i+1]): read as stored
    smollm3  SmolLM3: NoPE layers
    qwen2    Qwen 2/2.5: Q/K/V biases    these keep the checkpoint's row order, where RoPE rotates
    qwen3    Qwen 3: QK-norm             (x[i], x[i + D/2]) (llama.cpp's NEOX mode): the rows (and their
    qwen3moe Qwen3-MoE: QK-norm, experts biases and QK-norm gains) are reordered once here, as
    gemma2   Gemma 2: soft caps          kvref.formats.hf does for every HF checkpoint
    gemma3   Gemma 3
    phi3     Phi-3/3.5: fused tensors, LongRoPE
    deepseek2  DeepSeek-V2/V3 (MLA)      adjacent pairs as stored; the converter writes the latent
                                         attention as MQA (head_count_kv 1, key_length R + Dr,
                                         value_length R) and splits kv_b into attn_k_b [H, R, Dn]
                                         (W_UK transposed) and attn_v_b [H, Dv, R] (W_UV), which are
                                         joined back into wkv_b here; blocks from
                                         leading_dense_block_count on are mixtures

A mixture of experts (`<arch>.expert_count`, in llama, qwen3moe and deepseek2 files) stores each MoE
layer's experts as one 3-D tensor per projection (ffn_gate_exps, ffn_up_exps [X, Fx, E]; ffn_down_exps
[X, E, Fx]) and its router as ffn_gate_inp [X, E]; llama.cpp renormalises the chosen experts' softmax
scores for llama and qwen3moe, and so does kvref. deepseek2 files say their router: leading dense
blocks, a shared expert (ffn_*_shexp), softmax or sigmoid gating, expert groups scored by their two
best (sigmoid only), a selection bias (exp_probs_b.bias), renormalisation and a weights scale. In
llama and qwen3moe files those keys are refused by name.

Gemma 2 and 3 files store their norm gains as 1 + w already. What they do not carry, llama.cpp assumes
and so does kvref: a global layer after every windowed one (Gemma 2) or every 5 (Gemma 3), RoPE base
10,000 on Gemma 3's windowed layers, embeddings scaled by sqrt(d_model), and scores scaled by
1/sqrt(head_dim) (query_pre_attn_scalar = head_dim, as in every released Gemma 3 text model and Gemma 2
but its 27B, which llama.cpp recognises by its 46 blocks and scales by 1/sqrt(d_model / n_heads)).
SmolLM3 files carry no NoPE pattern: llama.cpp takes every 4th layer, as SmolLM3-3B has it. Phi-3 files
fuse Q, K and V (attn_qkv) and gate and up (ffn_up, [gate | up] rows), split here, and carry LongRoPE as
two tensors of divisors (rope_factors_short, rope_factors_long), the original context length and the
attention factor (rope.scaling.attn_factor, folded into attention_scale squared, as kvref.formats.hf).
docs/architectures.md has the table; anything else a file asks for (other RoPE scaling, partial RoPE)
is refused by name.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import GGUFError
from ..limits import CONFIG_CEILINGS, bounded_float, bounded_int, check_layer_count
from ..spec import ops as spec_ops
from ..spec.ggml import QuantizedTensor
from ..weights import LayerWeights, Weights

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "qwen3moe", "deepseek2", "gpt-oss")
HALF_SPLIT_PAIRS = ("qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe", "gpt-oss")  # Q/K rows in rotate_half order in the file
GEMMAS = ("gemma2", "gemma3")
# llama.cpp's sliding-window patterns: layer i is global if (i + 1) % n == 0
GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # llama.cpp's defaults
GEMMA2_27B_BLOCKS = 46  # llama.cpp's sign of Gemma 2 27B, whose query_pre_attn_scalar is d_model / n_heads
SMOLLM3_NOPE_EVERY = 4  # llama.cpp's SmolLM3: layer i is NoPE if (i + 1) % 4 == 0
LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
MOE_ARCHITECTURES = ("llama", "qwen3moe", "gpt-oss", "deepseek2")  # where <arch>.expert_count makes a mixture of experts
GPT_OSS_WINDOW_EVERY = 2  # llama.cpp's sliding-window pattern for gpt-oss: layer i is windowed if i % 2 == 0
FFN_NORM = {"gpt-oss": "post_attention_norm"}  # the pre-MLP norm's name where it is not ffn_norm
# router keys llama.cpp may write, which kvref does not read from GGUF yet -> the values that change nothing
UNREAD_EXPERT_KEYS = {"expert_shared_count": (0,), "leading_dense_block_count": (0,), "expert_group_count": (0, 1),
                      "expert_gating_func": (0, 1), "expert_weights_scale": (0, 1)}  # gating func 1: softmax
# deepseek2's expert_gating_func -> router_score; 0 (absent, as in the first V2 files): softmax, as llama.cpp reads it
DEEPSEEK2_GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}

# LayerWeights field -> GGUF tensor name within block i (the optional ones when the config asks)
LAYER_TENSORS = {
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
    "ffn_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
}
BIAS_TENSORS = {"bq": "attn_q", "bk": "attn_k", "bv": "attn_v"}  # .bias
QK_NORM_TENSORS = {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
SANDWICH_TENSORS = {"post_attn_norm": "post_attention_norm", "post_ffn_norm": "post_ffw_norm"}
DENSE_MLP_TENSORS = ("w_gate", "w_up", "w_down")  # a MoE layer has these instead:
EXPERT_TENSORS = {"router": "ffn_gate_inp", "experts_gate": "ffn_gate_exps", "experts_up": "ffn_up_exps",
                  "experts_down": "ffn_down_exps"}
# gpt-oss's tensors beside those: LayerWeights field -> name within block i, when the config asks
SINK_TENSORS = {"sinks": "attn_sinks.weight"}  # config.attention_sinks
OUT_BIAS_TENSORS = {"bo": "attn_output.bias"}  # config.attention_out_bias
ROUTER_BIAS_TENSORS = {"router_bias": "ffn_gate_inp.bias"}  # config.router_bias
EXPERT_BIAS_TENSORS = {"experts_gate_bias": "ffn_gate_exps.bias", "experts_up_bias": "ffn_up_exps.bias",
                       "experts_down_bias": "ffn_down_exps.bias"}  # config.expert_bias
SHARED_EXPERT_TENSORS = {"shared_gate": "ffn_gate_shexp", "shared_up": "ffn_up_shexp", "shared_down": "ffn_down_shexp"}
SELECTION_BIAS_TENSOR = "exp_probs_b"  # .bias: DeepSeek-V3's e_score_correction_bias
ROTATED = ("wq", "wk", "bq", "bk", "q_norm", "k_norm")  # what RoPE rotates: rows in pair order
FUSED = ("phi3",)  # attn_qkv rows [Q | K | V], ffn_up rows [gate | up]


def config_from_metadata(metadata: dict, tensor_names, rope_factors=None, longrope_factors=None) -> ModelConfig:
    """ModelConfig from the `<architecture>.*` keys; anything the spec does not implement is refused by name.

    Every number is type-checked and bounded (kvref.limits) before it sizes anything, and the block
    count is compared with the blocks whose tensors the file holds before any per-layer table is made.
    rope_factors: the values of the file's rope_freqs.weight tensor (Llama 3.1+: one divisor per
    RoPE frequency), which a file with that tensor needs; longrope_factors: the values of its
    LONGROPE_TENSORS (Phi-3), short then long, which a file with them needs.
    """
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise GGUFError(f"architecture {arch!r} is not supported; expected one of {ARCHITECTURES}")

    def key(name, default=None):
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"metadata key {arch}.{name} is missing")
        return value

    def integer(name, field, default=None):
        return bounded_int(key(name, default), f"{arch}.{name}", 1, CONFIG_CEILINGS[field], GGUFError)

    def number(name, default=None):
        return bounded_float(key(name, default), f"{arch}.{name}", GGUFError)

    n_heads = integer("attention.head_count", "n_heads")
    d_model = integer("embedding_length", "d_model")
    latent = _latent_metadata(metadata, arch, integer) if arch == "deepseek2" else {}
    head_dim = latent.pop("head_dim") if latent else integer("attention.key_length", "head_dim",
                                                              max(d_model // n_heads, 1))
    rotary = integer("rope.dimension_count", "head_dim", head_dim)
    if not latent and rotary != head_dim:
        raise GGUFError(f"{arch}.rope.dimension_count={rotary} (partial RoPE) is not supported; expected {head_dim}")
    rope_scaling = _rope_scaling(metadata, arch, tensor_names, rope_factors, rotary)
    attention_scale = None
    if any(name in tensor_names for name in LONGROPE_TENSORS):
        rope_scaling = _longrope(arch, tensor_names, longrope_factors, head_dim, rope_scaling,
                                 integer("rope.scaling.original_context_length", "max_seq_len"))
        attention_factor = number("rope.scaling.attn_factor", 1.0)
        attention_scale = attention_factor ** 2 / head_dim ** 0.5 if attention_factor != 1.0 else None
    n_layers = integer("block_count", "n_layers")
    check_layer_count(n_layers, tensor_names, "blk.", f"{arch}.block_count", GGUFError)
    gemma = arch in GEMMAS
    windows = None
    if gemma:
        window = integer("attention.sliding_window", "max_seq_len")
        windows = tuple(None if (i + 1) % GEMMA_GLOBAL_EVERY[arch] == 0 else window for i in range(n_layers))
        if arch == "gemma2" and n_layers == GEMMA2_27B_BLOCKS:
            attention_scale = (d_model / n_heads) ** -0.5
    gpt_oss = arch == "gpt-oss"
    if gpt_oss:
        window = integer("attention.sliding_window", "max_seq_len")
        windows = tuple(window if i % GPT_OSS_WINDOW_EVERY == 0 else None for i in range(n_layers))
    if arch == "phi3" and metadata.get("phi3.attention.sliding_window", 0):  # 0: Phi-4, no window
        windows = (integer("attention.sliding_window", "max_seq_len"),) * n_layers
    softcaps = dict.fromkeys(GEMMA2_SOFTCAPS)  # None: no cap
    if arch == "gemma2":  # always capped: at 50 and 30 unless the file says otherwise (llama.cpp's defaults)
        softcaps = {name: number(name, cap) for name, cap in GEMMA2_SOFTCAPS.items()}
    elif arch == "gemma3":  # where the file says
        softcaps.update({name: number(name) for name in GEMMA2_SOFTCAPS if f"{arch}.{name}" in metadata})
    return ModelConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_heads if latent else integer("attention.head_count_kv", "n_kv_heads", n_heads),
        head_dim=head_dim,
        d_ff=integer("feed_forward_length", "d_ff"),
        vocab_size=_vocab_size(metadata, arch),
        max_seq_len=integer("context_length", "max_seq_len"),
        rope_theta=number("rope.freq_base", 10000.0),
        norm_eps=number("attention.layer_norm_rms_epsilon"),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias=arch in ("qwen2", "gpt-oss"),
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
        sandwich_norms=gemma,
        embedding_scale=float(np.float32(d_model ** 0.5)) if gemma else 1.0,
        activation="gelu_tanh" if gemma else "swiglu_oai" if gpt_oss else "silu",
        attention_scale=attention_scale,
        layer_windows=windows,
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA if arch == "gemma3" else None,
        rope_scaling=rope_scaling,
        attn_softcap=softcaps["attn_logit_softcapping"],
        final_softcap=softcaps["final_logit_softcapping"],
        nope_layers=tuple(i for i in range(n_layers) if (i + 1) % SMOLLM3_NOPE_EVERY == 0) if arch == "smollm3" else (),
        attention_sinks=gpt_oss,
        attention_out_bias=gpt_oss,
        **_experts(metadata, arch, integer, number, tensor_names),
        **latent,
    )


def _experts(metadata, arch, integer, number, tensor_names):
    # the ModelConfig fields of a mixture of experts ({} for a dense file: no expert_count, or 0)
    what = f"{arch}.expert_count"
    if arch not in MOE_ARCHITECTURES or what not in metadata:
        return {}
    n_experts = bounded_int(metadata[what], what, 0, CONFIG_CEILINGS["n_experts"], GGUFError)
    if n_experts == 0:
        return {}
    if arch == "deepseek2":
        return _deepseek2_experts(metadata, arch, integer, number, tensor_names, n_experts)
    unread = [f"{arch}.{name}={metadata[f'{arch}.{name}']!r}" for name, plain in UNREAD_EXPERT_KEYS.items()
              if not _one_of(metadata.get(f"{arch}.{name}", plain[0]), plain)]
    if unread:
        raise GGUFError(f"this file's router sets {', '.join(unread)}, which kvref does not read from GGUF yet")
    biases = {"router_bias": True, "expert_bias": True} if arch == "gpt-oss" else {}
    return {"n_experts": n_experts, "n_experts_used": integer("expert_used_count", "n_experts"),
            "expert_d_ff": integer("expert_feed_forward_length", "d_ff", metadata.get(f"{arch}.feed_forward_length")),
            "norm_topk_prob": True, **biases}


def _deepseek2_experts(metadata, arch, integer, number, tensor_names, n_experts):
    # DeepSeek-V2/V3's router: blocks from leading_dense_block_count on are mixtures beside a shared MLP
    # (expert_shared_count experts wide); {} when every block is dense
    n_layers = integer("block_count", "n_layers")
    what = f"{arch}.leading_dense_block_count"
    dense = bounded_int(metadata.get(what, 0), what, 0, CONFIG_CEILINGS["n_layers"], GGUFError)
    if dense >= n_layers:
        return {}
    what = f"{arch}.expert_gating_func"
    gating = metadata.get(what, 0)
    if not _one_of(gating, DEEPSEEK2_GATING):
        raise GGUFError(f"{what}={gating!r} is not a gating kvref computes; expected 1 (softmax) or 2 (sigmoid)")
    score = DEEPSEEK2_GATING[int(gating)]
    groups = {"n_expert_groups": integer("expert_group_count", "n_experts", 1),
              "n_expert_groups_used": integer("expert_group_used_count", "n_experts", 1)}
    if groups["n_expert_groups"] > 1 and score == "softmax":  # DeepSeek-V2's group_limited_greedy
        raise GGUFError(f"{arch}.expert_group_count={groups['n_expert_groups']} with softmax gating is not read: "
                        "DeepSeek-V2 scores a group by its best expert, llama.cpp by its two best")
    norm = metadata.get(f"{arch}.expert_weights_norm", False)
    if not isinstance(norm, (bool, np.bool_)):
        raise GGUFError(f"{arch}.expert_weights_norm={norm!r} must be true or false")
    Fx = integer("expert_feed_forward_length", "d_ff")
    shared = bounded_int(metadata.get(f"{arch}.expert_shared_count", 0), f"{arch}.expert_shared_count", 0,
                         CONFIG_CEILINGS["n_experts"], GGUFError)
    return {"n_experts": n_experts, "n_experts_used": integer("expert_used_count", "n_experts"), "expert_d_ff": Fx,
            "first_dense_layers": dense, "router_score": score, "expert_group_score": "top2_sum", **groups,
            "expert_selection_bias": f"blk.{dense}.{SELECTION_BIAS_TENSOR}.bias" in tensor_names,
            "norm_topk_prob": bool(norm), "routed_scaling_factor": number("expert_weights_scale", 1.0),
            "shared_expert_d_ff": shared * Fx}


def _one_of(value, numbers):
    # a metadata value is one of `numbers` (a number of any type, never a bool, string or array)
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and value in numbers


def _latent_metadata(metadata, arch, integer) -> dict:
    # deepseek2's keys -> the ModelConfig MLA fields (and head_dim, a query head's Dn + Dr)
    R, rope = integer("attention.kv_lora_rank", "head_dim"), integer("rope.dimension_count", "head_dim")
    mqa = (integer("attention.key_length", "head_dim"), integer("attention.value_length", "head_dim"))
    if mqa != (R + rope, R):
        raise GGUFError(f"{arch}.attention.key_length/value_length = {mqa}; the latent attention's MQA view is "
                        f"(kv_lora_rank + rope.dimension_count, kv_lora_rank) = {(R + rope, R)}")
    q_lora = metadata.get(f"{arch}.attention.q_lora_rank")
    return {"head_dim": integer("attention.key_length_mla", "head_dim"), "kv_lora_rank": R,
            "q_lora_rank": None if q_lora is None else integer("attention.q_lora_rank", "head_dim"),
            "qk_rope_head_dim": rope, "v_head_dim": integer("attention.value_length_mla", "head_dim")}


def _vocab_size(metadata, arch):
    # the stated vocab_size, else the number of tokens the tokenizer lists
    what = f"{arch}.vocab_size"
    value = metadata.get(what)
    if value is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        what = "the length of tokenizer.ggml.tokens (no vocab_size key)"
        value = len(tokens) if isinstance(tokens, (list, np.ndarray)) else 0
    return bounded_int(value, what, 1, CONFIG_CEILINGS["vocab_size"], GGUFError)


def _rope_scaling(metadata, arch, tensor_names, rope_factors, head_dim):
    # llama.cpp's two ways: rope.scaling.type linear (+ factor), or a rope_freqs.weight tensor of divisors
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind is not None and not isinstance(kind, str):
        raise GGUFError(f"{arch}.rope.scaling.type={kind!r} must be a string")
    if "rope_freqs.weight" in tensor_names:
        if kind not in ("none", None) or rope_factors is None:
            raise GGUFError(f"a rope_freqs.weight tensor with {arch}.rope.scaling.type={kind!r} is not supported")
        return ("factors", _divisors("rope_freqs.weight", rope_factors, head_dim))
    if kind in ("none", None):
        return None
    if kind == "linear":
        factor = metadata.get(f"{arch}.rope.scaling.factor", 1.0)
        return ("linear", bounded_float(factor, f"{arch}.rope.scaling.factor", GGUFError))
    if kind == "yarn":
        return _yarn(metadata, arch)
    raise GGUFError(f"RoPE scaling {arch}.rope.scaling.type={kind!r} is not supported; kvref reads 'linear', "
                    "'yarn' and Llama 3.1's rope_freqs.weight")


# YaRN keys whose meaning kvref does not compute (DeepSeek's log multiplier, llama.cpp's own factor knobs)
YARN_REFUSED_KEYS = ("rope.scaling.yarn_log_multiplier", "rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor",
                     "rope.scaling.yarn_attn_factor")


def _yarn(metadata, arch):
    # llama.cpp's YaRN (ggml's rope_yarn): factor and original_context_length from the file, beta_fast and
    # beta_slow defaulting to 32 and 1, the correction range always truncated to whole pairs (floor, ceil:
    # ggml_rope_yarn_corr_dims; transformers' truncate flag has no key), attention factor 1 + 0.1 ln(factor)
    refused = [f"{arch}.{k}" for k in YARN_REFUSED_KEYS if f"{arch}.{k}" in metadata]
    if refused:
        raise GGUFError(f"YaRN RoPE with {', '.join(refused)} is not supported")

    def number(name, default=None):
        value = metadata.get(f"{arch}.rope.scaling.{name}", default)
        if value is None:
            raise GGUFError(f"metadata key {arch}.rope.scaling.{name} is missing (YaRN RoPE needs it)")
        return bounded_float(value, f"{arch}.rope.scaling.{name}", GGUFError)

    factor = number("factor")
    original = bounded_int(metadata.get(f"{arch}.rope.scaling.original_context_length"),
                           f"{arch}.rope.scaling.original_context_length", 1, CONFIG_CEILINGS["max_seq_len"], GGUFError)
    return ("yarn", factor, number("yarn_beta_fast", 32.0), number("yarn_beta_slow", 1.0), original,
            spec_ops.yarn_attention_factor(factor), True)


def _longrope(arch, tensor_names, factors, head_dim, other_scaling, original):
    # Phi-3's two tensors of divisors -> ("longrope", short, long, original)
    if other_scaling is not None or not all(name in tensor_names for name in LONGROPE_TENSORS) or factors is None:
        raise GGUFError(f"a {arch} file with LongRoPE needs both {' and '.join(LONGROPE_TENSORS)} and no other RoPE "
                        "scaling")
    return ("longrope", *(_divisors(name, values, head_dim) for name, values in zip(LONGROPE_TENSORS, factors)),
            original)


def _divisors(name, values, head_dim):
    # a RoPE tensor's values -> one positive finite divisor per frequency, as a tuple
    values = np.asarray(values, dtype=np.float64)
    if values.shape != (head_dim // 2,) or not np.all(np.isfinite(values) & (values > 0)):
        raise GGUFError(f"{name} must hold one positive finite divisor per RoPE frequency, shape ({head_dim // 2},); "
                        f"it has shape {values.shape}")
    return tuple(float(f) for f in values)


def expected_shapes(config: ModelConfig, architecture: str = "llama") -> dict:
    """Every tensor name the decoder needs, with its shape in NumPy order ([out, in] for matrices)."""
    E, F, V, D = config.d_model, config.d_ff, config.vocab_size, config.head_dim
    X, Fx = config.n_experts, config.experts_d_ff
    per_layer = {
        "attn_norm.weight": (E,), "attn_q.weight": (config.q_dim, E), "attn_k.weight": (config.kv_dim, E),
        "attn_v.weight": (config.kv_dim, E), "attn_output.weight": (E, config.q_dim),
        f"{FFN_NORM.get(architecture, 'ffn_norm')}.weight": (E,),
    }
    dense = {"ffn_gate.weight": (F, E), "ffn_up.weight": (F, E), "ffn_down.weight": (E, F)}
    if architecture in FUSED:  # Phi-3: Q, K, V in one tensor, gate and up in another
        for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight"):
            del per_layer[name]
        per_layer["attn_qkv.weight"] = (config.q_dim + 2 * config.kv_dim, E)
        dense = {"ffn_up.weight": (2 * F, E), "ffn_down.weight": (E, F)}
    experts = {"ffn_gate_inp.weight": (X, E), "ffn_gate_exps.weight": (X, Fx, E), "ffn_up_exps.weight": (X, Fx, E),
               "ffn_down_exps.weight": (X, E, Fx)}
    if config.shared_expert_d_ff:
        Fs = config.shared_expert_d_ff
        experts.update({"ffn_gate_shexp.weight": (Fs, E), "ffn_up_shexp.weight": (Fs, E),
                        "ffn_down_shexp.weight": (E, Fs)})
    if config.expert_selection_bias:
        experts[f"{SELECTION_BIAS_TENSOR}.bias"] = (X,)
    if config.latent:
        del per_layer["attn_q.weight"], per_layer["attn_k.weight"], per_layer["attn_v.weight"]
        per_layer.update(latent_shapes(config))
    if config.qkv_bias:
        per_layer.update({"attn_q.bias": (config.q_dim,), "attn_k.bias": (config.kv_dim,),
                          "attn_v.bias": (config.kv_dim,)})
    if config.qk_norm:
        per_layer.update({"attn_q_norm.weight": (D,), "attn_k_norm.weight": (D,)})
    if config.sandwich_norms:
        per_layer.update({"post_attention_norm.weight": (E,), "post_ffw_norm.weight": (E,)})
    if config.attention_sinks:
        per_layer["attn_sinks.weight"] = (config.n_heads,)
    if config.attention_out_bias:
        per_layer["attn_output.bias"] = (E,)
    if config.router_bias:
        experts["ffn_gate_inp.bias"] = (X,)
    if config.expert_bias:
        experts.update({"ffn_gate_exps.bias": (X, Fx), "ffn_up_exps.bias": (X, Fx), "ffn_down_exps.bias": (X, E)})
    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    if not config.tie_embeddings:
        shapes["output.weight"] = (V, E)
    for i in range(config.n_layers):
        mlp = experts if config.moe_layer(i) else dense
        shapes.update({f"blk.{i}.{name}": shape for name, shape in {**per_layer, **mlp}.items()})
    return shapes


def check_tensors(config: ModelConfig, tensor_shapes: dict, architecture: str = "llama") -> None:
    """Every needed tensor is present with the shape the config implies."""
    for name, shape in expected_shapes(config, architecture).items():
        if name not in tensor_shapes:
            raise GGUFError(f"tensor {name} is missing from the file")
        if tuple(tensor_shapes[name]) != shape:
            raise GGUFError(f"tensor {name} has shape {tuple(tensor_shapes[name])}; the metadata implies {shape}")


def latent_shapes(config: ModelConfig) -> dict:
    """deepseek2's attention tensors of one block (they replace attn_q's shape, attn_k and attn_v)."""
    E, H, R, Dr, Dv, Q = (config.d_model, config.n_heads, config.kv_lora_rank, config.qk_rope_head_dim,
                          config.v_head_dim, config.q_lora_rank)
    query = ({"attn_q.weight": (config.q_dim, E)} if Q is None else
             {"attn_q_a.weight": (Q, E), "attn_q_a_norm.weight": (Q,), "attn_q_b.weight": (config.q_dim, Q)})
    return {**query, "attn_kv_a_mqa.weight": (R + Dr, E), "attn_kv_a_norm.weight": (R,),
            "attn_k_b.weight": (H, R, config.qk_nope_head_dim), "attn_v_b.weight": (H, Dv, R),
            "attn_output.weight": (E, H * Dv)}


def latent_layer(config: ModelConfig, tensor, i: int) -> dict:
    """Block i's MLA LayerWeights fields from a deepseek2 file: wkv_b joined back from attn_k_b and attn_v_b
    (3-D, so the loader gives them as float arrays)."""
    def t(name):
        return tensor(f"blk.{i}.{name}.weight")

    R = config.kv_lora_rank
    w_uk = np.swapaxes(t("attn_k_b"), 1, 2)  # [H, R, Dn] -> W_UK [H, Dn, R]
    wkv_b = np.concatenate([w_uk, t("attn_v_b")], axis=1).reshape(-1, R)  # [H * (Dn + Dv), R], HF's row order
    query = ({"wq": t("attn_q")} if config.q_lora_rank is None else
             {"wq_a": t("attn_q_a"), "q_a_norm": t("attn_q_a_norm"), "wq": t("attn_q_b")})
    return {**query, "wk": None, "wv": None, "wkv_a": t("attn_kv_a_mqa"), "kv_a_norm": t("attn_kv_a_norm"),
            "wkv_b": np.ascontiguousarray(wkv_b), "wo": t("attn_output")}


def build_weights(config: ModelConfig, tensor, architecture: str = "llama") -> Weights:
    """Weights whose every tensor is `tensor(name)`: the backend decides what a tensor is."""
    reorder = architecture in HALF_SPLIT_PAIRS

    def reordered(t, field):
        return half_split_to_adjacent(t, heads[field], config.head_dim) if reorder and field in ROTATED else t

    heads = {"wq": config.n_heads, "bq": config.n_heads, "wk": config.n_kv_heads, "bk": config.n_kv_heads,
             "q_norm": 1, "k_norm": 1}
    fused = architecture in FUSED
    q, kv, F = config.q_dim, config.kv_dim, config.d_ff
    layers = []
    for i in range(config.n_layers):
        names = {field: f"blk.{i}.{name}.weight" for field, name in LAYER_TENSORS.items()
                 if not (fused and field in ("wq", "wk", "wv", "w_gate", "w_up"))}
        names["ffn_norm"] = f"blk.{i}.{FFN_NORM.get(architecture, 'ffn_norm')}.weight"
        if config.moe_layer(i):
            names = {field: name for field, name in names.items() if field not in DENSE_MLP_TENSORS}
            names.update({field: f"blk.{i}.{name}.weight" for field, name in EXPERT_TENSORS.items()})
            for present, tensors in ((config.router_bias, ROUTER_BIAS_TENSORS), (config.expert_bias, EXPERT_BIAS_TENSORS)):
                names.update({field: f"blk.{i}.{name}" for field, name in tensors.items() if present})
            if config.shared_expert_d_ff:
                names.update({field: f"blk.{i}.{name}.weight" for field, name in SHARED_EXPERT_TENSORS.items()})
            if config.expert_selection_bias:
                names["expert_selection_bias"] = f"blk.{i}.{SELECTION_BIAS_TENSOR}.bias"
        for present, tensors in ((config.attention_sinks, SINK_TENSORS), (config.attention_out_bias, OUT_BIAS_TENSORS)):
            names.update({field: f"blk.{i}.{name}" for field, name in tensors.items() if present})
        latent = latent_layer(config, tensor, i) if config.latent else {}
        for field in latent:
            names.pop(field, None)  # MLA's attention tensors come from latent_layer
        if config.qkv_bias:
            names.update({field: f"blk.{i}.{name}.bias" for field, name in BIAS_TENSORS.items()})
        if config.qk_norm:
            names.update({field: f"blk.{i}.{name}.weight" for field, name in QK_NORM_TENSORS.items()})
        if config.sandwich_norms:
            names.update({field: f"blk.{i}.{name}.weight" for field, name in SANDWICH_TENSORS.items()})
        fields = {field: reordered(tensor(name), field) for field, name in names.items()}
        if fused:  # Phi-3: split once here into the decoder's separate projections
            wq, wk, wv = split_rows(tensor(f"blk.{i}.attn_qkv.weight"), (q, kv, kv))
            w_gate, w_up = split_rows(tensor(f"blk.{i}.ffn_up.weight"), (F, F))
            fields.update(wq=reordered(wq, "wq"), wk=reordered(wk, "wk"), wv=wv, w_gate=w_gate, w_up=w_up)
        layers.append(LayerWeights(**{**dict.fromkeys(DENSE_MLP_TENSORS), **fields, **latent}))  # w_* None on a MoE layer
    tok_embeddings = tensor("token_embd.weight")
    output = tok_embeddings if config.tie_embeddings else tensor("output.weight")
    return Weights(tok_embeddings, layers, tensor("output_norm.weight"), output)



def split_rows(t, sizes):
    """Consecutive row ranges of `sizes` rows of a [sum(sizes), K] float array or QuantizedTensor (a
    row is whole blocks, so a quantized one splits between rows as it is)."""
    bounds = np.cumsum([0, *sizes])
    if isinstance(t, QuantizedTensor):
        return [QuantizedTensor(t.ggml_type, (int(b - a), t.shape[1]), np.ascontiguousarray(t.data[a:b]))
                for a, b in zip(bounds[:-1], bounds[1:])]
    return [np.ascontiguousarray(np.asarray(t)[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def half_split_to_adjacent(t, heads: int, head_dim: int):
    """Rows [heads * D, ...] whose RoPE pairs are (i, i + D/2) in each head -> pairs (2i, 2i + 1).

    Row 2i of a head takes row i, row 2i + 1 takes row i + D/2: the same rotations of the same numbers,
    and q . k is unchanged when q and k are reordered alike. Works on float arrays (what the spec
    reads) and on the rows of a QuantizedTensor (what the native kernels read in place: a row is whole
    blocks, so its bytes move as they are).
    """
    order = np.arange(head_dim).reshape(2, head_dim // 2).T.reshape(-1)  # 0, D/2, 1, D/2 + 1, ...
    index = (np.arange(heads)[:, None] * head_dim + order).reshape(-1)
    if isinstance(t, QuantizedTensor):
        return QuantizedTensor(t.ggml_type, t.shape, np.ascontiguousarray(t.data[index]))
    return np.ascontiguousarray(np.asarray(t)[index])
