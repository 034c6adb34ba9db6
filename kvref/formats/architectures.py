"""The architectures of a GGUF file: metadata keys -> ModelConfig, tensor names -> Weights.

`general.architecture` names the family, and its keys are prefixed with that name (`llama.block_count`,
`qwen3.attention.head_count`, ...):

    llama    Llama, SmolLM, Mistral      llama.cpp's converter permutes each head's Q/K rows so that RoPE
                                         rotates adjacent pairs (x[2i], x[2i+1]): read as stored
    qwen2    Qwen 2/2.5: Q/K/V biases    these keep the checkpoint's row order, where RoPE rotates
    qwen3    Qwen 3: QK-norm             (x[i], x[i + D/2]) (llama.cpp's NEOX mode): the rows (and their
    gemma3   Gemma 3                     biases and QK-norm gains) are reordered once here, as
                                         kvref.formats.hf does for every HF checkpoint
    deepseek2  DeepSeek-V2/V3 (MLA)      adjacent pairs as stored; the converter writes the latent
                                         attention as MQA (head_count_kv 1, key_length R + Dr,
                                         value_length R) and splits kv_b into attn_k_b [H, R, Dn]
                                         (W_UK transposed) and attn_v_b [H, Dv, R] (W_UV), which are
                                         joined back into wkv_b here; only all-dense files are read

Gemma 3 files store its norm gains as 1 + w already. What they do not carry, llama.cpp assumes and so
does kvref: a global layer after every 5 windowed ones, RoPE base 10,000 on the windowed layers,
embeddings scaled by sqrt(d_model), and scores scaled by 1/sqrt(head_dim) (query_pre_attn_scalar =
head_dim, as in every released Gemma 3 text model). docs/architectures.md has the table; anything
else a file asks for (RoPE scaling, partial RoPE) is refused by name.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import GGUFError
from ..limits import CONFIG_CEILINGS, bounded_float, bounded_int, check_layer_count
from ..spec.ggml import QuantizedTensor
from ..weights import LayerWeights, Weights

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "deepseek2")
HALF_SPLIT_PAIRS = ("qwen2", "qwen3", "gemma3")  # Q/K rows in rotate_half order in the file
GEMMA3_GLOBAL_EVERY = 6  # llama.cpp's sliding-window pattern for gemma3: layer i is global if (i + 1) % 6 == 0
GEMMA3_LOCAL_ROPE_THETA = 10000.0

# LayerWeights field -> GGUF tensor name within block i (the optional ones when the config asks)
LAYER_TENSORS = {
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
    "ffn_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
}
BIAS_TENSORS = {"bq": "attn_q", "bk": "attn_k", "bv": "attn_v"}  # .bias
QK_NORM_TENSORS = {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
SANDWICH_TENSORS = {"post_attn_norm": "post_attention_norm", "post_ffn_norm": "post_ffw_norm"}
ROTATED = ("wq", "wk", "bq", "bk", "q_norm", "k_norm")  # what RoPE rotates: rows in pair order


def config_from_metadata(metadata: dict, tensor_names, rope_factors=None) -> ModelConfig:
    """ModelConfig from the `<architecture>.*` keys; anything the spec does not implement is refused by name.

    Every number is type-checked and bounded (kvref.limits) before it sizes anything, and the block
    count is compared with the blocks whose tensors the file holds before any per-layer table is made.
    rope_factors: the values of the file's rope_freqs.weight tensor (Llama 3.1+: one divisor per
    RoPE frequency), which a file with that tensor needs.
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
    n_layers = integer("block_count", "n_layers")
    check_layer_count(n_layers, tensor_names, "blk.", f"{arch}.block_count", GGUFError)
    gemma = arch == "gemma3"
    windows = None
    if gemma:
        window = integer("attention.sliding_window", "max_seq_len")
        windows = tuple(None if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else window for i in range(n_layers))
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
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        sandwich_norms=gemma,
        embedding_scale=float(np.float32(d_model ** 0.5)) if gemma else 1.0,
        activation="gelu_tanh" if gemma else "silu",
        layer_windows=windows,
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA if gemma else None,
        rope_scaling=rope_scaling,
        **latent,
    )


def _latent_metadata(metadata, arch, integer) -> dict:
    # deepseek2's keys -> the ModelConfig MLA fields (and head_dim, a query head's Dn + Dr)
    n_layers = integer("block_count", "n_layers")
    dense = metadata.get(f"{arch}.leading_dense_block_count", n_layers)
    if metadata.get(f"{arch}.expert_count") and not (isinstance(dense, (int, np.integer)) and dense >= n_layers):
        raise GGUFError(f"this {arch} file has mixture-of-experts layers ({arch}.leading_dense_block_count={dense!r} "
                        f"of {n_layers} blocks are dense), which kvref does not compute yet")
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
        factors = np.asarray(rope_factors, dtype=np.float64)
        if factors.shape != (head_dim // 2,) or not np.all(np.isfinite(factors) & (factors > 0)):
            raise GGUFError(f"rope_freqs.weight must hold one positive finite divisor per RoPE frequency, "
                            f"shape ({head_dim // 2},); it has shape {factors.shape}")
        return ("factors", tuple(float(f) for f in factors))
    if kind in ("none", None):
        return None
    if kind == "linear":
        factor = metadata.get(f"{arch}.rope.scaling.factor", 1.0)
        return ("linear", bounded_float(factor, f"{arch}.rope.scaling.factor", GGUFError))
    raise GGUFError(f"RoPE scaling {arch}.rope.scaling.type={kind!r} is not supported; kvref reads 'linear' "
                    "and Llama 3.1's rope_freqs.weight")


def expected_shapes(config: ModelConfig) -> dict:
    """Every tensor name the decoder needs, with its shape in NumPy order ([out, in] for matrices)."""
    E, F, V, D = config.d_model, config.d_ff, config.vocab_size, config.head_dim
    per_layer = {
        "attn_norm.weight": (E,), "attn_q.weight": (config.q_dim, E), "attn_k.weight": (config.kv_dim, E),
        "attn_v.weight": (config.kv_dim, E), "attn_output.weight": (E, config.q_dim), "ffn_norm.weight": (E,),
        "ffn_gate.weight": (F, E), "ffn_up.weight": (F, E), "ffn_down.weight": (E, F),
    }
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
    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    if not config.tie_embeddings:
        shapes["output.weight"] = (V, E)
    for i in range(config.n_layers):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def check_tensors(config: ModelConfig, tensor_shapes: dict) -> None:
    """Every needed tensor is present with the shape the config implies."""
    for name, shape in expected_shapes(config).items():
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

    def rows(field, name, heads):
        t = tensor(name)
        return half_split_to_adjacent(t, heads, config.head_dim) if reorder and field in ROTATED else t

    heads = {"wq": config.n_heads, "bq": config.n_heads, "wk": config.n_kv_heads, "bk": config.n_kv_heads,
             "q_norm": 1, "k_norm": 1}
    layers = []
    for i in range(config.n_layers):
        names = {field: f"blk.{i}.{name}.weight" for field, name in LAYER_TENSORS.items()}
        latent = latent_layer(config, tensor, i) if config.latent else {}
        for field in latent:
            names.pop(field, None)  # MLA's attention tensors come from latent_layer
        if config.qkv_bias:
            names.update({field: f"blk.{i}.{name}.bias" for field, name in BIAS_TENSORS.items()})
        if config.qk_norm:
            names.update({field: f"blk.{i}.{name}.weight" for field, name in QK_NORM_TENSORS.items()})
        if config.sandwich_norms:
            names.update({field: f"blk.{i}.{name}.weight" for field, name in SANDWICH_TENSORS.items()})
        layers.append(LayerWeights(**{field: rows(field, name, heads.get(field)) for field, name in names.items()},
                                   **latent))
    tok_embeddings = tensor("token_embd.weight")
    output = tok_embeddings if config.tie_embeddings else tensor("output.weight")
    return Weights(tok_embeddings, layers, tensor("output_norm.weight"), output)



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
