"""The contiguous cache and the memory formula."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvref
from kvref.errors import CacheError, CacheFullError, DTypeError, ShapeError
from kvref.tolerance import FLOAT32, QUANTIZED_LOGIT_BOUNDS, assert_close

CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=32)


def test_cache_bytes_reproduces_the_articles_example_of_one_gib():
    assert kvref.cache_bytes(n_layers=32, n_tokens=8192, n_kv_heads=8, head_dim=128, dtype="float16") == 2**30


@given(st.integers(1, 64), st.integers(0, 10_000), st.integers(1, 16), st.integers(1, 256),
       st.sampled_from(["float64", "float32", "float16", "bfloat16", "int8"]))
def test_cache_bytes_is_two_times_layers_tokens_kv_heads_head_dim_bytes(layers, tokens, kv_heads, head_dim, dtype):
    size = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}[dtype]
    assert kvref.cache_bytes(layers, tokens, kv_heads, head_dim, dtype) == 2 * layers * tokens * kv_heads * head_dim * size


def test_cache_bytes_accepts_numpy_dtypes_and_rejects_unknown_names():
    assert kvref.cache_bytes(1, 1, 1, 1, np.float32) == 8
    with pytest.raises(DTypeError, match="float8"):
        kvref.cache_bytes(1, 1, 1, 1, "float8")


@given(st.lists(st.integers(1, 6), min_size=1, max_size=5), st.sampled_from(["float32", "float16", "float64"]))
def test_nbytes_of_a_cache_holding_n_positions_equals_cache_bytes(chunks, kv_dtype):
    model = kvref.Model.random(CFG, seed=0, backend="numpy")
    cache = model.new_cache(kv_dtype=kv_dtype)
    assert cache.nbytes == 0
    for n in chunks:
        model.forward(list(range(n)), cache)
        assert cache.nbytes == kvref.cache_bytes(CFG.n_layers, cache.length, CFG.n_kv_heads, CFG.head_dim, kv_dtype)


def test_kv_is_stored_in_the_model_dtype_unless_kv_dtype_says_otherwise():
    assert kvref.Model.random(CFG, dtype="float64").new_cache().keys(0).dtype == np.float64
    model = kvref.Model.random(CFG)
    assert model.new_cache().keys(0).dtype == np.float32
    assert model.new_cache(kv_dtype="float16").keys(0).dtype == np.float16


def test_float16_cache_stays_close_to_the_float32_cache():
    model = kvref.Model.random(CFG, seed=2)
    tokens = list(range(20))
    a = model.forward(tokens, model.new_cache(), all_logits=True)
    b = model.forward(tokens, model.new_cache(kv_dtype="float16"), all_logits=True)
    # float16 keeps 11 significant bits: relative error 2**-11 per stored K/V element; the stated
    # bound of quantized caches, a fraction of each row's largest logit
    bound = QUANTIZED_LOGIT_BOUNDS["float16"] * np.abs(a).max(axis=-1) + FLOAT32.atol  # [T]
    assert np.all(np.abs(b - a).max(axis=-1) <= bound)
    assert np.mean(np.argmax(a, -1) == np.argmax(b, -1)) >= 0.9


def test_capacity_defaults_to_max_seq_len_and_a_full_cache_refuses_to_append():
    model = kvref.Model.random(CFG)
    assert model.new_cache().capacity == CFG.max_seq_len
    cache = model.new_cache(capacity=4)
    model.forward([1, 2, 3], cache)
    with pytest.raises(CacheFullError, match=r"cannot append 2 positions: the cache holds 3 of 4 \(1 free\)"):
        model.forward([4, 5], cache)
    assert cache.length == 3


def test_new_cache_rejects_bad_layouts_capacities_and_dtypes():
    model = kvref.Model.random(CFG)
    with pytest.raises(CacheError, match="'ring'"):
        model.new_cache(layout="ring")
    with pytest.raises(CacheError, match="capacity=0"):
        model.new_cache(capacity=0)
    with pytest.raises(kvref.ContextOverflowError, match="max_seq_len=32"):
        model.new_cache(capacity=33)
    with pytest.raises(DTypeError):
        model.new_cache(kv_dtype="float8")
    with pytest.raises(CacheError, match="window does not apply to layout 'contiguous'"):
        model.new_cache(window=8)
    with pytest.raises(CacheError, match="group_size=8 applies to int8 K/V"):
        model.new_cache(kv_dtype="float16", group_size=8)
    if kvref.native.available():  # the native attention reads float32/float16; float64 stays in the spec
        with pytest.raises(CacheError, match="kv_dtype 'float64' is not supported by the 'c' backend"):
            kvref.Model.random(CFG, backend="c").new_cache(kv_dtype="float64")


def test_update_rejects_kv_of_the_wrong_shape_and_the_execution_commits_nothing():
    cache = kvref.Model.random(CFG).new_cache()
    for layer, shape, message in ((0, (1, 3, 8), r"expected \[T, Hkv, D\] = \[1, 2, 8\]"),
                                  (0, (2, 2, 8), r"expected \[T, Hkv, D\] = \[1, 2, 8\]"),
                                  (2, (1, 2, 8), "layer 2 out of range")):
        with pytest.raises(ShapeError, match=message):
            with cache.begin([1]) as step:
                step.update(layer, np.zeros(shape), np.zeros(shape))
        assert cache.length == 0 and not cache.executing


def test_truncate_rolls_back_and_generation_resumes_as_if_never_extended():
    model = kvref.Model.random(CFG, seed=4, dtype="float64")
    cache = model.new_cache()
    model.forward([1, 2, 3], cache)
    model.forward([9, 9], cache)  # rejected speculative tokens
    cache.truncate(3)
    resumed = model.forward([4], cache)
    reference = model.forward([1, 2, 3, 4])
    assert_close(resumed, reference, "float64", "after truncate")
    with pytest.raises(CacheError, match="cannot truncate to 5"):
        cache.truncate(5)
    assert cache.length == 4 and cache.capabilities.truncate(4) and not cache.capabilities.truncate(5)


def test_fork_is_independent_of_its_parent():
    model = kvref.Model.random(CFG, seed=5, dtype="float64")
    parent = model.new_cache()
    model.forward([1, 2, 3], parent)
    child = parent.fork()
    a = model.forward([7], child)
    b = model.forward([8], parent)
    assert child.length == parent.length == 4
    assert_close(a, model.forward([1, 2, 3, 7]), "float64", "fork")
    assert_close(b, model.forward([1, 2, 3, 8]), "float64", "parent")


def test_stored_kv_is_read_only_through_the_accessors():
    model = kvref.Model.random(CFG)
    cache = model.new_cache()
    model.forward([1], cache)
    with pytest.raises(ValueError):
        cache.keys(0)[0, 0, 0] = 1.0


def test_layout_report_rows_match_what_real_caches_hold():
    from kvref.cache import layout_report, layout_rows

    config = CFG.replace(layer_windows=(4, None))  # a window layer and a global one: hybrid rows too
    model = kvref.Model.random(config, seed=0, backend="numpy")
    rows = layout_rows(config, tokens=20, batch=3, block_size=8, window=6, sinks=2, group_size=4, spare=2)
    assert {r["layout"].split()[0] for r in rows} == {"contiguous", "paged", "window", "hybrid"}
    assert {r["k_dtype"] for r in rows} == {"float32", "float16", "bfloat16", "int8/g4", "kivi4/g4"}
    for row in rows:
        k, v = (d.split("/")[0] for d in (row["k_dtype"], row["v_dtype"]))
        layout = row["layout"].split()[0]
        options = {"paged": {"block_size": 8}, "window": {"window": 6, "sinks": 2},
                   "hybrid": {"spare": 2, "capacity": 20}}.get(layout, {})
        grouped = {"int8", "kivi4"} & {k, v}
        cache = model.new_cache(layout=layout, k_dtype=k, v_dtype=v, group_size=4 if grouped else None, **options)
        model.forward(list(range(20)), cache)
        assert row["bytes_per_position"] == cache.bytes_per_position
        held = cache.allocated_nbytes if layout == "paged" else cache.nbytes
        assert row["bytes_per_sequence"] == held and row["bytes_total"] == 3 * held
    assert rows[0]["formula"] == "2 x 2 x 2 x 8 x 4"  # float32: the articles' formula
    text = layout_report(CFG, tokens=20, batch=3)
    assert "window (W=20, sinks 4)" in text and "int8/g8" in text and "hybrid (" not in text


def test_the_layout_report_lines_its_columns_up():
    from kvref.cache import layout_report

    gemma_like = kvref.ModelConfig(n_layers=18, d_model=640, n_heads=4, n_kv_heads=1, head_dim=256, d_ff=2048,
                                   vocab_size=64, max_seq_len=32768, layer_windows=((512,) * 5 + (None,)) * 3)
    lines = layout_report(gemma_like, tokens=4096).splitlines()
    header, rule = lines[1], lines[2]
    table = [line for line in lines[3:] if line.startswith(("contiguous ", "paged (", "window (", "hybrid ("))]
    assert len(table) == 6 * 4 - 2  # every K/V type in every layout, but kivi4 K in a ring
    assert set(rule) == {"-"} and len(rule) == max(map(len, [header, *table]))
    # a left-aligned column starts where its header does; a right-aligned one ends where its header does
    for name in ("K", "V", "formula"):
        start = header.index(f"  {name} ") + 2
        assert all(line[start - 2:start] == "  " and line[start] != " " for line in table), name
    for name in ("bytes/position", "positions held", "per sequence", "x 1"):
        end = header.index(name) + len(name)
        assert all(line[end - 1] != " " and line[end:end + 2] in ("  ", "") for line in table), name
    assert any("576 / 4,096" in line and line.startswith("hybrid") for line in table)
