"""kvref conformance llama-cpp-python on GGUF files of the issue-27 families that llama.cpp's own converter wrote.

tests/data/converted/ holds tiny random transformers models (tests/test_families.py) converted by
llama-cpp-python 0.3.36's convert_hf_to_gguf.py (benchmarks/convert_families.py made them; a Qwen-style
byte-level BPE, so the suite's texts encode): Gemma 2 (soft caps, windows of 4 on alternate layers), Phi-3 with
LongRoPE's short factors and a window of 5 on every layer, Phi-3 with the long factors and attention factor,
SmolLM3 (a NoPE layer), gpt-oss (sinks, YaRN, windows, biases, experts requantized to MXFP4 blocks) and
DeepSeek-V3 (latent attention, sigmoid router). The test needs llama_cpp in this Python; the default test venv
has none, so there it skips, saying so (run it with `PYTHONPATH=. /work/llama-venv/bin/python -m pytest
tests/test_conformance_llama_families.py`).

What is asserted is what docs/conformance.md reports of llama-cpp-python 0.3.36 on these files: every check
reaches a verdict, llama.cpp's prefill and decode are the spec's where it computes the same model, and the
two places it does not (Phi-3's window, which llama.cpp ignores; the MXFP4 experts, whose products it takes
with 8-bit activations) fail golden with the numbers that say so.
"""

import functools
from pathlib import Path

import pytest

from kvref.conformance import Spec, make_plan, run_suite
from kvref.conformance.suite import max_positions
from kvref.loader import load
from kvref.tolerance import CONFORMANCE_QUANTIZED
from tests.conftest import require

CONVERTED = Path(__file__).parent / "data" / "converted"
SAME_MODEL = ("gemma2", "phi3-long", "smollm3", "deepseek_v3")  # llama.cpp computes the model the file holds
DIFFERENT = ("phi3", "gpt-oss-mxfp4")  # it does not: golden fails, below


@functools.lru_cache(maxsize=None)
def results(name) -> dict:
    """{check name: CheckResult} of the quick suite with llama.cpp on tests/data/converted/<name>.gguf."""
    require("llama_cpp")
    from kvref.conformance.llama_engine import LlamaCppEngine

    path = CONVERTED / f"{name}.gguf"
    spec = Spec(load(path, backend="numpy", dtype="float32"))
    engine = LlamaCppEngine(path, spec.vocab_size, max_positions("quick"))
    try:
        return {r.name: r for r in run_suite(engine, spec, make_plan(spec.model))}
    finally:
        engine.close()


@pytest.mark.parametrize("name", SAME_MODEL + DIFFERENT)
def test_every_check_reaches_a_verdict_on_every_converted_family(name):
    checks = results(name)
    assert not [r.name for r in checks.values() if r.status == "error"]
    assert checks["prefix_cache"].status == "skip"  # llama-cpp-python's context has no prefix cache


@pytest.mark.parametrize("name", SAME_MODEL)
def test_llama_cpp_computes_the_spec_model_of_soft_caps_nope_longrope_and_latent_attention(name):
    checks = results(name)
    assert checks["golden"].status == "pass" and checks["golden"].metrics["max_kl"] < 1e-4, checks["golden"].evidence
    assert checks["greedy"].status == "pass"


def test_phi3s_window_is_what_llama_cpp_leaves_out():
    # the file says the window (phi3.attention.sliding_window 5): kvref attends to the last 5 positions,
    # llama.cpp to all, so they part once a prompt passes the window; llama.cpp agrees with itself
    checks = results("phi3")
    assert checks["golden"].status == "fail" and checks["golden"].metrics["mean_kl"] > CONFORMANCE_QUANTIZED.mean_kl
    assert checks["chunking"].status == "pass" and checks["batch"].status == "pass"


def test_mxfp4_experts_move_llama_cpps_logits_and_make_them_depend_on_the_execution():
    # the float32 file of the same model passes (docs/conformance.md): the difference is the MXFP4 products
    checks = results("gpt-oss-mxfp4")
    golden = checks["golden"]
    assert golden.status == "fail" and golden.metrics["mean_kl"] < CONFORMANCE_QUANTIZED.mean_kl < golden.metrics["max_kl"]
    assert checks["chunking"].metrics["max_kl"] > CONFORMANCE_QUANTIZED.same_engine_kl  # token by token vs at once
