"""The decoder: one function for prefill and decode, over layers, reading and extending the cache.

Prefill (the prompt, many new positions) and a decode step (one new position) are the *same*
`forward`; they differ only in how many token ids come in. Each layer computes Q, K, V for the new
positions only, stores K and V in the cache, and lets the new queries attend to every stored
position:  attention(new Q, [cached K, new K], [cached V, new V]).

Kernels are looked up by name on `ops` (kvref.spec.ops, or the native module with the same names),
so this one decoder serves both backends.

The cache hands out each execution as a transaction (kvref.cache.execution): `cache.begin` checks and
reserves room before any work, every layer writes its K/V through the execution, and leaving the
`with` block commits the new positions together with their ids and the last logits. An exception
anywhere inside (a bad kernel argument, Ctrl-C) aborts instead, leaving the cache as it was.

`forward_batch` is the same execution for several sequences at once (continuous batching): their
new positions are stacked into one [N, E] activation so every position-wise step runs once, and
only attention is split per sequence, because each sequence attends to its own cache. It runs
inside one transaction over every cache, opened by the caller (`kvref.cache.begin_all`, which
kvref.generation.batch.forward_batch uses): all commit or none.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..weights import LayerWeights, Weights


def forward(ops, config: ModelConfig, weights: Weights, token_ids, cache, all_logits=False):
    # [T] token ids, cache at length L -> logits [T, V] (all_logits) or [1, V]; cache at length L + T
    with cache.begin(token_ids) as execution:  # room checked first; an exception inside leaves the cache as it was
        x = embed_tokens(ops, config, weights, token_ids)  # [T, E]
        for layer, lw in enumerate(weights.layers):
            x = x + attention_block(ops, config, lw, x, execution, layer)  # [T, E]
            x = x + mlp_block(ops, config, lw, x)  # [T, E]
        if not all_logits:
            x = x[-1:]  # only the last position's logits select the next token
        x = ops.rms_norm(x, weights.output_norm, config.norm_eps)  # [T or 1, E]
        logits = ops.matmul(x, weights.output)  # [T or 1, V]
        execution.last_logits = logits[-1]  # committed with the new positions as the block ends
    return logits


def embed_tokens(ops, config: ModelConfig, weights: Weights, token_ids):
    # [T] -> [T, E]
    x = ops.embed(weights.tok_embeddings, token_ids)  # [T, E]
    if config.embedding_scale != 1.0:  # Gemma: x sqrt(E), rounded to the activation type first as Gemma does
        x = x * np.asarray(config.embedding_scale, dtype=x.dtype)
    return x


def attention_block(ops, config: ModelConfig, lw: LayerWeights, x, execution, layer):
    # [T, E] -> [T, E]; execution: the open one (positions, and the cache's K/V)
    positions = execution.positions  # [T] absolute positions of the new tokens
    q, k, v = project_qkv(ops, config, lw, x, positions, layer)  # [T, H, D], [T, Hkv, D] x2
    k_all, v_all, k_positions = execution.update(layer, k, v)  # [S, Hkv, D] x2, [S]; Q is never stored
    out = ops.attention(q, k_all, v_all, positions, k_positions,  # [T, H, D]
                        scale=config.score_scale, window=config.window(layer), sinks=lw.sinks)
    return attention_output(ops, config, lw, out)  # [T, E]


def project_qkv(ops, config: ModelConfig, lw: LayerWeights, x, positions, layer):
    # [T, E], [T] -> q [T, H, D], k [T, Hkv, D] (both rotated for their absolute positions), v [T, Hkv, D]
    T, H, Hkv, D = x.shape[0], config.n_heads, config.n_kv_heads, config.head_dim
    h = ops.rms_norm(x, lw.attn_norm, config.norm_eps)  # [T, E]
    q = project(ops, h, lw.wq, lw.bq).reshape(T, H, D)  # [T, H, D]
    k = project(ops, h, lw.wk, lw.bk).reshape(T, Hkv, D)  # [T, Hkv, D]
    v = project(ops, h, lw.wv, lw.bv).reshape(T, Hkv, D)  # [T, Hkv, D]
    if config.qk_norm:  # Qwen 3, Gemma 3: every head's q and k normalised on their own, before RoPE
        q = ops.rms_norm(q.reshape(T * H, D), lw.q_norm, config.norm_eps).reshape(T, H, D)
        k = ops.rms_norm(k.reshape(T * Hkv, D), lw.k_norm, config.norm_eps).reshape(T, Hkv, D)
    theta, scaling = config.layer_rope_theta(layer), config.rope_scaling
    q = ops.rope(q, positions, theta, scaling)  # rotated for the absolute positions
    k = ops.rope(k, positions, theta, scaling)  # stored rotated: never rotated again
    return q, k, v


def project(ops, x, w, bias):
    # [T, K], [N, K], [N] or None -> [T, N]
    y = ops.matmul(x, w)
    return y if bias is None else y + bias  # Qwen 2's Q, K, V biases; gpt-oss's on every attention projection


def attention_output(ops, config: ModelConfig, lw: LayerWeights, out):
    # [T, H, D] -> [T, E]
    y = project(ops, out.reshape(out.shape[0], -1), lw.wo, lw.bo)  # [T, E]
    if config.sandwich_norms:  # Gemma 3 normalises the block's output too, before the residual add
        y = ops.rms_norm(y, lw.post_attn_norm, config.norm_eps)
    return y


def mlp_block(ops, config: ModelConfig, lw: LayerWeights, x):
    # [T, E] -> [T, E]; position-wise: no position sees another, so caching cannot change it
    h = ops.rms_norm(x, lw.ffn_norm, config.norm_eps)  # [T, E]
    gate = ops.matmul(h, lw.w_gate)  # [T, F]
    up = ops.matmul(h, lw.w_up)  # [T, F]
    gated = gated_activation(ops, config, gate, up)  # [T, F]
    y = ops.matmul(gated, lw.w_down)  # [T, E]
    if config.sandwich_norms:
        y = ops.rms_norm(y, lw.post_ffn_norm, config.norm_eps)
    return y


GATES = {"silu": "swiglu", "gelu_tanh": "geglu", "swiglu_oai": "swiglu_oai"}  # ModelConfig.activation -> kernel


def gated_activation(ops, config: ModelConfig, gate, up):
    # [T, F], [T, F] -> [T, F]: the MLP's gate, by config.activation
    return getattr(ops, GATES[config.activation])(gate, up)


def forward_batch(ops, config: ModelConfig, weights: Weights, executions, all_logits=False):
    # B open executions (one per sequence, T_b new ids each, ragged), N = sum T_b rows
    #   -> B logits arrays [T_b, V] or [1, V]; the caller commits them all or none.
    # Every step that acts on positions one by one (embedding, norms, projections, RoPE at each
    # row's own position, the MLP, the LM head) runs once over all N rows; attention runs per
    # sequence, each against its own cache.
    bounds = np.cumsum([0, *(e.n_new for e in executions)])  # rows bounds[b]:bounds[b+1] are sequence b's
    positions = np.concatenate([e.positions for e in executions])  # [N]: each row's own position
    x = embed_tokens(ops, config, weights, np.concatenate([e.token_ids for e in executions]))  # [N, E]
    for layer, lw in enumerate(weights.layers):
        x = x + batch_attention_block(ops, config, lw, x, positions, bounds, executions, layer)  # [N, E]
        x = x + mlp_block(ops, config, lw, x)  # [N, E]
    rows = bounds
    if not all_logits:
        x = x[bounds[1:] - 1]  # [B, E]: each sequence's last position selects its next token
        rows = np.arange(len(executions) + 1)
    logits = ops.matmul(ops.rms_norm(x, weights.output_norm, config.norm_eps), weights.output)  # [N or B, V]
    out = [logits[rows[b]:rows[b + 1]] for b in range(len(executions))]  # [T_b or 1, V] each
    for execution, sequence_logits in zip(executions, out):
        execution.last_logits = sequence_logits[-1]  # committed with the sequence's new positions
    return out


def batch_attention_block(ops, config: ModelConfig, lw: LayerWeights, x, positions, bounds, executions, layer):
    # [N, E] rows of B sequences -> [N, E]; the projections are shared, attention is per sequence
    q, k, v = project_qkv(ops, config, lw, x, positions, layer)  # [N, H, D], [N, Hkv, D] x2
    out = np.empty_like(q)  # [N, H, D]
    for b, execution in enumerate(executions):
        rows = slice(bounds[b], bounds[b + 1])  # this sequence's new positions
        k_all, v_all, k_positions = execution.update(layer, k[rows], v[rows])  # [S_b, Hkv, D] x2, [S_b]
        out[rows] = ops.attention(q[rows], k_all, v_all, positions[rows], k_positions,  # [T_b, H, D]
                                  scale=config.score_scale, window=config.window(layer), sinks=lw.sinks)
    return attention_output(ops, config, lw, out)  # [N, E]
