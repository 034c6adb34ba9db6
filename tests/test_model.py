"""Model: construction and the checks at its public entry points; failed calls change nothing."""

import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvref
from kvref.errors import BackendError, CacheError, ContextOverflowError, DTypeError, TokenError
from kvref.tolerance import FLOAT32_SAME_POSITION, FLOAT32_SHORT_HISTORY, VISIBLE_CHANGE, assert_close, compare

CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=1, d_ff=64, vocab_size=50, max_seq_len=16)


def test_random_models_are_deterministic_per_seed_and_differ_across_seeds():
    a = kvref.Model.random(CFG, seed=7).forward([1, 2, 3])
    b = kvref.Model.random(CFG, seed=7).forward([1, 2, 3])
    c = kvref.Model.random(CFG, seed=8).forward([1, 2, 3])
    np.testing.assert_array_equal(a, b)
    assert not compare(a, c, VISIBLE_CHANGE).ok


def test_forward_returns_last_position_logits_or_all_of_them():
    model = kvref.Model.random(CFG)
    last = model.forward([1, 2, 3])
    every = model.forward([1, 2, 3], all_logits=True)
    assert last.shape == (50,) and every.shape == (3, 50)
    assert_close(every[-1], last, FLOAT32_SAME_POSITION, "last row vs last only")


def test_model_dtype_and_backend_are_checked():
    with pytest.raises(DTypeError, match="'float16'"):
        kvref.Model.random(CFG, dtype="float16")
    with pytest.raises(BackendError, match="'cuda'"):
        kvref.Model.random(CFG, backend="cuda")
    assert kvref.Model.random(CFG, backend="numpy").backend == "numpy"


def snapshot(cache):
    return cache.length, [cache.keys(i).copy() for i in range(cache.n_layers)], [
        cache.values(i).copy() for i in range(cache.n_layers)]


def assert_unchanged(cache, before):
    length, keys, values = snapshot(cache)
    assert length == before[0]
    for a, b in zip(keys + values, before[1] + before[2]):
        np.testing.assert_array_equal(a, b)


BAD_CALLS = {
    "id above vocab": ([3, 50], TokenError, r"token id 50 at index 1 is outside the vocabulary \[0, 50\)"),
    "negative id": ([-1], TokenError, "token id -1 at index 0"),
    "float ids": ([1.5], TokenError, "must be integers"),
    "empty": ([], TokenError, "non-empty 1-D"),
    "2-D ids": ([[1, 2]], TokenError, "non-empty 1-D"),
    "past max_seq_len": (list(range(14)), ContextOverflowError, r"exceed max_seq_len=16 \(3 already used \+ 14 new\)"),
}


@given(st.sampled_from(sorted(BAD_CALLS)), st.integers(0, 3))
def test_error_paths_leave_the_cache_unchanged(case, prefilled):
    tokens, error, message = BAD_CALLS[case]
    model = kvref.Model.random(CFG, seed=1)
    cache = model.new_cache()
    prefix = [4, 5, 6][:prefilled]
    if prefix:
        model.forward(prefix, cache)
    if case == "past max_seq_len":
        tokens = list(range(CFG.max_seq_len - cache.length + 1))
        message = "exceed max_seq_len=16"
    before = snapshot(cache)
    with pytest.raises(error, match=message):
        model.forward(tokens, cache)
    assert_unchanged(cache, before)
    assert_close(model.forward([7], cache), model.forward(prefix + [7]), FLOAT32_SHORT_HISTORY, "after a failed call")


def test_a_full_cache_fails_before_any_layer_runs_and_keeps_its_contents():
    model = kvref.Model.random(CFG, seed=1)
    cache = model.new_cache(capacity=3)
    model.forward([1, 2], cache)
    before = snapshot(cache)
    with pytest.raises(kvref.CacheFullError):
        model.forward([3, 4], cache)
    assert_unchanged(cache, before)


def test_a_cache_from_another_model_shape_is_refused():
    other = kvref.Model.random(CFG.replace(n_kv_heads=2, n_heads=4)).new_cache()
    with pytest.raises(CacheError, match=r"does not match the model's \(2, 1, 8\)"):
        kvref.Model.random(CFG).forward([1], other)
    with pytest.raises(CacheError, match="expected a KVCache"):
        kvref.Model.random(CFG).forward([1], cache={})


def test_numpy_integer_arrays_are_accepted_as_token_ids():
    model = kvref.Model.random(CFG)
    np.testing.assert_array_equal(model.forward(np.array([1, 2], dtype=np.uint16)), model.forward([1, 2]))


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_prefill_allocates_the_logits_of_its_last_position_only(backend):
    # a long prompt's logits [T, V] would dwarf everything else a prefill allocates (8,000 x 49,152
    # float32: 1.5 GB); without all_logits only the last row is ever computed
    T, V = 128, 8192
    cfg = kvref.ModelConfig(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=V, max_seq_len=T)
    model = kvref.Model.random(cfg, seed=0, backend=backend)
    cache = model.new_cache()
    tracemalloc.start()  # NumPy reports its array buffers to tracemalloc
    try:
        model.forward(np.arange(1, T + 1), cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < T * V * 4 // 4  # [T, V] float32 is 4 MiB; the spec's attention scores [H, T, T] take ~0.6


def test_importing_kvref_and_its_command_leaves_jinja2_unimported():
    # jinja2 costs ~7 MB resident: only a process that renders a chat template pays for it
    code = "import sys, kvref, kvref.tools.cli; print('jinja2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
