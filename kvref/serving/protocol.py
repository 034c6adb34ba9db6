"""The OpenAI request bodies `kvref serve` accepts, checked field by field into a Spec before any work.

Every field is checked for its type and range, and an unknown field is refused rather than ignored:
a client that sends `logit_bias` or `tools` would otherwise get an answer that silently did not do
what it asked. Errors are RequestError (HTTP 400) naming the field.

What the fields mean where kvref departs from, or adds to, the OpenAI API:

  temperature, top_p, ...  left out: the model's defaults (model.generation_config; greedy for
                           SmolLM2), not OpenAI's temperature 1. A sampling filter with greedy
                           decoding is refused, as everywhere in kvref; top_p 1, top_k 0 or -1 and
                           min_p 0 mean "off" and are accepted with any temperature.
  top_k, min_p, repetition_penalty, ignore_eos   kvref's (and vLLM's / llama.cpp's) extensions.
  return_tokens_as_token_ids   vLLM's extension: logprobs name each token "token_id:<id>", not its text.
  penalties                count the last 64 tokens of prompt + completion (kvref.generate's rule).
  seed                     with n > 1, choice i > 0 draws from the stream [seed, i] (kvref.generation.batch).
  logprobs                 log-probabilities of the model's own next-token distribution (log-softmax
                           of its logits), before penalties, temperature and filters; every selected
                           token has one except an end id (EOS), whose text is never shown.
  max_tokens               default: as many as the context and the pool leave (the prompt's positions and
                           one block for a copy-on-write taken), and no more than the server's
                           --max-tokens when it was given; prompt + max_tokens beyond the model's
                           context, or beyond what the pool can hold for one sequence, is refused.
  tools, functions         refused with a 400 saying so: kvref's chat templates are rendered without
                           tool definitions, and nothing parses a tool call out of the text.
  response_format          {"type": "json_object"}: the output is a JSON object; {"type": "json_schema",
                           "json_schema": {"name": ..., "schema": {...}}}: JSON valid against the schema
                           (kvref.generation.grammar, the structured extra; "strict" is accepted, and
                           always holds). A schema that cannot be satisfied is a 400 before any work;
                           not with ignore_eos (the grammar ends the output at an end id).
  echo with logprobs       refused: the prompt's log-probabilities would need every prompt position's
                           logits, which the batched prefill does not keep.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import KVRefError, RequestError
from ..generation.config import GenerationConfig

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_N = 16

# OpenAI's tool calling, which kvref refuses by name (a 400 that says why, not "unknown field")
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"}
# fields both endpoints read, and the ones accepted only to be refused with a reason
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream",
          "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "user",
          "return_tokens_as_token_ids", "response_format"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix", "logit_bias"}
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "logit_bias"} | TOOL_FIELDS
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Limits:
    """What the server allows one request (kvref serve's options)."""

    max_tokens: int | None = None  # the largest max_tokens a request may ask for, and its default; None: no cap
    max_n: int = MAX_N


@dataclass(frozen=True)
class Spec:
    """One checked request: what the engine runs and how the answer is written."""

    kind: str  # "completion" | "chat"
    prompt_ids: tuple  # token ids (a text prompt already tokenized by the caller of `tokenize`)
    config: GenerationConfig
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts
    logprobs: int | None = None  # None: off; k: the selected token's and the k most likely
    echo_text: str = ""  # completions with echo: the prompt text, put before each choice's text
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>"
    json_schema: dict | None = None  # response_format: the schema every choice's text is valid against


@dataclass(frozen=True)
class Parsed:
    """A body checked up to its prompt: the prompt still to tokenize (text or chat messages) or its ids."""

    kind: str
    prompt: object  # str | list[int] (completions) or list of messages (chat)
    settings: dict  # GenerationConfig fields given by the request
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: bool
    max_tokens: int | None
    tokens_as_ids: bool = False
    json_schema: dict | None = None


def parse_completion(body, vocab_size: int, limits: Limits) -> Parsed:
    """A /v1/completions body, checked (RequestError naming the field)."""
    body = _object(body, None)
    _known(body, COMPLETION_FIELDS)
    _refused(body, "suffix", None, "kvref has no fill-in-the-middle mode")
    _refused(body, "logit_bias", ({}, None), "kvref does not bias logits")
    prompt = _prompt(body.get("prompt"), vocab_size)
    n = _int(body, "n", 1, limits.max_n, 1)
    best_of = _int(body, "best_of", 1, limits.max_n, n)
    if best_of != n:
        raise RequestError(f"best_of={best_of} differs from n={n}: kvref returns every sequence it generates",
                           "best_of")
    logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS, None)
    echo = _bool(body, "echo", False)
    if echo and logprobs is not None:
        raise RequestError("echo with logprobs is not supported: the prompt's log-probabilities would need every "
                           "prompt position's logits", "echo")
    return Parsed("completion", prompt, _settings(body), n, *_stream(body), logprobs, echo,
                  _int(body, "max_tokens", 1, limits.max_tokens, None), _bool(body, "return_tokens_as_token_ids", False),
                  _response_format(body))


def parse_chat(body, limits: Limits) -> Parsed:
    """A /v1/chat/completions body, checked (RequestError naming the field)."""
    body = _object(body, None)
    _known(body, CHAT_FIELDS)
    _refused(body, "logit_bias", ({}, None), "kvref does not bias logits")
    for name in sorted(TOOL_FIELDS & set(body)):
        _refused(body, name, None, "kvref does not call tools: the chat template is rendered without tool "
                 "definitions and no tool call is parsed from the reply (describe the tools in a message instead)")
    messages = _messages(body.get("messages"))
    n = _int(body, "n", 1, limits.max_n, 1)
    logprobs = None
    if _bool(body, "logprobs", False):
        logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
    elif body.get("top_logprobs") is not None:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", 1, limits.max_tokens, None)
    given = _int(body, "max_tokens", 1, limits.max_tokens, None)
    if max_tokens is not None and given is not None and given != max_tokens:
        raise RequestError(f"max_tokens={given} and max_completion_tokens={max_tokens} disagree; give one",
                           "max_tokens")
    return Parsed("chat", messages, _settings(body), n, *_stream(body), logprobs, False,
                  given if max_tokens is None else max_tokens, _bool(body, "return_tokens_as_token_ids", False),
                  _response_format(body))


def make_spec(parsed: Parsed, prompt_ids, base: GenerationConfig, max_seq_len: int, limits: Limits,
              echo_text: str = "", pool_positions: int | None = None) -> Spec:
    """The Spec of a parsed body whose prompt is now token ids: the settings become a GenerationConfig
    (checked again there), max_tokens is bounded by the context. pool_positions: the most positions one
    sequence may hold in the server's pool (Scheduler.most_positions), which bounds the default too; a
    larger max_tokens given is left to the scheduler's admission check (a 400 naming the pool)."""
    room = max_seq_len - len(prompt_ids)
    if room < 1:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the model's context holds {max_seq_len}, "
                           "which leaves no room for a completion", "prompt" if parsed.kind == "completion"
                           else "messages", code="context_length_exceeded")
    max_tokens = parsed.max_tokens
    if max_tokens is None:
        # the last selected token needs no position, hence + 1
        bounds = [room, limits.max_tokens, None if pool_positions is None else pool_positions - len(prompt_ids) + 1]
        max_tokens = max(1, min(b for b in bounds if b is not None))
    elif max_tokens > room:
        raise RequestError(f"max_tokens={max_tokens} with a prompt of {len(prompt_ids)} tokens needs "
                           f"{len(prompt_ids) + max_tokens - 1} positions; the model's context holds {max_seq_len}",
                           "max_tokens", code="context_length_exceeded")
    try:
        config = base.updated(**parsed.settings, max_new_tokens=max_tokens)
    except KVRefError as error:  # a combination GenerationConfig refuses (a filter with greedy decoding)
        raise RequestError(str(error), _field_named_in(str(error), parsed.settings)) from None
    return Spec(parsed.kind, tuple(int(t) for t in prompt_ids), config, parsed.n, parsed.stream,
                parsed.include_usage, parsed.logprobs, echo_text, parsed.tokens_as_ids, parsed.json_schema)


def _response_format(body) -> dict | None:
    """The JSON schema response_format asks for (json_object: any object); None for text or no field."""
    value = body.get("response_format")
    if value is None:
        return None
    value = _object(value, "response_format")
    kind = value.get("type")
    fields = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in fields:
        raise RequestError(f"response_format.type must be one of {', '.join(fields)}; got {_describe(kind)}",
                           "response_format.type")
    _known(value, fields[kind], "response_format.")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = _object(value.get("json_schema"), "response_format.json_schema")
    _known(spec, {"name", "description", "schema", "strict"}, "response_format.json_schema.")
    _bool(spec, "strict", False, "response_format.json_schema.strict")
    return _object(spec.get("schema", {}), "response_format.json_schema.schema")


# ---- fields --------------------------------------------------------------------------------------

def _settings(body) -> dict:
    """The GenerationConfig fields the body gives (an "off" value of a filter is left out)."""
    settings = {}
    temperature = _number(body, "temperature", 0, 2)
    if temperature is not None:
        settings["temperature"] = float(temperature)
    top_p = _number(body, "top_p", 0, 1, low_open=True)
    if top_p is not None and top_p < 1:
        settings["top_p"] = float(top_p)
    top_k = _int(body, "top_k", -1, None, None)
    if top_k is not None and top_k > 0:
        settings["top_k"] = top_k
    min_p = _number(body, "min_p", 0, 1)
    if min_p is not None and min_p > 0:
        settings["min_p"] = float(min_p)
    seed = _int(body, "seed", 0, 2**63 - 1, None)
    if seed is not None:
        settings["seed"] = seed
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, -2, 2)
        if value is not None:
            settings[name] = float(value)
    repetition = _number(body, "repetition_penalty", 0, None, low_open=True)
    if repetition is not None:
        settings["repetition_penalty"] = float(repetition)
    stop = _stop(body.get("stop"))
    if stop:
        settings["stop"] = stop
    if _bool(body, "ignore_eos", False):
        settings["ignore_eos"] = True
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError("user must be a string", "user")
    _model_name(body)
    return settings


def _model_name(body):
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError("model must be a string (GET /v1/models lists it)", "model")


def _stream(body) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise RequestError("stream_options needs stream: true", "stream_options")
    options = _object(options, "stream_options")
    _known(options, {"include_usage"}, "stream_options.")
    return stream, _bool(options, "include_usage", False, "stream_options.include_usage")


def _prompt(prompt, vocab_size):
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("several prompts in one request are not supported: send one prompt (a string or a "
                           "list of token ids) per request", "prompt")
    raise RequestError(f"prompt must be a non-empty string or a non-empty list of token ids; got "
                       f"{_describe(prompt)}", "prompt")


def _messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of {{role, content}} objects; got "
                           f"{_describe(messages)}", "messages")
    checked = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        m = _object(m, where)
        _known(m, {"role", "content", "name"}, where + ".")
        if m.get("role") not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}; got {_describe(m.get('role'))}",
                               where + ".role")
        checked.append({"role": m["role"], "content": _content(m.get("content"), where + ".content")})
    return checked


def _content(content, where) -> str:
    # a string, or a list of text parts (what the OpenAI client sends for multi-part messages)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            part = _object(part, f"{where}[{j}]")
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{j}] must be {{\"type\": \"text\", \"text\": str}}: kvref reads text only",
                                   f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text parts; got {_describe(content)}", where)


def _stop(stop) -> list:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty "
                           f"strings; got {_describe(stop)}", "stop")
    return stops


# ---- primitives ----------------------------------------------------------------------------------

def _object(value, where):
    if not isinstance(value, Mapping):
        raise RequestError(f"{where or 'the body'} must be a JSON object; got {_describe(value)}", where)
    return value


def _known(body, fields, prefix=""):
    unknown = sorted(set(body) - fields)
    if unknown:
        raise RequestError(f"unknown field {prefix}{unknown[0]}; this endpoint reads "
                           f"{', '.join(prefix + f for f in sorted(fields))}", prefix + unknown[0])


def _refused(body, name, allowed, why):
    allowed = allowed if isinstance(allowed, tuple) else (allowed,)
    if name in body and body[name] not in allowed:
        raise RequestError(f"{name} is not supported: {why}", name)


def _int(body, name, low, high, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise RequestError(f"{name} must be an integer >= {low}" + ("" if high is None else f" and <= {high}")
                           + f"; got {_describe(value)}", name)
    return value


def _number(body, name, low, high, low_open=False):
    value = body.get(name)
    if value is None:
        return None
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or (value <= low if low_open else value < low) or (high is not None and value > high):
        bounds = f"{'>' if low_open else '>='} {low}" + ("" if high is None else f" and <= {high}")
        raise RequestError(f"{name} must be a number {bounds}; got {_describe(value)}", name)
    return value


def _bool(body, name, default, where=None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{where or name} must be true or false; got {_describe(value)}", where or name)
    return value


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_FIELD_OF_SETTING = {"max_new_tokens": "max_tokens"}


def _field_named_in(message: str, settings: dict) -> str | None:
    """The request field a GenerationConfig message is about (it starts with 'name=value')."""
    for name in [*settings, *(f.name for f in dataclasses.fields(GenerationConfig))]:
        if message.startswith(f"{name}=") or f", {name}=" in message:
            return _FIELD_OF_SETTING.get(name, name)
    return None
