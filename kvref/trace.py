"""Cost accounting: what each execution computed, recomputed and read from the cache.

An Execution is one forward pass. Its positions fall in three groups:
    new         computed for the first time (their K/V did not exist before)
    recomputed  computed again although an earlier execution already computed them (no cache)
    cached      not computed at all: their K/V were read from the cache
FLOPs count multiply-adds as 2; norms, RoPE and softmax are left out (they are O(E) per position).
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


def attention_flops(config: ModelConfig, first: int, n_positions: int) -> int:
    """q.k scores and the weighted sum of V; the query at position p sees p + 1 keys."""
    keys_seen = sum(p + 1 for p in range(first, first + n_positions))
    return config.n_layers * config.n_heads * 4 * config.head_dim * keys_seen


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
