"""The decoder: one function for prefill and decode, over layers, reading and extending the cache.

Prefill (the prompt, many new positions) and a decode step (one new position) are the *same*
`forward`; they differ only in how many token ids come in. Each layer computes Q, K, V for the new
positions only, stores K and V in the cache, and lets the new queries attend to every stored
position:  attention(new Q, [cached K, new K], [cached V, new V]).

Kernels are looked up by name on `ops` (kvref.spec.ops, or the native module with the same names),
so this one decoder serves both backends.

`forward_batch` is the same execution for several sequences at once (continuous batching): their
new positions are stacked into one [N, E] activation so every position-wise step runs once, and
only attention is split per sequence, because each sequence attends to its own cache.
"""

from __future__ import annotations

import numpy as np

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


def forward_batch(ops, config: ModelConfig, weights: Weights, token_lists, caches, all_logits=False):
    # B sequences, T_b new ids each (ragged), N = sum T_b rows -> B logits arrays [T_b, V] or [1, V]
    # Several sequences advance in one execution. Every step that acts on positions one by one
    # (embedding, norms, projections, RoPE at each row's own position, the MLP, the LM head) runs
    # once over all N rows; attention runs per sequence, each against its own cache.
    lengths = [len(ids) for ids in token_lists]
    bounds = np.cumsum([0, *lengths])  # rows bounds[b]:bounds[b+1] belong to sequence b
    reserved = []  # caches holding a reservation for this execution
    try:
        positions = []
        for cache, n in zip(caches, lengths):
            positions.append(cache.next_positions(n))  # [T_b]; a full cache fails here, before any work
            reserved.append(cache)
        positions = np.concatenate(positions)  # [N]: each row's own absolute position
        x = ops.embed(weights.tok_embeddings, np.concatenate(token_lists))  # [N, E]
        for layer, lw in enumerate(weights.layers):
            x = x + batch_attention_block(ops, config, lw, x, positions, bounds, caches, layer)  # [N, E]
            x = x + mlp_block(ops, config, lw, x)  # [N, E]
    except BaseException:
        for cache in reserved:  # one sequence failed: none of them commits
            cache.abort()
        raise
    for cache, n in zip(caches, lengths):
        cache.advance(n)  # every layer of every sequence wrote its K/V: commit
    if not all_logits:
        x = x[bounds[1:] - 1]  # [B, E]: each sequence's last position selects its next token
    logits = ops.matmul(ops.rms_norm(x, weights.output_norm, config.norm_eps), weights.output)  # [N or B, V]
    if not all_logits:
        return [logits[b:b + 1] for b in range(len(caches))]
    return [logits[bounds[b]:bounds[b + 1]] for b in range(len(caches))]


def batch_attention_block(ops, config: ModelConfig, lw: LayerWeights, x, positions, bounds, caches, layer):
    # [N, E] rows of B sequences -> [N, E]; the projections are shared, attention is per sequence
    N, H, Hkv, D = x.shape[0], config.n_heads, config.n_kv_heads, config.head_dim
    h = ops.rms_norm(x, lw.attn_norm, config.norm_eps)  # [N, E]
    q = ops.rope(ops.matmul(h, lw.wq).reshape(N, H, D), positions, config.rope_theta)  # [N, H, D]
    k = ops.rope(ops.matmul(h, lw.wk).reshape(N, Hkv, D), positions, config.rope_theta)  # [N, Hkv, D]
    v = ops.matmul(h, lw.wv).reshape(N, Hkv, D)  # [N, Hkv, D]
    out = np.empty_like(q)  # [N, H, D]
    for b, cache in enumerate(caches):
        rows = slice(bounds[b], bounds[b + 1])  # this sequence's new positions
        k_all, v_all, k_positions = cache.update(layer, k[rows], v[rows])  # [S_b, Hkv, D] x2, [S_b]
        out[rows] = ops.attention(q[rows], k_all, v_all, positions[rows], k_positions)  # [T_b, H, D]
    return ops.matmul(out.reshape(N, H * D), lw.wo)  # [N, E]
