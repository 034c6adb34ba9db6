"""The HTTP side of `kvref serve`: a Starlette app with the OpenAI routes, /health and /metrics.

    POST /v1/completions        prompt (text or token ids) -> text; stream: true for server-sent events
    POST /v1/chat/completions   messages, rendered with the model's chat template (sandboxed jinja2)
    GET  /v1/models             the one model served
    GET  /health                {"status": "ok"} (never needs the API key)
    GET  /metrics               Prometheus text: requests, tokens, batch sizes, blocks, prefix hits, queue

A request is read (at most max_body_bytes, nested at most kvref.limits.MAX_JSON_DEPTH deep), checked
(kvref.serving.protocol) and tokenized before the engine sees it, so a bad one costs no execution. Errors
are JSON in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with status 400 (a field,
or a body that is not JSON or nests too deep), 401 (the API key), 404 (a model or route), 413 (the body's
size) or 500. A client that disconnects, streaming or not, cancels its request: its sequences leave the
batch at the next step and their blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ..errors import CacheFullError, GenerationError, KVRefError, RequestError
from ..generation.grammar import Grammar
from ..limits import bounded_json
from .engine import BATCH_BUCKETS, EngineThread, Job
from .protocol import Limits, Spec, make_spec, parse_chat, parse_completion

MAX_BODY_BYTES = 1 << 20  # 1 MiB: a prompt of the whole context is ~100 KB of text


def create_app(model, engine: EngineThread, model_name: str, *, api_key: str | None = None,
               limits: Limits = Limits(), max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The ASGI app; it starts the engine's thread when the server starts, and stops it at shutdown."""
    server = _Server(model, engine, model_name, api_key, limits, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    routes = [Route("/health", server.health), Route("/metrics", server.metrics),
              Route("/v1/models", server.models),
              Route("/v1/completions", server.completions, methods=["POST"]),
              Route("/v1/chat/completions", server.chat, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: _http_error, RequestError: _request_error})


class _Server:
    def __init__(self, model, engine, model_name, api_key, limits, max_body_bytes):
        self.model, self.engine, self.model_name = model, engine, model_name
        self.api_key, self.limits, self.max_body_bytes = api_key, limits, max_body_bytes
        self.created = int(time.time())

    # ---- routes ---------------------------------------------------------------------------------------

    async def health(self, request: Request):
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request):
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvref"}]})

    async def metrics(self, request: Request):
        self._authorize(request)
        return PlainTextResponse(prometheus_text(self.engine), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request):
        self._authorize(request)
        body = await self._read_json(request)
        parsed = parse_completion(body, self.model.config.vocab_size, self.limits)
        self._check_model(body)
        spec = await anyio.to_thread.run_sync(self._completion_spec, parsed)
        return await self._answer(request, spec)

    async def chat(self, request: Request):
        self._authorize(request)
        body = await self._read_json(request)
        parsed = parse_chat(body, self.limits)
        self._check_model(body)
        spec = await anyio.to_thread.run_sync(self._chat_spec, parsed)
        return await self._answer(request, spec)

    # ---- checks ---------------------------------------------------------------------------------------

    def _authorize(self, request):
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive and may be followed by several spaces (RFC 9110, 11.1 and 11.4); the key is
        # compared in constant time
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.lstrip(" ").encode(), self.api_key.encode()):
            raise RequestError("missing or wrong API key: send the header Authorization: Bearer KEY", None,
                               status=401, code="invalid_api_key")

    def _check_model(self, body):
        name = body.get("model")
        if name is not None and name != self.model_name:
            raise RequestError(f"model {name!r} is not served here; this server serves {self.model_name!r}",
                               "model", status=404, code="model_not_found")

    async def _read_json(self, request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
        return bounded_json(bytes(body), "the body", RequestError)  # json.loads alone recurses once per level

    # ---- prompts (in a worker thread: tokenizing and rendering a template take time) -------------------

    def _completion_spec(self, parsed) -> Spec:
        tokenizer = self.model.tokenizer
        if isinstance(parsed.prompt, str):
            ids = _tokenize(lambda: tokenizer.encode(parsed.prompt, add_special=True), "prompt")
            echo = parsed.prompt
        else:
            ids = parsed.prompt
            echo = tokenizer.decode(ids) if parsed.echo else ""
        return make_spec(parsed, ids, self.model.generation_config, self.model.config.max_seq_len, self.limits,
                         echo if parsed.echo else "", self.engine.scheduler.most_positions())

    def _chat_spec(self, parsed) -> Spec:
        if not self.model.chat_template:
            raise RequestError("this model has no chat template; use /v1/completions (or start the server with "
                               "--chat-template FILE)", "messages")
        ids = _tokenize(lambda: self.model.text.chat_ids(parsed.prompt), "messages")
        return make_spec(parsed, ids, self.model.generation_config, self.model.config.max_seq_len, self.limits,
                         pool_positions=self.engine.scheduler.most_positions())

    def _check_schema(self, spec: Spec):
        """A 400 now for a response_format the engine could not follow (it builds each choice's grammar)."""
        if spec.config.ignore_eos:
            raise RequestError("response_format needs the output to end at an end id; drop ignore_eos", "ignore_eos")
        try:
            Grammar(self.model.tokenizer, json_schema=spec.json_schema)
        except GenerationError as error:
            raise RequestError(str(error), "response_format") from None

    # ---- answers --------------------------------------------------------------------------------------

    async def _answer(self, request: Request, spec: Spec):
        if spec.json_schema is not None:
            await asyncio.to_thread(self._check_schema, spec)
        job = Job(spec, asyncio.get_running_loop())
        try:  # the Scheduler's own admission bound, checked here so it is a 400 before any work
            self.engine.scheduler.check_fits(len(spec.prompt_ids), spec.config.max_new_tokens)
        except CacheFullError as error:
            raise RequestError(f"{error} (the server's --num-blocks / --cache-mib)", "max_tokens") from None
        self.engine.submit(job)
        answer = _Answer(job, self.model, self.model_name)
        if spec.stream:
            return StreamingResponse(self._stream(answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(answer.collect())
        gone = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if collect not in done:  # the client went away: its sequences leave the batch
            self.engine.cancel(job)
            collect.cancel()
            return PlainTextResponse("", status_code=499)
        gone.cancel()
        if collect.exception() is not None:
            return _error_response(500, str(collect.exception()), None, None)
        return JSONResponse(collect.result())

    async def _stream(self, answer):
        try:
            async for chunk in answer.chunks():
                yield f"data: {json.dumps(chunk)}\n\n"
        except RuntimeError as error:  # the engine failed the job: say so in the stream, whose status was sent
            yield f"data: {json.dumps(_error_body(500, str(error), None, None))}\n\n"
        finally:
            if not answer.finished:
                self.engine.cancel(answer.job)  # a disconnect cancels this generator mid-way: free the sequences
        yield "data: [DONE]\n\n"


class _Answer:
    """The OpenAI response objects of one job, built from its engine events."""

    def __init__(self, job: Job, model, model_name):
        spec = job.spec
        self.job, self.tokenizer, self.model_name = job, model.tokenizer, model_name
        self.chat = spec.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self.texts = [spec.echo_text] * spec.n
        self.logprobs = [[] for _ in range(spec.n)]
        self.reasons = [None] * spec.n
        self.completion_tokens = 0
        self.finished = False

    async def events(self):
        """The job's events until every choice has finished (RuntimeError on an engine error)."""
        open_choices = self.job.spec.n
        while open_choices:
            event = await self.job.events.get()
            if event[0] == "error":
                raise RuntimeError(event[1])
            if event[0] == "finish":
                open_choices -= 1
                self.reasons[event[1]] = event[2]
                self.completion_tokens += event[3]
            yield event
        self.finished = True

    async def collect(self) -> dict:
        async for event in self.events():
            if event[0] == "token":
                _, i, text, logprobs = event
                self.texts[i] += text
                self.logprobs[i] += logprobs or []
        choices = [self._choice(i) for i in range(self.job.spec.n)]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model_name,
                "choices": choices, "usage": self._usage()}

    async def chunks(self):
        """The streamed chunks: each choice's text as it becomes final, then its finish reason."""
        spec = self.job.spec
        chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        base = {"id": self.id, "object": chunk_object, "created": self.created, "model": self.model_name}
        if self.chat:
            for i in range(spec.n):  # the role comes first, as OpenAI sends it
                yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
        elif spec.echo_text:
            for i in range(spec.n):
                yield {**base, "choices": [{"index": i, "text": spec.echo_text, "logprobs": None,
                                            "finish_reason": None}]}
        async for event in self.events():
            if event[0] == "token":
                _, i, text, logprobs = event
                if text or logprobs:
                    yield {**base, "choices": [self._delta(i, text, logprobs)]}
            else:
                _, i, reason, _ = event
                yield {**base, "choices": [self._delta(i, "", None, reason)]}
        if spec.include_usage:
            yield {**base, "choices": [], "usage": self._usage()}

    def _choice(self, i) -> dict:
        if self.chat:
            return {"index": i, "message": {"role": "assistant", "content": self.texts[i]},
                    "logprobs": self._chat_logprobs(self.logprobs[i]), "finish_reason": self.reasons[i]}
        return {"index": i, "text": self.texts[i], "logprobs": self._completion_logprobs(self.logprobs[i]),
                "finish_reason": self.reasons[i]}

    def _delta(self, i, text, logprobs, reason=None) -> dict:
        if self.chat:
            return {"index": i, "delta": {"content": text} if text or reason is None else {},
                    "logprobs": self._chat_logprobs(logprobs or []) if logprobs else None, "finish_reason": reason}
        return {"index": i, "text": text, "logprobs": self._completion_logprobs(logprobs or []) if logprobs else None,
                "finish_reason": reason}

    def _usage(self) -> dict:
        prompt = len(self.job.spec.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

    def _piece(self, token) -> str:
        return f"token_id:{token}" if self.job.spec.tokens_as_ids else self.tokenizer.decode([token])

    def _chat_logprobs(self, items):
        if self.job.spec.logprobs is None:
            return None

        def entry(token, logprob):
            return {"token": self._piece(token), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token))}

        return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                            for x in items]}

    def _completion_logprobs(self, items):
        if self.job.spec.logprobs is None:
            return None
        pieces = [self._piece(x.token) for x in items]
        offsets, at = [], len(self.job.spec.echo_text)
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": pieces, "token_logprobs": [x.logprob for x in items],
                "top_logprobs": [{self._piece(t): lp for t, lp in x.top} for x in items], "text_offset": offsets}


async def _disconnected(request: Request):
    # the body has been read, so the next message the server sends is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _tokenize(encode, field):
    try:
        return encode()
    except KVRefError as error:  # a template that refuses the conversation, text the tokenizer cannot take
        raise RequestError(str(error), field) from None


def _too_large(limit):
    return RequestError(f"the body is larger than {limit} bytes (--max-body-bytes)", None, status=413,
                        code="body_too_large")


async def _request_error(request, error: RequestError):
    return _error_response(error.status, str(error), error.param, error.code)


async def _http_error(request, error: HTTPException):
    return _error_response(error.status_code, error.detail, None, "not_found" if error.status_code == 404 else None)


def _error_response(status, message, param, code):
    return JSONResponse(_error_body(status, message, param, code), status_code=status)


def _error_body(status, message, param, code) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def prometheus_text(engine: EngineThread) -> str:
    """/metrics: the engine's counters and the pool's figures in the Prometheus text format."""
    c, s = engine.counters, engine.snapshot
    lines = []

    def metric(name, kind, help_text, samples):
        lines.append(f"# HELP kvref_{name} {help_text}")
        lines.append(f"# TYPE kvref_{name} {kind}")
        for labels, value in samples:
            lines.append(f"kvref_{name}{labels} {value}")

    metric("requests_total", "counter", "HTTP generation requests by outcome",
           [(f'{{outcome="{o}"}}', c[f"requests_{o}"]) for o in ("submitted", "finished", "cancelled", "failed")])
    metric("prompt_tokens_total", "counter", "prompt tokens of the requests submitted", [("", c["prompt_tokens"])])
    metric("generation_tokens_total", "counter", "tokens selected", [("", c["generation_tokens"])])
    metric("steps_total", "counter", "batched executions run", [("", c["steps"])])
    cumulative, buckets = 0, []
    for bound, count in zip([*BATCH_BUCKETS, "+Inf"], engine.batch_histogram):
        cumulative += count
        buckets.append((f'_bucket{{le="{bound}"}}', cumulative))
    metric("batch_size", "histogram", "sequences that selected a token in one step",
           [*buckets, ("_sum", engine.batch_sum), ("_count", cumulative)])
    metric("blocks", "gauge", "KV blocks of the pool: in_use (held by running requests), cached (free but "
           "holding a reusable prefix), free",
           [(f'{{state="{k}"}}', s[f"blocks_{k}"]) for k in ("in_use", "cached", "free")])
    metric("block_size", "gauge", "positions per KV block", [("", s["block_size"])])
    metric("prefix_cache_queries_total", "counter", "prompt positions of admitted requests",
           [("", s["prompt_positions"])])
    metric("prefix_cache_hits_total", "counter", "prompt positions whose K/V came from the prefix cache",
           [("", s["reused_positions"])])
    hit_rate = s["reused_positions"] / s["prompt_positions"] if s["prompt_positions"] else 0.0
    metric("prefix_cache_hit_rate", "gauge", "prefix_cache_hits_total / prefix_cache_queries_total",
           [("", f"{hit_rate:.6f}")])
    metric("queue_length", "gauge", "requests waiting for room in the batch or the pool", [("", s["waiting"])])
    metric("running", "gauge", "sequences in the running batch", [("", s["running"])])
    metric("preemptions_total", "counter", "sequences preempted (blocks freed, recomputed later)",
           [("", s["preemptions"])])
    return "\n".join(lines) + "\n"
