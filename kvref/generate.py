"""The generation loop: prefill the prompt, then one decode step per selected token.

With the cache, each execution computes only the new positions and reads the rest from the cache.
Without it (use_cache=False), every execution recomputes the whole token history from position 0:
the baseline the cache exists to avoid. Both select the same tokens.
"""

from __future__ import annotations

import numpy as np

from . import trace
from .cache import KVCache
from .errors import CacheFullError, GenerationError
from .sampling import Sampler, check_sampling


def generate(model, prompt_ids, max_new_tokens: int, temperature=0.0, top_k=None, top_p=None,
             min_p=None, seed=None, stop_ids=(), use_cache=True, cache: KVCache | None = None,
             executions: list | None = None):
    """Yield up to max_new_tokens selected token ids, one at a time, stopping after a stop id.

    cache: continue a cache that already holds earlier positions (a chat); prompt_ids are then the
    new positions after them. Without one, a fresh cache is made (if use_cache).
    executions: a list that receives one trace.Execution per forward pass.
    Everything is checked before the first token: the context must fit max_seq_len and the cache.
    """
    prompt = model.check_tokens(prompt_ids)
    check_sampling(temperature, top_k, top_p, min_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if cache is not None and not use_cache:
        raise GenerationError("a cache was given with use_cache=False; pass one or the other")
    if use_cache and cache is None:
        cache = model.new_cache()
    start = 0 if cache is None else cache.next_position
    if cache is not None:
        model.check_cache(cache)
    # the last selected token is never run through the model, so it needs no position
    n_positions = len(prompt) + max(max_new_tokens - 1, 0)
    model.check_context(start, n_positions)
    if cache is not None and not cache.can_append(n_positions):
        raise CacheFullError(
            f"prompt ({len(prompt)}) + {max_new_tokens} new tokens need {n_positions} positions; "
            f"the cache has {cache.capacity - cache.length} free of {cache.capacity}")
    select = Sampler(temperature, top_k, top_p, min_p, seed)
    loop = _cached_loop if use_cache else _uncached_loop
    return loop(model, prompt, max_new_tokens, select, frozenset(stop_ids), cache, executions)


def resume(model, cache: KVCache, max_new_tokens: int, temperature=0.0, top_k=None, top_p=None, min_p=None,
           seed=None, stop_ids=(), executions: list | None = None):
    """Continue a generation from a cache alone: the first token comes from cache.sequence.last_logits.

    Every execution commits the logits of its last position with the cache's sequence, and they
    survive save/load, so `resume(model, model.load_cache(path), n)` selects exactly the tokens the
    interrupted generation would have selected next (with the same sampling arguments and seed).
    """
    check_sampling(temperature, top_k, top_p, min_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    model.check_cache(cache)
    last_logits = cache.sequence.last_logits
    if last_logits is None:
        raise GenerationError("the cache holds no last logits to select a token from (no execution has run "
                              "since its positions last changed)")
    n_positions = max(max_new_tokens - 1, 0)  # the first token needs no execution, the last needs none either
    model.check_context(cache.next_position, n_positions)
    if not cache.can_append(n_positions):
        raise CacheFullError(f"{max_new_tokens} new tokens need {n_positions} positions; the cache has "
                             f"{cache.capacity - cache.length} free of {cache.capacity}")
    select = Sampler(temperature, top_k, top_p, min_p, seed)
    return _resumed_loop(model, np.array(last_logits), max_new_tokens, select, frozenset(stop_ids), cache,
                         executions)


def _resumed_loop(model, logits, max_new_tokens, select, stop_ids, cache, executions):
    for step in range(max_new_tokens):
        if step:  # a decode step for the token just selected
            first = cache.next_position
            logits = model.forward([token], cache)
            _record(executions, model, first, first + 1, first)
        token = select(logits)
        yield token
        if token in stop_ids:
            return


def _cached_loop(model, prompt, max_new_tokens, select, stop_ids, cache, executions):
    new_tokens = prompt
    for step in range(max_new_tokens):
        # Prefill on the first step (the whole prompt), a decode step after (the token just selected)
        first = cache.next_position
        logits = model.forward(new_tokens, cache)
        _record(executions, model, first, first + len(new_tokens), first)
        token = select(logits)
        yield token  # token history is now cache.length + 1 long: this token has no K/V yet
        if token in stop_ids:
            return
        new_tokens = [token]


def _uncached_loop(model, prompt, max_new_tokens, select, stop_ids, cache, executions):
    history = list(prompt)
    computed_before = 0
    for step in range(max_new_tokens):
        logits = model.forward(history)  # every position from 0, every time
        _record(executions, model, computed_before, len(history), 0)
        computed_before = len(history)
        token = select(logits)
        yield token
        if token in stop_ids:
            return
        history.append(token)


def _record(executions, model, first_new, end, n_cached):
    if executions is not None:
        executions.append(trace.execution(model.config, first_new, end, n_cached))


# Positions per execution when a long prompt is prefilled ahead of generate: long enough that the
# projections stay matrix-matrix products, short enough that progress shows and an interrupt
# loses at most one chunk of work.
PREFILL_CHUNK = 256


def prefill_in_chunks(model, token_ids, cache: KVCache, progress=None, chunk: int = PREFILL_CHUNK) -> list:
    """Prefill all but the last part of a long prompt in executions of `chunk` positions; return the
    ids left for `generate` (1 to `chunk` of them, its prefill). progress(done, total) follows each.

    Each chunk commits on its own, so an interrupted prefill keeps the chunks done (cache.sequence
    says which). A prompt of at most `chunk` ids, or a cache whose attention depends on the chunking
    (cache.chunking_invariant False), is returned whole: generate prefills it in one execution.
    """
    ids = [int(t) for t in model.check_tokens(token_ids)]
    if not cache.chunking_invariant or len(ids) <= chunk:
        return ids
    ahead = (len(ids) - 1) // chunk * chunk  # whole chunks, leaving 1..chunk ids
    model.check_context(cache.next_position, len(ids))
    for start in range(0, ahead, chunk):
        model.forward(ids[start:start + chunk], cache)
        if progress is not None:
            progress(start + chunk, len(ids))
    return ids[ahead:]
