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
import re

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

NO_SPECIAL_IDS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # defaults past the tiny vocabulary
# DeepSeek: layer 0 dense, layers 1 and 2 mixtures of 2 of 4 experts (2 groups of 2) beside one shared expert
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
           first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
           n_shared_experts=1, n_group=2)
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
    # Gemma 2: caps small enough that tanh bends the random model's scores and logits; every other layer windowed
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=12, sliding_window=4,
                                    attn_logit_softcapping=1.5, final_logit_softcapping=1.0)),
    # Phi-3: fused qkv_proj and gate_up_proj, LongRoPE; max_position_embeddings == original: the short
    # factors, attention factor 1 (Phi-3-mini-4k's shape), and Mistral-like windows on every layer
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, hidden_size=40, sliding_window=5, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0],
        "long_factor": [1.5, 2.5, 4.0, 7.0, 12.0], "original_max_position_embeddings": 48},
        original_max_position_embeddings=48, **NO_SPECIAL_IDS)),
    # Phi-3 128k's shape: max_position_embeddings 48 > original 8, so the long factors and the attention
    # factor sqrt(1 + ln 6 / ln 8) (the prompt also passes 8 positions, as transformers needs to pick them)
    "phi3-long": ("Phi3Config", dict(num_key_value_heads=4, hidden_size=40, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0],
        "long_factor": [1.5, 2.5, 4.0, 7.0, 12.0], "original_max_position_embeddings": 8},
        original_max_position_embeddings=8, **NO_SPECIAL_IDS)),
    # SmolLM3: layer 3 of 4 skips RoPE (NoPE), llama.cpp's fixed pattern
    "smollm3": ("SmolLM3Config", dict(num_key_value_heads=2, hidden_size=40, num_hidden_layers=4,
                                      no_rope_layer_interval=4, **NO_SPECIAL_IDS)),
    # mixtures of experts: 2 of 5 or 6 experts per position, narrower than the dense width
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=10, num_experts=6, num_experts_per_tok=2,
                                         moe_intermediate_size=20, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=1, head_dim=12, num_local_experts=5, num_experts_per_tok=2,
                                      sliding_window=5)),
    # multi-head latent attention and DeepSeek's mixtures. V2-Lite's one query projection and softmax router
    # (its best group, as group_limited_greedy scores groups by their best expert; scaled, not renormalised);
    # V3's low-rank query, half-split RoPE rows, sigmoid router with a selection bias (groups by their two best)
    "deepseek_v2": ("DeepseekV2Config", dict(MLA, q_lora_rank=None, topk_method="group_limited_greedy", topk_group=1,
                                             routed_scaling_factor=1.5)),
    "deepseek_v3": ("DeepseekV3Config", dict(MLA, q_lora_rank=12, rope_interleave=False, topk_group=1,
                                             norm_topk_prob=True)),
    # DeepSeek's YaRN: mscale_all_dim's factor squared on every score, and (mscale != mscale_all_dim) an
    # attention factor of 1.07 on the rotated parts of q and k only; positions past the original 8
    "deepseek_v3-yarn": ("DeepseekV3Config", dict(MLA, q_lora_rank=12, rope_interleave=False, topk_group=1,
                                                  norm_topk_prob=True, rope_parameters={
                                                      "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "mscale": 1.2, "mscale_all_dim": 0.7,
                                                      "original_max_position_embeddings": 8})),
    # gpt-oss: sink logits, biases on every attention projection, the router and the experts, the clamped
    # SwiGLU, windows of 4 on alternate layers (its default layer_types), YaRN blending pairs 0..4 of 6
    "gpt_oss": ("GptOssConfig", dict(num_key_value_heads=2, head_dim=12, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=4, rope_parameters={
                                         "rope_type": "yarn", "rope_theta": 100.0, "factor": 8.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 100})),
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
                p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            if name.endswith("sinks"):  # logits of the order of the scores: the sinks take a real share
                p.mul_(4.0)
            if name.endswith("gate_up_proj"):  # gpt-oss: some gates and ups past its clamp limit of 7
                p.mul_(40.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection bias: a buffer, zeros until set
                b.copy_(0.3 * torch.randn_like(b))
    return model.eval()


@functools.lru_cache(maxsize=None)
def config_json(family):
    return hf_model(family).config.to_dict()


def hf_logits(model, ids, dtype):
    model = model.to(getattr(torch, dtype))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def checkpoint(model):
    """{name: tensor} as save_pretrained writes them: transformers holds a mixture's experts as 3-D tensors
    in memory and writes (as every released checkpoint stores) one matrix per expert."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, model.state_dict())


def kvref_model(model, dtype):
    tensors = {name: t.detach().to(torch.float64).numpy() for name, t in checkpoint(model).items()}
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
    with pytest.raises(ConfigError, match="final_logit_softcapping"):  # a Gemma field nowhere else computed
        config_from_hf({**base, "model_type": "llama", "final_logit_softcapping": 30.0})
    phi3 = config_json("phi3")
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.75"):  # Phi-4-mini
        config_from_hf({**phi3, "rope_parameters": {**phi3["rope_parameters"], "partial_rotary_factor": 0.75}})
    with pytest.raises(ConfigError, match="long_factor .* must list 5 numbers"):
        config_from_hf({**phi3, "rope_parameters": {**phi3["rope_parameters"], "long_factor": [1.0, 2.0]}})
    with pytest.raises(ConfigError, match="use_sliding_window"):
        config_from_hf({**config_json("smollm3"), "use_sliding_window": True, "sliding_window": 4})
    with pytest.raises(ConfigError, match="no_rope_layers"):
        config_from_hf({**config_json("smollm3"), "no_rope_layers": [1, 0, 1]})
    deepseek = config_json("deepseek_v3")
    with pytest.raises(ConfigError, match="moe_layer_freq=2"):
        config_from_hf({**deepseek, "moe_layer_freq": 2})
    with pytest.raises(ConfigError, match="scoring_func='softmax' with topk_method='noaux_tc'"):
        config_from_hf({**deepseek, "scoring_func": "softmax", "topk_method": "noaux_tc"})
    hf = hf_model("qwen2")
    tensors = {k: v.numpy() for k, v in hf.state_dict().items() if not k.endswith("k_proj.bias")}
    with pytest.raises(ShapeError, match="k_proj.bias"):
        weights_from_hf(hf.config.to_dict(), tensors)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_on_the_native_backend_gives_transformers_logits_in_one_c_call(family):
    if not kvref.native.available():
        pytest.skip("the native module is not built")
    hf = hf_model(family)
    tensors = {name: t.detach().to(torch.float64).numpy() for name, t in checkpoint(hf).items()}
    config, weights = weights_from_hf(hf.config.to_dict(), tensors, "float32")
    model = kvref.Model(config, weights, dtype="float32", backend="auto")
    assert model.backend == "c"
    assert model.executor(model.new_cache()).fallback is None
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


def test_kvref_inspect_says_how_many_experts_a_mixture_runs(tmp_path, capsys):
    from kvref.tools.cli import main

    hf_model("qwen3_moe").save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    assert "2 of 6 per position, each 20 wide" in capsys.readouterr().out


# what llama.cpp's converter writes for each family (architecture, Q/K rows reordered to adjacent pairs?)
GGUF_ARCHITECTURES = {"llama": ("llama", True), "llama3": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False),
                      "qwen3": ("qwen3", False), "gemma3": ("gemma3", False), "gemma2": ("gemma2", False),
                      "phi3": ("phi3", False), "phi3-long": ("phi3", False), "smollm3": ("smollm3", True),
                      "qwen3_moe": ("qwen3moe", False), "mixtral": ("llama", True),
                      "deepseek_v2": ("deepseek2", False), "deepseek_v3": ("deepseek2", False)}
# what GGUF can express: a llama-architecture file carries no window (llama.cpp runs Mistral without
# one), and Gemma 3's files carry the window but not the layer pattern or query_pre_attn_scalar, which
# llama.cpp (and kvref) take as every 6th layer global and head_dim; Gemma 2's, every 2nd and head_dim
GGUF_EXPRESSIBLE = {"mistral": dict(sliding_window=None), "mixtral": dict(sliding_window=None),
                    "gemma2": dict(query_pre_attn_scalar=16),
                    "gemma3": dict(num_hidden_layers=6, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention"] * 5 + ["full_attention"]),
                    # deepseek2 files rotate adjacent pairs: the converter does not reorder rope_interleave=false
                    "deepseek_v3": dict(rope_interleave=True),
                    # nor V2's group_limited_greedy (llama.cpp scores a group by its two best): greedy
                    "deepseek_v2": dict(topk_method="greedy")}
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
              "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
              "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
              "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
              "self_attn.kv_a_layernorm": "attn_kv_a_norm", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
              "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
# a checkpoint's expert j matrices -> the one 3-D tensor of the layer's experts llama.cpp's converter stacks them into
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def write_gguf(hf, family, path, expert_type=None):
    """The model as llama.cpp's convert_hf_to_gguf.py lays it out: names, metadata, row order, gains; a
    mixture's experts stacked into one tensor per projection, in `expert_type` blocks (a GGMLQuantizationType;
    None: float32)."""
    gguf = require("gguf")
    arch, permute = GGUF_ARCHITECTURES[family]
    c = hf.config
    gemma = family.startswith("gemma")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    if arch == "deepseek2":  # the latent attention as MQA over R + Dr wide keys, as the converter writes it
        write_latent_metadata(writer, c, gguf)
    else:
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if family in ("qwen3_moe", "mixtral"):
        writer.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        if family == "qwen3_moe":
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_rope_freq_base(c.rope_parameters.get("full_attention", c.rope_parameters)["rope_theta"])
    if gemma:
        writer.add_sliding_window(c.sliding_window)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "phi3":  # Phi3MiniModel: the window (0: none), LongRoPE's tensors and attention factor
        writer.add_sliding_window(c.sliding_window or 0)
        original = c.rope_parameters["original_max_position_embeddings"]
        scale = c.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(original)) if scale > 1 else 1.0)
        for name in ("long", "short"):
            writer.add_tensor(f"rope_factors_{name}.weight",
                              np.array(c.rope_parameters[f"{name}_factor"], dtype=np.float32))
    if c.rope_parameters.get("rope_type") == "llama3":  # Llama 3.1+: one divisor per frequency, as a tensor
        plain = c.rope_parameters["rope_theta"] ** (-np.arange(0, head_dim, 2) / head_dim)
        scaled = kvref.spec.ops.rope_frequencies(head_dim, c.rope_parameters["rope_theta"],
                                                 config_from_hf(c.to_dict()).rope_scaling)
        writer.add_tensor("rope_freqs.weight", (plain / scaled).astype(np.float32))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab", *(f"t{i}" for i in range(3, c.vocab_size))])
    writer.add_token_merges(["a b"])
    experts = {}  # GGUF name -> {j: expert j's matrix}
    for name, t in checkpoint(hf).items():
        a = t.detach().to(torch.float32).numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if match := EXPERT.fullmatch(name):
            layer, j, projection = match.groups()
            experts.setdefault(f"blk.{layer}.{EXPERT_NAMES[projection]}.weight", {})[int(j)] = a
            continue
        if "norm" in name and gemma:
            a = a + 1  # Gemma files store the (1 + w) of its RMSNorm
        if name.endswith("kv_b_proj.weight"):  # split per head: W_UK transposed [H, R, Dn], W_UV [H, Dv, R]
            kv_b = a.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            writer.add_tensor(gguf_name(name, gemma).replace("kv_b", "k_b"),
                              np.ascontiguousarray(kv_b[:, :c.qk_nope_head_dim].transpose(0, 2, 1)))
            writer.add_tensor(gguf_name(name, gemma).replace("kv_b", "v_b"),
                              np.ascontiguousarray(kv_b[:, c.qk_nope_head_dim:]))
            continue
        if permute and ("q_proj" in name or "k_proj" in name):  # llama.cpp's permute: to adjacent pairs
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            a = a.reshape(heads, 2, -1, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        writer.add_tensor(gguf_name(name, gemma), a)
    for name, matrices in experts.items():
        stack = np.stack([matrices[j] for j in range(len(matrices))])  # [X, N, K]
        if expert_type is None:
            writer.add_tensor(name, stack)
        else:
            writer.add_tensor(name, gguf.quants.quantize(stack, expert_type), raw_dtype=expert_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_latent_metadata(writer, c, gguf):
    # deepseek2's keys for a DeepSeek-V2/V3 config (llama.cpp's conversion/deepseek.py)
    writer.add_head_count_kv(1)
    writer.add_kv_lora_rank(c.kv_lora_rank)
    writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    writer.add_value_length(c.kv_lora_rank)
    writer.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    writer.add_value_length_mla(c.v_head_dim)
    writer.add_rope_dimension_count(c.qk_rope_head_dim)
    writer.add_leading_dense_block_count(c.first_k_dense_replace)
    writer.add_expert_count(c.n_routed_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_shared_count(c.n_shared_experts)
    writer.add_expert_weights_scale(c.routed_scaling_factor)
    writer.add_expert_weights_norm(c.norm_topk_prob)
    sigmoid = c.model_type == "deepseek_v3"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if sigmoid:  # V2's groups (scored by their best expert) have no GGUF form (GGUF_EXPRESSIBLE)
        writer.add_expert_group_count(c.n_group)
        writer.add_expert_group_used_count(c.topk_group)
    writer.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        writer.add_q_lora_rank(c.q_lora_rank)


def gguf_name(name, gemma):
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    if kind == "e_score_correction_bias":
        return f"blk.{layer}.exp_probs_b.bias"
    names = dict(GGUF_NAMES, **{"self_attn.kv_b_proj": "attn_kv_b"},
                 post_attention_layernorm="post_attention_norm" if gemma else "ffn_norm",
                 pre_feedforward_layernorm="ffn_norm")
    return f"blk.{layer}.{names[module]}.{kind}"


@pytest.mark.parametrize("family", [f for f in sorted(FAMILIES) if f in GGUF_ARCHITECTURES])
def test_every_family_written_as_gguf_gives_transformers_logits(family, tmp_path):
    hf = hf_model(family, seed=4, **GGUF_EXPRESSIBLE.get(family, {}))
    write_gguf(hf, family, tmp_path / "model.gguf")
    model = kvref.load(tmp_path / "model.gguf", backend="auto")
    def fields(config):  # the family fields, with the score scale and RoPE scaling as the numbers they stand for
        frequencies = kvref.spec.ops.rope_frequencies(config.head_dim, *config.layer_rope(0))
        scale = config.attention_scale or config.head_dim ** -0.5
        return {**config.family_fields(), "attention_scale": float(f"{scale:.6g}"),  # a file stores float32s
                "rope_scaling": tuple(float(f"{f:.6g}") for f in frequencies)}

    assert fields(model.config) == fields(config_from_hf(hf.config.to_dict()))
    assert model.backend == ("c" if kvref.native.available() else "numpy")  # every family runs natively
    if model.backend == "c" and not (model.config.n_experts or model.config.latent):  # those: the decoder over C kernels
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


def test_quantized_experts_are_read_in_place_and_give_the_spec_logits_of_their_dequantized_values(tmp_path):
    gguf = require("gguf")
    hf = hf_model("qwen3_moe", seed=5, hidden_size=64, moe_intermediate_size=32)  # whole blocks of 32 values
    write_gguf(hf, "qwen3_moe", tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    spec = kvref.load(tmp_path / "q8.gguf", backend="numpy")  # every tensor dequantized to float32
    want = spec.forward(PROMPT, all_logits=True)
    if not kvref.native.available():
        pytest.skip("the native module is not built")
    native = kvref.load(tmp_path / "q8.gguf", backend="c")
    stack = native.weights.layers[1].experts_down
    assert isinstance(stack, kvref.spec.ggml.QuantizedTensor) and stack.shape == (6, 64, 32)  # [X, E, Fx], in place
    assert_close(native.forward(PROMPT, all_logits=True), want, "float32", "Q8_0 experts: native vs spec")


def test_a_gguf_router_kvref_does_not_read_is_refused_by_name(tmp_path):
    from kvref.errors import GGUFError

    write_gguf(hf_model("qwen3_moe", seed=6), "qwen3_moe", tmp_path / "m.gguf")
    with kvref.formats.gguf.GGUFFile(tmp_path / "m.gguf") as f:
        metadata, names = dict(f.metadata), list(f.tensors)
    config = kvref.formats.architectures.config_from_metadata(metadata, names)
    assert (config.n_experts, config.n_experts_used, config.experts_d_ff, config.norm_topk_prob) == (6, 2, 20, True)
    for key, value in (("expert_shared_count", 2), ("expert_gating_func", 2), ("expert_group_count", 4)):
        with pytest.raises(GGUFError, match=f"qwen3moe.{key}={value}"):
            kvref.formats.architectures.config_from_metadata({**metadata, f"qwen3moe.{key}": value}, names)


def test_a_deepseek2_gguf_router_kvref_does_not_compute_or_another_mqa_view_is_refused_by_name():
    from kvref.errors import GGUFError
    from kvref.formats.architectures import config_from_metadata

    keys = {"block_count": 3, "embedding_length": 36, "feed_forward_length": 52, "attention.head_count": 4,
            "attention.head_count_kv": 1, "attention.kv_lora_rank": 16, "attention.key_length": 22,
            "attention.value_length": 16, "attention.key_length_mla": 14, "attention.value_length_mla": 10,
            "rope.dimension_count": 6, "context_length": 48, "attention.layer_norm_rms_epsilon": 1e-6,
            "vocab_size": 61, "expert_count": 4, "leading_dense_block_count": 3}
    names = [f"blk.{i}.attn_norm.weight" for i in range(3)]

    def metadata(**changes):
        return {"general.architecture": "deepseek2", **{f"deepseek2.{k}": v for k, v in {**keys, **changes}.items()}}

    config = config_from_metadata(metadata(), names)
    assert (config.kv_lora_rank, config.head_dim, config.n_kv_heads, config.q_lora_rank) == (16, 14, 4, None)
    assert config.n_experts == 0  # 3 leading dense blocks of 3
    moe = dict(leading_dense_block_count=1, expert_used_count=2, expert_feed_forward_length=8)
    assert config_from_metadata(metadata(**moe), names).first_dense_layers == 1
    with pytest.raises(GGUFError, match="expert_gating_func=3"):
        config_from_metadata(metadata(**moe, expert_gating_func=3), names)
    with pytest.raises(GGUFError, match="expert_group_count=2 with softmax gating"):  # V2's group_limited_greedy
        config_from_metadata(metadata(**moe, expert_group_count=2, expert_group_used_count=1), names)
    with pytest.raises(GGUFError, match="MQA view"):
        config_from_metadata(metadata(**{"attention.value_length": 10}), names)


def test_gpt_oss_swiglu_constants_other_than_its_own_are_refused_by_name():
    hf = dict(config_json("gpt_oss"))
    assert config_from_hf(hf).activation == "swiglu_oai"
    with pytest.raises(ConfigError, match="swiglu_limit=5.0"):
        config_from_hf({**hf, "swiglu_limit": 5.0})
    with pytest.raises(ConfigError, match="swiglu_alpha=1.0"):
        config_from_hf({**hf, "swiglu_alpha": 1.0})


def write_gpt_oss_gguf(hf, path):
    """A gpt-oss model as llama.cpp's converter lays it out: keys of the `gpt-oss` architecture, Q/K rows as in
    the checkpoint (NEOX), the pre-MLP norm as post_attention_norm, sinks and biases, and the experts split
    (gate, up de-interleaved), transposed to [X, out, in] and stored as MXFP4 blocks, as released files store them."""
    gguf = require("gguf")
    c, MXFP4 = hf.config, gguf.GGMLQuantizationType.MXFP4
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    rope = c.rope_parameters
    keys = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "expert_feed_forward_length": c.intermediate_size, "head_count": c.num_attention_heads,
            "head_count_kv": c.num_key_value_heads, "key_length": c.head_dim, "value_length": c.head_dim,
            "layer_norm_rms_eps": c.rms_norm_eps, "expert_count": c.num_local_experts,
            "expert_used_count": c.num_experts_per_tok, "sliding_window": c.sliding_window,
            "rope_freq_base": rope["rope_theta"], "rope_scaling_type": gguf.RopeScalingType.YARN,
            "rope_scaling_factor": rope["factor"], "rope_scaling_orig_ctx_len": rope["original_max_position_embeddings"]}
    for key, value in keys.items():  # each through the writer's own add_<key>, as the converter writes them
        getattr(writer, f"add_{key}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab", *(f"t{i}" for i in range(3, c.vocab_size))])
    writer.add_token_merges(["a b"])
    names = dict(GGUF_NAMES, post_attention_layernorm="post_attention_norm", **{
        "self_attn.sinks": "attn_sinks.weight", "mlp.router": "ffn_gate_inp"})
    for name, t in checkpoint(hf).items():
        a = t.detach().to(torch.float32).numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            writer.add_tensor(gguf_name(name, False), a)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest.startswith("mlp.experts."):
            kind = rest.removeprefix("mlp.experts.")
            if kind == "gate_up_proj":  # [X, E, 2 Fx] -> gate and up [X, Fx, E], MXFP4 blocks along E
                for part, j in (("ffn_gate_exps", 0), ("ffn_up_exps", 1)):
                    stack = np.ascontiguousarray(a[:, :, j::2].transpose(0, 2, 1))
                    writer.add_tensor(f"blk.{layer}.{part}.weight", gguf.quants.quantize(stack, MXFP4), raw_dtype=MXFP4)
            elif kind == "down_proj":  # [X, Fx, E] -> [X, E, Fx]
                stack = np.ascontiguousarray(a.transpose(0, 2, 1))
                writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", gguf.quants.quantize(stack, MXFP4), raw_dtype=MXFP4)
            elif kind == "gate_up_proj_bias":
                writer.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(a[:, 0::2]))
                writer.add_tensor(f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(a[:, 1::2]))
            else:
                writer.add_tensor(f"blk.{layer}.ffn_down_exps.bias", a)
            continue
        module, _, kind = rest.rpartition(".")
        target = names.get(rest) or f"{names[module]}.{kind}"
        writer.add_tensor(f"blk.{layer}.{target}", a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def round_experts_to_mxfp4(hf):
    # the experts' weights replaced by the values their MXFP4 blocks hold, so that the file written from them
    # holds the model exactly and its logits must be transformers'
    gguf = require("gguf")
    MXFP4 = gguf.GGMLQuantizationType.MXFP4

    def rounded(stack):  # [X, N, K], blocks along K
        return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(stack), MXFP4), MXFP4)

    with torch.no_grad():
        for layer in hf.model.layers:
            experts = layer.mlp.experts
            w = experts.gate_up_proj.numpy().transpose(0, 2, 1)  # [X, 2 Fx, E]
            experts.gate_up_proj.copy_(torch.from_numpy(rounded(w).transpose(0, 2, 1).copy()))
            w = experts.down_proj.numpy().transpose(0, 2, 1)  # [X, E, Fx]
            experts.down_proj.copy_(torch.from_numpy(rounded(w).transpose(0, 2, 1).copy()))


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_gpt_oss_written_as_gguf_with_mxfp4_experts_gives_transformers_logits(backend, tmp_path):
    # widths of whole MXFP4 blocks; YaRN truncated as ggml always truncates it (GGUF has no truncate key)
    if backend == "c" and not kvref.native.available():
        pytest.skip("the native module is not built")
    rope = dict(FAMILIES["gpt_oss"][1]["rope_parameters"], truncate=True)
    hf = hf_model("gpt_oss", seed=5, hidden_size=64, intermediate_size=32, rope_parameters=rope)
    round_experts_to_mxfp4(hf)
    write_gpt_oss_gguf(hf, tmp_path / "gpt-oss.gguf")
    model = kvref.load(tmp_path / "gpt-oss.gguf", backend=backend)
    assert model.config.layer_windows == (4, None, 4) and model.config.attention_sinks
    if backend == "c":  # the experts stay MXFP4 blocks, multiplied where they lie
        assert model.weights.layers[0].experts_gate.ggml_type == kvref.spec.ggml.GGMLType.MXFP4
    assert_close(model.forward(PROMPT, all_logits=True), hf_logits(hf, PROMPT, "float32"), "float32",
                 f"gpt-oss GGUF (MXFP4 experts) on {backend} vs transformers")
