"""`kvref export hf MODEL DIR`: a GGUF model as a Hugging Face checkpoint folder that transformers
loads (and kvref.load reads back), so the conformance tool's transformers engine runs on the same model.

    config.json              the family's fields (model_type llama, qwen2, qwen3, gemma2, gemma3_text, phi3,
                             smollm3, deepseek_v2/v3; for a mixture of experts qwen3_moe, gpt_oss, or
                             mixtral for a llama file with experts)
    model.safetensors        every weight dequantized (gpt-oss's MXFP4 experts too), float32 (default) or
                             bfloat16
    tokenizer.json           the GGUF tokenizer as HF's pipeline (kvref/text/hf.py reads the same)
    tokenizer_config.json    BOS/EOS, whether they are added, the chat template
    generation_config.json   BOS and every end-of-generation id

What the export undoes of kvref.formats.hf's conversion, since the decoder's weights are what it writes:

  - RoPE pairs: the decoder rotates adjacent pairs (x[2i], x[2i+1]), HF rotates (x[i], x[i + D/2])
    (rotate_half); each head's Q and K rows (biases, QK-norm gains) go back to HF's order.
  - Gemma's RMSNorm multiplies by (1 + w) and its checkpoints store w: the gains g are written as g - 1.
  - Phi-3 fuses Q, K and V into qkv_proj (rows [Q | K | V]) and gate and up into gate_up_proj (rows
    [gate | up]); LongRoPE's two factor sets, original length and attention factor go in rope_scaling.
  - SmolLM3's NoPE layers are written as no_rope_layers (0 on a NoPE layer).
  - gpt-oss: its experts as its checkpoints hold them, two stacks multiplied from the left with gate and
    up interleaved (gate_up_proj [X, E, 2 Fx], down_proj [X, Fx, E], each with a bias), beside the sinks,
    the router and attention biases; YaRN as the GGUF computes it (truncated, llama.cpp's only way).
  - deepseek2 (MLA): written as deepseek_v2, or deepseek_v3 when its router is sigmoid, both with RoPE on
    adjacent pairs as the decoder rotates them; all-dense files with first_k_dense_replace = num_hidden_layers.

float32 is the default because it is the same model: a dequantized block value (d * q + m, with d and
m float16) rarely fits in bfloat16's 8 significant bits, so a bfloat16 export rounds nearly every
weight and its logits differ from the GGUF's by more than the float32 tolerance. bfloat16 halves the
size for uses that do not compare.

The config is checked by reading it back (kvref.formats.hf.config_from_hf must give the model's own
ModelConfig), so anything HF's fields cannot say (Llama 3.1's rope_freqs divisors, RoPE scaling on
Gemma) is refused by name instead of written wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np

from ..cache.quant import to_bfloat16
from ..errors import ConfigError, ModelNotFoundError, TokenizerError
from ..formats.architectures import half_split_to_adjacent
from ..formats.gguf import GGUFFile
from ..formats.hf import EXPERT_TENSORS, GEMMAS, config_from_hf
from ..formats.safetensors import write_file
from ..text.bytelevel import PRE_TOKENIZERS
from ..text.gguf import merge_pair, tokenizer_parts
from ..text.sentencepiece import SPACE
from ..text.vocab import CONTROL, UNKNOWN, USER_DEFINED

# GGUF general.architecture -> (HF model_type, HF architectures class)
FAMILIES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
            "qwen3": ("qwen3", "Qwen3ForCausalLM"), "gemma2": ("gemma2", "Gemma2ForCausalLM"),
            "gemma3": ("gemma3_text", "Gemma3ForCausalLM"), "phi3": ("phi3", "Phi3ForCausalLM"),
            "smollm3": ("smollm3", "SmolLM3ForCausalLM"), "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
            "gpt-oss": ("gpt_oss", "GptOssForCausalLM"), "deepseek2": ("deepseek_v2", "DeepseekV2ForCausalLM")}
MIXTRAL = ("mixtral", "MixtralForCausalLM")  # a llama file with experts
DEEPSEEK_V3 = ("deepseek_v3", "DeepseekV3ForCausalLM")  # a deepseek2 file whose router is V3's sigmoid one
DTYPES = {"float32": "F32", "bfloat16": "BF16"}  # --dtype -> safetensors code
# attention_scale read back from the number config.json states (a square root then a square, or a power of -2
# then of -1/2): a few float64 roundings apart from the model's own
ATTENTION_SCALE_RTOL = 1e-14


def export_hf(model, directory, dtype: str = "float32") -> Path:
    """Write the GGUF model `model` (a path or short name) as a Hugging Face checkpoint in `directory`,
    which must not exist or be empty. Written into a sibling folder and renamed at the end, so a
    failed export leaves nothing behind."""
    from ..loader import load, resolve

    if dtype not in DTYPES:
        raise ConfigError(f"export dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(f"{directory} exists and is not an empty folder; export writes a new one")
    source = resolve(model)
    if source.is_dir():
        raise ModelNotFoundError(f"{source} is a folder; export reads a GGUF file")
    with GGUFFile(source) as gguf:
        metadata = gguf.metadata
    m = load(source, backend="numpy", dtype="float32")
    arch = metadata["general.architecture"]
    parts = tokenizer_parts(metadata)  # validates every tokenizer key the export reads
    files = {"config.json": hf_config(m.config, arch, parts),
             "tokenizer.json": tokenizer_json(metadata, parts),
             "tokenizer_config.json": tokenizer_config(parts, m.chat_template, m.config.max_seq_len),
             "generation_config.json": generation_config(parts)}
    partial = directory.with_name(f"{directory.name}.{os.getpid()}.partial")
    partial.mkdir(parents=True)
    try:
        for name, value in files.items():
            (partial / name).write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        tensors = hf_tensors(m.config, m.weights, dtype, files["config.json"]["model_type"])
        write_file(partial / "model.safetensors", tensors, {"format": "pt"})
        os.replace(partial, directory)  # rename(2) replaces an empty folder
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return directory


# ---- config.json ----------------------------------------------------------------------------------

def hf_config(config, arch: str, parts: dict) -> dict:
    """config.json for `config`, checked by reading it back with kvref.formats.hf."""
    if arch not in FAMILIES:
        raise ConfigError(f"architecture {arch!r} has no Hugging Face family here; export writes {sorted(FAMILIES)}")
    model_type, architecture = FAMILIES[arch]
    if arch == "llama" and config.n_experts:
        model_type, architecture = MIXTRAL
    if arch == "deepseek2" and config.router_score == "sigmoid":
        model_type, architecture = DEEPSEEK_V3
    c = config
    out = {
        "architectures": [architecture], "model_type": model_type, "torch_dtype": "float32",
        "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": _rope_scaling(c),
        "tie_word_embeddings": c.tie_embeddings,
        # a family's default pad id may lie past a small vocabulary; a pad id changes no logit
        "bos_token_id": parts["bos_id"], "eos_token_id": parts["eos_id"], "pad_token_id": None,
    }
    if model_type in ("gemma2", "gemma3_text"):
        # GGUF files leave the score scale at 1/sqrt(head_dim) (attention_scale None)
        scalar = c.head_dim if c.attention_scale is None else c.attention_scale ** -2
        out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                   final_logit_softcapping=c.final_softcap, attn_logit_softcapping=c.attn_softcap)
        if model_type == "gemma3_text":
            out.update(rope_local_base_freq=c.rope_local_theta)
    else:
        out.update(hidden_act="silu", attention_bias=c.qkv_bias and model_type != "qwen2")
    if model_type in ("gemma2", "gemma3_text", "gpt_oss"):  # windows on some layers
        window = next((w for w in c.layer_windows or () if w is not None), None)
        out.update(sliding_window=window, layer_types=["full_attention" if w is None else "sliding_attention"
                                                       for w in c.layer_windows or (None,) * c.n_layers])
    if model_type in ("phi3", "mixtral"):  # one window on every layer, or none (a llama file has none)
        out.update(sliding_window=c.layer_windows[0] if c.layer_windows else None)
    if model_type == "phi3":  # transformers picks LongRoPE's long factors past this length (and kvref by it)
        out.update(original_max_position_embeddings=(out["rope_scaling"] or {}).get(
            "original_max_position_embeddings", c.max_seq_len))
    if model_type == "smollm3":
        out.update(no_rope_layers=[int(i not in c.nope_layers) for i in range(c.n_layers)], use_sliding_window=False,
                   sliding_window=None)
    if model_type == "qwen3_moe":
        out.update(num_experts=c.n_experts, num_experts_per_tok=c.n_experts_used, moe_intermediate_size=c.experts_d_ff,
                   norm_topk_prob=c.norm_topk_prob, mlp_only_layers=[], decoder_sparse_step=1)
    if model_type in ("mixtral", "gpt_oss"):  # their experts are intermediate_size wide
        out.update(num_local_experts=c.n_experts, num_experts_per_tok=c.n_experts_used,
                   intermediate_size=c.experts_d_ff)
    if c.latent:  # HF's head_dim names the rotated part; a query head's width is nope + rope
        out.update(head_dim=c.qk_rope_head_dim, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
                   qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                   rope_interleave=True, **_deepseek_router(c))
    out = {k: v.item() if isinstance(v, np.generic) else v for k, v in out.items()}  # JSON numbers
    _check_round_trip(config, out)
    return out


def _deepseek_router(c) -> dict:
    # DeepSeek's config.json fields of a latent model's mixture; every layer dense when it has none. What
    # they cannot say (a sigmoid router without its selection bias, a shared width not a whole number of
    # experts) the round-trip check refuses by name.
    if not c.n_experts:
        return {"first_k_dense_replace": c.n_layers, "n_routed_experts": None}
    sigmoid = c.router_score == "sigmoid"
    method = "noaux_tc" if sigmoid else "group_limited_greedy" if c.n_expert_groups > 1 else "greedy"
    return {"first_k_dense_replace": c.first_dense_layers, "n_routed_experts": c.n_experts,
            "num_experts_per_tok": c.n_experts_used, "moe_intermediate_size": c.experts_d_ff,
            "n_shared_experts": c.shared_expert_d_ff // c.experts_d_ff,
            "routed_scaling_factor": c.routed_scaling_factor, "norm_topk_prob": c.norm_topk_prob,
            "scoring_func": "sigmoid" if sigmoid else "softmax", "topk_method": method,
            "n_group": c.n_expert_groups, "topk_group": c.n_expert_groups_used}


def _rope_scaling(config):
    # ModelConfig.rope_scaling -> HF's rope_scaling; the divisors of a rope_freqs tensor have no HF field
    scaling = config.rope_scaling
    if scaling is None:
        return None
    if scaling[0] == "linear":
        return {"rope_type": "linear", "factor": scaling[1]}
    if scaling[0] == "llama3":
        _, factor, low, high, original = scaling
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": original}
    if scaling[0] == "longrope":  # HF's attention factor m multiplies q and k; kvref's scores by m**2 / sqrt(D)
        _, short, long, original = scaling
        m = 1.0 if config.attention_scale is None else float(np.sqrt(config.attention_scale * config.head_dim ** 0.5))
        return {"rope_type": "longrope", "short_factor": list(short), "long_factor": list(long),
                "original_max_position_embeddings": original, "attention_factor": m}
    if scaling[0] == "yarn":
        _, factor, beta_fast, beta_slow, original, attention_factor, truncate = scaling
        return {"rope_type": "yarn", "factor": factor, "beta_fast": beta_fast, "beta_slow": beta_slow,
                "original_max_position_embeddings": original, "attention_factor": attention_factor,
                "truncate": truncate}
    raise ConfigError(f"RoPE scaling {scaling[0]!r} (a rope_freqs.weight tensor of divisors) has no Hugging Face "
                      "config field; this model cannot be exported")


def _check_round_trip(config, hf: dict) -> None:
    back = config_from_hf(hf)
    # attention_scale comes back from a number HF derives it from (Gemma's query_pre_attn_scalar, LongRoPE's
    # attention factor); None means 1/sqrt(head_dim), which Gemma writes too
    scale = config.attention_scale or config.head_dim ** -0.5
    if np.isclose(back.attention_scale or config.head_dim ** -0.5, scale, rtol=ATTENTION_SCALE_RTOL, atol=0):
        back = dataclasses.replace(back, attention_scale=config.attention_scale)
    differ = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(back, f.name)]
    if differ:
        raise ConfigError(f"a Hugging Face {hf['model_type']} config cannot say this model's "
                          f"{', '.join(differ)}; it cannot be exported")


# ---- model.safetensors ----------------------------------------------------------------------------

def hf_tensors(config, weights, dtype: str, model_type: str = "llama") -> dict:
    """{HF tensor name: (safetensors dtype, array)} from the decoder's float32 Weights, named and laid out
    as `model_type`'s checkpoints store them."""
    code = DTYPES[dtype]
    gemma = model_type in GEMMAS

    def tensor(a):
        a = np.asarray(a, dtype=np.float32)
        return code, to_bfloat16(a) if code == "BF16" else a

    def norm(g):
        return tensor((g.astype(np.float64) - 1) if gemma else g)  # Gemma stores w of (1 + w)

    def pairs_half_split(a, heads):
        # [heads * D, ...] in the decoder's adjacent pair order -> HF's (i, i + D/2) order
        return a[_half_split_order(heads, config.head_dim)]

    out = {"model.embed_tokens.weight": tensor(weights.tok_embeddings)}
    for i, lw in enumerate(weights.layers):
        p, attn = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out[p + "input_layernorm.weight"] = norm(lw.attn_norm)
        if config.latent:
            out.update(latent_tensors(config, lw, attn, tensor))
        else:
            q, k = pairs_half_split(lw.wq, config.n_heads), pairs_half_split(lw.wk, config.n_kv_heads)
            if model_type == "phi3":  # rows [Q | K | V] of one projection
                out[attn + "qkv_proj.weight"] = tensor(np.concatenate([q, k, lw.wv]))
            else:
                out.update({attn + "q_proj.weight": tensor(q), attn + "k_proj.weight": tensor(k),
                            attn + "v_proj.weight": tensor(lw.wv)})
        out[attn + "o_proj.weight"] = tensor(lw.wo)
        if config.qkv_bias:
            out[attn + "q_proj.bias"] = tensor(pairs_half_split(lw.bq, config.n_heads))
            out[attn + "k_proj.bias"] = tensor(pairs_half_split(lw.bk, config.n_kv_heads))
            out[attn + "v_proj.bias"] = tensor(lw.bv)
        if config.attention_out_bias:
            out[attn + "o_proj.bias"] = tensor(lw.bo)
        if config.attention_sinks:
            out[attn + "sinks"] = tensor(lw.sinks)
        if config.qk_norm:
            out[attn + "q_norm.weight"] = norm(pairs_half_split(lw.q_norm, 1))
            out[attn + "k_norm.weight"] = norm(pairs_half_split(lw.k_norm, 1))
        # Gemma's post_attention_layernorm is the sandwich norm on the attention output; Llama's is the pre-MLP norm
        if config.sandwich_norms:
            out[p + "post_attention_layernorm.weight"] = norm(lw.post_attn_norm)
            out[p + "pre_feedforward_layernorm.weight"] = norm(lw.ffn_norm)
            out[p + "post_feedforward_layernorm.weight"] = norm(lw.post_ffn_norm)
        else:
            out[p + "post_attention_layernorm.weight"] = norm(lw.ffn_norm)
        if config.moe_layer(i) and model_type == "gpt_oss":
            out.update(gpt_oss_expert_tensors(lw, p + "mlp.", tensor))
        elif config.moe_layer(i):  # the router, and one matrix per expert
            module, projections = EXPERT_TENSORS[model_type]
            out[f"{p}{module}.gate.weight"] = tensor(lw.router)
            for j in range(config.n_experts):
                for name, stack in zip(projections, (lw.experts_gate, lw.experts_up, lw.experts_down)):
                    out[f"{p}{module}.experts.{j}.{name}.weight"] = tensor(stack[j])
            if config.expert_selection_bias:
                out[f"{p}{module}.gate.e_score_correction_bias"] = tensor(lw.expert_selection_bias)
            if config.shared_expert_d_ff:
                for name, w in zip(("gate", "up", "down"), (lw.shared_gate, lw.shared_up, lw.shared_down)):
                    out[f"{p}{module}.shared_experts.{name}_proj.weight"] = tensor(w)
        elif model_type == "phi3":  # rows [gate | up] of one projection
            out[p + "mlp.gate_up_proj.weight"] = tensor(np.concatenate([lw.w_gate, lw.w_up]))
            out[p + "mlp.down_proj.weight"] = tensor(lw.w_down)
        else:
            out[p + "mlp.gate_proj.weight"] = tensor(lw.w_gate)
            out[p + "mlp.up_proj.weight"] = tensor(lw.w_up)
            out[p + "mlp.down_proj.weight"] = tensor(lw.w_down)
    out["model.norm.weight"] = norm(weights.output_norm)
    if not config.tie_embeddings:
        out["lm_head.weight"] = tensor(weights.output)
    return out


def gpt_oss_expert_tensors(lw, mlp: str, tensor) -> dict:
    """A gpt-oss MoE layer by its HF names: the inverse of kvref.formats.hf.gpt_oss_experts (stacks that
    multiply from the left, gate in the even columns of gate_up_proj and up in the odd ones)."""
    X, Fx, E = lw.experts_gate.shape
    gate_up = np.empty((X, E, 2 * Fx), dtype=np.float32)
    gate_up[:, :, 0::2], gate_up[:, :, 1::2] = lw.experts_gate.transpose(0, 2, 1), lw.experts_up.transpose(0, 2, 1)
    gate_up_bias = np.empty((X, 2 * Fx), dtype=np.float32)
    gate_up_bias[:, 0::2], gate_up_bias[:, 1::2] = lw.experts_gate_bias, lw.experts_up_bias
    return {mlp + "router.weight": tensor(lw.router), mlp + "router.bias": tensor(lw.router_bias),
            mlp + "experts.gate_up_proj": tensor(gate_up), mlp + "experts.gate_up_proj_bias": tensor(gate_up_bias),
            mlp + "experts.down_proj": tensor(lw.experts_down.transpose(0, 2, 1)),  # [X, E, Fx] -> [X, Fx, E]
            mlp + "experts.down_proj_bias": tensor(lw.experts_down_bias)}


def latent_tensors(config, lw, attn: str, tensor) -> dict:
    """An MLA layer's attention tensors by their HF (deepseek_v2) names; adjacent RoPE pairs, as stored."""
    query = ({attn + "q_proj.weight": tensor(lw.wq)} if config.q_lora_rank is None else
             {attn + "q_a_proj.weight": tensor(lw.wq_a), attn + "q_a_layernorm.weight": tensor(lw.q_a_norm),
              attn + "q_b_proj.weight": tensor(lw.wq)})
    return {**query, attn + "kv_a_proj_with_mqa.weight": tensor(lw.wkv_a),
            attn + "kv_a_layernorm.weight": tensor(lw.kv_a_norm), attn + "kv_b_proj.weight": tensor(lw.wkv_b)}


def _half_split_order(heads: int, head_dim: int):
    # the inverse of half_split_to_adjacent's row order: adjacent[k] = half_split[order[k]]
    order = half_split_to_adjacent(np.arange(heads * head_dim), heads, head_dim)
    return np.argsort(order)


# ---- tokenizer.json, tokenizer_config.json, generation_config.json --------------------------------

def tokenizer_json(metadata: dict, parts: dict) -> dict:
    """The GGUF tokenizer as an HF tokenizer.json: byte-level BPE ("gpt2") with its pre-tokenizer's
    regexes as Splits, or SentencePiece ("llama") as BPE over "▁"-spaced text with byte fallback,
    whose merges are every pair forming a token, ranked by that token's score (llama.cpp's order)."""
    tokens, types = parts["tokens"], parts["token_types"]
    vocab = {text: i for i, text in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError("tokenizer.ggml.tokens has duplicate texts, which a tokenizer.json vocab cannot hold")
    byte_level = metadata["tokenizer.ggml.model"] == "gpt2"
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": not byte_level,
             "ignore_merges": byte_level and metadata.get("tokenizer.ggml.pre") == "llama-bpe", "vocab": vocab}
    if byte_level:
        model["merges"] = [list(merge_pair(m)) for m in metadata["tokenizer.ggml.merges"]]
        normalizer = None
        pre = {"type": "Sequence", "pretokenizers": [
            *({"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
              for p in PRE_TOKENIZERS[metadata.get("tokenizer.ggml.pre", "default")]),
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
        decoder = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    else:
        unk = metadata.get("tokenizer.ggml.unknown_token_id")
        model["unk_token"] = None if unk is None else tokens[int(unk)]
        model["merges"] = _merges_by_score(tokens, vocab, np.asarray(metadata["tokenizer.ggml.scores"]))
        prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
        normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace]} \
            if prefix else replace
        pre = None
        decoder = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])]}
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": kind != USER_DEFINED}
                             for i, (text, kind) in enumerate(zip(tokens, types))
                             if kind in (CONTROL, UNKNOWN, USER_DEFINED)],
            "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": _post_processor(parts),
            "decoder": decoder, "model": model}


def _merges_by_score(tokens, vocab, scores) -> list:
    # [[left, right], ...]: every split of a token into two tokens, the token of highest score first
    # (ties: lower id first); HF merges the pair of lowest rank, llama.cpp the pair forming the best token
    found = [(-float(scores[i]), i, k) for i, text in enumerate(tokens) for k in range(1, len(text))
             if text[:k] in vocab and text[k:] in vocab]
    found.sort()
    return [[tokens[i][:k], tokens[i][k:]] for _, i, k in found]


def _post_processor(parts):
    # BOS before and EOS after the text, as the GGUF says to add them
    bos = [parts["tokens"][parts["bos_id"]]] if parts["add_bos"] and parts["bos_id"] is not None else []
    eos = [parts["tokens"][parts["eos_id"]]] if parts["add_eos"] and parts["eos_id"] is not None else []
    if not bos and not eos:
        return None
    ids = {parts["tokens"][parts["bos_id"]]: parts["bos_id"]} if bos else {}
    ids.update({parts["tokens"][parts["eos_id"]]: parts["eos_id"]} if eos else {})

    def special(text):
        return {"SpecialToken": {"id": text, "type_id": 0}}

    def sequence(name):
        return {"Sequence": {"id": name, "type_id": 0}}

    return {"type": "TemplateProcessing",
            "single": [*map(special, bos), sequence("A"), *map(special, eos)],
            "pair": [*map(special, bos), sequence("A"), *map(special, eos), sequence("B"), *map(special, eos)],
            "special_tokens": {text: {"id": text, "ids": [i], "tokens": [text]} for text, i in ids.items()}}


def tokenizer_config(parts: dict, chat_template, max_seq_len: int) -> dict:
    def text(key):
        return None if parts[key] is None else parts["tokens"][parts[key]]

    out = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text("bos_id"), "eos_token": text("eos_id"),
           "add_bos_token": parts["add_bos"], "add_eos_token": parts["add_eos"],
           "model_max_length": max_seq_len, "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        out["chat_template"] = chat_template
    return out


def generation_config(parts: dict) -> dict:
    # every id that ends generation: the EOS token and the end-of-turn tokens kvref stops at
    ends = {*parts["eos_ids"], *([parts["eos_id"]] if parts["eos_id"] is not None else [])}
    return {"bos_token_id": parts["bos_id"], "eos_token_id": sorted(ends)}


# ---- the command --------------------------------------------------------------------------------

def add_export(commands):
    p = commands.add_parser("export", help="write a GGUF model in another format")
    formats = p.add_subparsers(dest="format", required=True, help="the format to write (hf: Hugging Face)")
    hf = formats.add_parser("hf", help="a Hugging Face checkpoint folder (config.json, model.safetensors, "
                                       "tokenizer.json) that transformers and kvref load")
    hf.add_argument("model", help="a GGUF file, a short name (smollm2, gemma3-270m) or org/name in the HF cache")
    hf.add_argument("directory", type=Path, help="the folder to write (must not exist, or be empty)")
    hf.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="weight type: float32 (default) is the GGUF's dequantized values exactly; "
                         "bfloat16 is half the size but rounds them")
    p.set_defaults(run=run_export)


def run_export(args) -> int:
    directory = export_hf(args.model, args.directory, args.dtype)
    size = sum(f.stat().st_size for f in directory.iterdir())
    print(f"wrote {directory} ({size / 2**20:.1f} MiB, {args.dtype}); compare with: "
          f"kvref conformance transformers -m {directory}")
    return 0
