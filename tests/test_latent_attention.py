"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the latent cache and the two forms of attention over it.

The cache holds, per layer and position, one latent key [c_kv ; k_rope] (kv_lora_rank + qk_rope_head_dim
values) and no V. The naive form expands it to every head's K and V; the absorbed form folds W_UK into
the query and runs MQA over the latent. Both are the spec (kvref/spec/decoder.py); here they are proven
equal to each other and to full recomputation in float64, in every cache layout and storage type that
applies, and the native kernels' attention over a latent cache read in place equals the spec's.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvref
from kvref.errors import CacheError, ShapeError
from kvref.spec import ops as spec_ops
from kvref.tolerance import assert_close

R, DR = 16, 6  # kv_lora_rank, qk_rope_head_dim


def mla_config(q_lora_rank=12, **changes):
    fields = dict(n_layers=2, d_model=32, n_heads=3, n_kv_heads=3, d_ff=40, vocab_size=50, max_seq_len=40,
                  head_dim=14, kv_lora_rank=R, q_lora_rank=q_lora_rank, qk_rope_head_dim=DR, v_head_dim=10)
    return kvref.ModelConfig(**{**fields, **changes})


def run_chunks(model, ids, sizes, **cache_options):
    # ids in executions of `sizes` (cycled) -> logits [T, V] of every position
    cache, out, start, i = model.new_cache(**cache_options), [], 0, 0
    while start < len(ids):
        n = sizes[i % len(sizes)]
        out.append(model.forward(ids[start:start + n], cache, all_logits=True))
        start, i = start + n, i + 1
    return np.concatenate(out), cache


@settings(max_examples=25)
@given(st.lists(st.integers(0, 49), min_size=1, max_size=20), st.lists(st.integers(1, 6), min_size=1, max_size=4),
       st.sampled_from([None, 12]), st.integers(0, 3))
def test_naive_and_absorbed_latent_attention_equal_each_other_and_full_recomputation_in_any_chunking(
        ids, sizes, q_lora_rank, seed):
    absorbed = kvref.Model.random(mla_config(q_lora_rank), seed=seed, dtype="float64", backend="numpy")
    naive = kvref.Model(absorbed.config.replace(mla_form="naive"), absorbed.weights, dtype="float64", backend="numpy")
    full = naive.forward(ids, all_logits=True)  # expanded per-head K/V, one execution
    assert_close(absorbed.forward(ids, all_logits=True), full, "float64", "absorbed vs naive")
    for model in (absorbed, naive):
        cached, _ = run_chunks(model, ids, sizes)
        assert_close(cached, full, "float64", f"{model.config.mla_form} in chunks {sizes}")


LAYOUTS = [{"layout": "contiguous"}, {"layout": "paged", "block_size": 3}, {"layout": "window", "window": 40},
           {"layout": "hybrid"}]


@pytest.mark.parametrize("options", LAYOUTS, ids=lambda o: o["layout"])
@pytest.mark.parametrize("kv_dtype", [None, "float16", "bfloat16", "int8"])
def test_every_layout_of_a_latent_cache_equals_the_contiguous_one_and_stores_the_latent_only(options, kv_dtype):
    model = kvref.Model.random(mla_config(), seed=1, dtype="float64", backend="numpy")
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    plain, reference = run_chunks(model, ids, [4, 1], layout="contiguous", kv_dtype=kv_dtype)
    got, cache = run_chunks(model, ids, [2, 3, 1], kv_dtype=kv_dtype, **options)
    assert_close(got, plain, "float64", f"{options} {kv_dtype}")
    width = {None: 8, "float16": 2, "bfloat16": 2, "int8": 1}[kv_dtype]  # bytes per element (int8 scales below)
    scales = (R + DR) // cache.group_size * 4 if kv_dtype == "int8" else 0
    assert cache.bytes_per_position == model.config.n_layers * ((R + DR) * width + scales)
    for layer in range(model.config.n_layers):
        assert cache.keys(layer).shape == (len(ids), 1, R + DR)
        np.testing.assert_array_equal(cache.values(layer), cache.keys(layer)[..., :R])  # V is c_kv, not stored
        assert_close(cache.keys(layer), reference.keys(layer), "float64", f"layer {layer} latent keys")


def test_a_float32_latent_cache_takes_layers_times_rank_plus_rope_times_4_bytes_per_position():
    config = mla_config()
    model = kvref.Model.random(config, seed=0, dtype="float32", backend="numpy")
    cache = model.new_cache()
    model.forward([1, 2, 3], cache)
    assert cache.bytes_per_position == config.n_layers * (R + DR) * 4 == 176
    assert cache.nbytes == 3 * 176 == kvref.cache_bytes(2, 3, dtype="float32", kv_lora_rank=R, qk_rope_head_dim=DR)
    # DeepSeek-V3: 61 layers x (512 + 64) latent values against 128 heads x (192 + 128) expanded K and V
    assert kvref.cache_bytes(61, 1, dtype="bfloat16", kv_lora_rank=512, qk_rope_head_dim=64) == 61 * 576 * 2
    assert kvref.cache_bytes(61, 1, dtype="int8", kv_lora_rank=512, qk_rope_head_dim=64, group_size=32) == 61 * (
        576 + 18 * 4)


def test_a_context_shift_rotates_only_the_rope_part_of_a_latent_key():
    model = kvref.Model.random(mla_config(), seed=2, dtype="float64", backend="numpy")
    ids = [7, 8, 9, 10, 11, 12, 13]
    cache = model.new_cache()
    model.forward(ids, cache)
    before = cache.keys(0).copy()
    cache.shift(2, keep=1)  # drop positions 1 and 2
    fresh = model.new_cache()
    model.forward([ids[0], *ids[3:]], fresh)  # layer 0's keys depend on the token and position only
    assert_close(cache.keys(0), fresh.keys(0), "float64", "shifted latent keys vs a fresh prefill")
    np.testing.assert_array_equal(cache.keys(0)[1:, :, :R], before[3:, :, :R])  # c_kv untouched, bit for bit


@pytest.mark.parametrize("options", [{}, {"kv_dtype": "int8"}, {"layout": "paged", "block_size": 2},
                                     {"layout": "hybrid", "spare": 0}], ids=str)
def test_a_saved_latent_cache_loads_back_byte_for_byte_and_generation_resumes(options, tmp_path):
    model = kvref.Model.random(mla_config(), seed=3, dtype="float32", backend="numpy")
    cache = model.new_cache(**options)
    model.forward([5, 6, 7, 8, 9], cache)
    cache.save(tmp_path / "latent.kvc")
    loaded = model.load_cache(tmp_path / "latent.kvc")
    for layer in range(2):
        np.testing.assert_array_equal(loaded.keys(layer), cache.keys(layer))
    np.testing.assert_array_equal(model.forward([10], loaded), model.forward([10], cache))


def test_a_latent_cache_refuses_what_a_latent_cannot_be_with_the_reason():
    model = kvref.Model.random(mla_config(), seed=0, backend="numpy")
    with pytest.raises(CacheError, match="stores no V"):
        model.new_cache(k_dtype="float32", v_dtype="float16")
    with pytest.raises(CacheError, match="kivi4"):
        model.new_cache(kv_dtype="kivi4")
    with pytest.raises(CacheError, match="divide kv_lora_rank"):
        model.new_cache(kv_dtype="int8", group_size=11)  # divides R + DR = 22, not R = 16
    with pytest.raises(ShapeError, match="v=None"):
        with model.new_cache().begin(1) as step:
            step.update(0, np.zeros((1, 1, R + DR)), np.zeros((1, 1, R + DR)))
    with pytest.raises(kvref.errors.ConfigError, match="n_kv_heads"):
        mla_config(n_kv_heads=1)


needs_native = pytest.mark.skipif(not kvref.native.available(), reason="the native module is not built")


def native_kernels(isa):
    from kvref.native import ops  # only where the module is built

    return ops.kernels(1, isa)


def isas():
    if not kvref.native.available():
        return ()
    from kvref.native import ops

    return ops.supported_isas()


@needs_native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("options", LAYOUTS[:2] + LAYOUTS[3:], ids=lambda o: o["layout"])  # the window stages writes
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_native_attention_over_a_latent_cache_in_place_equals_the_spec(options, kv_dtype, isa):
    # the absorbed form's MQA: keys R + DR wide, values the keys' first R elements, read where they lie;
    # a latent of 32 values and a RoPE key of 16 take every instruction set's vector kernels (int8: groups of 16)
    rng = np.random.default_rng(4)
    model = kvref.Model.random(mla_config(kv_lora_rank=32, qk_rope_head_dim=16, head_dim=24), seed=4,
                               dtype="float32", backend="c")
    cache = model.new_cache(kv_dtype=kv_dtype, **options)
    model.forward(list(range(1, 12)), cache)
    R, DR = 32, 16
    q = rng.standard_normal((3, 5, R + DR)).astype(np.float32)  # [T, H, R + Dr]
    q_pos, scale = np.arange(8, 11), 24 ** -0.5
    for layer in range(2):
        got = native_kernels(isa).cache_attention(q, q_pos, cache, layer, scale=scale)  # [T, H, R]
        k, positions = cache.keys(layer), cache.layer_positions(layer)
        if kv_dtype == "int8":
            k8, ks, _, _ = cache.read_raw(layer)
            want = spec_ops.attention_int8_keys(q, k8, ks, k[..., :R], q_pos, positions, scale)
        else:
            k = k.astype(np.float32)
            want = spec_ops.attention(q, k, k[..., :R], q_pos, positions, scale)
        assert got.shape == (3, 5, R)
        assert_close(got, want, "float32", f"layer {layer} {options} {kv_dtype}")


@needs_native
@settings(max_examples=20)
@given(st.integers(1, 9), st.integers(1, 4), st.sampled_from([(12, 8), (8, 12), (16, 16), (48, 32), (24, 20)]),
       st.integers(0, 9), st.sampled_from(isas() or ("none",)))
def test_native_attention_with_values_of_another_width_equals_the_spec(S, T, widths, seed, isa):
    # MLA's naive form: per-head keys Dn + Dr wide, values Dv wide, Dv != D either way
    D, Dv = widths
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, 4, D)).astype(np.float32)
    k = rng.standard_normal((S, 2, D)).astype(np.float32)
    v = rng.standard_normal((S, 2, Dv)).astype(np.float32)
    q_pos, k_pos = np.arange(S - T, S) if T <= S else np.arange(T), np.arange(S)
    got = native_kernels(isa).attention(q, k, v, q_pos, k_pos, scale=0.3)
    assert got.shape == (T, 4, Dv)
    assert_close(got, spec_ops.attention(q, k, v, q_pos, k_pos, scale=0.3), "float32", f"D {D} Dv {Dv} {isa}")
    prefix = native_kernels(isa).attention(q, k, k[..., :D // 2], q_pos, k_pos, scale=0.3)  # in place
    assert_close(prefix, spec_ops.attention(q, k, k[..., :D // 2], q_pos, k_pos, scale=0.3), "float32", "prefix")


@needs_native
@pytest.mark.parametrize("options", [{"layout": "paged", "block_size": 4}, {"kv_dtype": "bfloat16"}], ids=str)
def test_an_mla_model_runs_the_fused_c_forward_and_equals_the_spec(options):
    model = kvref.Model.random(mla_config(), seed=5, dtype="float32", backend="c")
    spec = kvref.Model(model.config, model.weights, dtype="float32", backend="numpy")
    cache = model.new_cache(**options)
    assert model.executor(cache).fallback is None  # the latent cache is read and written in place by C
    model.fused.reset_timings()
    ids = [4, 8, 15, 16, 23, 42 % 50]
    got = np.concatenate([model.forward(ids[:4], cache, all_logits=True), model.forward(ids[4:], cache, all_logits=True)])
    assert model.fused.timings()["calls"] == 2
    want = spec.forward(ids, spec.new_cache(**options), all_logits=True)
    assert_close(got, want, "float32", f"fused C vs spec, {options}")
