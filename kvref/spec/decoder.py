"""The decoder: one function for prefill and decode, over layers, reading and extending the cache.

Prefill (the prompt, many new positions) and a decode step (one new position) are the *same*
`forward`; they differ only in how many token ids come in. Each layer computes Q, K, V for the new
positions only, stores K and V in the cache, and lets the new queries attend to every stored
position:  attention(new Q, [cached K, new K], [cached V, new V]).

Kernels are looked up by name on `ops` (kvref.spec.ops, or the native module with the same names),
so this one decoder serves both backends.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..weights import LayerWeights, Weights


def forward(ops, config: ModelConfig, weights: Weights, token_ids, cache, all_logits=False):
    # [T] token ids, cache at length L -> logits [T, V] (all_logits) or [1, V]; cache at length L + T
    positions = cache.next_positions(len(token_ids))  # [T]; a full cache fails here, before any work
    x = ops.embed(weights.tok_embeddings, token_ids)  # [T, E]
    for layer, lw in enumerate(weights.layers):
        x = x + attention_block(ops, config, lw, x, positions, cache, layer)  # [T, E]
        x = x + mlp_block(ops, config, lw, x)  # [T, E]
    cache.advance(len(token_ids))  # every layer wrote its K/V: commit the new positions
    if not all_logits:
        x = x[-1:]  # only the last position's logits select the next token
    x = ops.rms_norm(x, weights.output_norm, config.norm_eps)  # [T or 1, E]
    return ops.matmul(x, weights.output)  # [T or 1, V]


def attention_block(ops, config: ModelConfig, lw: LayerWeights, x, positions, cache, layer):
    # [T, E] -> [T, E]
    T, H, Hkv, D = x.shape[0], config.n_heads, config.n_kv_heads, config.head_dim
    h = ops.rms_norm(x, lw.attn_norm, config.norm_eps)  # [T, E]
    q = ops.matmul(h, lw.wq).reshape(T, H, D)  # [T, H, D]
    k = ops.matmul(h, lw.wk).reshape(T, Hkv, D)  # [T, Hkv, D]
    v = ops.matmul(h, lw.wv).reshape(T, Hkv, D)  # [T, Hkv, D]
    q = ops.rope(q, positions, config.rope_theta)  # rotated for the absolute positions
    k = ops.rope(k, positions, config.rope_theta)  # stored rotated: never rotated again
    k_all, v_all, k_positions = cache.update(layer, k, v)  # [S, Hkv, D] x2, [S]; Q is never stored
    out = ops.attention(q, k_all, v_all, positions, k_positions)  # [T, H, D]
    return ops.matmul(out.reshape(T, H * D), lw.wo)  # [T, E]


def mlp_block(ops, config: ModelConfig, lw: LayerWeights, x):
    # [T, E] -> [T, E]; position-wise: no position sees another, so caching cannot change it
    h = ops.rms_norm(x, lw.ffn_norm, config.norm_eps)  # [T, E]
    gate = ops.matmul(h, lw.w_gate)  # [T, F]
    up = ops.matmul(h, lw.w_up)  # [T, F]
    return ops.matmul(ops.swiglu(gate, up), lw.w_down)  # [T, E]
