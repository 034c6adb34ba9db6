"""The Llama architecture in a GGUF file: metadata keys -> ModelConfig, tensor names -> Weights.

Q and K weights need no rearranging: llama.cpp's converter permutes the rows of each head so that
RoPE rotates adjacent pairs (x[2i], x[2i+1]) — the convention kvref.spec.ops.rope implements. See
docs/formats.md.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..errors import GGUFError
from ..weights import LayerWeights, Weights

ARCHITECTURE = "llama"

# LayerWeights field -> GGUF tensor name within block i
LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "ffn_norm": "ffn_norm",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
}


def config_from_metadata(metadata: dict, tensor_names) -> ModelConfig:
    """ModelConfig from the `llama.*` keys; anything the spec does not implement is refused by name."""
    arch = metadata.get("general.architecture")
    if arch != ARCHITECTURE:
        raise GGUFError(f"architecture {arch!r} is not supported; expected {ARCHITECTURE!r}")
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFError(f"llama.rope.scaling.type={scaling!r} is not supported; expected 'none'")

    def key(name, default=None):
        value = metadata.get(f"llama.{name}", default)
        if value is None:
            raise GGUFError(f"metadata key llama.{name} is missing")
        return value

    n_heads = int(key("attention.head_count"))
    d_model = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", d_model // n_heads if n_heads else 0))
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GGUFError(f"llama.rope.dimension_count={rotary} (partial RoPE) is not supported; expected {head_dim}")
    vocab = metadata.get("llama.vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())))
    return ModelConfig(
        n_layers=int(key("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(key("feed_forward_length")),
        vocab_size=int(vocab),
        max_seq_len=int(key("context_length")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensor_names,
    )


def expected_shapes(config: ModelConfig) -> dict:
    """Every tensor name the decoder needs, with its shape in NumPy order ([out, in] for matrices)."""
    E, F, V = config.d_model, config.d_ff, config.vocab_size
    per_layer = {
        "attn_norm": (E,), "attn_q": (config.q_dim, E), "attn_k": (config.kv_dim, E),
        "attn_v": (config.kv_dim, E), "attn_output": (E, config.q_dim), "ffn_norm": (E,),
        "ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F),
    }
    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    if not config.tie_embeddings:
        shapes["output.weight"] = (V, E)
    for i in range(config.n_layers):
        shapes.update({f"blk.{i}.{name}.weight": shape for name, shape in per_layer.items()})
    return shapes


def check_tensors(config: ModelConfig, tensor_shapes: dict) -> None:
    """Every needed tensor is present with the shape the config implies."""
    for name, shape in expected_shapes(config).items():
        if name not in tensor_shapes:
            raise GGUFError(f"tensor {name} is missing from the file")
        if tuple(tensor_shapes[name]) != shape:
            raise GGUFError(f"tensor {name} has shape {tuple(tensor_shapes[name])}; the metadata implies {shape}")


def build_weights(config: ModelConfig, tensor) -> Weights:
    """Weights whose every tensor is `tensor(name)`: the backend decides what a tensor is."""
    tok_embeddings = tensor("token_embd.weight")
    layers = [
        LayerWeights(**{field: tensor(f"blk.{i}.{name}.weight") for field, name in LAYER_TENSORS.items()})
        for i in range(config.n_layers)
    ]
    output = tok_embeddings if config.tie_embeddings else tensor("output.weight")
    return Weights(tok_embeddings, layers, tensor("output_norm.weight"), output)
