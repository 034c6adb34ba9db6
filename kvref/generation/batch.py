"""Continuous batching: many requests share one block pool and advance together, one step at a time.

    engine = Engine(model, max_batch=8, prefix_reuse=True)
    a = engine.submit(prompt_a, max_new_tokens=64)
    b = engine.submit(prompt_b, max_new_tokens=16, temperature=0.7, seed=1)
    for request, token in engine.stream():     # or: while engine.pending: engine.step()
        ...                                    # each request's tokens, as they are selected

Two parts, as in vLLM: the Scheduler keeps the queue and decides each step (`plan()` -> StepPlan:
who is admitted, which ids each running request feeds, who is preempted) without running the model
or sampling; the Engine's `step()` runs the plan as one batched execution and samples. The Scheduler
also keeps the books a step's tokens change (`record`: a request ends at a stop id or its budget).

Each step is one batched execution (`forward_batch`): a newly admitted request contributes its
prompt (its prefill), every running request its last selected token (a decode step). Sequences of
very different lengths mix freely, since positions and attention are per sequence. A request
leaves the batch when it reaches max_new_tokens or a stop id, and its blocks go back to the pool at
once, so a waiting request can take its place in the next step.

Admission is conservative by default, so a running request never runs out of blocks: a request is
admitted only when the pool can hold every position it may still need (prompt + max_new_tokens - 1,
plus one block for a copy-on-write) on top of what the running requests may still need. With
preempt=True admission is optimistic instead (the request's prompt must fit, with one block to spare
per running sequence), which keeps far more requests running; when a step then needs more blocks
than the pool has free, the newest running request is preempted: its blocks go back to the pool, it
returns to the front of the queue with the tokens it selected, and on readmission it recomputes
them (after adopting whatever of its history the prefix index still holds) and goes on. Its sampler
keeps its state, so a preemption changes no token (up to the float rounding of a prefill against
decode steps). With prefix reuse, a new request first adopts the pool's blocks for the longest known
prefix of its prompt and prefills only the rest.

prefill_chunk=C caps the prompt positions one step computes (over all requests), so a long prompt is
prefilled over several steps while the running requests go on decoding: a request selects its first
token in the step that completes its prompt. submit(..., n=k) runs k sequences of one prompt: the
prompt is prefilled once, then the cache is forked (copy-on-write: the prompt's blocks are shared)
and each sequence selects from the same logits with its own sampler (seeds seed, [seed, 1], ...,
[seed, k - 1]). cancel(request) ends a request at once and frees its blocks.

Each request draws its tokens from its own seeded generator, so a request selects the same tokens
in a batch as it does alone with kvref.generate (up to the float rounding of batched matmuls).
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..cache import begin_all
from ..cache.paged import PagedCache
from ..cache.pool import BlockPool, blocks_for
from ..errors import CacheError, CacheFullError, GenerationError
from .grammar import Constrained, Grammar
from .sampling import Sampler
from .stop import StopCondition


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
    executor = model.batch_executor(caches)  # checks each cache the first time it comes to the model
    for cache, t in zip(caches, ids):
        model.check_context(cache.next_position, len(t))
    with begin_all(caches, ids) as executions:
        logits = executor.run(executions, all_logits)
    return logits if all_logits else [out[0] for out in logits]


@dataclass(frozen=True)
class StepPlan:
    """What one step runs, as Scheduler.plan decided it."""

    feeds: tuple  # ((request, ids), ...) every running request in batch order, with the ids it feeds now
    admitted: tuple = ()  # requests that joined the batch for this step (their caches made)
    preempted: tuple = ()  # requests sent back to the queue (their blocks freed) so the step fits


@dataclass(eq=False)
class Request:
    """One generation request and its progress."""

    id: int
    prompt: np.ndarray  # [P] token ids
    max_new_tokens: int
    stop: StopCondition  # when it ends (an end id, a stop string)
    tokens: list = field(default_factory=list)  # selected so far (the last one has no K/V yet)
    new_text: str = ""  # the text the last selected token made final (a StopCondition that decodes)
    state: str = "waiting"  # waiting -> running -> finished
    finish_reason: str | None = None  # "length" | "stop"
    reused: int = 0  # prompt positions whose K/V came from the prefix index (first admission)
    index: int = 0  # which of the n sequences of one submit this is
    logits: np.ndarray | None = None  # [V] what the last token was selected from
    preempted: int = 0  # times this request was preempted (its blocks freed, its tokens recomputed)
    cache: PagedCache | None = None
    siblings: list = field(default_factory=list)  # sequences to fork from this one after its prefill
    sampler: Sampler | Constrained | None = None  # selects its tokens: its own seeded stream, kept across preemptions
    _blocks_reserved: int = 0  # the most blocks this request may take from the pool

    @property
    def done(self) -> bool:
        return self.state == "finished"

    @property
    def stop_ids(self) -> frozenset:
        """The ids it ends after."""
        return self.stop.end_ids

    def unfed(self) -> list:
        """Ids of the request's history with no K/V in its cache yet: the prompt (past any reused
        prefix) before its prefill, then the last selected token. Derived from what the cache has
        committed, so a step interrupted anywhere is neither lost nor run twice."""
        history = [*self.prompt, *self.tokens]
        return history[self.cache.next_position:]


class Scheduler:
    """The queue of a continuous batch over one BlockPool, and what each step runs (see the module docstring)."""

    def __init__(self, model, max_batch: int = 8, *, pool: BlockPool | None = None, kv_dtype=None,
                 block_size=None, num_blocks=None, prefix_reuse=None, preempt: bool = False,
                 prefill_chunk: int | None = None, **cache_options):
        if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) or max_batch <= 0:
            raise GenerationError(f"max_batch={max_batch!r} must be a positive integer")
        if not isinstance(preempt, bool):
            raise GenerationError(f"preempt={preempt!r} must be True or False")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(
                prefill_chunk, (int, np.integer)) or prefill_chunk <= 0):
            raise GenerationError(f"prefill_chunk={prefill_chunk!r} must be None (whole prompts) or a positive integer")
        self.model = model
        self.max_batch = int(max_batch)
        self.preempt = preempt
        self.prefill_chunk = None if prefill_chunk is None else int(prefill_chunk)
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
        self.preemptions = 0
        self.prompt_positions = 0  # prompt positions of the admitted requests (first admission)
        self.reused_positions = 0  # ... of which came from the prefix index
        self._next_id = 0
        self._engine = None  # for the deprecated step/stream/run

    @property
    def pending(self) -> bool:
        """Whether any request is still waiting or running."""
        return bool(self.waiting or self.running)

    def submit(self, prompt_ids, max_new_tokens: int, temperature=0.0, top_k=None, top_p=None, min_p=None,
               seed=None, stop_ids=(), *, n: int = 1, stop: StopCondition | None = None, grammar: str | None = None,
               json_schema: dict | str | None = None, **penalties) -> Request:
        """Queue a request; it is checked now (ids, sampling, context, pool size), run by later steps.

        It ends after one of stop_ids, or where `stop` (a kvref.generation.stop.StopCondition, instead of
        stop_ids: end ids and stop strings, the text of each token on request.new_text) says.

        penalties: repetition_penalty, frequency_penalty, presence_penalty, penalty_last_n as
        kvref.Sampler takes them (over the token history, prompt included). n > 1: the request's
        `siblings` are the other n - 1 sequences, forked from it once its prompt is prefilled.
        grammar, json_schema: structured output as kvref.generate takes it; each sequence keeps its own
        grammar state (its sampler is a kvref.generation.grammar.Constrained), across preemptions too.
        """
        model = self.model
        prompt = model.check_tokens(prompt_ids)
        Sampler(temperature, top_k, top_p, min_p, seed, **penalties)  # checks every setting (SamplingError)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= self.max_batch:
            raise GenerationError(f"n={n!r} must be an integer in [1, max_batch={self.max_batch}]")
        model.check_context(0, len(prompt) + max(max_new_tokens - 1, 0))
        reserve = self.check_fits(len(prompt), max_new_tokens)
        if stop is None:
            stop = StopCondition.of_ids(stop_ids)
        elif not isinstance(stop, StopCondition) or stop_ids:
            raise GenerationError("stop= takes a StopCondition, and stop_ids then go in its settings")
        structured = grammar is not None or json_schema is not None
        if structured and not stop.end_ids & getattr(model.tokenizer, "eos_ids", frozenset()):
            raise GenerationError("grammar= and json_schema= need the model's end ids among the stop ids (the "
                                  "grammar ends the output with one)")
        requests = []
        for i in range(n):
            # sequence i > 0 draws from its own stream, so n samples of one prompt differ
            seed_i = seed if seed is None or i == 0 else [int(seed), i]
            sampler = Sampler(temperature, top_k, top_p, min_p, seed_i, **penalties)
            if structured:
                sampler = Constrained(sampler, Grammar(model.tokenizer, json_schema=json_schema, grammar=grammar))
            requests.append(Request(self._next_id, prompt, int(max_new_tokens), stop if i == 0 else stop.fresh(),
                                    index=i, sampler=sampler, _blocks_reserved=reserve))
            self._next_id += 1
        request = requests[0]
        if max_new_tokens == 0:
            for r in requests:
                self._finish(r, "length")
            return request
        request.siblings = requests[1:]
        request._blocks_reserved = reserve * n  # until the fork, the first sequence holds the family's room
        self.waiting.append(request)
        return request

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> int:
        """The most blocks one sequence of a request may take from the pool: every position it may hold
        (prompt + max_new_tokens - 1) and one block for a copy-on-write. CacheFullError if the pool has
        fewer in all, since such a request could never run. submit checks it; the server checks it before
        it queues a request (it reads only the pool's fixed sizes, so any thread may call it)."""
        positions = n_prompt + max(max_new_tokens - 1, 0)
        reserve = blocks_for(positions, self.pool.block_size) + 1
        if positions > self.most_positions():
            raise CacheFullError(f"a prompt of {n_prompt} tokens and max_new_tokens={max_new_tokens} may need "
                                 f"{reserve} blocks of {self.pool.block_size}; the pool has {self.pool.num_blocks} "
                                 f"in all")
        return reserve

    def most_positions(self) -> int:
        """The most positions one sequence may hold in this pool: every block but one, kept for a
        copy-on-write (check_fits)."""
        return (self.pool.num_blocks - 1) * self.pool.block_size

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """End a request now, waiting or running, and free its blocks; its unforked siblings end too.
        A finished request is left as it is."""
        if request.done:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        for sibling in request.siblings:
            self._finish(sibling, reason)
        request.siblings = []
        self._finish(request, reason)

    def plan(self) -> StepPlan:
        """Decide the next step: admit the waiting requests there is room for, give each running request
        its feed (every unfed id, or with prefill_chunk a share of the step's prompt budget), and with
        preempt=True send the newest requests back to the queue until the step's blocks fit.

        Runs no model and selects nothing; it changes the queue and the pool's references (an admitted
        request's new cache adopts its prefix, a preempted request's blocks are freed). A request whose
        last execution committed but whose token was never selected (an interrupted step) feeds nothing:
        it selects from the logits its cache recorded.
        """
        admitted = self._admit()
        feeds, preempted = self._feeds(), []
        if self.preempt:
            while len(self.running) > 1 and self._blocks_needed(feeds) > self.pool.blocks_free:
                preempted.append(self.running[-1])
                self._preempt(self.running[-1])
                feeds = self._feeds()
        return StepPlan(tuple(feeds.items()), tuple(admitted), tuple(preempted))

    def _feeds(self) -> dict:
        # request -> the ids it feeds this step: every unfed id, or (prefill_chunk) a share of a step's
        # budget of prompt positions, oldest request first; a decode step always runs
        budget = self.prefill_chunk
        feeds = {}
        for r in self.running:
            ids = r.unfed()
            if budget is not None and len(ids) > 1:
                ids = ids[:budget]
                budget -= len(ids)
            feeds[r] = ids
        return feeds

    def _blocks_needed(self, feeds) -> int:
        return sum(r.cache.blocks_needed(len(ids)) for r, ids in feeds.items())

    def record(self, request, token: int, logits) -> None:
        """A token selected for a running request from `logits` [V]; it ends where its StopCondition says
        or at its budget."""
        request.logits = logits
        request.tokens.append(token)
        request.new_text = request.stop.push(token)
        if request.stop.ended:
            self._finish(request, "stop")
        elif len(request.tokens) == request.max_new_tokens:
            self._finish(request, "length")

    def fork_siblings(self, request) -> list:
        """The request's prompt is prefilled: each of its siblings takes a copy-on-write fork of its cache,
        the room it may need and a place in the batch right after it. Returns the siblings forked."""
        family = len(request.siblings) + 1
        siblings = [s for s in request.siblings if not s.done]  # cancel() may have ended some
        request.siblings = []
        request._blocks_reserved //= family
        at = self.running.index(request) + 1
        for s in siblings:
            s.cache, s.state, s.reused = request.cache.fork(), "running", request.reused
        self.running[at:at] = siblings
        return siblings

    # ---- deprecated: the step moved to Engine ----------------------------------------------------------

    def step(self) -> list:
        """Deprecated: Engine.step (an Engine runs a Scheduler's plans: Engine(model, ...) or Engine.over)."""
        return self._deprecated("step").step()

    def stream(self):
        """Deprecated: Engine.stream."""
        return self._deprecated("stream").stream()

    def run(self) -> dict:
        """Deprecated: Engine.run."""
        return self._deprecated("run").run()

    @property
    def steps(self) -> int:
        """Deprecated: Engine.steps."""
        return 0 if self._engine is None else self._engine.steps

    def _deprecated(self, name):
        warnings.warn(f"Scheduler.{name}() is deprecated: kvref.generation.batch.Engine(model, ...).{name}() runs the "
                      f"scheduler's plans", DeprecationWarning, stacklevel=3)
        if self._engine is None:
            self._engine = Engine.over(self)
        return self._engine

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def _outstanding(self) -> int:
        # blocks the running requests may still take: what each reserved minus what its table holds
        return sum(max(0, r._blocks_reserved - r.cache.blocks_used) for r in self.running)

    def _admit(self) -> list:
        admitted = []
        while self.waiting and len(self.running) + 1 + len(self.waiting[0].siblings) <= self.max_batch:
            request = self.waiting[0]
            history = [*request.prompt, *request.tokens]  # a preempted request recomputes its tokens too
            cache = self.pool.new_cache()
            reused = cache.prefill_reuse(history) if self.pool.prefix_reuse else 0
            if not self._room_for(request, cache, len(history) - reused):
                cache.free()  # not enough room yet: wait for a running request to finish
                break
            self.waiting.popleft()
            if not request.preempted:
                request.reused = reused
                self.prompt_positions += len(request.prompt)
                self.reused_positions += reused
            request.cache, request.state = cache, "running"
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _room_for(self, request, cache, n_new) -> bool:
        if self.preempt:  # its history now, with a block to spare for each running sequence's next step
            return cache.blocks_needed(n_new) + len(self.running) <= self.pool.blocks_free
        return self.pool.blocks_free - self._outstanding() >= request._blocks_reserved - cache.blocks_used

    def _preempt(self, request):
        # free and recompute later: the request keeps its tokens and sampler, not its blocks
        request.cache.free()
        request.cache, request.state = None, "waiting"
        request.preempted += 1
        self.preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)

    def _finish(self, request, reason):
        request.state, request.finish_reason = "finished", reason
        if request.cache is not None:
            request.cache.free()  # its blocks go back to the pool now
        if request in self.running:
            self.running.remove(request)
        self.finished.append(request)


class Engine:
    """Continuous batching: each step runs its Scheduler's plan as one batched execution, then selects a
    token for every request whose history is now fed (see the module docstring). Options as Scheduler's."""

    def __init__(self, model, max_batch: int = 8, **options):
        self.model = model
        self.scheduler = Scheduler(model, max_batch, **options)
        self.steps = 0  # batched executions run

    @classmethod
    def over(cls, scheduler: Scheduler) -> "Engine":
        """An engine that runs an existing scheduler's plans (with its model)."""
        engine = cls.__new__(cls)
        engine.model, engine.scheduler, engine.steps = scheduler.model, scheduler, 0
        return engine

    @property
    def pending(self) -> bool:
        return self.scheduler.pending

    def submit(self, prompt_ids, max_new_tokens: int, *args, **kwargs) -> Request:
        """Queue a request: Scheduler.submit."""
        return self.scheduler.submit(prompt_ids, max_new_tokens, *args, **kwargs)

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """End a request now: Scheduler.cancel."""
        self.scheduler.cancel(request, reason)

    def step(self) -> list:
        """One batched execution of the scheduler's plan; returns the (request, token) pairs it selected,
        in batch order."""
        plan = self.scheduler.plan()
        if not plan.feeds:
            return []
        fed = [(r, ids) for r, ids in plan.feeds if ids]
        if fed:
            forward_batch(self.model, [ids for _, ids in fed], [r.cache for r, _ in fed])
        self.steps += 1
        out = []
        for request in [r for r, _ in plan.feeds if not r.unfed()]:  # a part-prefilled prompt selects nothing yet
            for r in [request, *self.scheduler.fork_siblings(request)]:
                out.append((r, self._select(r)))
        return out

    def _select(self, request) -> int:
        logits = request.cache.sequence.last_logits
        token = request.sampler(logits, [*request.prompt, *request.tokens])
        self.scheduler.record(request, token, logits)
        return token

    def stream(self):
        """Yield (request, token) as tokens are selected, until every submitted request has finished."""
        while self.pending:
            yield from self.step()

    def run(self) -> dict:
        """Run every request to the end; returns {request id: tokens}."""
        for _ in self.stream():
            pass
        return {r.id: list(r.tokens) for r in self.scheduler.finished}
