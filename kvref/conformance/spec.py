"""The reference side: the float32 NumPy spec on the same file's weights, and how far an engine is from it.

KL is KL(spec || engine) of one position's next-token distributions, in nats. From full logits it is
exact. From an engine's top-k log-probabilities (an HTTP server) both distributions are *coarsened* to
k + 1 outcomes: each of the engine's k tokens, and "any other token" (the spec's remaining mass
against 1 - the engine's top-k mass). Coarsening never increases KL (the data-processing
inequality), so the top-k figure is a lower bound on the full KL, exact when the k tokens carry all
the mass; docs/conformance.md states it beside every top-k result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..spec import ops
from .engine import Rows

TINY = 1e-300  # floor of a probability before its log: a mass the engine rounds to 0 costs ~690 nats, not inf


class Spec:
    """The float32 spec decoder (backend numpy, contiguous cache) as the oracle of every check."""

    def __init__(self, model):
        self.model = model
        self._rows = {}
        self._greedy = {}

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def rows(self, ids) -> np.ndarray:
        """log p(next token) at every position of ids: [T, V] float64, one execution from position 0."""
        key = tuple(int(t) for t in ids)
        if key not in self._rows:
            self._rows[key] = Rows.from_logits(self.model.forward(list(key), all_logits=True)).full
        return self._rows[key]

    def last(self, ids) -> np.ndarray:
        """log p(next token) after ids: [V] (the last position only: no [T, V] for long inputs)."""
        return Rows.from_logits(self.model.forward(list(ids))).full[0]

    def greedy(self, ids, n: int):
        """The spec's n greedy tokens after ids, with the [V] log-probabilities each was chosen from."""
        key = (tuple(int(t) for t in ids), n)
        if key not in self._greedy:
            self._greedy[key] = self._decode(list(key[0]), n)
        return self._greedy[key]

    def _decode(self, ids, n):
        cache = self.model.new_cache(layout="contiguous", capacity=len(ids) + n)
        row = Rows.from_logits(self.model.forward(list(ids), cache)).full[0]
        tokens, rows = [], []
        for _ in range(n):
            tokens.append(int(np.argmax(row)))
            rows.append(row)
            if len(tokens) < n:
                row = Rows.from_logits(self.model.forward([tokens[-1]], cache)).full[0]
        return tokens, rows

    def shifted(self, ids, n: int, keep: int, continuation) -> np.ndarray:
        """[len(continuation), V]: the continuation's log-probabilities after ids ran and positions
        keep..keep+n-1 were dropped, the later keys rotated again to their positions - n (RoPE
        rotations compose). Written out here from the stored K/V, not with KVCache.shift, so an
        engine's shift is never checked against itself; each layer uses its own RoPE base. A latent
        key (MLA) turns only its k_rope part, after the kv_lora_rank values of c_kv, and has no V."""
        model, c = self.model, self.model.config
        run = model.new_cache(layout="contiguous", capacity=len(ids))
        model.forward(list(ids), run)
        kept = np.r_[0:keep, keep + n:len(ids)]  # [S] old positions that stay
        moved = kept >= keep + n
        k = np.stack([np.array(run.keys(layer))[kept] for layer in range(c.n_layers)])  # [L, S, Hkv, D]
        v = None if c.latent else np.stack([np.array(run.values(layer))[kept] for layer in range(c.n_layers)])
        back = np.full(int(moved.sum()), -n)
        rotated = slice(c.kv_lora_rank if c.latent else 0, None)  # the part of a key RoPE turned
        for layer in range(c.n_layers):
            if c.layer_rope(layer) is not None:  # a NoPE layer's keys carry no position
                k[layer, moved, :, rotated] = ops.rope(k[layer, moved, :, rotated], back, *c.layer_rope(layer))
        cache = model.new_cache(layout="contiguous", capacity=len(kept) + len(continuation))
        cache.append(k, v)
        return Rows.from_logits(model.forward(list(continuation), cache, all_logits=True)).full


@dataclass
class Divergence:
    """Per position: KL(reference || actual), whether the top-1 tokens agree, the reference's top-2 margin."""

    kl: np.ndarray  # [T] nats
    agree: np.ndarray  # [T] bool
    margin: np.ndarray  # [T] log p(top-1) - log p(top-2) of the reference

    @property
    def disagreements(self) -> np.ndarray:
        return np.flatnonzero(~self.agree)


def top2_margin(logprobs) -> np.ndarray:
    # [T, V] -> [T]
    top = np.partition(logprobs, -2, axis=-1)[:, -2:]
    return top[:, 1] - top[:, 0]


def divergence(reference, actual: Rows) -> Divergence:
    """How far `actual` (full or top-k rows) is from `reference` ([T, V] log-probabilities)."""
    ref = np.atleast_2d(reference)
    if len(ref) != len(actual):
        raise ValueError(f"{len(actual)} rows against {len(ref)} reference rows")
    kl = full_kl(ref, actual.full) if actual.full is not None else topk_kl(ref, actual.top_ids, actual.top_logprobs)
    return Divergence(kl, actual.top1() == ref.argmax(axis=-1), top2_margin(ref))


def full_kl(ref, act) -> np.ndarray:
    # [T, V] log-probabilities x2 -> [T]
    return np.maximum(np.sum(np.exp(ref) * (ref - act), axis=-1), 0.0)


def topk_kl(ref, top_ids, top_logprobs) -> np.ndarray:
    # [T, V], [T, k] ids, [T, k] log-probabilities -> [T] KL over the k tokens + "the rest"
    # an entry of log-probability -inf is padding (an engine with fewer than k tokens to report, its id a
    # repeat): it goes into "the rest" on both sides, so no spec mass is counted twice
    listed = np.isfinite(top_logprobs)  # [T, k]
    p = np.where(listed, np.exp(np.take_along_axis(ref, top_ids, axis=-1)), 0.0)  # [T, k] the spec's mass on them
    q = np.exp(top_logprobs)
    p_rest = np.clip(1.0 - p.sum(axis=-1), TINY, 1.0)
    q_rest = np.clip(1.0 - q.sum(axis=-1), TINY, 1.0)
    kl = np.sum(p * (np.log(np.maximum(p, TINY)) - np.log(np.maximum(q, TINY))), axis=-1)
    return np.maximum(kl + p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)
