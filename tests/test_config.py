import pytest

import kvref
from kvref.errors import ConfigError

BASE = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256, max_seq_len=128)


def test_head_dim_defaults_to_d_model_over_n_heads_and_can_be_decoupled():
    assert kvref.ModelConfig(**BASE).head_dim == 16
    assert kvref.ModelConfig(**BASE, head_dim=32).head_dim == 32


def test_config_is_frozen():
    cfg = kvref.ModelConfig(**BASE)
    with pytest.raises(AttributeError):
        cfg.n_layers = 3


@pytest.mark.parametrize("change, message", [
    (dict(n_heads=6, n_kv_heads=4, head_dim=16), "n_heads=6 must be a multiple of n_kv_heads=4"),
    (dict(n_kv_heads=3), "n_heads=4 must be a multiple of n_kv_heads=3"),
    (dict(head_dim=7), "head_dim=7 must be even"),
    (dict(d_model=30, n_heads=4, n_kv_heads=1), "d_model=30 is not divisible by n_heads=4"),
    (dict(n_layers=0), r"n_layers=0 must be an integer in \[1, 1024\]"),
    (dict(vocab_size=-5), r"vocab_size=-5 must be an integer in \[1, 16777216\]"),
    (dict(d_ff=2.5), r"d_ff=2.5 \(float\) must be an integer"),
    (dict(max_seq_len=True), r"max_seq_len=True \(bool\) must be an integer"),
    (dict(vocab_size="64"), r"vocab_size='64' \(str\) must be an integer"),
    (dict(n_layers=2**31 - 1), r"n_layers=2147483647 must be an integer in \[1, 1024\]"),
    (dict(max_seq_len=2**64), r"max_seq_len=18446744073709551616 must be an integer in \[1, 1073741824\]"),
    (dict(head_dim=2**20), r"head_dim=1048576 must be an integer in \[1, 4096\]"),
    (dict(rope_theta=0.0), "rope_theta=0.0 must be a positive number"),
    (dict(norm_eps=-1e-6), "norm_eps=-1e-06 must be a positive number"),
    (dict(tie_embeddings="yes"), "tie_embeddings='yes' must be True or False"),
])
def test_invalid_configs_raise_config_error_naming_the_value(change, message):
    with pytest.raises(ConfigError, match=message):
        kvref.ModelConfig(**{**BASE, **change})


def test_group_size_names_mha_gqa_and_mqa():
    assert kvref.ModelConfig(**{**BASE, "n_kv_heads": 4}).group_size == 1  # MHA
    assert kvref.ModelConfig(**BASE).group_size == 2  # GQA
    assert kvref.ModelConfig(**{**BASE, "n_kv_heads": 1}).group_size == 4  # MQA


@pytest.mark.parametrize("fields, message", [
    ({"activation": "relu"}, "activation='relu' is unknown"),
    ({"layer_windows": (4, None)}, "layer_windows=.* must be a tuple of 3 entries"),
    ({"layer_windows": (4, 0, None)}, "must be a tuple of 3 entries"),
    ({"attention_scale": -1.0}, "attention_scale=-1.0 must be a positive finite number"),
    ({"embedding_scale": float("inf")}, "embedding_scale=inf"),
    ({"qk_norm": 1}, "qk_norm=1 must be True or False"),
    ({"attention_sinks": "yes"}, "attention_sinks='yes' must be True or False"),
    ({"rope_scaling": ("yarn", 32.0, 32.0, 1.0, 4096, 1.3)}, "rope_scaling=.* must be"),
    ({"rope_scaling": ("yarn", 32.0, 32.0, 1.0, 4096, 1.3, "no")}, "truncate: True or False"),
    ({"rope_scaling": ("yarn", 32.0, 32.0, 1.0, 4096, -1.0, False)}, "rope_scaling=.* must be"),
])
def test_family_fields_are_validated(fields, message):
    with pytest.raises(ConfigError, match=message):
        kvref.ModelConfig(n_layers=3, d_model=8, n_heads=2, n_kv_heads=1, d_ff=8, vocab_size=8, max_seq_len=8, **fields)


def test_family_fields_name_what_differs_from_llama_and_the_layers_read_them():
    base = dict(n_layers=3, d_model=8, n_heads=2, n_kv_heads=1, d_ff=8, vocab_size=8, max_seq_len=8)
    assert kvref.ModelConfig(**base).family_fields() == {}
    gemma = kvref.ModelConfig(**base, layer_windows=(4, 4, None), rope_theta=1e6, rope_local_theta=1e4, qk_norm=True)
    assert gemma.family_fields() == {"qk_norm": True, "layer_windows": (4, 4, None), "rope_local_theta": 1e4}
    assert [gemma.window(i) for i in range(3)] == [4, 4, None]
    assert [gemma.layer_rope_theta(i) for i in range(3)] == [1e4, 1e4, 1e6]


def test_yarn_attention_factor_multiplies_the_score_scale_by_its_square():
    base = dict(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=8, vocab_size=8, max_seq_len=8)
    yarn = ("yarn", 32.0, 32.0, 1.0, 4096, 1.5, False)
    assert kvref.ModelConfig(**base).score_scale is None  # 1/sqrt(head_dim), as the kernels default it
    assert kvref.ModelConfig(**base, rope_scaling=yarn).score_scale == 8 ** -0.5 * 2.25
    assert kvref.ModelConfig(**base, rope_scaling=yarn, attention_scale=0.5).score_scale == 0.5 * 2.25
    assert kvref.ModelConfig(**base, rope_scaling=("linear", 2.0), attention_scale=0.5).score_scale == 0.5


MOE = dict(BASE, n_experts=8, n_experts_used=2)


@pytest.mark.parametrize("fields, message", [
    (dict(n_experts_used=0), r"n_experts_used=0 must be in 1..n_experts=8"),
    (dict(n_experts_used=9), r"n_experts_used=9 must be in 1..n_experts=8"),
    (dict(n_experts=0, n_experts_used=0, norm_topk_prob=True), r"\['norm_topk_prob'\] describe a mixture of experts"),
    (dict(n_experts=5000), r"n_experts=5000 must be an integer in \[0, 4096\]"),
    (dict(router_score="relu"), "router_score='relu' is unknown"),
    (dict(expert_group_score="mean", n_expert_groups=2), "expert_group_score='mean' is unknown"),
    (dict(n_expert_groups=3), "n_expert_groups=3 must divide n_experts=8"),
    (dict(n_expert_groups=4, n_expert_groups_used=5), "n_expert_groups_used=5 groups"),
    (dict(n_expert_groups=4, n_expert_groups_used=1, n_experts_used=3), "at least n_experts_used=3 experts"),
    (dict(n_expert_groups_used=2), "n_expert_groups_used=2 needs n_expert_groups > 1"),
    (dict(n_expert_groups=8, n_experts_used=1), "expert_group_score='top2_sum' needs groups of at least 2 experts"),
    (dict(first_dense_layers=3), r"first_dense_layers=3 must be an integer in \[0, 2\]"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0 must be a positive finite number"),
    (dict(expert_d_ff=0), r"expert_d_ff=0 must be an integer in \[1, 1048576\]"),
    (dict(router_bias=1), "router_bias=1 must be True or False"),
])
def test_moe_fields_are_validated_and_every_router_they_describe_is_computable(fields, message):
    with pytest.raises(ConfigError, match=message):
        kvref.ModelConfig(**{**MOE, **fields})


def test_moe_layers_are_the_ones_after_the_dense_first_layers():
    config = kvref.ModelConfig(**MOE, first_dense_layers=1, expert_d_ff=32)
    assert [config.moe_layer(i) for i in range(2)] == [False, True]
    assert config.experts_d_ff == 32 and kvref.ModelConfig(**MOE).experts_d_ff == BASE["d_ff"]
    assert not kvref.ModelConfig(**BASE).moe_layer(1)
