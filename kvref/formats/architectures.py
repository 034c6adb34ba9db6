"""The architectures of a GGUF file: metadata keys -> ModelConfig, tensor names -> Weights.

`general.architecture` names the family, and its keys are prefixed with that name (`llama.block_count`,
`qwen3.attention.head_count`, ...):

    llama    Llama, SmolLM, Mistral      llama.cpp's converter permutes each head's Q/K rows so that RoPE
                                         rotates adjacent pairs (x[2i], x[2i+1]): read as stored
    qwen2    Qwen 2/2.5: Q/K/V biases    these keep the checkpoint's row order, where RoPE rotates
    qwen3    Qwen 3: QK-norm             (x[i], x[i + D/2]) (llama.cpp's NEOX mode): the rows (and their
    gemma3   Gemma 3                     biases and QK-norm gains) are reordered once here, as
                                         kvref.formats.hf does for every HF checkpoint

Gemma 3 files store its norm gains as 1 + w already. What they do not carry, llama.cpp assumes and so
does kvref: a global layer after every 5 windowed ones, RoPE base 10,000 on the windowed layers,
embeddings scaled by sqrt(d_model), and scores scaled by 1/sqrt(head_dim) (query_pre_attn_scalar =
head_dim, as in every released Gemma 3 text model). docs/architectures.md has the table; anything
else a file asks for (RoPE scalings other than linear, yarn and rope_freqs, partial RoPE) is refused by name.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import GGUFError
from ..limits import CONFIG_CEILINGS, bounded_float, bounded_int, check_layer_count
from ..spec import ops as spec_ops
from ..spec.ggml import QuantizedTensor
from ..weights import LayerWeights, Weights

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
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
    head_dim = integer("attention.key_length", "head_dim", max(d_model // n_heads, 1))
    rotary = integer("rope.dimension_count", "head_dim", head_dim)
    if rotary != head_dim:
        raise GGUFError(f"{arch}.rope.dimension_count={rotary} (partial RoPE) is not supported; expected {head_dim}")
    rope_scaling = _rope_scaling(metadata, arch, tensor_names, rope_factors, head_dim)
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
        n_kv_heads=integer("attention.head_count_kv", "n_kv_heads", n_heads),
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
    )


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


def expected_shapes(config: ModelConfig) -> dict:
    """Every tensor name the decoder needs, with its shape in NumPy order ([out, in] for matrices)."""
    E, F, V, D = config.d_model, config.d_ff, config.vocab_size, config.head_dim
    per_layer = {
        "attn_norm.weight": (E,), "attn_q.weight": (config.q_dim, E), "attn_k.weight": (config.kv_dim, E),
        "attn_v.weight": (config.kv_dim, E), "attn_output.weight": (E, config.q_dim), "ffn_norm.weight": (E,),
        "ffn_gate.weight": (F, E), "ffn_up.weight": (F, E), "ffn_down.weight": (E, F),
    }
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
        if config.qkv_bias:
            names.update({field: f"blk.{i}.{name}.bias" for field, name in BIAS_TENSORS.items()})
        if config.qk_norm:
            names.update({field: f"blk.{i}.{name}.weight" for field, name in QK_NORM_TENSORS.items()})
        if config.sandwich_norms:
            names.update({field: f"blk.{i}.{name}.weight" for field, name in SANDWICH_TENSORS.items()})
        layers.append(LayerWeights(**{field: rows(field, name, heads.get(field)) for field, name in names.items()}))
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
