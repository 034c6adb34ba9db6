"""The hybrid layout (kvref/cache/hybrid.py): window layers keep rings, and nothing a query reads is lost.

Every operation the layout allows is exact: any chunking equals the contiguous cache (which keeps
every position) bit for bit, an abort restores the rings, fork/save/load keep what they hold, a
truncate is allowed exactly when the rings still hold every key the next query reads. What it
refuses, it refuses with a CacheError that says why.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvref
from kvref.cache import HybridCache, fileformat
from kvref.cache.hybrid import DEFAULT_SPARE
from kvref.errors import CacheError, CacheFullError
from kvref.tolerance import assert_close
from tests.conftest import chunkings, configs, token_lists
from tests.test_cache_layouts import run_chunks


BACKENDS = ["numpy", "c"] if kvref.native.available() else ["numpy"]


@st.composite
def window_models(draw, backends=("numpy",)):
    """A small random model whose layers mix sliding windows (1..6 positions) and global attention:
    float64 on the spec, float32 on the native path (the fused C forward over the rings in place)."""
    cfg = draw(configs(max_layers=3, max_seq_len=48))
    windows = tuple(draw(st.one_of(st.none(), st.integers(1, 6))) for _ in range(cfg.n_layers))
    cfg = dataclasses.replace(cfg, layer_windows=windows)
    backend = draw(st.sampled_from(backends))
    return kvref.Model.random(cfg, seed=draw(st.integers(0, 2**16)), dtype="float64" if backend == "numpy" else
                              "float32", backend=backend)


def held(cache, layer):
    # what a layer holds: (positions, K, V) decoded
    k, v = cache.read(layer)
    return cache.layer_positions(layer), k, v


@settings(max_examples=60, deadline=None)
@given(window_models(), st.data())
def test_hybrid_in_any_chunking_equals_the_contiguous_cache(model, data):
    # equal up to float64 rounding: a ring layer's attention sums over fewer (masked) keys, in another order
    tokens = data.draw(token_lists(model.config, max_size=30))
    sizes = data.draw(chunkings(len(tokens)))
    reference = model.new_cache(layout="contiguous")
    expected = run_chunks(model, reference, tokens, [len(tokens)])
    cache = model.new_cache(layout="hybrid", spare=data.draw(st.integers(0, 3)))
    assert_close(run_chunks(model, cache, tokens, sizes), expected, "float64", f"chunks {sizes}")
    for layer in range(model.config.n_layers):
        positions, k, v = held(cache, layer)
        ring = cache.rings[layer]
        assert list(positions) == list(range(len(tokens)))[-ring if ring else 0:]
        assert_close(k, reference.keys(layer)[positions], "float64", f"layer {layer} K")
        assert_close(v, reference.values(layer)[positions], "float64", f"layer {layer} V")


def test_a_window_layer_keeps_a_ring_of_window_plus_spare_and_nbytes_counts_what_is_held():
    cfg = kvref.ModelConfig(n_layers=3, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8, vocab_size=11,
                            max_seq_len=40, layer_windows=(5, None, 3))
    model = kvref.Model.random(cfg, seed=1, backend="numpy")
    cache = model.new_cache(spare=2)
    assert cache.layout == "hybrid" and cache.rings == (7, 0, 5)
    model.forward(list(range(11)) * 2, cache)  # 22 positions
    assert [len(cache.layer_positions(layer)) for layer in range(3)] == [7, 22, 5]
    assert list(cache.layer_positions(2)) == list(range(17, 22))
    per_row = 2 * 1 * 4 * 4  # K and V, 1 kv head x head_dim 4 x float32
    assert cache.nbytes == per_row * (7 + 22 + 5)
    assert cache.allocated_nbytes == per_row * (7 + 40 + 5)
    assert cache.stats()["layer_positions_held"] == [7, 22, 5]
    assert model.new_cache(layout="contiguous").layout == "contiguous"


def test_gemma3_270m_at_32k_positions_keeps_5_5_times_fewer_rows_than_a_full_cache():
    # Gemma 3 270M: 18 layers, every 6th global, windows of 512, one kv head of 256, f16 K/V
    windows = tuple(None if (layer + 1) % 6 == 0 else 512 for layer in range(18))
    for tokens, ratio in ((4096, 3.52), (32768, 5.52)):
        cache = HybridCache(18, 1, 256, tokens, windows, "float16")
        full = kvref.cache.cache_bytes(18, tokens, 1, 256, "float16")
        assert cache.allocated_nbytes == kvref.cache.cache_bytes(1, 3 * tokens + 15 * (512 + DEFAULT_SPARE), 1, 256,
                                                                 "float16")
        assert full / cache.allocated_nbytes == pytest.approx(ratio, abs=0.01)


@settings(max_examples=40, deadline=None)
@given(window_models(), st.data())
def test_an_aborted_execution_leaves_every_ring_as_it_was(model, data):
    tokens = data.draw(token_lists(model.config, min_size=2, max_size=30))
    cut = data.draw(st.integers(1, len(tokens) - 1))
    cache = model.new_cache(layout="hybrid", spare=data.draw(st.integers(0, 3)))
    model.forward(tokens[:cut], cache)
    before = [held(cache, layer) for layer in range(model.config.n_layers)]
    stored = [a.copy() for _, a in cache.store.arrays()]
    fail_at = data.draw(st.integers(0, model.config.n_layers - 1))
    with pytest.raises(RuntimeError):
        with cache.begin(tokens[cut:]) as execution:
            for layer in range(fail_at + 1):  # layers before the failure have overwritten ring slots
                k = np.ones((execution.n_new, model.config.n_kv_heads, model.config.head_dim))
                execution.update(layer, k, -k)
            raise RuntimeError("a kernel failed")
    assert cache.next_position == cut
    for layer, (positions, k, v) in enumerate(before):
        p, k2, v2 = held(cache, layer)
        np.testing.assert_array_equal(p, positions)
        np.testing.assert_array_equal(k2, k)
        np.testing.assert_array_equal(v2, v)
    for (_, a), b in zip(cache.store.arrays(), stored):
        ring_rows = np.concatenate([cache._slots(layer, np.arange(r)) for layer, r in enumerate(cache.rings) if r]
                                   or [np.zeros(0, dtype=np.int64)])
        np.testing.assert_array_equal(a[0, ring_rows], b[0, ring_rows])  # the rings byte for byte


@settings(max_examples=80, deadline=None)
@given(window_models(BACKENDS), st.data())
def test_truncate_is_allowed_exactly_when_the_rings_still_hold_what_the_next_query_reads(model, data):
    tokens = data.draw(token_lists(model.config, min_size=2, max_size=30))
    spare = data.draw(st.integers(0, 3))
    cache = model.new_cache(layout="hybrid", spare=spare)
    model.forward(tokens, cache)
    n = data.draw(st.integers(0, len(tokens)))
    exact = n == 0 or all(not ring or len(tokens) <= ring or n >= len(tokens) - 1 - spare
                          for ring in cache.rings)
    assert bool(cache.capabilities.truncate(n)) == exact
    if not exact:
        with pytest.raises(CacheError, match="rolls back at most"):
            cache.truncate(n)
        return
    cache.truncate(n)
    again = data.draw(st.integers(0, n))  # a second truncate: what the first left must be right too
    if cache.capabilities.truncate(again):
        cache.truncate(again)
        n = again
    rest = tokens[n:] + tokens[:3]
    want = model.forward(tokens[:n] + rest, model.new_cache(layout="contiguous"), all_logits=True)[n:]
    assert_close(model.forward(rest, cache, all_logits=True), want, model.dtype, f"truncated to {n}")


@settings(max_examples=40, deadline=None)
@given(model=window_models(BACKENDS), data=st.data())
def test_fork_and_save_load_keep_what_each_layer_holds_and_continue_exactly(model, data, tmp_path_factory):
    tokens = data.draw(token_lists(model.config, min_size=1, max_size=30))
    kv = data.draw(st.sampled_from([None, "bfloat16", "int8"]))
    options = {} if kv is None else {"kv_dtype": kv}
    cache = model.new_cache(layout="hybrid", spare=data.draw(st.integers(0, 3)), **options)
    model.forward(tokens, cache)
    path = tmp_path_factory.mktemp("hybrid") / "cache.kvc"
    cache.save(path)
    copies = [cache.fork(), model.load_cache(path)]
    more = tokens[:5]
    want = model.forward(more, cache, all_logits=True)
    for copy in copies:
        assert copy.layout == "hybrid" and copy.rings == cache.rings
        np.testing.assert_array_equal(model.forward(more, copy, all_logits=True), want)


def test_saved_rows_that_do_not_fit_a_ring_are_refused_and_leave_the_cache_empty(tmp_path):
    cfg = kvref.ModelConfig(n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8, vocab_size=11,
                            max_seq_len=40, layer_windows=(3, None))
    model = kvref.Model.random(cfg, seed=1, backend="numpy")
    cache = model.new_cache(spare=1)
    model.forward(list(range(10)), cache)
    assert [len(cache.read_raw(layer)[0]) for layer in range(2)] == [4, 10]
    small = model.new_cache(spare=0)  # a ring of 3 cannot take 4 saved rows
    with pytest.raises(CacheError, match="must hold from a position in 7..8 on"):
        small.load_rows(np.arange(10), 10, [cache.read_raw(0), cache.read_raw(1)])
    wide = model.new_cache(spare=5)  # a ring of 8 takes them, and continues exactly
    wide.load_rows(np.arange(10), 10, [cache.read_raw(0), cache.read_raw(1)])
    np.testing.assert_array_equal(model.forward([4], wide), model.forward([4], cache))


def test_a_hybrid_cache_refuses_shift_and_overflow_with_reasons():
    cfg = kvref.ModelConfig(n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8, vocab_size=11,
                            max_seq_len=12, layer_windows=(3, None))
    model = kvref.Model.random(cfg, seed=1, backend="numpy")
    cache = model.new_cache(capacity=11)
    model.forward(list(range(10)), cache)
    assert not cache.capabilities.shift(2)
    with pytest.raises(CacheError, match="does not shift"):
        cache.shift(2)
    with pytest.raises(CacheFullError, match="holds 10 of 11"):
        model.forward([1, 2], cache)
    assert cache.next_position == 10
    with pytest.raises(CacheError, match="spare=-1"):
        model.new_cache(spare=-1)
    with pytest.raises(CacheError, match="spare does not apply"):
        model.new_cache(layout="contiguous", spare=2)


def test_a_saved_hybrid_file_with_rows_of_the_wrong_type_is_refused(tmp_path, monkeypatch):
    cfg = kvref.ModelConfig(n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8, vocab_size=11,
                            max_seq_len=40, layer_windows=(3, None))
    model = kvref.Model.random(cfg, seed=1, backend="numpy")
    cache = model.new_cache(spare=1)
    model.forward(list(range(10)), cache)
    cache.save(tmp_path / "c.kvc")
    read = fileformat.read_cache_file
    for tamper in (lambda rows: rows.astype(np.float64), lambda rows: rows.astype(np.int8)):
        def tampered(path, max_bytes=None, tamper=tamper):
            header, arrays = read(path, max_bytes)
            return header, {**arrays, "layer_rows": tamper(arrays["layer_rows"])}

        monkeypatch.setattr(fileformat, "read_cache_file", tampered)
        with pytest.raises(CacheError, match="'layer_rows' is .*; expected int64"):
            model.load_cache(tmp_path / "c.kvc")


def test_an_execution_writes_each_layer_once():
    cfg = kvref.ModelConfig(n_layers=1, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8, vocab_size=11,
                            max_seq_len=40, layer_windows=(3,))
    cache = kvref.Model.random(cfg, seed=1, backend="numpy").new_cache(spare=0)
    k = np.ones((2, 1, 4))
    with pytest.raises(CacheError, match="layer 0's K/V were already written"):
        with cache.begin(2) as execution:
            execution.update(0, k, k)
            execution.update(0, k, k)  # it would read ring slots the first write replaced
    assert cache.next_position == 0
