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
    (dict(n_layers=0), "n_layers=0 must be a positive integer"),
    (dict(vocab_size=-5), "vocab_size=-5 must be a positive integer"),
    (dict(d_ff=2.5), "d_ff=2.5 must be a positive integer"),
    (dict(max_seq_len=True), "max_seq_len=True must be a positive integer"),
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
