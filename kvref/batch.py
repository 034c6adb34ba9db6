"""Continuous batching: many requests share one block pool and advance together, one step at a time.

    sched = Scheduler(model, max_batch=8, prefix_reuse=True)
    a = sched.submit(prompt_a, max_new_tokens=64)
    b = sched.submit(prompt_b, max_new_tokens=16, temperature=0.7, seed=1)
    for request, token in sched.stream():      # or: while sched.pending: sched.step()
        ...                                    # each request's tokens, as they are selected

Each `step()` is one batched execution (`forward_batch`): a newly admitted request contributes its
prompt (its prefill), every running request its last selected token (a decode step). Sequences of
very different lengths mix freely, since positions and attention are per sequence. A request
leaves the batch when it reaches max_new_tokens or a stop id, and its blocks go back to the pool at
once, so a waiting request can take its place in the next step.

Admission is conservative, so a running request never runs out of blocks: a request is admitted
only when the pool can hold every position it may still need (prompt + max_new_tokens - 1, plus one
block for a copy-on-write) on top of what the running requests may still need. With prefix reuse,
a new request first adopts the pool's blocks for the longest known prefix of its prompt and
prefills only the rest.

Each request draws its tokens from its own seeded generator, so a request selects the same tokens
in a batch as it does alone with kvref.generate (up to the float rounding of batched matmuls).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .cache import begin_all
from .cache.paged import BlockPool, PagedCache, blocks_for
from .errors import CacheError, CacheFullError, GenerationError
from .sampling import Sampler, check_sampling
from .spec import decoder


def forward_batch(model, token_lists, caches, all_logits=False):
    """Model.forward for several sequences in one execution: returns one logits array per sequence.

    token_lists[b] are the new ids of caches[b] (any lengths); the result is [V] per sequence, or
    [T_b, V] with all_logits. The checks of Model.forward apply to every sequence before any work;
    the execution is one transaction over every cache (kvref.cache.begin_all): if one sequence
    cannot take its positions, or anything fails on the way, none of the caches changes.
    """
    if len(token_lists) != len(caches) or not caches:
        raise GenerationError(f"forward_batch needs one id list per cache; got {len(token_lists)} lists "
                              f"and {len(caches)} caches")
    ids = [model.check_tokens(t) for t in token_lists]
    for cache, t in zip(caches, ids):
        model.check_cache(cache)
        model.check_context(cache.next_position, len(t))
    run = decoder.forward_batch if model.fused is None else model.fused.forward_batch
    with begin_all(caches, ids) as executions:
        logits = run(model.ops, model.config, model.weights, executions, all_logits)
    return logits if all_logits else [out[0] for out in logits]


@dataclass(eq=False)
class Request:
    """One generation request and its progress."""

    id: int
    prompt: np.ndarray  # [P] token ids
    max_new_tokens: int
    stop_ids: frozenset
    tokens: list = field(default_factory=list)  # selected so far (the last one has no K/V yet)
    state: str = "waiting"  # waiting -> running -> finished
    finish_reason: str | None = None  # "length" | "stop"
    reused: int = 0  # prompt positions whose K/V came from the prefix index
    cache: PagedCache | None = None
    _select: object = None
    _blocks_reserved: int = 0  # the most blocks this request may take from the pool

    @property
    def done(self) -> bool:
        return self.state == "finished"

    def unfed(self) -> list:
        """Ids of the request's history with no K/V in its cache yet: the prompt (past any reused
        prefix) before its prefill, then the last selected token. Derived from what the cache has
        committed, so a step interrupted anywhere is neither lost nor run twice."""
        history = [*self.prompt, *self.tokens]
        return history[self.cache.next_position:]


class Scheduler:
    """A continuous-batching loop over one BlockPool (see the module docstring)."""

    def __init__(self, model, max_batch: int = 8, *, pool: BlockPool | None = None, kv_dtype=None,
                 block_size=None, num_blocks=None, prefix_reuse=None, **cache_options):
        if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) or max_batch <= 0:
            raise GenerationError(f"max_batch={max_batch!r} must be a positive integer")
        self.model = model
        self.max_batch = int(max_batch)
        if pool is None:
            if num_blocks is None:  # room for max_batch sequences of max_seq_len
                bs = 16 if block_size is None else block_size
                num_blocks = self.max_batch * blocks_for(model.config.max_seq_len, bs) if isinstance(bs, int) else None
            first = model.new_cache(layout="paged", kv_dtype=kv_dtype, block_size=block_size, num_blocks=num_blocks,
                                    prefix_reuse=prefix_reuse, **cache_options)
            pool = first.pool
            first.free()
        elif any(x is not None for x in (kv_dtype, block_size, num_blocks, prefix_reuse)) or cache_options:
            raise CacheError("cache options come from the pool when pool= is given")
        self.pool = pool
        self.waiting: deque = deque()
        self.running: list = []
        self.finished: list = []
        self.steps = 0
        self._next_id = 0

    @property
    def pending(self) -> bool:
        """Whether any request is still waiting or running."""
        return bool(self.waiting or self.running)

    def submit(self, prompt_ids, max_new_tokens: int, temperature=0.0, top_k=None, top_p=None, min_p=None,
               seed=None, stop_ids=()) -> Request:
        """Queue a request; it is checked now (ids, sampling, context, pool size), run by later steps."""
        model = self.model
        prompt = model.check_tokens(prompt_ids)
        check_sampling(temperature, top_k, top_p, min_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
        n_positions = len(prompt) + max(max_new_tokens - 1, 0)
        model.check_context(0, n_positions)
        reserve = blocks_for(n_positions, self.pool.block_size) + 1
        if reserve > self.pool.num_blocks:
            raise CacheFullError(f"a request of {n_positions} positions may need {reserve} blocks of "
                                 f"{self.pool.block_size}; the pool has {self.pool.num_blocks} in all")
        request = Request(self._next_id, prompt, int(max_new_tokens), frozenset(int(t) for t in stop_ids),
                          _select=Sampler(temperature, top_k, top_p, min_p, seed), _blocks_reserved=reserve)
        self._next_id += 1
        if max_new_tokens == 0:
            self._finish(request, "length")
        else:
            self.waiting.append(request)
        return request

    def step(self) -> list:
        """One batched execution; returns the (request, token) pairs it selected, in batch order."""
        self._admit()
        if not self.running:
            return []
        batch = list(self.running)
        # a request whose last execution committed but whose token was never selected (an interrupted
        # step) has nothing to feed: it selects from the logits its cache recorded
        fed = [r for r in batch if r.unfed()]
        if fed:
            forward_batch(self.model, [r.unfed() for r in fed], [r.cache for r in fed])
        self.steps += 1
        out = []
        for request in batch:
            token = request._select(request.cache.sequence.last_logits)
            request.tokens.append(token)
            out.append((request, token))
            if token in request.stop_ids:
                self._finish(request, "stop")
            elif len(request.tokens) == request.max_new_tokens:
                self._finish(request, "length")
        return out

    def stream(self):
        """Yield (request, token) as tokens are selected, until every submitted request has finished."""
        while self.pending:
            yield from self.step()

    def run(self) -> dict:
        """Run every request to the end; returns {request id: tokens}."""
        for _ in self.stream():
            pass
        return {r.id: list(r.tokens) for r in self.finished}

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def _outstanding(self) -> int:
        # blocks the running requests may still take: what each reserved minus what its table holds
        return sum(max(0, r._blocks_reserved - r.cache.blocks_used) for r in self.running)

    def _admit(self):
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            cache = self.pool.new_cache()
            if self.pool.prefix_reuse:
                request.reused = cache.prefill_reuse(request.prompt)
            if self.pool.blocks_free - self._outstanding() < request._blocks_reserved - cache.blocks_used:
                cache.free()  # not enough room yet: wait for a running request to finish
                request.reused = 0
                return
            self.waiting.popleft()
            request.cache, request.state = cache, "running"
            self.running.append(request)

    def _finish(self, request, reason):
        request.state, request.finish_reason = "finished", reason
        if request.cache is not None:
            request.cache.free()  # its blocks go back to the pool now
        if request in self.running:
            self.running.remove(request)
        self.finished.append(request)
