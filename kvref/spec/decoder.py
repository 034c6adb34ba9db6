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

A mixture of experts changes only the MLP of its layers (`moe`): a router scores the experts for each
position, the k best run, and their outputs are summed with the router's weights. Every router the
config can describe (softmax or sigmoid scores, a selection bias, grouped top-k, renormalised or
scaled weights) is the one kernel `route` (kvref.spec.ops.Router holds its fields); the experts' projections are one kernel,
`matmul_experts`, which takes the rows of each expert together, so a batch reads each routed
expert's weights once.

Multi-head latent attention (MLA, DeepSeek-V2/V3; config.kv_lora_rank) changes what is cached: per
layer and position one latent key [c_kv ; k_rope] (kv_lora_rank + qk_rope_head_dim values) instead of
per-head K and V. `latent_attention_block` writes it, and attention reads it in one of two forms
(config.mla_form) that compute the same numbers: naive, expanding the latent to every head's K and V,
or absorbed, folding the key up-projection into the query so attention runs over the latent itself.

`forward_batch` is the same execution for several sequences at once (continuous batching): their
new positions are stacked into one [N, E] activation so every position-wise step runs once, and
only attention is split per sequence, because each sequence attends to its own cache. It runs
inside one transaction over every cache, opened by the caller (`kvref.cache.begin_all`, which
kvref.generation.batch.forward_batch uses): all commit or none.
"""

from __future__ import annotations

import numpy as np

from ..config import LATENT_NORM_EPS, ModelConfig
from ..weights import LayerWeights, Weights
from . import ops as spec_ops


def forward(ops, config: ModelConfig, weights: Weights, token_ids, cache, all_logits=False):
    # [T] token ids, cache at length L -> logits [T, V] (all_logits) or [1, V]; cache at length L + T
    with cache.begin(token_ids) as execution:  # room checked first; an exception inside leaves the cache as it was
        x = embed_tokens(ops, config, weights, token_ids)  # [T, E]
        for layer, lw in enumerate(weights.layers):
            x = x + attention_block(ops, config, lw, x, execution, layer)  # [T, E]
            x = x + mlp_block(ops, config, lw, x, layer)  # [T, E]
        if not all_logits:
            x = x[-1:]  # only the last position's logits select the next token
        x = ops.rms_norm(x, weights.output_norm, config.norm_eps)  # [T or 1, E]
        logits = lm_head(ops, config, weights, x)  # [T or 1, V]
        execution.last_logits = logits[-1]  # committed with the new positions as the block ends
    return logits


def lm_head(ops, config: ModelConfig, weights: Weights, x):
    # [N, E] final-normed -> [N, V]
    logits = ops.matmul(x, weights.output)  # [N, V]
    if config.final_softcap is not None:  # Gemma 2 squashes the logits into (-cap, cap)
        logits = ops.soft_cap(logits, config.final_softcap)
    return logits


def embed_tokens(ops, config: ModelConfig, weights: Weights, token_ids):
    # [T] -> [T, E]
    x = ops.embed(weights.tok_embeddings, token_ids)  # [T, E]
    if config.embedding_scale != 1.0:  # Gemma: x sqrt(E), rounded to the activation type first as Gemma does
        x = x * np.asarray(config.embedding_scale, dtype=x.dtype)
    return x


def attention_block(ops, config: ModelConfig, lw: LayerWeights, x, execution, layer):
    # [T, E] -> [T, E]; execution: the open one (positions, and the cache's K/V)
    if config.latent:
        return latent_attention_block(ops, config, lw, x, execution.positions, [0, len(x)], [execution], layer)
    positions = execution.positions  # [T] absolute positions of the new tokens
    q, k, v = project_qkv(ops, config, lw, x, positions, layer)  # [T, H, D], [T, Hkv, D] x2
    k_all, v_all, k_positions = execution.update(layer, k, v)  # [S, Hkv, D] x2, [S]; Q is never stored
    out = ops.attention(q, k_all, v_all, positions, k_positions,  # [T, H, D]
                        scale=config.score_scale, window=config.window(layer), softcap=config.attn_softcap,
                        sinks=lw.sinks)
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
    rope = config.layer_rope(layer)  # (base, scaling), or None on a NoPE layer (SmolLM3): q, k carry no position
    if rope is not None:
        q = ops.rope(q, positions, *rope)  # rotated for the absolute positions
        k = ops.rope(k, positions, *rope)  # stored rotated: never rotated again
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


def mlp_block(ops, config: ModelConfig, lw: LayerWeights, x, layer):
    # [T, E] -> [T, E]; position-wise: no position sees another, so caching cannot change it
    h = ops.rms_norm(x, lw.ffn_norm, config.norm_eps)  # [T, E]
    if config.moe_layer(layer):
        y = moe(ops, config, lw, h)  # [T, E]
    else:
        y = gated_mlp(ops, config, h, lw.w_gate, lw.w_up, lw.w_down)  # [T, E]
    if config.sandwich_norms:
        y = ops.rms_norm(y, lw.post_ffn_norm, config.norm_eps)
    return y


def gated_mlp(ops, config: ModelConfig, h, w_gate, w_up, w_down):
    # [T, E], [F, E], [F, E], [E, F] -> [T, E]: down(act(gate h) * up h)
    return ops.matmul(gated(ops, config, ops.matmul(h, w_gate), ops.matmul(h, w_up)), w_down)


GATES = {"silu": "swiglu", "gelu_tanh": "geglu", "swiglu_oai": "swiglu_oai"}  # ModelConfig.activation -> kernel


def gated(ops, config: ModelConfig, gate, up):
    # [R, F], [R, F] -> [R, F]: the gate of config.activation, one dispatch for dense MLPs and experts alike
    return getattr(ops, GATES[config.activation])(gate, up)


def moe(ops, config: ModelConfig, lw: LayerWeights, h):
    # [T, E] -> [T, E]: each position through its k routed experts, their outputs weighted and summed,
    # plus the shared expert when there is one
    logits = project(ops, h, lw.router, lw.router_bias)  # [T, X]
    experts, weights = ops.route(logits, lw.expert_selection_bias, router(config))  # [T, k] ids, [T, k]
    T, k = experts.shape
    ids = experts.reshape(-1)  # [T*k]: row t*k + j is position t through its j-th expert
    hk = np.repeat(h, k, axis=0)  # [T*k, E]
    gate = project_experts(ops, hk, lw.experts_gate, lw.experts_gate_bias, ids)  # [T*k, Fx]
    up = project_experts(ops, hk, lw.experts_up, lw.experts_up_bias, ids)  # [T*k, Fx]
    out = project_experts(ops, gated(ops, config, gate, up), lw.experts_down, lw.experts_down_bias, ids)  # [T*k, E]
    out = out.reshape(T, k, -1) * weights[:, :, None].astype(out.dtype)  # [T, k, E]
    y = out[:, 0]  # [T, E]
    for j in range(1, k):  # added best first, in a fixed order (the C forward adds them so)
        y = y + out[:, j]
    if config.shared_expert_d_ff:
        y = y + gated_mlp(ops, config, h, lw.shared_gate, lw.shared_up, lw.shared_down)  # [T, E]
    return y


def project_experts(ops, x, w, bias, experts):
    # [R, K], [X, N, K], [X, N] or None, [R] -> [R, N]: row r through expert experts[r]
    y = ops.matmul_experts(x, w, experts)
    return y if bias is None else y + bias[experts]  # gpt-oss's expert biases


def router(config: ModelConfig) -> spec_ops.Router:
    # the config's router fields as the `route` kernel takes them
    return spec_ops.Router(config.n_experts_used, config.router_score, config.n_expert_groups,
                           config.n_expert_groups_used, config.expert_group_score, config.norm_topk_prob,
                           config.routed_scaling_factor)


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
        x = x + mlp_block(ops, config, lw, x, layer)  # [N, E]
    rows = bounds
    if not all_logits:
        x = x[bounds[1:] - 1]  # [B, E]: each sequence's last position selects its next token
        rows = np.arange(len(executions) + 1)
    logits = lm_head(ops, config, weights, ops.rms_norm(x, weights.output_norm, config.norm_eps))  # [N or B, V]
    out = [logits[rows[b]:rows[b + 1]] for b in range(len(executions))]  # [T_b or 1, V] each
    for execution, sequence_logits in zip(executions, out):
        execution.last_logits = sequence_logits[-1]  # committed with the sequence's new positions
    return out


def batch_attention_block(ops, config: ModelConfig, lw: LayerWeights, x, positions, bounds, executions, layer):
    # [N, E] rows of B sequences -> [N, E]; the projections are shared, attention is per sequence
    if config.latent:
        return latent_attention_block(ops, config, lw, x, positions, bounds, executions, layer)
    q, k, v = project_qkv(ops, config, lw, x, positions, layer)  # [N, H, D], [N, Hkv, D] x2
    out = np.empty_like(q)  # [N, H, D]
    for b, execution in enumerate(executions):
        rows = slice(bounds[b], bounds[b + 1])  # this sequence's new positions
        k_all, v_all, k_positions = execution.update(layer, k[rows], v[rows])  # [S_b, Hkv, D] x2, [S_b]
        out[rows] = ops.attention(q[rows], k_all, v_all, positions[rows], k_positions,  # [T_b, H, D]
                                  scale=config.score_scale, window=config.window(layer),
                                  softcap=config.attn_softcap, sinks=lw.sinks)
    return attention_output(ops, config, lw, out)  # [N, E]


# ---- multi-head latent attention (DeepSeek-V2/V3) ---------------------------------------------------
# Legend: R kv_lora_rank (the latent c_kv), Dr qk_rope_head_dim (the rotated part, one key shared by all
# heads), Dn = D - Dr (the part RoPE leaves alone), Dv v_head_dim. Per head h the up-projection wkv_b
# holds W_UK[h] [Dn, R] (latent -> the key's unrotated part) and W_UV[h] [Dv, R] (latent -> value).


def latent_attention_block(ops, config: ModelConfig, lw: LayerWeights, x, positions, bounds, executions, layer):
    # [N, E] rows of B sequences (bounds as forward_batch's) -> [N, E]
    # The absorbed form: q_nope . (W_UK c) = (W_UK^T q_nope) . c, so W_UK is folded into every row's query
    # (position-wise, like the projections: once for all rows), and the scores are MQA over the cached latent
    # keys (width R + Dr) with values their first R elements (c). W_UV is linear, so it moves after the
    # weighted sum: W_UV (sum_s p_s c_s). Per step this reads S x (R + Dr) cached values instead of the
    # S x H x (D + Dv) the naive form expands them to.
    q_nope, q_rope, latent_key = project_latent(ops, config, lw, x, positions, layer)  # [N,H,Dn], [N,H,Dr], [N,1,R+Dr]
    absorbed = config.mla_form == "absorbed"
    q = absorbed_queries(ops, config, lw, q_nope, q_rope) if absorbed else None  # [N, H, R + Dr]
    out = np.empty((len(x), config.n_heads, config.kv_lora_rank if absorbed else config.v_head_dim), dtype=x.dtype)
    for b, execution in enumerate(executions):
        rows = slice(bounds[b], bounds[b + 1])
        # the cache stores the latent key only; its V is the key's first R values (c_kv), never stored
        latent_all, c_all, k_positions = execution.update(layer, latent_key[rows], None)  # [S, 1, R+Dr], [S, 1, R], [S]
        if absorbed:
            out[rows] = ops.attention(q[rows], latent_all, c_all, positions[rows], k_positions,  # [T_b, H, R]
                                      scale=latent_scale(config))
        else:
            out[rows] = naive_latent_attention(ops, config, lw, q_nope[rows], q_rope[rows], latent_all, c_all,
                                               positions[rows], k_positions)  # [T_b, H, Dv]
    if absorbed:
        out = absorbed_values(ops, config, lw, out)  # [N, H, Dv]
    return attention_output(ops, config, lw, out)  # [N, E]


def project_latent(ops, config: ModelConfig, lw: LayerWeights, x, positions, layer):
    # [N, E], [N] -> q_nope [N, H, Dn], q_rope [N, H, Dr] (rotated), latent_key [N, 1, R + Dr] (k_rope rotated)
    N, H, D, R, Dn = x.shape[0], config.n_heads, config.head_dim, config.kv_lora_rank, config.qk_nope_head_dim
    theta, scaling = config.layer_rope_theta(layer), config.rope_scaling
    h = ops.rms_norm(x, lw.attn_norm, config.norm_eps)  # [N, E]
    if lw.wq_a is not None:  # DeepSeek-V2/V3: the query through its own low-rank bottleneck
        h_q = ops.rms_norm(ops.matmul(h, lw.wq_a), lw.q_a_norm, LATENT_NORM_EPS)  # [N, q_lora_rank]
    else:  # DeepSeek-V2-Lite: one projection
        h_q = h
    q = ops.matmul(h_q, lw.wq).reshape(N, H, D)  # [N, H, D]: per head [nope | rope]
    q_rope = ops.rope(np.ascontiguousarray(q[..., Dn:]), positions, theta, scaling)  # [N, H, Dr]
    rope_scale = latent_rope_scale(config)
    if rope_scale != 1.0:  # YaRN's attention factor on the rotated parts of the scores
        q_rope = q_rope * np.asarray(rope_scale, dtype=q_rope.dtype)
    kv = ops.matmul(h, lw.wkv_a)  # [N, R + Dr]: [c_kv | k_rope]
    c_kv = ops.rms_norm(np.ascontiguousarray(kv[:, :R]), lw.kv_a_norm, LATENT_NORM_EPS)  # [N, R]
    k_rope = ops.rope(np.ascontiguousarray(kv[:, None, R:]), positions, theta, scaling)  # [N, 1, Dr]: one for all heads
    latent_key = np.concatenate([c_kv[:, None, :], k_rope], axis=-1)  # [N, 1, R + Dr]: what the cache stores
    return np.ascontiguousarray(q[..., :Dn]), q_rope, latent_key


def latent_up_projections(config: ModelConfig, lw: LayerWeights, dtype):
    # wkv_b [H*(Dn+Dv), R] -> W_UK [H, Dn, R], W_UV [H, Dv, R] (views, file layout, in `dtype`)
    w = np.asarray(lw.wkv_b, dtype=dtype).reshape(config.n_heads, config.qk_nope_head_dim + config.v_head_dim,
                                                  config.kv_lora_rank)
    return w[:, :config.qk_nope_head_dim], w[:, config.qk_nope_head_dim:]


def per_head_matmul(ops, x, w):
    # [T, H, K], [H, N, K] -> [T, H, N]: head h's rows through its own matrix (ops.matmul, y = x @ W.T)
    return np.stack([ops.matmul(np.ascontiguousarray(x[:, h]), w[h]) for h in range(x.shape[1])], axis=1)


def latent_scale(config: ModelConfig) -> float:
    # the softmax scale of a query head of D = Dn + Dr values, whichever form computes the scores; DeepSeek's
    # YaRN factor of mscale_all_dim, squared, is in attention_scale (kvref.formats.hf)
    return config.head_dim ** -0.5 if config.attention_scale is None else config.attention_scale


def latent_rope_scale(config: ModelConfig) -> float:
    # YaRN's attention factor m (config.rope_scaling[5]) multiplies the cos and sin transformers rotates with,
    # and DeepSeek rotates only q_rope and k_rope: their part of each score carries m**2. The query takes it
    # alone, so the cached k_rope stays as rotation made it. 1 for DeepSeek's own configs (mscale ==
    # mscale_all_dim makes m 1).
    scaling = config.rope_scaling
    return 1.0 if scaling is None or scaling[0] != "yarn" else scaling[5] ** 2


def naive_latent_attention(ops, config: ModelConfig, lw, q_nope, q_rope, latent_all, c_all, q_positions, k_positions):
    # [T, H, Dn], [T, H, Dr], [S, 1, R + Dr], [S, 1, R], [T], [S] -> [T, H, Dv]
    # Expand the cached latent of every position to each head's key and value, then attend as MHA:
    # key h = [W_UK[h] c ; k_rope] (k_rope shared), value h = W_UV[h] c.
    S, H, R, Dn = latent_all.shape[0], config.n_heads, config.kv_lora_rank, config.qk_nope_head_dim
    c = np.ascontiguousarray(c_all[:, 0])  # [S, R]
    kv = ops.matmul(c, lw.wkv_b).reshape(S, H, Dn + config.v_head_dim)  # [S, H, Dn + Dv]: W_UK c, W_UV c per head
    k_rope = np.broadcast_to(latent_all[:, :, R:], (S, H, config.qk_rope_head_dim))  # [S, H, Dr]
    k = np.concatenate([kv[..., :Dn], k_rope], axis=-1)  # [S, H, D]
    v = np.ascontiguousarray(kv[..., Dn:])  # [S, H, Dv]
    q = np.concatenate([q_nope, q_rope], axis=-1)  # [T, H, D]
    return ops.attention(q, k, v, q_positions, k_positions, scale=latent_scale(config))  # [T, H, Dv]


def absorbed_queries(ops, config: ModelConfig, lw, q_nope, q_rope):
    # [N, H, Dn], [N, H, Dr] -> [N, H, R + Dr]: per head [W_UK[h]^T q_nope[h] ; q_rope[h]], what attends to
    # the cached latent keys
    w_uk, _ = latent_up_projections(config, lw, q_nope.dtype)  # [H, Dn, R]
    w_uk_t = np.ascontiguousarray(w_uk.transpose(0, 2, 1))  # [H, R, Dn]: the form ops.matmul multiplies by
    return np.concatenate([per_head_matmul(ops, q_nope, w_uk_t), q_rope], axis=-1)


def absorbed_values(ops, config: ModelConfig, lw, out_latent):
    # [N, H, R] -> [N, H, Dv]: W_UV[h] times each head's attention output over the latent
    _, w_uv = latent_up_projections(config, lw, out_latent.dtype)  # [H, Dv, R]
    return per_head_matmul(ops, out_latent, w_uv)
