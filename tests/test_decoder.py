"""The invariants that make a KV cache correct, checked on random models (float64 is the oracle)."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import kvref
from kvref.spec import ops as spec
from kvref.tolerance import FLOAT64, VISIBLE_CHANGE, assert_close, compare
from tests.conftest import chunkings, configs, token_lists


def prefill_in_chunks(model, tokens, sizes):
    """Feed `tokens` through one cache in consecutive chunks; return logits of every position."""
    cache = model.new_cache()
    out, start = [], 0
    for n in sizes:
        out.append(model.forward(tokens[start:start + n], cache, all_logits=True))
        start += n
    assert cache.length == len(tokens)
    return np.concatenate(out), cache


@given(st.data())
def test_cached_logits_equal_full_recomputation(data):
    cfg = data.draw(configs())
    dtype = data.draw(st.sampled_from(["float64", "float32"]))
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), dtype=dtype)
    tokens = data.draw(token_lists(cfg))
    cached, _ = prefill_in_chunks(model, tokens, data.draw(chunkings(len(tokens))))
    full = model.forward(tokens, cache=None, all_logits=True)
    assert cached.dtype == np.dtype(dtype)
    assert_close(cached, full, dtype, "cached vs full recomputation")


@given(st.data())
def test_prefill_in_one_chunk_equals_any_chunking_equals_token_by_token(data):
    cfg = data.draw(configs())
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), dtype="float64")
    tokens = data.draw(token_lists(cfg))
    one, one_cache = prefill_in_chunks(model, tokens, [len(tokens)])
    chunked, chunked_cache = prefill_in_chunks(model, tokens, data.draw(chunkings(len(tokens))))
    stepwise, step_cache = prefill_in_chunks(model, tokens, [1] * len(tokens))
    assert_close(chunked, one, "float64", "chunked vs one chunk")
    assert_close(stepwise, one, "float64", "token by token vs one chunk")
    for layer in range(cfg.n_layers):  # the stored K/V agree too, not just the logits
        for other in (chunked_cache, step_cache):
            np.testing.assert_allclose(other.keys(layer), one_cache.keys(layer), rtol=0, atol=FLOAT64.atol)
            np.testing.assert_allclose(other.values(layer), one_cache.values(layer), rtol=0, atol=FLOAT64.atol)


@given(st.data())
def test_appending_positions_never_changes_earlier_logits_or_kv(data):
    cfg = data.draw(configs())
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), dtype="float64")
    prefix = data.draw(token_lists(cfg, max_size=32))
    suffix = data.draw(token_lists(cfg, max_size=32))
    short = model.forward(prefix, all_logits=True)
    long = model.forward(prefix + suffix, all_logits=True)
    # causality is exact in the math; only the association order of the sums may differ
    assert_close(long[: len(prefix)], short, "float64", "earlier logits after appending")
    cache_short, cache_long = model.new_cache(), model.new_cache()
    model.forward(prefix, cache_short)
    model.forward(prefix + suffix, cache_long)
    for layer in range(cfg.n_layers):
        np.testing.assert_allclose(cache_long.keys(layer)[: len(prefix)], cache_short.keys(layer),
                                   atol=FLOAT64.atol, rtol=0)
        np.testing.assert_allclose(cache_long.values(layer)[: len(prefix)], cache_short.values(layer),
                                   atol=FLOAT64.atol, rtol=0)


@given(st.data())
def test_changing_a_later_token_never_changes_earlier_logits(data):
    cfg = data.draw(configs(max_layers=2))
    model = kvref.Model.random(cfg, seed=0, dtype="float64")
    tokens = data.draw(token_lists(cfg, min_size=2, max_size=24))
    i = data.draw(st.integers(1, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = (tokens[i] + 1) % cfg.vocab_size
    a = model.forward(tokens, all_logits=True)
    b = model.forward(changed, all_logits=True)
    assert_close(b[:i], a[:i], "float64", "positions before the changed token")
    assert not compare(b[i], a[i], VISIBLE_CHANGE).ok  # the change is seen from its own position on


def arrays_held(obj, seen=None):
    """Every ndarray reachable from a kvref object's attributes (through containers and other kvref
    objects), each once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            yield from arrays_held(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from arrays_held(item, seen)
    elif type(obj).__module__.startswith("kvref.") and hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            yield from arrays_held(item, seen)


def test_cache_stores_k_and_v_per_layer_and_kv_head_never_q():
    cfg = kvref.ModelConfig(n_layers=3, d_model=32, n_heads=8, n_kv_heads=2, d_ff=64, vocab_size=50, max_seq_len=16)
    L, H, Hkv, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    model = kvref.Model.random(cfg, seed=1, dtype="float64", backend="numpy")
    tokens = [1, 2, 3, 4, 5]
    cache = model.new_cache()
    model.forward(tokens, cache)
    # layer 0 holds exactly its K (after RoPE) and V of the five positions, as the decoder computes them
    lw = model.weights.layers[0]
    h = spec.rms_norm(spec.embed(model.weights.tok_embeddings, tokens), lw.attn_norm, cfg.norm_eps)  # [5, E]
    k = spec.rope(spec.matmul(h, lw.wk).reshape(5, Hkv, D), np.arange(5), cfg.rope_theta)  # [5, Hkv, D]
    v = spec.matmul(h, lw.wv).reshape(5, Hkv, D)  # [5, Hkv, D]
    np.testing.assert_array_equal(cache.keys(0), k)
    np.testing.assert_array_equal(cache.values(0), v)
    for layer in range(L):
        assert cache.keys(layer).shape == cache.values(layer).shape == (5, Hkv, D)
    # nothing the cache holds is shaped like Q ([.., H, D] with H = 4 Hkv), and its per-position
    # arrays take exactly the bytes of K and V for every slot: 2 x layers x capacity x Hkv x D x 8
    held = list(arrays_held(cache))
    assert not [a.shape for a in held if a.shape[-2:] == (H, D)]
    per_position = [a for a in held if a.ndim >= 3]
    assert sum(a.nbytes for a in per_position) == 2 * L * cache.capacity * Hkv * D * 8 == cache.allocated_nbytes
    assert cache.nbytes == kvref.cache_bytes(L, 5, Hkv, D, "float64")


def test_float32_run_agrees_with_the_float64_oracle():
    cfg = kvref.ModelConfig(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256, max_seq_len=128)
    tokens = list(np.random.default_rng(0).integers(0, 256, 48))
    f32 = kvref.Model.random(cfg, seed=3, dtype="float32").forward(tokens, all_logits=True)
    f64 = kvref.Model.random(cfg, seed=3, dtype="float64").forward(tokens, all_logits=True)
    # the float32 weights are the float64 weights rounded once: same model up to float32 rounding
    assert_close(f32, f64, "float32", "float32 model vs float64 oracle")


def test_tied_embeddings_share_one_matrix_and_untied_do_not():
    base = dict(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, vocab_size=40, max_seq_len=8)
    tied = kvref.Model.random(kvref.ModelConfig(**base, tie_embeddings=True), seed=0)
    untied = kvref.Model.random(kvref.ModelConfig(**base, tie_embeddings=False), seed=0)
    assert tied.weights.output is tied.weights.tok_embeddings
    assert untied.weights.output is not untied.weights.tok_embeddings
    assert untied.weights.output.shape == (40, 16)


def test_a_nan_embedding_at_a_later_position_never_reaches_earlier_logits():
    # issue 16: the spec's masked product formed 0 x NaN, so position 0's logits were NaN when
    # position 1's embedding was; on both backends position 0 is untouched and position 1 is NaN
    cfg = kvref.ModelConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, vocab_size=40, max_seq_len=8)
    weights = kvref.weights.random_weights(cfg, seed=0)
    weights.tok_embeddings[7, 3] = np.nan
    for backend in ("numpy", *(("c",) if kvref.native.available() else ())):
        model = kvref.Model(cfg, weights, backend=backend)
        with np.errstate(invalid="ignore"):
            logits = model.forward([5, 7, 5], all_logits=True)
        assert np.isfinite(logits[0]).all() and np.isnan(logits[1:]).all()
        assert_close(logits[0], kvref.Model.random(cfg, seed=0, backend=backend).forward([5]), "float32", backend)
