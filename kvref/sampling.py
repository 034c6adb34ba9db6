"""Choosing the next token from logits: greedy, or seeded sampling with truncation filters.

Order of operations (as in transformers): divide by temperature, softmax, then keep the top_k most
likely, then the smallest set whose probability reaches top_p, then those with at least
min_p x the top probability; renormalise and draw with a numpy.random.Generator. Temperature 0 is
greedy: the argmax, first index on ties. Ranking ties break by token id, so results are exact.

A Sampler holds one request's settings and its own seeded generator, and is called on logits:

    select = Sampler(temperature=0.7, top_p=0.9, seed=1)   # checked here (SamplingError)
    token = select(logits)                                # [V] -> token id; the next call draws on

Each call consumes the draws of one token, so two samplers made alike select alike over the same
logits: what makes a request select the same tokens in a batch (kvref.batch) as alone (kvref.generate).
"""

from __future__ import annotations

import numpy as np

from .errors import SamplingError


def check_sampling(temperature=0.0, top_k=None, top_p=None, min_p=None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise SamplingError(f"temperature={temperature!r} must be a number >= 0")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise SamplingError(f"top_k={top_k!r} must be None or an integer >= 1")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise SamplingError(f"top_p={top_p!r} must be None or in (0, 1]")
    if min_p is not None and not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
        raise SamplingError(f"min_p={min_p!r} must be None or in [0, 1]")


def greedy(logits) -> int:
    # [V] -> token id
    return int(np.argmax(logits))


def sampling_probs(logits, temperature, top_k=None, top_p=None, min_p=None) -> np.ndarray:
    # [V] -> [V] float64 probabilities, zero outside the kept set, summing to 1
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-z, kind="stable")  # most likely first (by logit, exact), ties by token id
    keep = np.ones(p.size, dtype=bool)  # over `order`
    if top_k is not None:
        keep[top_k:] = False
    if top_p is not None:
        ranked = np.where(keep, p[order], 0.0)
        before = np.cumsum(ranked) / ranked.sum() - ranked / ranked.sum()  # mass strictly above each token
        keep &= before < top_p  # the smallest prefix reaching top_p: the token that crosses it stays
    if min_p is not None:
        keep &= p[order] >= min_p * p[order[0]]
    kept = np.zeros_like(p)
    kept[order[keep]] = p[order[keep]]
    return kept / kept.sum()


def sample(logits, rng: np.random.Generator, temperature=0.0, top_k=None, top_p=None, min_p=None) -> int:
    """The next token id: greedy at temperature 0, else one draw from the filtered distribution."""
    if temperature == 0:
        return greedy(logits)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p)
    candidates = np.flatnonzero(probs)  # only tokens the filters kept can be drawn
    cumulative = np.cumsum(probs[candidates])
    index = np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")
    # u * total can round up to total itself; that draw belongs to the last candidate
    return int(candidates[min(index, candidates.size - 1)])


class Sampler:
    """Selects token ids from logits with fixed settings and its own generator, seeded once.

    Sampler(temperature=0.0, top_k=None, top_p=None, min_p=None, seed=None); calling it on [V]
    logits returns a token id (see the module docstring). Settings are checked on construction.
    """

    def __init__(self, temperature=0.0, top_k=None, top_p=None, min_p=None, seed=None):
        check_sampling(temperature, top_k, top_p, min_p)
        self.temperature, self.top_k, self.top_p, self.min_p, self.seed = temperature, top_k, top_p, min_p, seed
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits) -> int:
        # [V] -> token id
        return sample(logits, self.rng, self.temperature, self.top_k, self.top_p, self.min_p)

    def __repr__(self):
        return (f"Sampler(temperature={self.temperature!r}, top_k={self.top_k!r}, top_p={self.top_p!r}, "
                f"min_p={self.min_p!r}, seed={self.seed!r})")
