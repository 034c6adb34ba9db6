"""Cost accounting: what each execution computed, recomputed and read from the cache.

An Execution is one forward pass. Its positions fall in three groups:
    new         computed for the first time (their K/V did not exist before)
    recomputed  computed again although an earlier execution already computed them (no cache)
    cached      not computed at all: their K/V were read from the cache
FLOPs count multiply-adds as 2; norms, RoPE and softmax are left out (they are O(E) per position).
A multi-head latent attention model (config.latent) is counted in the absorbed form the decoder runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class Execution:
    new: range
    recomputed: range
    cached: range
    n_logits: int  # positions whose logits were computed (the LM head is the largest projection)
    projection_flops: int
    attention_flops: int

    @property
    def computed(self) -> int:
        return len(self.new) + len(self.recomputed)

    @property
    def kind(self) -> str:
        if self.recomputed:
            return "recompute"  # the whole history again: what a cache avoids
        return "decode step" if self.computed == 1 else "prefill"


def projection_flops(config: ModelConfig, n_positions: int, n_logits: int) -> int:
    """Q, K, V, output and MLP projections per position per layer, plus the LM head per logit row."""
    E = config.d_model
    if config.latent:
        attention = 2 * latent_projection_weights(config)
    else:
        attention = 2 * E * (config.q_dim + 2 * config.kv_dim) + 2 * config.q_dim * E
    per_position = sum(attention + mlp_flops(config, layer) for layer in range(config.n_layers))
    return n_positions * per_position + n_logits * 2 * E * config.vocab_size


def mlp_flops(config: ModelConfig, layer: int) -> int:
    """One position's MLP projections in `layer`: the dense gate, up and down; in a mixture of experts the
    router, the n_experts_used experts the position runs and the shared expert."""
    E = config.d_model
    if not config.moe_layer(layer):
        return 2 * 3 * E * config.d_ff
    experts = config.n_experts_used * config.experts_d_ff + config.shared_expert_d_ff
    return 2 * E * config.n_experts + 2 * 3 * E * experts


def latent_projection_weights(config: ModelConfig) -> int:
    """MLA, absorbed: the weights one new position multiplies in a layer's attention: the query (through its
    low-rank bottleneck or not), the latent down-projection, W_UK folded into the query, W_UV after attention
    and the output projection."""
    E, H, R, Dr, Dv, Q = (config.d_model, config.n_heads, config.kv_lora_rank, config.qk_rope_head_dim,
                          config.v_head_dim, config.q_lora_rank)
    query = E * config.q_dim if Q is None else E * Q + Q * config.q_dim
    return query + E * (R + Dr) + H * config.qk_nope_head_dim * R + H * R * Dv + H * Dv * E


def attention_flops(config: ModelConfig, first: int, n_positions: int) -> int:
    """q.k scores and the weighted sum of V; the query at position p sees p + 1 keys. MLA (absorbed): every
    head scores the R + Dr wide latent key and sums its R wide c_kv."""
    keys_seen = sum(p + 1 for p in range(first, first + n_positions))
    if config.latent:
        per_key = 2 * (2 * config.kv_lora_rank + config.qk_rope_head_dim)
    else:
        per_key = 4 * config.head_dim
    return config.n_layers * config.n_heads * per_key * keys_seen


def latent_read_bytes(config: ModelConfig, n_keys: int, element_bytes: int) -> dict:
    """MLA: the K/V bytes one decode step over n_keys cached positions reads, in each form of attention.
    absorbed: the cached latent keys themselves, layers x n_keys x (R + Dr), shared by every head; naive:
    the per-head K and V expanded from them, layers x n_keys x H x (D + Dv) (formed from the latent first)."""
    c = config
    return {"absorbed": c.n_layers * n_keys * (c.kv_lora_rank + c.qk_rope_head_dim) * element_bytes,
            "naive": c.n_layers * n_keys * c.n_heads * (c.head_dim + c.v_head_dim) * element_bytes}


def execution(config: ModelConfig, first_new: int, end: int, n_cached: int, n_logits: int = 1) -> Execution:
    """The record of an execution that computes positions n_cached..end-1 and reads 0..n_cached-1.

    Positions in [n_cached, first_new) had been computed before and are computed again.
    """
    computed = end - n_cached
    return Execution(
        new=range(first_new, end),
        recomputed=range(n_cached, first_new),
        cached=range(0, n_cached),
        n_logits=n_logits,
        projection_flops=projection_flops(config, computed, n_logits),
        attention_flops=attention_flops(config, n_cached, computed),
    )


GLYPHS = {"new": "N", "recomputed": "R", "cached": "c", "idle": "."}


def render_grid(executions: list[Execution], labels: list[str]) -> str:
    """Executions x positions: N new, R recomputed, c read from the cache, . not yet in the history."""
    width = max(len(label) for label in labels) + 1
    header = "execution      " + "".join(label.rjust(width) for label in labels)
    header += "    new  recomp  cached     proj FLOPs   attn FLOPs"
    lines = [header]
    for i, ex in enumerate(executions):
        cells = []
        for p in range(len(labels)):
            kind = next((k for k in ("new", "recomputed", "cached") if p in getattr(ex, k)), "idle")
            cells.append(GLYPHS[kind].rjust(width))
        lines.append(
            f"{i + 1:>3} {ex.kind:<11}" + "".join(cells)
            + f"  {len(ex.new):>5}  {len(ex.recomputed):>6}  {len(ex.cached):>6}"
            + f"  {ex.projection_flops:>13,}  {ex.attention_flops:>11,}")
    return "\n".join(lines)


def totals(executions: list[Execution]) -> dict:
    return {
        "executions": len(executions),
        "new": sum(len(e.new) for e in executions),
        "recomputed": sum(len(e.recomputed) for e in executions),
        "cached": sum(len(e.cached) for e in executions),
        "projection_flops": sum(e.projection_flops for e in executions),
        "attention_flops": sum(e.attention_flops for e in executions),
    }
