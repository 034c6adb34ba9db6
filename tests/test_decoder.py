"""The invariants that make a KV cache correct, checked on random models (float64 is the oracle)."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import kvref
from kvref.spec import ops as spec
from kvref.tolerance import FLOAT64, VISIBLE_CHANGE, assert_close, compare
from tests.conftest import chunkings, configs, moe_configs, token_lists


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


# ---- mixtures of experts ------------------------------------------------------------------------

@given(st.data())
def test_cached_moe_logits_in_any_chunking_equal_full_recomputation_for_every_router(data):
    cfg = data.draw(moe_configs())
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), dtype="float64")
    tokens = data.draw(token_lists(cfg, max_size=24))
    cached, _ = prefill_in_chunks(model, tokens, data.draw(chunkings(len(tokens))))
    assert_close(cached, model.forward(tokens, cache=None, all_logits=True), "float64", "MoE cached vs full")


def route_by_hand(cfg, logits, selection_bias):
    # one position at a time, with Python's sort: [X] -> (expert ids best first, weights)
    X, scores = len(logits), [float(spec.sigmoid(z)) for z in logits]
    if cfg.router_score == "softmax":
        scores = list(np.exp(logits - max(logits)) / np.sum(np.exp(logits - max(logits))))
    choice = [s + (0 if selection_bias is None else b) for s, b in zip(scores, selection_bias if selection_bias
                                                                      is not None else [0] * X)]
    size = X // cfg.n_expert_groups
    groups = [sorted(choice[g * size:(g + 1) * size], reverse=True) for g in range(cfg.n_expert_groups)]
    group_scores = [sum(g[:2]) if cfg.expert_group_score == "top2_sum" else g[0] for g in groups]
    kept = sorted(range(cfg.n_expert_groups), key=lambda g: -group_scores[g])[:cfg.n_expert_groups_used]
    candidates = [e for e in range(X) if cfg.n_expert_groups == 1 or e // size in kept]
    chosen = sorted(candidates, key=lambda e: -choice[e])[:cfg.n_experts_used]
    weights = [scores[e] for e in chosen]
    total = sum(weights) if cfg.norm_topk_prob else 1.0
    return chosen, [w / total * cfg.routed_scaling_factor for w in weights]


def expert_mlp(cfg, lw, e, h):
    # [E] -> [E]: expert e alone, dense, as one MLP of its own
    def bias(b):
        return 0 if b is None else b[e]

    gate = lw.experts_gate[e] @ h + bias(lw.experts_gate_bias)
    up = lw.experts_up[e] @ h + bias(lw.experts_up_bias)
    return lw.experts_down[e] @ (spec.silu(gate) * up) + bias(lw.experts_down_bias)


@given(st.data())
def test_a_mixture_is_the_weighted_sum_of_the_chosen_experts_mlps_for_every_router(data):
    cfg = data.draw(moe_configs()).replace(first_dense_layers=0)
    lw = kvref.weights.random_weights(cfg, seed=data.draw(st.integers(0, 2**16)), dtype="float64").layers[0]
    h = np.random.default_rng(data.draw(st.integers(0, 2**16))).standard_normal((data.draw(st.integers(1, 6)),
                                                                                  cfg.d_model))
    got = kvref.spec.decoder.moe(spec, cfg, lw, h)  # [T, E]
    for t in range(h.shape[0]):
        logits = lw.router @ h[t] + (0 if lw.router_bias is None else lw.router_bias)
        chosen, weights = route_by_hand(cfg, logits, lw.expert_selection_bias)
        want = sum(w * expert_mlp(cfg, lw, e, h[t]) for e, w in zip(chosen, weights))
        if cfg.shared_expert_d_ff:
            want = want + lw.shared_down @ (spec.silu(lw.shared_gate @ h[t]) * (lw.shared_up @ h[t]))
        np.testing.assert_allclose(got[t], want, rtol=1e-10, atol=1e-10)


def router_config(**fields):
    return kvref.ModelConfig(n_layers=1, d_model=4, n_heads=1, n_kv_heads=1, d_ff=4, vocab_size=8, max_seq_len=8,
                             **{"n_experts": 4, "n_experts_used": 2, **fields})


def route(config, logits, selection_bias):
    return spec.route(logits, selection_bias, kvref.spec.decoder.router(config))


def test_each_router_variant_chooses_and_weights_as_its_model_does():
    logits = np.array([[0.0, 1.0, 2.0, 3.0]])
    softmax = np.exp(logits[0]) / np.exp(logits[0]).sum()
    experts, weights = route(router_config(), logits, None)  # Qwen3-MoE without renormalising, DeepSeek-V2
    assert experts.tolist() == [[3, 2]] and np.allclose(weights, [softmax[[3, 2]]])
    experts, weights = route(router_config(norm_topk_prob=True), logits, None)  # Mixtral, gpt-oss
    assert np.allclose(weights, [[np.e / (np.e + 1), 1 / (np.e + 1)]])
    _, scaled = route(router_config(routed_scaling_factor=2.5), logits, None)
    assert np.allclose(scaled, [2.5 * softmax[[3, 2]]])
    # DeepSeek-V3: sigmoid scores; the selection bias chooses expert 0, its unbiased score weights it
    experts, weights = route(router_config(router_score="sigmoid", expert_selection_bias=True, n_experts_used=1),
                             logits, np.array([5.0, 0.0, 0.0, 0.0]))
    assert experts.tolist() == [[0]] and np.allclose(weights, [[0.5]])


def test_grouped_top_k_keeps_the_best_groups_by_their_two_best_or_their_best_score():
    choice = np.array([[0.9, 0.01, 0.5, 0.45]])  # groups {0, 1} and {2, 3}
    grouped = dict(n_expert_groups=2, n_expert_groups_used=1)
    by_top2 = spec.best_groups_only(kvref.spec.decoder.router(router_config(**grouped)), choice)
    assert by_top2.tolist() == [[-np.inf, -np.inf, 0.5, 0.45]]  # 0.95 > 0.91
    by_max = spec.best_groups_only(kvref.spec.decoder.router(router_config(**grouped, expert_group_score="max")),
                                 choice)
    assert by_max.tolist() == [[0.9, 0.01, -np.inf, -np.inf]]  # 0.9 > 0.5
    sigmoid_logits = np.log(choice / (1 - choice))  # the router logits whose sigmoid scores are `choice`
    experts, _ = route(router_config(**grouped, router_score="sigmoid"), sigmoid_logits, None)
    assert sorted(experts[0].tolist()) == [2, 3]  # the best single expert (0) is in the group left out


def test_matmul_experts_sends_each_row_through_its_own_experts_matrix_only():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 3)), rng.standard_normal((4, 2, 3))
    w[1] = np.nan  # an expert no row names is never read
    ids = np.array([2, 0, 2, 3, 0])
    np.testing.assert_allclose(spec.matmul_experts(x, w, ids), np.stack([w[e] @ x[r] for r, e in enumerate(ids)]))
