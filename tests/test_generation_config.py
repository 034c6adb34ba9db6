"""GenerationConfig: one checked set of settings; the defaults a model file gives, read as transformers
and llama.cpp read them."""

import json

import pytest

import kvref
from kvref.errors import ConfigError, GenerationError, SamplingError
from kvref.generation.config import (GenerationConfig, from_gguf_metadata, from_hf_directory,
                                     from_hf_generation_config)


def test_kvref_decodes_greedily_and_stops_at_end_ids_by_default():
    config = GenerationConfig()
    assert config.greedy and config.max_new_tokens == 128 and not config.ignore_eos
    assert (config.repetition_penalty, config.frequency_penalty, config.presence_penalty) == (1.0, 0.0, 0.0)


@pytest.mark.parametrize("name, value", [("top_k", 40), ("top_p", 0.5), ("min_p", 0.1)])
def test_a_sampling_filter_with_greedy_decoding_is_refused_not_ignored(name, value):
    with pytest.raises(SamplingError, match=f"{name}={value} has no effect with greedy decoding"):
        GenerationConfig(**{name: value})
    assert getattr(GenerationConfig(temperature=0.7, **{name: value}), name) == value


def test_choosing_greedy_drops_the_filters_a_config_had_and_refuses_filters_given_with_it():
    sampling = GenerationConfig(temperature=0.7, top_k=64, top_p=0.95, seed=3)
    greedy = sampling.updated(temperature=0)
    assert (greedy.top_k, greedy.top_p, greedy.seed) == (None, None, 3)
    with pytest.raises(SamplingError, match="top_p=0.5 has no effect"):
        sampling.updated(temperature=0, top_p=0.5)
    assert sampling.updated(top_p=0.5).top_k == 64  # other settings keep the config's


@pytest.mark.parametrize("settings, error, message", [
    (dict(temprature=0.5), GenerationError, "unknown generation setting temprature"),
    (dict(stop=[""]), GenerationError, "stop string '' must be a non-empty str"),
    (dict(stop="\n"), GenerationError, "must be a list of strings"),
    (dict(stop_ids=[-1]), GenerationError, "stop id -1"),
    (dict(max_new_tokens=-1), GenerationError, "max_new_tokens=-1"),
    (dict(seed=-5), SamplingError, "seed=-5"),
    (dict(repetition_penalty=0), SamplingError, "repetition_penalty=0 must be > 0"),
    (dict(ignore_eos="yes"), GenerationError, "ignore_eos='yes'"),
])
def test_bad_settings_are_refused_naming_the_setting(settings, error, message):
    with pytest.raises(error, match=message):
        GenerationConfig().updated(**settings)


def test_hf_generation_config_samples_only_with_do_sample_as_transformers_does():
    assert from_hf_generation_config({"temperature": 0.6, "top_p": 0.9}) == GenerationConfig()
    sampled = from_hf_generation_config({"do_sample": True, "top_p": 0.95})
    assert (sampled.temperature, sampled.top_k, sampled.top_p) == (1.0, 50, 0.95)  # transformers' defaults
    assert from_hf_generation_config({"do_sample": True, "top_k": 0, "top_p": 1.0}).top_k is None
    penalized = from_hf_generation_config({"repetition_penalty": 1.2})
    assert penalized.greedy and penalized.repetition_penalty == 1.2
    assert penalized.penalty_last_n is None  # transformers counts every token of the history


def test_gguf_general_sampling_keys_give_llama_cpp_defaults():
    config = from_gguf_metadata({"general.sampling.temp": 0.8, "general.sampling.top_k": 20,
                                 "general.sampling.top_p": 1.0, "general.sampling.min_p": 0.05,
                                 "general.sampling.penalty_repeat": 1.1, "general.sampling.penalty_last_n": -1})
    assert (config.temperature, config.top_k, config.top_p, config.min_p) == (0.8, 20, None, 0.05)
    assert (config.repetition_penalty, config.penalty_last_n) == (1.1, None)
    assert from_gguf_metadata({"general.sampling.top_k": 20}) == GenerationConfig()  # no temp: greedy


def test_a_bad_value_in_a_model_file_names_the_file(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": -1}))
    with pytest.raises(ConfigError, match="generation_config.json: temperature=-1"):
        from_hf_directory(tmp_path)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot be read as JSON"):
        from_hf_directory(tmp_path)


def test_generate_uses_the_models_defaults_and_keywords_replace_them():
    cfg = kvref.ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=32, max_seq_len=32)
    model = kvref.Model.random(cfg, seed=1, dtype="float64")
    greedy = list(kvref.generate(model, [1, 2], 8))
    model.generation_config = GenerationConfig(temperature=1.5, top_k=8, seed=4, max_new_tokens=8)
    sampled = list(kvref.generate(model, [1, 2]))
    assert sampled == list(kvref.generate(model, [1, 2], config=GenerationConfig(temperature=1.5, top_k=8, seed=4,
                                                                                max_new_tokens=8)))
    assert sampled != greedy
    assert list(kvref.generate(model, [1, 2], temperature=0)) == greedy  # top_k dropped with the file's sampling
