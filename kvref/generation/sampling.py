"""Choosing the next token from logits: penalties, then greedy, or seeded sampling with truncation filters.

Order of operations (as in transformers and llama.cpp): penalize tokens seen in the last
penalty_last_n tokens of the token history (apply_penalties), divide by temperature, softmax, then
keep the top_k most likely, then the smallest set whose probability reaches top_p, then those with
at least min_p x the top probability; renormalise and draw with a numpy.random.Generator.
Temperature 0 is greedy: the argmax, first index on ties. Ranking ties break by token id, so
results are exact.

Penalties, for each token t that occurs c(t) > 0 times among the previous tokens counted:

    repetition   logit / r if logit > 0, else logit * r        transformers' RepetitionPenaltyLogitsProcessor,
                                                               llama.cpp's repeat_penalty (r > 0; 1 = off)
    frequency    logit - c(t) * f                              OpenAI's and llama.cpp's frequency_penalty
    presence     logit - p                                     OpenAI's and llama.cpp's presence_penalty

applied in that order (llama.cpp's penalties sampler does both in one pass, repetition first).
Which previous tokens count is the caller's choice (kvref.generate: the last penalty_last_n = 64 of
the token history, prompt included, as llama.cpp's repeat_last_n; None = all of it, as transformers).

A Sampler holds one request's settings and its own seeded generator, and is called on logits:

    select = Sampler(temperature=0.7, top_p=0.9, seed=1)   # checked here (SamplingError)
    token = select(logits)                                # [V] -> token id; the next call draws on

Each call consumes the draws of one token, so two samplers made alike select alike over the same
logits: what makes a request select the same tokens in a batch (kvref.generation.batch) as alone (kvref.generate).
"""

from __future__ import annotations

import numpy as np

from ..errors import SamplingError


def check_sampling(temperature=0.0, top_k=None, top_p=None, min_p=None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise SamplingError(f"temperature={temperature!r} must be a number >= 0")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise SamplingError(f"top_k={top_k!r} must be None or an integer >= 1")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise SamplingError(f"top_p={top_p!r} must be None or in (0, 1]")
    if min_p is not None and not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
        raise SamplingError(f"min_p={min_p!r} must be None or in [0, 1]")


def check_penalties(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                    penalty_last_n=None) -> None:
    for name, value in (("repetition_penalty", repetition_penalty), ("frequency_penalty", frequency_penalty),
                        ("presence_penalty", presence_penalty)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise SamplingError(f"{name}={value!r} must be a finite number")
    if not repetition_penalty > 0:
        raise SamplingError(f"repetition_penalty={repetition_penalty!r} must be > 0 (1 = off; it divides "
                            "positive logits and multiplies negative ones)")
    if penalty_last_n is not None and (isinstance(penalty_last_n, bool) or not isinstance(
            penalty_last_n, (int, np.integer)) or penalty_last_n < 0):
        raise SamplingError(f"penalty_last_n={penalty_last_n!r} must be None (every previous token) or an integer >= 0")


def apply_penalties(logits, previous, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0):
    """Logits with the penalties applied to every token in `previous` (see the module docstring)."""
    # [V], [N] token ids -> [V] float64
    counts = np.bincount(np.asarray(previous, dtype=np.int64), minlength=len(logits))
    seen = counts > 0
    z = np.array(logits, dtype=np.float64)
    z[seen] = np.where(z[seen] > 0, z[seen] / repetition_penalty, z[seen] * repetition_penalty)
    return z - (counts * frequency_penalty + seen * presence_penalty)


def greedy(logits) -> int:
    # [V] -> token id
    return int(np.argmax(logits))


def sampling_probs(logits, temperature, top_k=None, top_p=None, min_p=None) -> np.ndarray:
    # [V] -> [V] float64 probabilities, zero outside the kept set, summing to 1
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_k is None and top_p is None:  # no ranking needed (a sort of V logits is most of a step's Python)
        kept = p if min_p is None else np.where(p >= min_p * p.max(), p, 0.0)
        return kept / kept.sum()
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
    return draw(sampling_probs(logits, temperature, top_k, top_p, min_p), rng)


def draw(probs, rng: np.random.Generator) -> int:
    """One token id drawn from a distribution ([V] float64, summing to 1) with one uniform draw."""
    candidates = np.flatnonzero(probs)  # only tokens the filters kept can be drawn
    cumulative = np.cumsum(probs[candidates])
    index = np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")
    # u * total can round up to total itself; that draw belongs to the last candidate
    return int(candidates[min(index, candidates.size - 1)])


def accept_draft(probs, draft: int, rng: np.random.Generator) -> int:
    """The speculative acceptance rule for a deterministic draft token (Leviathan et al. 2023, Chen et
    al. 2023, with the draft distribution q one-hot at `draft`): keep the draft with probability p(draft),
    else draw from the residual normalize(max(p - q, 0)), which is p without the draft token. The token
    returned is distributed exactly as p, whatever the draft; it consumes one or two uniform draws."""
    # [V] float64 probabilities, token id -> token id
    if rng.random() < probs[draft]:
        return int(draft)
    residual = np.array(probs, dtype=np.float64)
    residual[draft] = 0.0  # p(draft) < 1 here (the draw was below it otherwise), so some mass remains
    return draw(residual / residual.sum(), rng)


class Sampler:
    """Selects token ids from logits with fixed settings and its own generator, seeded once.

    Sampler(temperature=0.0, top_k=None, top_p=None, min_p=None, seed=None, repetition_penalty=1.0,
    frequency_penalty=0.0, presence_penalty=0.0, penalty_last_n=64); calling it on [V] logits and the
    token history so far returns a token id (see the module docstring). Settings are checked on
    construction.
    """

    def __init__(self, temperature=0.0, top_k=None, top_p=None, min_p=None, seed=None, *,
                 repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, penalty_last_n=64):
        check_sampling(temperature, top_k, top_p, min_p)
        check_penalties(repetition_penalty, frequency_penalty, presence_penalty, penalty_last_n)
        self.temperature, self.top_k, self.top_p, self.min_p, self.seed = temperature, top_k, top_p, min_p, seed
        self.penalties = (repetition_penalty, frequency_penalty, presence_penalty)
        self.penalty_last_n = penalty_last_n
        # greedy selection never draws, and importing numpy.random adds ~1.5 MiB resident
        self.rng = np.random.default_rng(seed) if temperature else None

    @classmethod
    def from_config(cls, config) -> "Sampler":
        """The sampler of a kvref.GenerationConfig."""
        return cls(config.temperature, config.top_k, config.top_p, config.min_p, config.seed,
                   repetition_penalty=config.repetition_penalty, frequency_penalty=config.frequency_penalty,
                   presence_penalty=config.presence_penalty, penalty_last_n=config.penalty_last_n)

    def __call__(self, logits, history=()) -> int:
        # [V], token history -> token id
        return sample(self.penalized(logits, history), self.rng, self.temperature, self.top_k, self.top_p,
                      self.min_p)

    def verify(self, logits, history, draft: int) -> int:
        """The token selected at a drafted position (speculative decoding): greedy, the argmax as
        __call__ selects it (the draft is accepted when they are equal); sampling, the acceptance rule
        (accept_draft), so each token is distributed as __call__ would draw it."""
        # [V], token history before this position, the drafted id -> token id
        logits = self.penalized(logits, history)
        if self.temperature == 0:
            return greedy(logits)
        return accept_draft(sampling_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p),
                            draft, self.rng)

    def penalized(self, logits, history):
        """The logits with the penalties over the counted end of the token history (unchanged when off)."""
        if self.penalties != (1.0, 0.0, 0.0) and self.penalty_last_n != 0:
            previous = history if self.penalty_last_n is None else history[-self.penalty_last_n:]
            logits = apply_penalties(logits, previous, *self.penalties)
        return logits

    def __repr__(self):
        return (f"Sampler(temperature={self.temperature!r}, top_k={self.top_k!r}, top_p={self.top_p!r}, "
                f"min_p={self.min_p!r}, seed={self.seed!r}, penalties={self.penalties!r}, "
                f"penalty_last_n={self.penalty_last_n!r})")
