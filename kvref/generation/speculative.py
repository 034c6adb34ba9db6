"""Speculative decoding by prompt lookup: draft tokens copied from the token history, verified together.

A decode step reads every weight to compute one position. When the text being generated repeats
earlier text (code being rewritten, a quoted passage, a list that continues a pattern), the next few
tokens can be guessed without the model: find the first earlier occurrence of the history's last n
tokens (prompt lookup, Saxena 2023; llama.cpp's lookup decoding) and draft the tokens that followed
it, a draft whose length adapts to how well the last one did (next_budget). kvref.generate(..., speculate=N) then runs the token just selected and up to N drafted tokens in one
execution with every position's logits, and selects position by position exactly as plain decoding
would (greedy: the argmax; sampling: the speculative acceptance rule, kvref.generation.sampling.accept_draft). The
first position whose selection differs from the draft ends the step: that selection is kept, and the
positions of the drafts after it are removed with cache.truncate. One execution thus yields between 1
and N + 1 tokens.

The rollback needs a cache that can truncate exactly (cache.capabilities.roll_back): contiguous and paged caches
always can; a window cache until its ring first drops a position; a hybrid cache for executions of at
most spare + 1 positions once its rings are full. Where the cache cannot, the step drafts fewer tokens or
none (a plain decode step), and SpeculationStats counts it as a fallback with the cache's reason.

Greedy output equals plain decoding's wherever both executions agree on the argmax. The verification
execution computes the same positions with more rows per matrix product, which sums in another order
(tolerance.SPECULATIVE_VERIFICATION): a selection can differ only at a step whose top-2 margin is below
that bound, and SpeculationStats.near_ties lists those steps. Sampling draws from the same distribution
as plain decoding at every position but consumes the seeded generator differently, so a seed selects
other tokens than it does without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..errors import GenerationError

# Longest and shortest suffix n-gram looked up (transformers' prompt lookup tries 3 down to 1,
# llama-cpp-python's 2 down to 1). Measured on SmolLM2 rewriting a code block (benchmarks/speculative.py,
# replayed offline for every setting): a 1-gram match drafts wrong tokens far more often than not, and a
# wrong draft is not free on the native backend (an execution of T rows costs ~1.8x a decode step at T=2,
# ~5x at T=8), so single-token matches are not drafted from; 3..2 drafted 98 tokens with 92 accepted
# where 3..1 drafted 104 with 92 accepted.
MAX_NGRAM = 3
MIN_NGRAM = 2


@dataclass
class SpeculationStats:
    """What speculative decoding did in one generation (filled by kvref.generate(..., stats=...))."""

    steps: int = 0  # executions that verified at least one drafted token
    plain_steps: int = 0  # decode steps without a draft (no earlier occurrence, or a fallback)
    drafted: int = 0  # drafted tokens verified
    accepted: int = 0  # drafted tokens that were also the selected tokens
    fallbacks: int = 0  # steps that drafted fewer tokens than found because the cache could not roll back
    fallback_reason: str | None = None  # the cache's reason, the first time
    # indices (in the generated tokens) of greedy selections whose top-2 margin was below the
    # verification's rounding bound: where plain decoding may have selected the runner-up
    near_ties: list = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def __str__(self):
        text = (f"speculation: {self.drafted} drafted, {self.accepted} accepted ({self.acceptance_rate:.1%}), "
                f"{self.steps} verifying steps, {self.plain_steps} plain steps")
        if self.fallbacks:
            text += f", {self.fallbacks} drafts cut short by the cache ({self.fallback_reason})"
        if self.near_ties:
            text += f", {len(self.near_ties)} near ties"
        return text


def check_speculate(speculate) -> int:
    if isinstance(speculate, bool) or not isinstance(speculate, (int, np.integer)) or speculate < 0:
        raise GenerationError(f"speculate={speculate!r} must be an integer >= 0 (drafted tokens per step; 0 = off)")
    return int(speculate)


def prompt_lookup(history, max_tokens: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list:
    """Up to max_tokens drafted ids: what followed the first occurrence of the history's last n ids, for
    the longest n from max_ngram down to min_ngram that occurs earlier; [] when none does.

    The first occurrence, as transformers and llama-cpp-python take it: in a rewrite it is the source
    text, which the replay above found to predict better than the most recent occurrence (2.1x against
    1.7x modelled speed at 16 drafted tokens)."""
    h = np.asarray(history, dtype=np.int64)
    if max_tokens < 1:
        return []
    for n in range(min(max_ngram, len(h) - 1), min_ngram - 1, -1):
        # n-grams that end before the last id, so at least one id follows each: [len(h) - n, n]
        grams = sliding_window_view(h[:-1], n)
        hits = np.flatnonzero((grams == h[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return h[start:start + max_tokens].tolist()
    return []


def next_budget(budget: int, drafted: int, accepted: int, speculate: int) -> int:
    """Tokens to draft at most in the next step: twice as many after a step that accepted its whole
    draft (up to speculate), one more than were accepted after a step that did not: long drafts while
    the text is being copied, short ones once it stops. In the replay, with the generation running on
    past the copied code, drafts of a fixed 16 tokens modelled 1.03x, this rule 1.25x. It depends on
    the tokens alone, so a seeded sampling run drafts, and so draws, the same way every time."""
    if drafted == 0:
        return budget
    return min(speculate, 2 * budget) if accepted == drafted else max(1, accepted + 1)


def fit_rollback(cache, draft: list, stats: SpeculationStats) -> list:
    """The longest beginning of `draft` whose execution (the token just selected + the draft) the cache
    can truncate back exactly; a cut is counted in stats with the cache's reason."""
    n = len(draft)
    while n and not cache.capabilities.roll_back(1 + n):
        n -= 1
    if n < len(draft):
        stats.fallbacks += 1
        if stats.fallback_reason is None:
            stats.fallback_reason = cache.capabilities.roll_back(1 + len(draft)).reason
    return draft[:n]


def top2_margin(logits) -> float:
    """Largest minus second largest logit (inf for a vocabulary of one)."""
    if len(logits) < 2:
        return float("inf")
    top = np.partition(np.asarray(logits), -2)[-2:]
    return float(top[1] - top[0])
