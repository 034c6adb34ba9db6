"""Model families: the one decoder, configured by a checkpoint's fields, computes what transformers does.

The strongest oracle: the same weights in two implementations. Each test builds a tiny random model of
a family with transformers (a few layers, odd sizes, GQA or MQA, a window shorter than the prompt),
converts its config and tensors with kvref.formats.hf, and compares the logits at every position
with transformers' float32 logits by the rule of kvref/tolerance.py. (A float64 comparison would
prove no more: transformers computes RoPE angles, and Gemma 3 its norms, in float32 even in a
float64 model.) On every family, cached generation equals full recomputation and the paged cache
equals the contiguous one, in float64.
"""

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvref
from kvref.errors import BackendError, ConfigError, ShapeError
from kvref.formats.hf import config_from_hf, weights_from_hf
from kvref.tolerance import FLOAT32_KERNEL_RTOL, assert_close
from tests.conftest import require

torch = require("torch")
transformers = require("transformers")

# a tiny model of each family; windows (Mistral's on every layer, Gemma 3's on its local layers)
# shorter than the prompts below, so the window changes what later positions see
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, head_dim=12)),
    # Llama 3.1's RoPE scaling, with an original context short enough that the prompt's positions
    # reach every band (divided, blended and kept frequencies)
    "llama3": ("LlamaConfig", dict(num_key_value_heads=2, head_dim=16, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # YaRN (gpt-oss's and DeepSeek's scaling): a base and original context that put pairs 0..4 of 8 in
    # the blended band, and the attention factor 0.1 ln(8) + 1 on the scores
    "llama-yarn": ("LlamaConfig", dict(num_key_value_heads=2, head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 100.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 100, "truncate": False})),
    "llama-linear": ("LlamaConfig", dict(num_key_value_heads=4, head_dim=12, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, head_dim=12, sliding_window=5)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True, hidden_size=40)),  # D = E / H
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=10)),
    "gemma3": ("Gemma3TextConfig", dict(num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=12,
                                        sliding_window=4, layer_types=["sliding_attention", "sliding_attention",
                                                                       "full_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "default",
                                                                            "rope_theta": 1000000.0}})),
}
COMMON = dict(hidden_size=36, num_hidden_layers=3, num_attention_heads=4, intermediate_size=52, vocab_size=61,
              max_position_embeddings=48, rms_norm_eps=1e-6)
PROMPT = [3, 17, 42, 8, 8, 60, 1, 29, 33, 5, 12, 47, 19]  # 13 positions: past every window above


def hf_model(family, seed=0, **overrides):
    """A transformers model of `family` with random weights everywhere (norm gains and biases too)."""
    config_class, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **fields, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # gains near 1 (Gemma stores w of 1 + w: near 0)
                p.copy_((0.0 if family == "gemma3" else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model.eval()


@functools.lru_cache(maxsize=None)
def config_json(family):
    return hf_model(family).config.to_dict()


def hf_logits(model, ids, dtype):
    model = model.to(getattr(torch, dtype))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def kvref_model(model, dtype):
    tensors = {name: t.detach().to(torch.float64).numpy() for name, t in model.state_dict().items()}
    config, weights = weights_from_hf(model.config.to_dict(), tensors, dtype)
    return kvref.Model(config, weights, dtype=dtype, backend="numpy")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gives_transformers_logits_at_every_position(family):
    hf = hf_model(family)
    model = kvref_model(hf, "float32")
    assert_close(model.forward(PROMPT, all_logits=True), hf_logits(hf, PROMPT, "float32"), "float32",
                 f"{family} kvref vs transformers")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_cached_in_any_chunking_and_layout_equals_full_recomputation(family):
    model = kvref_model(hf_model(family, seed=1), "float64")
    full = model.forward(PROMPT, model.new_cache(layout="contiguous"), all_logits=True)  # every position kept
    layouts = ({"layout": "contiguous"}, {"layout": "paged", "block_size": 3}, {"layout": "hybrid", "spare": 0},
               {"layout": "hybrid", "spare": 2}, {})  # the default: hybrid on window models
    for options in layouts:
        for sizes in ([1] * len(PROMPT), [5, 1, 4, 3], [13]):
            cache, out, start = model.new_cache(**options), [], 0
            for n in sizes:
                out.append(model.forward(PROMPT[start:start + n], cache, all_logits=True))
                start += n
            assert_close(np.concatenate(out), full, "float64", f"{family} {options} chunks {sizes}")


def test_gemma3_fields_come_from_config_json_and_a_window_shows_the_last_w_positions():
    # Gemma's local layers see the last 4 positions: the query at position 12 sees 9..12 only
    hf = hf_model("gemma3", seed=2)
    config, _ = weights_from_hf(hf.config.to_dict(), {k: v.numpy() for k, v in hf.state_dict().items()})
    assert config.layer_windows == (4, 4, None) and config.rope_local_theta == 10000.0
    assert config.rope_theta == 1000000.0 and config.attention_scale == 12 ** -0.5
    model = kvref_model(hf, "float64")
    spec = kvref.spec.ops
    q = np.ones((1, 1, 4))
    k = np.eye(4)[None].repeat(13, axis=0)[:, :1]  # [13, 1, 4]
    v = np.arange(13.0)[:, None, None] * np.ones((13, 1, 4))
    seen = spec.attention(q, k, v, [12], np.arange(13), window=4)[0, 0, 0]
    assert seen == pytest.approx(np.mean([9, 10, 11, 12]))  # positions 9..12, equally weighted
    assert model.config.window(2) is None


def test_unsupported_checkpoints_are_refused_by_name():
    base = dict(COMMON, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        config_from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="mlp_bias"):
        config_from_hf({**base, "model_type": "llama", "mlp_bias": True})
    with pytest.raises(ConfigError, match="RoPE type 'dynamic'"):
        config_from_hf({**base, "model_type": "llama",
                        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}})
    with pytest.raises(ConfigError, match="incomplete"):
        config_from_hf({**base, "model_type": "llama",
                        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}})
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        config_from_hf({**base, "model_type": "gemma3_text", "final_logit_softcapping": 30.0})
    hf = hf_model("qwen2")
    tensors = {k: v.numpy() for k, v in hf.state_dict().items() if not k.endswith("k_proj.bias")}
    with pytest.raises(ShapeError, match="k_proj.bias"):
        weights_from_hf(hf.config.to_dict(), tensors)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_on_the_native_backend_gives_transformers_logits_in_one_c_call(family):
    if not kvref.native.available():
        pytest.skip("the native module is not built")
    hf = hf_model(family)
    tensors = {name: t.detach().to(torch.float64).numpy() for name, t in hf.state_dict().items()}
    config, weights = weights_from_hf(hf.config.to_dict(), tensors, "float32")
    model = kvref.Model(config, weights, dtype="float32", backend="auto")
    assert model.backend == "c" and model.executor(model.new_cache()).fallback is None
    model.fused.reset_timings()
    assert_close(model.forward(PROMPT, model.new_cache(), all_logits=True), hf_logits(hf, PROMPT, "float32"),
                 "float32", f"{family} native vs transformers")
    assert model.fused.timings()["calls"] == 1


def test_the_native_backend_says_which_fields_it_does_not_compute(monkeypatch):
    # every family field runs natively today; one added later stays on the spec until it does
    config = config_from_hf(hf_model("qwen3").config.to_dict())
    monkeypatch.setattr(kvref.backends, "NATIVE_FAMILY_FIELDS", ("layer_windows",))
    if kvref.native.available():
        with pytest.raises(BackendError, match="qk_norm"):
            kvref.Model.random(config, backend="c")
    assert kvref.Model.random(config, backend="auto").backend == "numpy"


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("storage", ["float32", "bfloat16 sharded"])
def test_kvref_load_reads_an_hf_checkpoint_directory_of_every_family(family, storage, tmp_path):
    hf = hf_model(family, seed=3)
    if storage != "float32":  # round the weights to bfloat16 values first: bfloat16 widens exactly
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    want = hf_logits(hf, PROMPT, "float32")
    if storage == "float32":
        hf.save_pretrained(tmp_path)
    else:  # bfloat16 weights in several shards with an index, as big checkpoints come
        hf.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = kvref.load(tmp_path, backend="numpy")
    assert model.config == config_from_hf(hf.config.to_dict())
    assert_close(model.forward(PROMPT, all_logits=True), want, "float32", f"{family} {storage} kvref.load vs transformers")


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=3), max_leaves=5)


@settings(max_examples=300)
@given(st.sampled_from(sorted(FAMILIES)), st.data())
def test_any_value_in_config_json_is_read_or_refused_with_a_config_error(family, data):
    config = dict(config_json(family))
    key = data.draw(st.sampled_from(sorted(config)))
    config[key] = data.draw(JSON_VALUES)
    try:
        config_from_hf(config)
    except ConfigError:
        pass


def test_kvref_run_on_a_checkpoint_without_a_tokenizer_says_so(tmp_path, capsys):
    from kvref.tools.cli import main

    hf_model("qwen3").save_pretrained(tmp_path)
    assert main(["run", "-m", str(tmp_path), "--backend", "numpy", "hello"]) != 0
    assert "TokenizerError" in capsys.readouterr().err
    assert main(["inspect", "--tensors", str(tmp_path)]) == 0  # inspect reads the directory itself
    out = capsys.readouterr().out
    assert "model_type 'qwen3'" in out and "model.layers.0.self_attn.q_norm.weight" in out and "qk_norm=True" in out


# what llama.cpp's converter writes for each family (architecture, Q/K rows reordered to adjacent pairs?)
GGUF_ARCHITECTURES = {"llama": ("llama", True), "llama3": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False),
                      "qwen3": ("qwen3", False), "gemma3": ("gemma3", False)}
# what GGUF can express: a llama-architecture file carries no window (llama.cpp runs Mistral without
# one), and Gemma 3's files carry the window but not the layer pattern or query_pre_attn_scalar, which
# llama.cpp (and kvref) take as every 6th layer global and head_dim
GGUF_EXPRESSIBLE = {"mistral": dict(sliding_window=None),
                    "gemma3": dict(num_hidden_layers=6, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention"] * 5 + ["full_attention"])}
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf(hf, family, path):
    """The model as llama.cpp's convert_hf_to_gguf.py lays it out: names, metadata, row order, gains."""
    gguf = require("gguf")
    arch, permute = GGUF_ARCHITECTURES[family]
    c = hf.config
    gemma = family == "gemma3"
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"] if gemma else c.rope_parameters["rope_theta"])
    if gemma:
        writer.add_sliding_window(c.sliding_window)
    if c.rope_parameters.get("rope_type") == "llama3":  # Llama 3.1+: one divisor per frequency, as a tensor
        plain = c.rope_parameters["rope_theta"] ** (-np.arange(0, head_dim, 2) / head_dim)
        scaled = kvref.spec.ops.rope_frequencies(head_dim, c.rope_parameters["rope_theta"],
                                                 config_from_hf(c.to_dict()).rope_scaling)
        writer.add_tensor("rope_freqs.weight", (plain / scaled).astype(np.float32))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab", *(f"t{i}" for i in range(3, c.vocab_size))])
    writer.add_token_merges(["a b"])
    for name, t in hf.state_dict().items():
        a = t.detach().to(torch.float32).numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if "norm" in name and gemma:
            a = a + 1  # Gemma files store the (1 + w) of its RMSNorm
        if permute and ("q_proj" in name or "k_proj" in name):  # llama.cpp's permute: to adjacent pairs
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            a = a.reshape(heads, 2, -1, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        writer.add_tensor(gguf_name(name, gemma), a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_name(name, gemma):
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = dict(GGUF_NAMES, post_attention_layernorm="post_attention_norm" if gemma else "ffn_norm",
                 pre_feedforward_layernorm="ffn_norm")
    return f"blk.{layer}.{names[module]}.{kind}"


@pytest.mark.parametrize("family", [f for f in sorted(FAMILIES) if f in GGUF_ARCHITECTURES])
def test_every_family_written_as_gguf_gives_transformers_logits(family, tmp_path):
    hf = hf_model(family, seed=4, **GGUF_EXPRESSIBLE.get(family, {}))
    write_gguf(hf, family, tmp_path / "model.gguf")
    model = kvref.load(tmp_path / "model.gguf", backend="auto")
    def fields(config):  # the family fields, with the score scale and RoPE scaling as the numbers they stand for
        frequencies = kvref.spec.ops.rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        return {**config.family_fields(), "attention_scale": config.attention_scale or config.head_dim ** -0.5,
                "rope_scaling": tuple(float(f"{f:.6g}") for f in frequencies)}  # a file stores float32 divisors

    assert fields(model.config) == fields(config_from_hf(hf.config.to_dict()))
    assert model.backend == ("c" if kvref.native.available() else "numpy")  # every family runs natively
    if model.backend == "c":
        assert model.fused is not None and model.executor(model.new_cache()).fallback is None
    assert_close(model.forward(PROMPT, all_logits=True), hf_logits(hf, PROMPT, "float32"), "float32",
                 f"{family} GGUF vs transformers")


def test_chat_on_a_gemma3_checkpoint_keeps_one_hybrid_cache_across_turns_and_equals_recomputation(tmp_path):
    from kvref.generation.conversation import Conversation
    from tests.test_tokenizer_hf import qwen_style

    tok, _, _, directory = qwen_style()
    hf_model("gemma3", vocab_size=tok.vocab_size, max_position_embeddings=256).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    model = kvref.load(tmp_path, dtype="float64")  # windows of 4: every turn runs past them
    chat = Conversation(model)
    cache = chat.cache
    for turn, text in enumerate(["Hello there", "and what next?", "one more"]):
        reply = list(chat.say(text, 6))
        assert chat.cache is cache and cache.layout == "hybrid"
        assert (chat.last_turn.reused > 0) == (turn > 0)  # later turns prefill only their new tokens
        history = cache.sequence.token_ids  # this turn's prompt, then the reply but its last token
        prompt = history[:len(history) - len(reply) + 1]
        expected = list(kvref.generate(model, prompt, len(reply), cache=model.new_cache(layout="contiguous")))
        assert reply == expected  # the same greedy reply as recomputing the whole conversation


@pytest.mark.parametrize("parameters", [
    # gpt-oss's (its config's defaults): no truncation of the correction range
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    # DeepSeek-V3's: the attention factor from mscale / mscale_all_dim, truncation by default
    {"factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707,
     "original_max_position_embeddings": 4096},
    {"factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 0.8},  # given; betas default
    {"factor": 1.0, "original_max_position_embeddings": 256, "truncate": True},  # no interpolation at all
])
@pytest.mark.parametrize("theta, head_dim", [(150000.0, 64), (10000.0, 24)])
def test_yarn_frequencies_and_attention_factor_equal_transformers_rope_init(parameters, theta, head_dim):
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"]
    hf = transformers.LlamaConfig(**{**COMMON, "head_dim": head_dim, "max_position_embeddings": 131072,
                                     "rope_parameters": {"rope_type": "yarn", "rope_theta": theta, **parameters}})
    inv_freq, attention_factor = init(hf)
    config = config_from_hf(hf.to_dict())
    # transformers computes the frequencies in float32 (power, ramp and blend each rounded), kvref in float64
    np.testing.assert_allclose(kvref.spec.ops.rope_frequencies(head_dim, theta, config.rope_scaling),
                               inv_freq.numpy(), rtol=FLOAT32_KERNEL_RTOL)
    assert config.rope_scaling[5] == pytest.approx(attention_factor, rel=1e-12)
    score_scale = config.score_scale or head_dim ** -0.5  # None: 1/sqrt(head_dim)
    assert score_scale == pytest.approx(head_dim ** -0.5 * attention_factor ** 2, rel=1e-12)
