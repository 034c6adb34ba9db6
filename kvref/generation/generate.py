"""The generation loop: prefill the prompt, then one decode step per selected token.

With the cache, each execution computes only the new positions and reads the rest from the cache.
Without it (use_cache=False), every execution recomputes the whole token history from position 0:
the baseline the cache exists to avoid. Both select the same tokens.

What to select and when to stop is a kvref.GenerationConfig: the model's defaults
(model.generation_config: greedy unless its file recommends sampling), with any field replaced by
keyword (temperature=0.7, stop=["\n\n"], ...). Generation ends after max_new_tokens or where its
StopCondition (kvref.generation.stop) says: after one of the model's end ids (EOS, end of turn; not
with ignore_eos) or a stop id, or after the token that completes a stop string; that last token is
yielded (kvref.TextStream shows the text before the stop string).

Structured output: grammar= (Lark text) or json_schema= masks the logits before the same Sampler
(kvref.generation.grammar), so the output is in the grammar's language when it ends at an end id.
"""

from __future__ import annotations

import numpy as np

from .. import trace
from ..cache import KVCache
from ..errors import CacheError, CacheFullError, ContextOverflowError, GenerationError
from ..tolerance import speculative_margin_bound
from .config import GenerationConfig
from .grammar import Constrained, Grammar
from .sampling import Sampler
from .speculative import SpeculationStats, check_speculate, fit_rollback, next_budget, prompt_lookup, top2_margin
from .stop import StopCondition

OVERFLOWS = ("error", "shift")  # what generate does when the context would outgrow the cache


def generate(model, prompt_ids, max_new_tokens=None, *, config: GenerationConfig | None = None, use_cache=True,
             cache: KVCache | None = None, executions: list | None = None, speculate: int = 0,
             stats: SpeculationStats | None = None, overflow: str = "error", grammar: str | None = None,
             json_schema: dict | str | None = None, **settings):
    """Yield up to max_new_tokens selected token ids, one at a time, ending after an end id or stop string.

    config: the settings (default model.generation_config); max_new_tokens and `settings` (any
    GenerationConfig field by name: temperature, top_k, top_p, min_p, seed, repetition_penalty,
    frequency_penalty, presence_penalty, penalty_last_n, stop, stop_ids, ignore_eos) replace its own.
    cache: continue a cache that already holds earlier positions (a chat); prompt_ids are then the
    new positions after them. Without one, a fresh cache is made (if use_cache).
    executions: a list that receives one trace.Execution per forward pass.
    speculate: draft up to this many tokens per decode step by prompt lookup and verify them in one
    execution (kvref.generation.speculative; 0 = off); stats: a kvref.SpeculationStats that counts what it did.
    While the generator is suspended, the cache may hold positions of tokens selected but not yet
    yielded; ending, or closing the generator, leaves it as plain decoding would.
    overflow: "error" (default): everything is checked before the first token: the settings, and that
    the context fits max_seq_len and the cache. "shift": a context shift whenever the cache is full, as
    llama.cpp's: the first position stays, the older half of the rest is dropped and the kept keys are
    re-rotated to their new positions (cache.shift), so generation goes on past the cache's capacity
    while the model reads a context with a gap. A seeded sampler starts again from its seed after each
    shift; speculation stats add up over the segments.
    grammar, json_schema: structured output (kvref.generation.grammar.Grammar; the structured extra):
    only tokens that keep the output in the grammar's language are selected, and an end id only where
    the output is complete (an output cut short by max_new_tokens is not). Not with speculate, overflow
    "shift" or ignore_eos.
    """
    config = resolve_config(model, config, max_new_tokens, settings)
    if overflow not in OVERFLOWS:
        raise GenerationError(f"overflow={overflow!r} is unknown; expected one of {OVERFLOWS}")
    structured = grammar is not None or json_schema is not None
    if structured and (speculate or overflow == "shift" or config.ignore_eos):
        raise GenerationError("grammar= and json_schema= do not work with speculate, overflow='shift' or "
                              "ignore_eos (the grammar ends the output with an end id)")
    if overflow == "shift":
        return _shifting(model, prompt_ids, config, cache, executions, speculate, stats)
    prompt = model.check_tokens(prompt_ids)
    if cache is not None and not use_cache:
        raise GenerationError("a cache was given with use_cache=False; pass one or the other")
    speculate = check_speculate(speculate)
    if speculate and not use_cache:
        raise GenerationError("speculate needs the cache (use_cache=True): rejected drafts are rolled back "
                              "by truncating it")
    if stats is not None and not isinstance(stats, SpeculationStats):
        raise GenerationError(f"stats= takes a kvref.SpeculationStats; got {type(stats).__name__}")
    if stats is not None and not speculate:
        raise GenerationError("stats= counts speculative decoding; give speculate=N too")
    if use_cache and cache is None:
        cache = model.new_cache()
    start = 0 if cache is None else cache.next_position
    if cache is not None:
        model.check_cache(cache)
    # the last selected token is never run through the model, so it needs no position
    n_positions = len(prompt) + max(config.max_new_tokens - 1, 0)
    model.check_context(start, n_positions)
    if cache is not None and not cache.capabilities.append(n_positions):
        raise CacheFullError(
            f"prompt ({len(prompt)}) + {config.max_new_tokens} new tokens need {n_positions} positions; "
            f"the cache has {cache.capacity - cache.length} free of {cache.capacity}")
    history = _earlier_ids(cache) + [int(t) for t in prompt]
    select, stop = Sampler.from_config(config), StopCondition(model.tokenizer, config)
    if structured:
        select = Constrained(select, Grammar(model.tokenizer, json_schema=json_schema, grammar=grammar))
    if speculate:
        return _speculative_loop(model, prompt, config.max_new_tokens, select, stop, history, cache,
                                 executions, speculate, SpeculationStats() if stats is None else stats)
    loop = _cached_loop if use_cache else _uncached_loop
    return loop(model, prompt, config.max_new_tokens, select, stop, history, cache, executions)


def _shifting(model, prompt_ids, config, cache, executions, speculate, stats):
    # generate(overflow="shift"): plain generate calls, each filling the cache exactly, a shift between them
    cache = model.new_cache() if cache is None else cache
    problem = cache.capabilities.shift().reason
    if problem is not None:
        raise CacheError(f"overflow='shift' cannot work on this {cache.layout} cache: {problem}")
    speculation = {"speculate": speculate, "stats": stats} if speculate else {}
    return _shifted_segments(model, list(prompt_ids), config, cache, executions, speculation)


def _shifted_segments(model, new, config, cache, executions, speculation):
    keep, left = 1, config.max_new_tokens  # keep: the BOS, or the prompt's first token
    while True:
        n = min(left, cache.capacity - cache.length - len(new) + 1)  # fills the cache exactly
        selected = []
        for token in generate(model, new, n, config=config, cache=cache, executions=executions, **speculation):
            selected.append(token)
            yield token
        left -= len(selected)
        if left == 0 or len(selected) < n:
            return  # done, or stopped at an end id or a stop string
        discard = (cache.length - keep) // 2
        if discard < 1:
            raise ContextOverflowError(f"a cache of {cache.capacity} positions is too small to shift")
        cache.shift(discard, keep)
        new = selected[-1:]


def resume(model, cache: KVCache, max_new_tokens=None, *, config: GenerationConfig | None = None,
           executions: list | None = None, **settings):
    """Continue a generation from a cache alone: the first token comes from cache.sequence.last_logits.

    Every execution commits the logits of its last position with the cache's sequence, and they
    survive save/load, so `resume(model, model.load_cache(path), n)` selects exactly the tokens the
    interrupted generation would have selected next (with the same settings and seed).
    """
    config = resolve_config(model, config, max_new_tokens, settings)
    model.check_cache(cache)
    last_logits = cache.sequence.last_logits
    if last_logits is None:
        raise GenerationError("the cache holds no last logits to select a token from (no execution has run "
                              "since its positions last changed)")
    n_positions = max(config.max_new_tokens - 1, 0)  # the first token needs no execution, the last needs none either
    model.check_context(cache.next_position, n_positions)
    if not cache.capabilities.append(n_positions):
        raise CacheFullError(f"{config.max_new_tokens} new tokens need {n_positions} positions; the cache has "
                             f"{cache.capacity - cache.length} free of {cache.capacity}")
    return _resumed_loop(model, np.array(last_logits), config.max_new_tokens, Sampler.from_config(config),
                         StopCondition(model.tokenizer, config), _earlier_ids(cache), cache, executions)


def resolve_config(model, config, max_new_tokens, settings) -> GenerationConfig:
    """The settings of one call: `config` (default: the model's), with max_new_tokens and settings replaced."""
    config = model.generation_config if config is None else config
    if not isinstance(config, GenerationConfig):
        raise GenerationError(f"config= takes a GenerationConfig; got {type(config).__name__}")
    if max_new_tokens is not None:
        settings = {**settings, "max_new_tokens": max_new_tokens}
    return config.updated(**settings) if settings else config


def _earlier_ids(cache) -> list[int]:
    """The ids of the positions a cache already holds, where it knows them: the start of the token
    history the penalties count (a cache that lost them, e.g. a window, starts it afresh)."""
    return [] if cache is None else cache.sequence.token_ids or []


def _resumed_loop(model, logits, max_new_tokens, select, stop, history, cache, executions):
    for step in range(max_new_tokens):
        if step:  # a decode step for the token just selected
            first = cache.next_position
            logits = model.forward([token], cache)
            _record(executions, model, first, first + 1, first)
        token = select(logits, history)
        yield token
        if stop.ends_after(token):
            return
        history.append(token)


def _cached_loop(model, prompt, max_new_tokens, select, stop, history, cache, executions):
    new_tokens = prompt
    for step in range(max_new_tokens):
        # Prefill on the first step (the whole prompt), a decode step after (the token just selected)
        first = cache.next_position
        logits = model.forward(new_tokens, cache)
        _record(executions, model, first, first + len(new_tokens), first)
        token = select(logits, history)
        yield token  # token history is now cache.length + 1 long: this token has no K/V yet
        if stop.ends_after(token):
            return
        history.append(token)
        new_tokens = [token]


def _speculative_loop(model, prompt, max_new_tokens, select, stop, history, cache, executions, speculate,
                      stats):
    if max_new_tokens == 0:
        return
    # Prefill as plain decoding does; then each execution runs the token just selected and a draft
    first = cache.next_position
    rows, draft = model.forward(prompt, cache)[None], []  # [1 + len(draft), V]: row i selects after draft[:i]
    _record(executions, model, first, first + len(prompt), first)
    n_selected, budget = 0, speculate
    while True:
        selected = _select_drafted(rows, draft, select, history, model.dtype, n_selected, stats)
        budget = next_budget(budget, len(draft), len(selected) - 1, speculate)
        # rows[i] is position row0 + i; plain decoding, having selected selected[i], holds row0..row0 + i.
        # Keep the positions up to the last accepted draft; the rest were never selected
        row0 = cache.next_position - len(rows)
        _roll_back(cache, row0 + len(selected), rows[len(selected) - 1])
        for i, token in enumerate(selected):
            try:
                yield token
            except GeneratorExit:  # the caller stops here: leave the cache as plain decoding would
                _roll_back(cache, row0 + i + 1, rows[i])
                raise
            n_selected += 1
            if stop.ends_after(token) or n_selected == max_new_tokens:
                _roll_back(cache, row0 + i + 1, rows[i])
                return
            history.append(token)
        # no token past the end: the next execution selects at most max_new_tokens - n_selected tokens
        draft = prompt_lookup(history, min(budget, max_new_tokens - n_selected - 1))
        draft = fit_rollback(cache, draft, stats)
        first = cache.next_position
        tokens = [selected[-1]] + draft
        logits = model.forward(tokens, cache, all_logits=bool(draft))  # without a draft: a plain decode step
        rows = logits if draft else logits[None]
        _record(executions, model, first, first + len(tokens), first)
        stats.steps += bool(draft)
        stats.plain_steps += not draft


def _select_drafted(rows, draft, select, history, dtype, n_selected, stats) -> list:
    """The tokens plain decoding would select at rows' positions: row i's selection, while the one
    before it equalled its draft (penalties count the history as it would be at that position)."""
    selected = []
    for i, row in enumerate(rows):
        before = history + selected
        token = select(row, before) if i == len(draft) else select.verify(row, before, draft[i])
        if select.temperature == 0 and _near_tie(select.penalized(row, before), row, dtype):
            stats.near_ties.append(n_selected + i)
        selected.append(token)
        if i == len(draft) or token != draft[i]:
            break
    stats.drafted += len(draft)
    stats.accepted += len(selected) - 1
    return selected


def _near_tie(penalized, logits, dtype) -> bool:
    """Whether plain decoding's argmax may differ from this row's (its top-2 margin is within rounding)."""
    return top2_margin(penalized) < speculative_margin_bound(logits, dtype)


def _roll_back(cache, n, last_logits):
    """Truncate the cache to n positions, whose last one has last_logits (what an execution ending
    there would have committed, so kvref.resume continues from it)."""
    if cache.next_position > n:
        cache.truncate(n, last_logits=last_logits)


def _uncached_loop(model, prompt, max_new_tokens, select, stop, history, cache, executions):
    computed_before = 0
    for step in range(max_new_tokens):
        logits = model.forward(history)  # every position from 0, every time
        _record(executions, model, computed_before, len(history), 0)
        computed_before = len(history)
        token = select(logits, history)
        yield token
        if stop.ends_after(token):
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
