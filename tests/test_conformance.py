"""kvref conformance: the suite passes kvref on every layout, and each named check catches its bug.

The broken variants are test-only monkeypatches of kvref's cache (never in the package): each makes
exactly the claim its check tests false, and the test asserts that the check fails while checks
the bug cannot reach still pass. transformers runs on tiny random checkpoints; an OpenAI-compatible
server is a stub started here (serving a kvref model through /v1/completions).
"""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

import kvref
from kvref.cache import KVCache, PagedCache
from kvref.conformance import ConformanceError, KVRefEngine, Rows, Spec, make_plan, run_suite
from kvref.conformance.fixtures import SCHEMA_VERSION, to_half_split
from kvref.conformance.http_engine import OpenAIHTTPEngine
from kvref.conformance.kvref_engine import LAYOUTS
from kvref.conformance.spec import full_kl, topk_kl
from kvref.conformance.checks import CheckResult, Tally
from kvref.conformance.suite import table, verdict
from kvref.tolerance import FLOAT32
from kvref.tools.cli import main

CONFIG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=97, max_seq_len=256)
WINDOWED = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=97, max_seq_len=256,
                             layer_windows=(6, None))
BACKENDS = ["numpy"] + (["c"] if kvref.native.available() else [])
# checks every layout can run on a model without window layers
COMMON = {"golden", "greedy", "chunking", "batch", "save_restore", "fork", "rollback"}


@pytest.fixture(scope="module")
def spec():
    return Spec(kvref.Model.random(CONFIG, seed=0, backend="numpy"))


@pytest.fixture(scope="module")
def plan(spec):
    return make_plan(spec.model)


def run(engine, spec, plan, names=None) -> dict:
    return {r.name: r for r in run_suite(engine, spec, plan, names)}


def engine(layout, backend="numpy", config=CONFIG):
    return KVRefEngine(kvref.Model.random(config, seed=0, backend=backend), layout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kvref_passes_every_check_it_runs_on_every_layout_and_backend(layout, backend, spec, plan):
    results = run(engine(layout, backend), spec, plan)
    ran = {name for name, r in results.items() if r.status != "skip"}
    assert all(results[name].status == "pass" for name in ran), table(results.values(), {})
    expected = COMMON | ({"prefix_cache"} if layout == "paged" else set()) | (
        {"context_shift"} if layout in ("contiguous", "paged") else set())
    assert ran == expected
    assert "no sliding-window layers" in results["sliding_window"].evidence


def test_kvref_with_float16_kv_is_held_to_the_quantized_bounds_and_passes_them(spec, plan):
    kv16 = KVRefEngine(kvref.Model.random(CONFIG, seed=0, backend="numpy"), "paged", kv_dtype="float16")
    results = run(kv16, spec, plan)
    assert kv16.precision == "quantized" and "context_shift" not in kv16.capabilities  # float16 K never shifts
    assert {name for name, r in results.items() if r.status == "pass"} == COMMON | {"prefix_cache"}
    assert results["golden"].metrics["max_kl"] > 0  # float16 K/V do round


@pytest.mark.parametrize("layout", ["hybrid", "contiguous", "paged"])
def test_decode_past_a_sliding_window_equals_recomputation_on_kvref(layout):
    spec = Spec(kvref.Model.random(WINDOWED, seed=0, backend="numpy"))
    plan = make_plan(spec.model)
    assert plan.window == 6 and len(plan.long_prompt) == 10
    result = run(engine(layout, config=WINDOWED), spec, plan, ["sliding_window", "golden", "chunking"])
    assert {r.status for r in result.values()} == {"pass"}, table(result.values(), {})


# ---- the broken variants: each named check catches its bug ------------------------------------------

def test_a_kvref_engine_removes_its_saved_caches_when_it_goes_even_without_close():
    import gc
    import os

    kept = engine("contiguous")
    path = kept._saved
    assert os.path.isdir(path)
    del kept
    gc.collect()
    assert not os.path.exists(path)


def off_by_one_write(self, reservation, layer, k, v):
    # The bug: an execution that starts exactly at a block boundary writes its first position into
    # the previous block (a "current block" pointer not advanced when the last block was just filled),
    # and reads that position back from the new block, which holds whatever a freed sequence left.
    bs, length = self.pool.block_size, self.length
    end = length + reservation[0]
    new = np.arange(length, end)
    blocks = new // bs
    if length and length % bs == 0:
        blocks[0] -= 1
    self.pool.store.write(layer, (np.asarray(self.block_table)[blocks], new % bs), k, v)
    k_all, v_all = self.pool.store.decode_raw(self._gather(layer, end))
    return k_all, v_all, np.arange(end)


def test_a_block_table_off_by_one_at_block_multiples_fails_chunking(monkeypatch, spec, plan):
    monkeypatch.setattr(PagedCache, "_write", off_by_one_write)
    results = run(engine("paged"), spec, plan, ["golden", "chunking"])
    assert results["golden"].status == "pass"  # one execution from position 0 never starts at a boundary
    assert results["chunking"].status == "fail"
    assert "block multiples 16, 32" in results["chunking"].evidence


def test_a_prefix_key_without_the_previous_blocks_hash_fails_prefix_cache(monkeypatch, spec, plan):
    # the second block's key ignores the first block: [Q S] finds the S computed after P
    monkeypatch.setattr(kvref.cache.prefix, "block_key",
                        lambda previous, ids: hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).digest())
    results = run(engine("paged"), spec, plan, ["prefix_cache", "chunking"])
    assert results["chunking"].status == "pass"
    assert results["prefix_cache"].status == "fail"
    assert "32 positions reused" in results["prefix_cache"].evidence


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_restore_that_drops_the_last_logits_fails_save_restore(monkeypatch, layout, spec, plan):
    load_cache = kvref.Model.load_cache

    def lossy(self, path, pool=None):
        cache = load_cache(self, path, pool=pool)
        cache.sequence.replace(cache.sequence.token_ids, None)  # K/V restored, the last logits not
        return cache

    monkeypatch.setattr(kvref.Model, "load_cache", lossy)
    result = run(engine(layout), spec, plan, ["save_restore"])["save_restore"]
    assert result.status == "fail"
    assert result.evidence.startswith("the restored sequence has no last logits")


def test_a_fork_without_copy_on_write_fails_fork(monkeypatch, spec, plan):
    # both sequences write into their shared, partly filled last block
    monkeypatch.setattr(PagedCache, "_cow_needed", lambda self: 0)
    results = run(engine("paged"), spec, plan, ["fork", "rollback"])
    assert results["rollback"].status == "pass"
    assert results["fork"].status == "fail"


def test_a_rollback_that_keeps_one_position_too_many_fails_rollback(monkeypatch, spec, plan):
    truncate = KVCache.truncate
    monkeypatch.setattr(KVCache, "truncate", lambda self, n: truncate(self, n + 1))
    assert run(engine("contiguous"), spec, plan, ["rollback"])["rollback"].status == "fail"


def test_a_shift_that_does_not_rotate_keys_again_fails_context_shift(monkeypatch, spec, plan):
    monkeypatch.setattr(KVCache, "_rerotate", lambda self, k, n, layer: k)
    results = run(engine("contiguous"), spec, plan, ["context_shift", "golden"])
    assert results["golden"].status == "pass"
    assert results["context_shift"].status == "fail"


def test_another_models_logits_fail_golden_and_greedy(spec, plan):
    results = run(KVRefEngine(kvref.Model.random(CONFIG, seed=1, backend="numpy")), spec, plan, ["golden", "greedy"])
    assert results["golden"].status == "fail" and results["greedy"].status == "fail"
    assert "beyond a near-tie" in results["golden"].evidence


@pytest.mark.parametrize("changes", [{}, {"layer_windows": (40,), "rope_local_theta": 100.0},
                                     {"n_kv_heads": 4, "head_dim": 14, "kv_lora_rank": 16, "qk_rope_head_dim": 6,
                                      "v_head_dim": 10},  # latent attention (MLA)
                                     {"rope_scaling": ("longrope", (1.0, 1.3, 1.7, 2.2), (1.5, 2.5, 4.0, 7.0), 8),
                                      "attention_scale": 1.6 ** 2 / 8 ** 0.5}])  # Phi-3's LongRoPE, long factors
def test_the_spec_shift_of_a_one_layer_model_equals_a_prefill_of_the_kept_tokens(changes):
    # with one layer, K/V depend only on their own token and position: dropping positions and
    # rotating the later keys back must give exactly a prefill of the kept tokens (per-layer RoPE base too)
    config = kvref.ModelConfig(**{**dict(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=97,
                                         max_seq_len=128), **changes})
    spec = Spec(kvref.Model.random(config, seed=3, backend="numpy", dtype="float64"))
    ids, continuation = list(range(5, 58)), [7, 9, 11, 2]
    kept = ids[:4] + ids[4 + 19:]
    want = Rows.from_logits(spec.model.forward(kept + continuation, all_logits=True)).full[len(kept):]
    np.testing.assert_allclose(spec.shifted(ids, 19, 4, continuation), want, atol=1e-9)


# ---- KL from top-k log-probabilities ----------------------------------------------------------------

def test_top_k_kl_is_a_lower_bound_of_the_full_kl_and_equals_it_with_every_token():
    rng = np.random.default_rng(0)
    ref = Rows.from_logits(rng.normal(size=(50, 30)) * 3).full
    act = Rows.from_logits(np.log(np.exp(ref) + 0.05 * rng.random((50, 30)))).full
    exact = full_kl(ref, act)
    for k in (1, 5, 29):
        ids = np.argsort(-act, axis=-1)[:, :k]
        bound = topk_kl(ref, ids, np.take_along_axis(act, ids, axis=-1))
        assert np.all(bound <= exact + 1e-12)
    ids = np.argsort(-act, axis=-1)
    np.testing.assert_allclose(topk_kl(ref, ids, np.take_along_axis(act, ids, axis=-1)), exact, atol=1e-12)



def test_top_k_kl_of_a_row_padded_with_repeats_of_probability_zero_equals_the_unpadded_rows():
    # openai-http pads a row whose server texts do not all map to one id with repeats of its last id at -inf
    rng = np.random.default_rng(1)
    ref = Rows.from_logits(rng.normal(size=(4, 30)) * 3).full
    act = Rows.from_logits(rng.normal(size=(4, 30)) * 3).full
    ids = np.argsort(-act, axis=-1)[:, :5]
    padded = np.concatenate([ids, np.repeat(ids[:, -1:], 3, axis=-1)], axis=-1)
    lps = np.take_along_axis(act, ids, axis=-1)
    padded_lps = np.concatenate([lps, np.full((4, 3), -np.inf)], axis=-1)
    np.testing.assert_allclose(topk_kl(ref, padded, padded_lps), topk_kl(ref, ids, lps), atol=1e-12)

# ---- transformers, in process --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from tests.conftest import require

    require("torch")
    require("transformers")
    from tests.test_families import hf_model

    out = {}
    for family in ("llama", "gemma3"):
        path = tmp_path_factory.mktemp(family)
        hf_model(family, max_position_embeddings=256).save_pretrained(path)
        out[family] = path
    return out


def test_transformers_dynamic_cache_conforms_on_tiny_models(hf_dirs):
    from kvref.conformance.hf_engine import HFEngine

    for family, path in hf_dirs.items():
        spec = Spec(kvref.load(path, backend="numpy"))
        results = run(HFEngine(path), spec, make_plan(spec.model))
        summary = table(results.values(), {"family": family})
        for name in ("golden", "greedy", "chunking", "batch", "save_restore", "fork"):
            assert results[name].status == "pass", summary
        assert results["prefix_cache"].status == "skip" and "lacks prefix_cache" in results["prefix_cache"].evidence
        if family == "gemma3":
            assert results["sliding_window"].status == "pass", summary
            assert results["rollback"].status in ("pass", "refused"), summary
        else:
            assert results["rollback"].status == "pass", summary


def test_fixtures_hold_transformers_keys_in_rotate_half_order(hf_dirs, tmp_path):
    import torch
    import transformers

    path = hf_dirs["llama"]
    assert to_half_split(np.arange(6)).tolist() == [0, 2, 4, 1, 3, 5]
    assert main(["fixtures", "export", str(tmp_path / "fx"), "-m", str(path), "--backend", "numpy"]) == 0
    manifest = json.loads((tmp_path / "fx" / "manifest.json").read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["rope_dim_order"] == "half_split"
    data = np.load(tmp_path / "fx" / manifest["files"][0]["file"])
    prompt = list(data["token_ids"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    for layer, cached in enumerate(out.past_key_values.layers):
        np.testing.assert_allclose(data["k"][layer], cached.keys[0].transpose(0, 1).numpy(),
                                   atol=FLOAT32.atol, rtol=FLOAT32.rtol)
        np.testing.assert_allclose(data["v"][layer], cached.values[0].transpose(0, 1).numpy(),
                                   atol=FLOAT32.atol, rtol=FLOAT32.rtol)
    np.testing.assert_allclose(data["logits"], out.logits[0].numpy(), atol=FLOAT32.atol, rtol=FLOAT32.rtol)
    assert data["schema_version"] == SCHEMA_VERSION and list(data["positions"]) == list(range(len(prompt)))
    assert str(data["prompt"]) == ""  # the tiny checkpoint has no tokenizer


# ---- an OpenAI-compatible server (a stub serving a kvref model) ----------------------------------------

def serve(model, top_k=20, refuse=(), leave_out=(), api_key=None):
    """A /v1/completions server of token-id prompts with top logprobs named "token_id:N", refusing the
    fields in `refuse` as a strict server does, answering with no entry where its greedy token is in
    `leave_out` (as llama-cpp-python's server does for its BOS id), and with 401 to a request without
    `Authorization: Bearer api_key` when one is given; returns (server, url)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code, payload):
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def refused(self):
            if api_key is not None and self.headers.get("Authorization") != f"Bearer {api_key}":
                self.reply(401, {"error": {"message": "invalid api key"}})
                return True
            return False

        def do_GET(self):
            if not self.refused():
                self.reply(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})

        def do_POST(self):
            if self.refused():
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            unknown = [field for field in refuse if field in body]
            if unknown:
                return self.reply(400, {"error": {"message": f"unrecognized field: {unknown[0]}"}})
            lp = Rows.from_logits(model.forward(body["prompt"])).full[0]
            top = np.argsort(-lp, kind="stable")[:min(body["logprobs"], top_k)]
            entries = [{f"token_id:{t}": float(lp[t]) for t in top}] if top[0] not in leave_out else []
            self.reply(200, {"choices": [{"text": "", "logprobs": {"top_logprobs": entries},
                                          "finish_reason": "length"}]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize("seed, status", [(0, "pass"), (1, "fail")])
def test_openai_http_against_a_server_of_the_same_and_of_another_model(seed, status, spec, plan):
    server, url = serve(kvref.Model.random(CONFIG, seed=seed, backend="numpy"), refuse=("ignore_eos",))
    try:
        http = OpenAIHTTPEngine(url + "/v1", spec)
        results = run(http, spec, plan)
    finally:
        server.shutdown()
    assert http.extras == {"return_tokens_as_token_ids": True} and http.model == "stub"
    assert http.describe()["keys"] == "token ids"
    assert results["golden"].status == status and results["greedy"].status == status
    assert results["prefix_cache"].status == status
    assert "top-k: a lower bound" in results["golden"].evidence
    assert "against the spec: the engine has no cold path" in results["prefix_cache"].evidence
    assert {r.status for name, r in results.items() if name not in ("golden", "greedy", "prefix_cache")} == {"skip"}


def test_openai_http_skips_and_names_the_positions_a_server_leaves_out_and_compares_the_rest(spec, plan):
    ids = plan.prompts[0] + spec.greedy(plan.prompts[0], plan.greedy_tokens)[0]
    chosen = spec.rows(ids).argmax(axis=-1)  # [T] the server's greedy token at each position
    left_out = int(chosen[10])
    server, url = serve(spec.model, leave_out={left_out})
    try:
        results = run(OpenAIHTTPEngine(url, spec), spec, plan, ["golden", "greedy", "prefix_cache"])
    finally:
        server.shutdown()
    golden = results["golden"]
    assert golden.status == "pass", golden.evidence
    assert "prompt 0 @10 (the reply has no log-probabilities, finish_reason 'length')" in golden.metrics["skipped"]
    compared = sum(len(p) + plan.greedy_tokens for p in plan.prompts)
    assert golden.metrics["positions"] + len(golden.metrics["skipped"]) == compared
    assert "skipped, the engine gave no distribution there: prompt 0 @" in golden.evidence
    assert results["prefix_cache"].status == "pass" and results["greedy"].status == "pass"
    assert results["greedy"].metrics["decoded"] + len(results["greedy"].metrics["skipped"]) == len(plan.prompts)


def test_openai_http_sends_the_api_key_and_names_the_refusal_without_it(spec):
    server, url = serve(spec.model, api_key="k1")
    try:
        with pytest.raises(ConformanceError, match="HTTP 401"):
            OpenAIHTTPEngine(url, spec)
        http = OpenAIHTTPEngine(url, spec, api_key="k1")
        assert len(http.forward(http.new_sequence(), [1, 2, 3])) == 3
    finally:
        server.shutdown()


def test_a_check_whose_every_row_is_missing_is_skipped_not_passed():
    tally = Tally(1.0, 0.1)
    tally.add("prompt 0", np.zeros((2, 3)), Rows(top_ids=np.zeros((2, 1), dtype=int),
                                                 top_logprobs=np.full((2, 1), -np.inf), missing={0: "x", 1: "y"}))
    result = tally.result("golden")
    assert result.status == "skip" and result.evidence.startswith("no position compared; 2 positions skipped")


# ---- the command -----------------------------------------------------------------------------------

def test_the_command_prints_a_table_and_writes_json_and_markdown(hf_dirs, tmp_path, capsys):
    out, report = tmp_path / "out.json", tmp_path / "out.md"
    code = main(["conformance", "kvref", "-m", str(hf_dirs["llama"]), "--backend", "numpy", "--layout", "paged",
                 "--json", str(out), "--report", str(report)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "prefix_cache    PASS" in printed and "threshold: max KL <= 1e-05" in printed
    last = printed.strip().splitlines()[-1]
    assert last.startswith("conformance: PASS: ") and "checks on 1 engine configuration: " in last
    payload = json.loads(out.read_text())
    assert payload["engine"]["layout"] == "paged" and {c["status"] for c in payload["checks"]} <= {"pass", "skip"}
    assert "| prefix_cache | cold == prefix-cached | **pass** |" in report.read_text()


def test_the_verdict_is_fail_with_the_failed_checks_named_if_any_check_fails_or_errs_on_any_engine():
    ok = [CheckResult("golden", "pass", ""), CheckResult("shift", "refused", "")]
    assert verdict([ok, ok]) == "conformance: PASS: 4 checks on 2 engine configurations: 2 pass, 2 refused"
    bad = [CheckResult("golden", "pass", ""), CheckResult("fork", "fail", ""), CheckResult("shift", "error", "")]
    assert verdict([ok, bad]) == ("conformance: FAIL: 5 checks on 2 engine configurations: 2 pass, 1 fail, "
                                  "1 refused, 1 error (failed: fork, shift)")


def test_the_command_names_what_an_engine_needs(hf_dirs, capsys):
    assert main(["conformance", "transformers", "-m", "smollm2-not-a-dir"]) == 2
    assert "needs -m <Hugging Face checkpoint directory>" in capsys.readouterr().err
    assert main(["conformance", "openai-http", "-m", str(hf_dirs["llama"])]) == 2
    assert "needs --url" in capsys.readouterr().err
    assert main(["conformance", "kvref", "-m", str(hf_dirs["llama"]), "--api-key", "k1"]) == 2
    assert "--url and --api-key apply to openai-http only, not to kvref" in capsys.readouterr().err
    with pytest.raises(ConformanceError, match="must start with http"):
        OpenAIHTTPEngine("localhost:8080", None)
    short = kvref.Model.random(kvref.ModelConfig(n_layers=1, d_model=8, n_heads=2, n_kv_heads=1, d_ff=8,
                                                 vocab_size=11, max_seq_len=48), backend="numpy")
    with pytest.raises(ConformanceError, match=r"context \(48 positions\) is shorter than the quick suite's"):
        make_plan(short)
