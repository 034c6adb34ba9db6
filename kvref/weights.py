"""Weights: every tensor of a decoder, in file layout, one plain type per level.

Projection matrices are [out, in] as GGUF and PyTorch store them; nothing is transposed at load.
A backend may hold a tensor in its own form (the native path keeps quantized blocks); the decoder
never looks inside, it only passes tensors to kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig


@dataclass
class LayerWeights:
    attn_norm: object  # [E]        RMSNorm gain before attention
    wq: object  # [H*D, E]          query projection
    wk: object  # [Hkv*D, E]        key projection
    wv: object  # [Hkv*D, E]        value projection
    wo: object  # [E, H*D]          attention output projection
    ffn_norm: object  # [E]         RMSNorm gain before the MLP
    w_gate: object  # [F, E]        SwiGLU gate projection
    w_up: object  # [F, E]          SwiGLU up projection
    w_down: object  # [E, F]        SwiGLU down projection
    bq: object = None  # [H*D]      query bias (config.qkv_bias)
    bk: object = None  # [Hkv*D]    key bias
    bv: object = None  # [Hkv*D]    value bias
    q_norm: object = None  # [D]    RMSNorm gain of each query head (config.qk_norm)
    k_norm: object = None  # [D]    RMSNorm gain of each key head
    post_attn_norm: object = None  # [E]  RMSNorm gain on the attention output (config.sandwich_norms)
    post_ffn_norm: object = None  # [E]   RMSNorm gain on the MLP output


@dataclass
class Weights:
    tok_embeddings: object  # [V, E]
    layers: list  # n_layers x LayerWeights
    output_norm: object  # [E]
    output: object  # [V, E]: the LM head; the same object as tok_embeddings when tied


def random_weights(config: ModelConfig, seed: int, dtype="float32") -> Weights:
    """Deterministic random weights: the same seed gives the same numbers in every dtype.

    Drawn in float64 and rounded once, so a float32 model is the float64 model rounded: the
    float64 run is an exact oracle for it. Scales keep activations O(1) through the layers
    (matrices ~ N(0, 1/fan_in), norm gains near 1), so logits are neither flat nor saturated.
    """
    rng = np.random.default_rng(seed)
    E, F, V = config.d_model, config.d_ff, config.vocab_size

    def matrix(n_out, n_in):
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(dtype)

    def gain(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(dtype)

    tok_embeddings = rng.standard_normal((V, E)).astype(dtype)
    def bias(n):
        return (0.1 * rng.standard_normal(n)).astype(dtype) if config.qkv_bias else None

    def optional_gain(n, present):
        return gain(n) if present else None

    layers = [
        LayerWeights(
            attn_norm=gain(E),
            wq=matrix(config.q_dim, E),
            wk=matrix(config.kv_dim, E),
            wv=matrix(config.kv_dim, E),
            wo=matrix(E, config.q_dim),
            ffn_norm=gain(E),
            w_gate=matrix(F, E),
            w_up=matrix(F, E),
            w_down=matrix(E, F),
            bq=bias(config.q_dim), bk=bias(config.kv_dim), bv=bias(config.kv_dim),
            q_norm=optional_gain(config.head_dim, config.qk_norm),
            k_norm=optional_gain(config.head_dim, config.qk_norm),
            post_attn_norm=optional_gain(E, config.sandwich_norms),
            post_ffn_norm=optional_gain(E, config.sandwich_norms),
        )
        for _ in range(config.n_layers)
    ]
    output_norm = gain(E)
    output = tok_embeddings if config.tie_embeddings else matrix(V, E)
    return Weights(tok_embeddings, layers, output_norm, output)
