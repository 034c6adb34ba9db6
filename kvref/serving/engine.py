"""The engine thread: it owns a kvref.generation.batch.Engine and runs its steps, fed by the server's event loop.

    engine = EngineThread(model, max_batch=8, num_blocks=2048, kv_dtype="float16")
    engine.start()
    job = Job(spec, loop)                  # on the event loop
    engine.submit(job)                     # thread-safe; the job's events arrive on job.events
    engine.cancel(job)                     # a client that went away: its sequences end, blocks freed

Only the engine thread touches the Engine, its Scheduler and pool, and the model: the event loop talks to it
through a queue of commands, which the thread drains before every step, so a new request joins the
running batch at the next step and a cancelled one leaves it there. The scheduler runs with prefix
reuse (a shared system prompt is computed once and its blocks adopted by later requests; cached
blocks nobody references are evicted least recently freed first when the pool needs them), chunked
prefill (a long prompt is computed over several steps while the others decode), and preemption
(when the pool runs out mid-generation the newest request is freed and recomputed later: kvref never
swaps blocks to host memory).

Each choice's sequence ends where its StopCondition (kvref.generation.stop) says, the one rule of
kvref.generate: an end id, or the token completing a stop string; the scheduler records each token's
text with it (whole UTF-8 characters, nothing of a stop string). Events put on job.events (an
asyncio.Queue, from the engine thread through loop.call_soon_threadsafe):

    ("token", index, text, [TokenLogprob...] or None)   text may be "" while a stop string may begin
    ("finish", index, reason, completion_tokens)         reason "stop" | "length"
    ("error", message)                                   the execution failed; the job is over
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..generation import batch
from ..generation.stop import StopCondition
from ..spec.ops import log_softmax
from .protocol import Spec

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple  # ((token id, logprob), ...) most likely first


@dataclass(eq=False)
class Job:
    """One HTTP request: its checked Spec, the loop its events go to, and (engine side) its sequences."""

    spec: Spec
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.monotonic)
    requests: list = field(default_factory=list)  # the scheduler's Request of each choice
    open: int = 0  # choices not finished yet

    def emit(self, *event):
        if not self.loop.is_closed():  # at shutdown the loop may be gone before the engine stops
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineThread:
    """The batch engine's thread (see the module docstring). Options as kvref.generation.batch.Scheduler's, plus the
    tokenizer's end ids for every request."""

    def __init__(self, model, *, max_batch=8, num_blocks=None, block_size=16, kv_dtype=None,
                 prefill_chunk=256):
        self.model = model
        self.engine = batch.Engine(model, max_batch, kv_dtype=kv_dtype, block_size=block_size,
                                   num_blocks=num_blocks, prefix_reuse=True, preempt=True, prefill_chunk=prefill_chunk)
        self.scheduler = self.engine.scheduler
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._owner: dict = {}  # scheduler Request -> (job, choice index)
        self._thread = threading.Thread(target=self._run, name="kvref-engine", daemon=True)
        self.counters = {"requests_submitted": 0, "requests_finished": 0, "requests_cancelled": 0,
                         "requests_failed": 0, "prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self.batch_histogram = [0] * (len(BATCH_BUCKETS) + 1)  # per step, the last bucket is +Inf
        self.batch_sum = 0
        self.snapshot = self._snapshot()  # pool and queue figures, refreshed by the engine thread

    # ---- the event loop's side ------------------------------------------------------------------------

    def start(self):
        self._thread.start()

    def stop(self, timeout=10.0):
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, job: Job):
        self._inbox.put(("submit", job))
        self._wake.set()

    def cancel(self, job: Job):
        self._inbox.put(("cancel", job))
        self._wake.set()

    # ---- the engine thread ----------------------------------------------------------------------------

    def _run(self):
        while not self._stopping:
            try:
                self._drain()
                if self.scheduler.pending:
                    self._step()
                    continue
            except Exception as error:  # a bug must not take the server down: fail every job, go on
                for job in {job for job, _ in self._owner.values()}:
                    self._fail(job, f"{type(error).__name__}: {error}")
            self.snapshot = self._snapshot()
            if not self.scheduler.pending:
                self._wake.wait()
                self._wake.clear()  # anything sent before this is drained next
        for job in {job for job, _ in self._owner.values()}:
            self._fail(job, "the server is shutting down")

    def _drain(self):
        while True:
            try:
                command, job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command == "submit":
                self._start(job)
            elif job.open:
                self._end(job, "cancelled")

    def _start(self, job: Job):
        spec, tokenizer = job.spec, self.model.tokenizer
        config = spec.config
        try:
            first = self.scheduler.submit(
                list(spec.prompt_ids), config.max_new_tokens, config.temperature, config.top_k, config.top_p,
                config.min_p, config.seed, n=spec.n, stop=StopCondition(tokenizer, config, text=True),
                repetition_penalty=config.repetition_penalty, frequency_penalty=config.frequency_penalty,
                presence_penalty=config.presence_penalty, penalty_last_n=config.penalty_last_n,
                json_schema=spec.json_schema)
        except Exception as error:  # the app checked the request; this is a bug or an exotic limit
            job.emit("error", f"{type(error).__name__}: {error}")
            self.counters["requests_failed"] += 1
            return
        job.requests = [first, *first.siblings]
        job.open = len(job.requests)
        for i, request in enumerate(job.requests):
            self._owner[request] = (job, i)
        self.counters["requests_submitted"] += 1
        self.counters["prompt_tokens"] += len(spec.prompt_ids)

    def _step(self):
        try:
            out = self.engine.step()
        except Exception as error:  # an execution failed and committed nothing: end every running job
            for job in {self._owner[r][0] for r in self.scheduler.running if r in self._owner}:
                self._fail(job, f"{type(error).__name__}: {error}")
            return
        self.counters["steps"] += 1
        self._count_batch(len(out))
        for request, token in out:
            self._deliver(request, token)
        self.scheduler.finished.clear()  # the jobs keep what they need; a server runs for long
        self.snapshot = self._snapshot()

    def _deliver(self, request, token):
        job, i = self._owner[request]
        self.counters["generation_tokens"] += 1
        text = request.new_text
        if request.done:
            text += request.stop.flush()
        logprob = None
        if job.spec.logprobs is not None and token not in request.stop.end_ids:
            logprob = [token_logprob(request.logits, token, job.spec.logprobs)]
        job.emit("token", i, text, logprob)
        if request.done:
            job.emit("finish", i, request.finish_reason, len(request.tokens))
            self._forget(job, request, "requests_finished")

    def _end(self, job: Job, why: str):
        for request in job.requests:
            if not request.done:
                self.scheduler.cancel(request)
            if request in self._owner:
                self._forget(job, request, f"requests_{why}")

    def _fail(self, job: Job, message: str):
        job.emit("error", message)
        self._end(job, "failed")

    def _forget(self, job, request, counter):
        del self._owner[request]
        job.open -= 1
        if job.open == 0:
            self.counters[counter] += 1

    def _count_batch(self, size):
        self.batch_sum += size
        for b, bound in enumerate(BATCH_BUCKETS):
            if size <= bound:
                self.batch_histogram[b] += 1
                return
        self.batch_histogram[-1] += 1

    def _snapshot(self) -> dict:
        s, pool = self.scheduler, self.scheduler.pool
        cached = pool.blocks_cached
        return {"blocks_in_use": pool.blocks_used, "blocks_cached": cached, "blocks_free": pool.blocks_free - cached,
                "num_blocks": pool.num_blocks, "block_size": pool.block_size, "waiting": len(s.waiting),
                "running": len(s.running), "preemptions": s.preemptions, "prompt_positions": s.prompt_positions,
                "reused_positions": s.reused_positions}


def token_logprob(logits, token: int, k: int) -> TokenLogprob:
    """The selected token's log-probability under the model's distribution, and the k most likely."""
    lp = log_softmax(np.asarray(logits, dtype=np.float64))
    top = np.argsort(-lp, kind="stable")[:k] if k else ()
    return TokenLogprob(int(token), float(lp[token]), tuple((int(t), float(lp[t])) for t in top))


def __getattr__(name):
    if name == "Engine":  # the old name, before kvref.generation.batch.Engine (the step) took it
        warnings.warn("kvref.serving.engine.Engine is deprecated: it is EngineThread", DeprecationWarning, stacklevel=2)
        return EngineThread
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
