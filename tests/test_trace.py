import kvref
from kvref import trace

CFG = kvref.ModelConfig(n_layers=3, d_model=48, n_heads=6, n_kv_heads=2, d_ff=80, vocab_size=100, max_seq_len=64)


def test_projection_flops_are_two_per_weight_per_position():
    model = kvref.Model.random(CFG)
    layer = model.weights.layers[0]
    per_layer = sum(w.size for w in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down))
    assert trace.projection_flops(CFG, 5, 2) == 2 * (5 * 3 * per_layer + 2 * model.weights.output.size)


def test_a_mixtures_projection_flops_count_the_router_and_the_experts_a_position_runs_only():
    config = CFG.replace(n_experts=8, n_experts_used=2, expert_d_ff=16, first_dense_layers=1, shared_expert_d_ff=8)
    model = kvref.Model.random(config)
    dense, moe = model.weights.layers[0], model.weights.layers[1]
    attention = sum(w.size for w in (dense.wq, dense.wk, dense.wv, dense.wo))
    dense_mlp = sum(w.size for w in (dense.w_gate, dense.w_up, dense.w_down))
    one_expert = sum(w[0].size for w in (moe.experts_gate, moe.experts_up, moe.experts_down))
    moe_mlp = moe.router.size + 2 * one_expert + sum(w.size for w in (moe.shared_gate, moe.shared_up, moe.shared_down))
    per_position = 3 * attention + dense_mlp + 2 * moe_mlp
    assert trace.projection_flops(config, 5, 2) == 2 * (5 * per_position + 2 * model.weights.output.size)


def test_attention_flops_count_every_visible_key_once_per_head_and_layer():
    # positions 4, 5, 6 see 5, 6, 7 keys: 18 q.k dot products and 18 weighted V rows per head and layer
    assert trace.attention_flops(CFG, 4, 3) == 3 * 6 * 18 * 2 * 2 * CFG.head_dim


def test_a_prefill_in_chunks_costs_the_same_flops_as_one_prefill():
    whole = trace.execution(CFG, 0, 10, 0)
    parts = [trace.execution(CFG, 0, 4, 0), trace.execution(CFG, 4, 10, 4)]
    assert whole.attention_flops == sum(p.attention_flops for p in parts)
    assert whole.projection_flops + trace.projection_flops(CFG, 0, 1) == sum(p.projection_flops for p in parts)


def test_without_a_cache_flops_grow_quadratically_and_with_it_linearly():
    def run(n_new, use_cache):
        executions = []
        model = kvref.Model.random(CFG)
        list(kvref.generate(model, [1, 2], n_new, use_cache=use_cache, executions=executions))
        return trace.totals(executions)

    cached = [run(n, True)["projection_flops"] for n in (8, 16, 32)]
    uncached = [run(n, False)["projection_flops"] for n in (8, 16, 32)]
    assert cached[2] - cached[1] == 2 * (cached[1] - cached[0])  # constant cost per decode step
    assert uncached[2] - uncached[1] > 3 * (uncached[1] - uncached[0])  # cost per step grows with length


LATENT_CFG = kvref.ModelConfig(n_layers=2, d_model=48, n_heads=4, n_kv_heads=4, d_ff=80, vocab_size=100, max_seq_len=64,
                               head_dim=12, kv_lora_rank=20, q_lora_rank=16, qk_rope_head_dim=4, v_head_dim=10)


def test_mla_projection_flops_are_two_per_weight_per_position_absorbed():
    model = kvref.Model.random(LATENT_CFG)
    layer = model.weights.layers[0]
    per_layer = sum(w.size for w in (layer.wq_a, layer.wq, layer.wkv_a, layer.wkv_b, layer.wo, layer.w_gate,
                                     layer.w_up, layer.w_down))  # wkv_b: W_UK into the query, W_UV after
    assert trace.projection_flops(LATENT_CFG, 5, 2) == 2 * (5 * 2 * per_layer + 2 * model.weights.output.size)


def test_an_absorbed_decode_step_reads_the_latent_keys_and_a_naive_one_every_heads_k_and_v():
    read = trace.latent_read_bytes(LATENT_CFG, 100, 2)
    assert read == {"absorbed": 2 * 100 * (20 + 4) * 2, "naive": 2 * 100 * 4 * (12 + 10) * 2}
    # per key and head: R + Dr multiply-adds for the score, R for the value sum
    assert trace.attention_flops(LATENT_CFG, 0, 1) == 2 * 4 * 2 * (2 * 20 + 4)
