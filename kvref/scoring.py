"""Scoring a given text: the log-probability the model gives each token after the ones before it.

The token ids run through a KV cache in executions of at most chunk_size positions, each asking for
every position's logits; the logits at position i are the next-token distribution of position i + 1:

    log p(ids[i + 1] | ids[0..i]) = log_softmax(logits[i])[ids[i + 1]]

Only what is scored needs logits; the last token is never run (nothing after it is scored), so the
cache ends one position short of the ids, as after a generation. Log-probabilities are float64
(log_softmax of the model's logits in float64).
"""

from __future__ import annotations

import numpy as np

from .errors import ScoringError
from .spec.ops import log_softmax

SCORE_CHUNK = 128  # positions per execution: bounds the [chunk, V] logits held at once (25 MB at V = 49152)


def next_token_logprobs(model, token_ids, first_scored: int, cache, chunk_size: int = SCORE_CHUNK):
    """Run token_ids[:-1] at the cache's next positions; yield (i, rows) for the scored positions:
    rows[j] is the log-distribution [V] of token_ids[i + j] given everything before it, for
    first_scored <= i + j < len(token_ids). first_scored >= 1; earlier positions only give context."""
    # token ids [T] -> chunks of ([t, V] float64 log-probabilities)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ScoringError(f"chunk_size={chunk_size!r} must be an integer >= 1")
    ids = model.check_tokens(token_ids)
    for begin in range(0, len(ids) - 1, chunk_size):
        end = min(begin + chunk_size, len(ids) - 1)  # positions begin..end-1 predict ids begin+1..end
        if end < first_scored:
            model.forward(ids[begin:end], cache)  # context only: no logits needed
            continue
        logits = model.forward(ids[begin:end], cache, all_logits=True)  # [t, V]
        skip = max(first_scored - 1 - begin, 0)
        yield begin + 1 + skip, log_softmax(logits[skip:])


def score(model, token_ids, context=(), cache=None, chunk_size: int = SCORE_CHUNK) -> np.ndarray:
    """log p(token_ids[i] | context, token_ids[:i]) for every i: [len(token_ids)] float64.

    context: ids before the continuation (a prompt): run, not scored. cache: continue a cache that
    already holds earlier positions; with an empty context its last logits give the first token's
    distribution. Without a cache, a new one of exactly the positions needed is made.
    """
    continuation = [int(t) for t in model.check_tokens(token_ids)]
    sequence = [int(t) for t in context] + continuation
    out = np.empty(len(continuation))
    first_scored = len(context)
    if first_scored == 0:
        last_logits = None if cache is None else cache.sequence.last_logits
        if last_logits is None:
            raise ScoringError("the first token has nothing before it to be scored after: give context "
                               "(e.g. [BOS]) or a cache whose last execution left its logits")
        out[0] = log_softmax(last_logits)[sequence[0]]
        first_scored = 1
    if cache is None:
        cache = model.new_cache(capacity=len(sequence) - 1)
    for i, rows in next_token_logprobs(model, sequence, first_scored, cache, chunk_size):
        out[i - len(context):i - len(context) + len(rows)] = rows[np.arange(len(rows)), sequence[i:i + len(rows)]]
    return out
