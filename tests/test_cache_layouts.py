"""Every layout gives the logits of the contiguous cache: exactly for the same stored K/V, within the
stated bounds for narrower K/V types. Window, shift, fork, prefix reuse and capability checks."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvref
from kvref.cache import ContiguousCache, reorder
from kvref.errors import CacheError, CacheFullError, ContextOverflowError
from kvref.generation.generate import resume
from kvref.tolerance import FLOAT32, QUANTIZED_LOGIT_BOUNDS, VISIBLE_CHANGE, assert_close, compare
from tests.conftest import chunkings, configs, latent_configs, token_lists

CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=96)
# multi-head latent attention: the cache holds one latent key (kv_lora_rank + qk_rope_head_dim) per position
LATENT_CFG = CFG.replace(n_kv_heads=4, head_dim=14, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=6, v_head_dim=10)


def run_chunks(model, cache, tokens, sizes):
    out, start = [], 0
    for n in sizes:
        out.append(model.forward(tokens[start:start + n], cache, all_logits=True))
        start += n
    return np.concatenate(out)


def layouts(draw, n_tokens):
    """A layout that stores every one of n_tokens positions (so it must equal the contiguous cache)."""
    kind = draw(st.sampled_from(["paged", "window"]))
    if kind == "paged":
        return {"layout": "paged", "block_size": draw(st.integers(1, 9))}
    sinks = draw(st.integers(0, 4))
    return {"layout": "window", "window": max(1, n_tokens - sinks + draw(st.integers(0, 3))), "sinks": sinks}


@given(st.data())
def test_every_layout_gives_exactly_the_contiguous_logits_and_kv(data):
    cfg = data.draw(st.one_of(configs(max_layers=2, max_seq_len=48), latent_configs(max_layers=2, max_seq_len=48)))
    dtype = data.draw(st.sampled_from(["float32", "float64"]))
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), dtype=dtype, backend="numpy")
    tokens = data.draw(token_lists(cfg, max_size=40))
    sizes = data.draw(chunkings(len(tokens)))
    kv = data.draw(st.sampled_from([None, "float16", "bfloat16", "int8"]))
    options = {} if kv is None else {"kv_dtype": kv}
    reference = model.new_cache(**options)
    expected = run_chunks(model, reference, tokens, sizes)
    cache = model.new_cache(**layouts(data.draw, len(tokens)), **options)
    got = run_chunks(model, cache, tokens, sizes)
    np.testing.assert_array_equal(got, expected)  # the same stored values give the same bits
    assert cache.length == reference.length and cache.nbytes == reference.nbytes
    for layer in range(cfg.n_layers):
        np.testing.assert_array_equal(cache.keys(layer), reference.keys(layer))
        np.testing.assert_array_equal(cache.values(layer), reference.values(layer))


@st.composite
def realistic_configs(draw):
    """Configs where quantization error is not amplified by degenerate shapes (d_model >= 16, D >= 16)."""
    n_kv_heads, group = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return kvref.ModelConfig(
        n_layers=draw(st.integers(1, 3)), d_model=draw(st.integers(16, 64)), n_heads=n_kv_heads * group,
        n_kv_heads=n_kv_heads, head_dim=draw(st.sampled_from([16, 32, 64])), d_ff=draw(st.integers(16, 128)),
        vocab_size=draw(st.integers(8, 96)), max_seq_len=64, rope_theta=draw(st.sampled_from([1e4, 1e5, 500.0])),
        tie_embeddings=draw(st.booleans()))


@given(st.data())
def test_quantized_kv_moves_logits_by_at_most_the_stated_bound(data):
    cfg = data.draw(realistic_configs())
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), backend="numpy")
    tokens = data.draw(token_lists(cfg, min_size=8, max_size=48))
    k, v = data.draw(st.sampled_from(["float32", "float16", "bfloat16", "int8"]), label="k"), data.draw(
        st.sampled_from(["float32", "float16", "bfloat16", "int8"]), label="v")
    reference = model.forward(tokens, model.new_cache(), all_logits=True)
    got = model.forward(tokens, model.new_cache(k_dtype=k, v_dtype=v), all_logits=True)
    bound = max(QUANTIZED_LOGIT_BOUNDS.get(k, 0), QUANTIZED_LOGIT_BOUNDS.get(v, 0))
    scale = np.abs(reference).max(axis=-1)  # [T] the row's largest |logit|
    assert np.all(np.abs(got - reference).max(axis=-1) <= bound * scale + FLOAT32.atol), (k, v)


@given(st.data())
def test_quantized_layouts_read_new_kv_as_stored_so_chunking_does_not_matter(data):
    cfg = data.draw(configs(max_layers=2, max_seq_len=48))
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), dtype="float64", backend="numpy")
    tokens = data.draw(token_lists(cfg, max_size=32))
    kv = data.draw(st.sampled_from(["float16", "bfloat16", "int8"]))
    one = run_chunks(model, model.new_cache(kv_dtype=kv), tokens, [len(tokens)])
    stepwise = run_chunks(model, model.new_cache(kv_dtype=kv), tokens, [1] * len(tokens))
    assert_close(stepwise, one, "float64", f"{kv}: token by token vs one prefill")


# ---- sliding window ---------------------------------------------------------------------------------

class ReferenceWindow(ContiguousCache):
    """A trivially correct window: store every position, show the new queries what a window would hold."""

    def __init__(self, model, window, sinks):
        c = model.config
        super().__init__(c.n_layers, c.n_kv_heads, c.head_dim, c.max_seq_len, model.dtype)
        self.sequence.model = model.fingerprint()
        self.window, self.sinks = window, sinks

    def _write(self, reservation, layer, k, v):
        start = self.length
        k_all, v_all, pos = super()._write(reservation, layer, k, v)
        keep = (pos < self.sinks) | (pos >= start - self.window)  # sinks, the last W before, all new
        return k_all[keep], v_all[keep], pos[keep]


@given(st.data())
def test_window_equals_a_reference_that_hides_everything_but_sinks_and_the_last_w(data):
    window, sinks = data.draw(st.integers(1, 8)), data.draw(st.integers(0, 3))
    model = kvref.Model.random(CFG, seed=data.draw(st.integers(0, 2**16)), backend="numpy")
    # lengths around the window edge (W-1, W, W+1) and several wrap-arounds, in any chunking
    n = data.draw(st.sampled_from([sinks + window - 1, sinks + window, sinks + window + 1,
                                   sinks + 2 * window + 1, sinks + 5 * window + 3]) | st.integers(1, 60))
    n = max(n, 1)
    tokens = data.draw(st.lists(st.integers(0, CFG.vocab_size - 1), min_size=n, max_size=n))
    sizes = data.draw(st.sampled_from([[1] * n, [n]]) | chunkings(n))
    cache = model.new_cache(layout="window", window=window, sinks=sinks)
    got = run_chunks(model, cache, tokens, sizes)
    expected = run_chunks(model, ReferenceWindow(model, window, sinks), tokens, sizes)
    np.testing.assert_array_equal(got, expected)
    kept = sorted(set(range(min(sinks, n))) | set(range(max(sinks, n - window), n)))
    assert list(cache.positions()) == kept and cache.next_position == n and cache.length == len(kept)


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_window_until_full_is_the_contiguous_cache_and_decode_steps_see_the_last_w(extra):
    window, sinks = 6, 2
    model = kvref.Model.random(CFG, seed=3, dtype="float64", backend="numpy")
    tokens = list(range(sinks + window + extra))
    cache = model.new_cache(layout="window", window=window, sinks=sinks)
    steps = run_chunks(model, cache, tokens, [1] * len(tokens))
    plain = model.forward(tokens, all_logits=True)
    # W-1 and W positions: nothing dropped, the window is the contiguous cache
    assert_close(steps[: sinks + window], plain[: sinks + window], "float64", "window until full vs no cache")
    if extra == 1:  # W+1: position 0 of the ring (position `sinks`) is dropped for the next step
        assert list(cache.positions()) == [0, 1, *range(3, 9)]
        assert not compare(model.forward([5], cache.fork()), model.forward(tokens + [5]), VISIBLE_CHANGE).ok


def test_window_cannot_roll_back_past_a_dropped_position_and_says_so():
    model = kvref.Model.random(CFG, seed=1, backend="numpy")
    cache = model.new_cache(layout="window", window=4, sinks=1)
    model.forward([1, 2, 3], cache)
    assert cache.capabilities.truncate(1)  # nothing dropped yet: rollback is exact
    model.forward([4, 5, 6], cache)  # position 1 is dropped
    assert cache.capabilities.truncate(6) and not cache.capabilities.truncate(5)
    with pytest.raises(CacheError, match="cannot truncate to 5: the window has dropped positions 1..1"):
        cache.truncate(5)
    assert cache.next_position == 6 and cache.length == 5


def test_window_truncate_before_wrap_equals_never_extending():
    model = kvref.Model.random(CFG, seed=2, dtype="float64", backend="numpy")
    cache = model.new_cache(layout="window", window=8, sinks=2)
    model.forward([1, 2, 3, 4, 5], cache)
    model.forward([9, 9, 9], cache)
    cache.truncate(5)
    assert_close(model.forward([6], cache), model.forward([1, 2, 3, 4, 5, 6]), "float64", "after truncate")


# ---- context shift --------------------------------------------------------------------------------

@given(st.data())
def test_shift_equals_a_window_that_dropped_the_same_positions(data):
    # RoPE scores depend only on offsets: keys moved down by n and a query moved down by n see what
    # the unshifted keys show the unshifted query. Float rounding of one extra rotation: float32 tol.
    model = kvref.Model.random(data.draw(st.sampled_from([CFG, LATENT_CFG])), seed=data.draw(st.integers(0, 2**16)),
                               backend="numpy")
    L = data.draw(st.integers(2, 40))
    n = data.draw(st.integers(1, L - 1))
    tokens = data.draw(st.lists(st.integers(0, 63), min_size=L + 1, max_size=L + 1))
    layout = data.draw(st.sampled_from([{}, {"layout": "paged", "block_size": 4}]))
    cache = model.new_cache(**layout)
    model.forward(tokens[:L], cache)
    cache.shift(n)
    assert cache.next_position == L - n and cache.length == L - n
    window = model.new_cache(layout="window", window=L - n)
    model.forward(tokens[:L], window)
    assert_close(model.forward(tokens[L:], cache), model.forward(tokens[L:], window), "float32", "shift vs window")


@pytest.mark.parametrize("layout", [{}, {"layout": "paged", "block_size": 4}])
def test_a_shift_moves_nope_layers_keys_unrotated_and_equals_a_window_that_dropped_the_positions(layout, tmp_path):
    # SmolLM3's NoPE layers store keys that carry no position: a shift moves their bytes as they are and
    # turns back only the RoPE layers' keys; the next logits are then those of a window of the kept
    # positions (a rotated NoPE key would change them by far more than float32 rounding)
    model = kvref.Model.random(CFG.replace(n_layers=3, nope_layers=(1,)), seed=5, backend="numpy")
    tokens, n = list(range(3, 20)), 4
    cache = model.new_cache(**layout)
    model.forward(tokens[:16], cache)
    cache.save(tmp_path / "nope.kvc")  # its per-layer RoPE bases (None on the NoPE layer) go through the file
    cache = model.load_cache(tmp_path / "nope.kvc")
    assert cache.rope_theta == (CFG.rope_theta, None, CFG.rope_theta)
    before = [np.array(cache.keys(layer)) for layer in range(3)]
    cache.shift(n)
    after = [np.array(cache.keys(layer)) for layer in range(3)]
    np.testing.assert_array_equal(after[1], before[1][n:])  # the NoPE layer's keys, byte for byte
    assert not np.allclose(after[0], before[0][n:])  # a RoPE layer's keys turned back by n
    window = model.new_cache(layout="window", window=16 - n)
    model.forward(tokens[:16], window)
    assert_close(model.forward(tokens[16:], cache), model.forward(tokens[16:], window), "float32", "shift vs window")


@pytest.mark.parametrize("sinks", [0, 2])
def test_window_shift_closes_the_gap_so_generation_goes_past_max_seq_len(sinks):
    cfg = CFG.replace(max_seq_len=24)
    model = kvref.Model.random(cfg, seed=4, backend="numpy")
    cache = model.new_cache(layout="window", window=8, sinks=sinks)
    tokens = list(kvref.generate(model, [1, 2, 3], 20, cache=cache))
    assert len(tokens) == 20 and cache.next_position == 22
    with pytest.raises(ContextOverflowError):
        model.forward([1, 2, 3], cache)
    before = model.forward([7], cache.fork())
    cache.shift(14 - sinks, keep=sinks)  # positions 14..21 move to sinks..sinks+7, right after the sinks
    assert list(cache.positions()) == list(range(sinks + 8)) and cache.next_position == sinks + 8
    after = model.forward([7], cache)
    if sinks == 0:  # every offset between the query and a key is unchanged
        assert_close(after, before, "float32", "after closing the window's gap")
    else:  # the sinks are now closer to the query (StreamingLLM's positions within the cache): the
        # offsets to the sinks changed, so the logits move by far more than float32 rounding
        assert not compare(after, before, "float32").ok, "moving the window next to the sinks changed nothing"
    assert len(list(kvref.generate(model, [5], 10, cache=cache))) == 10



def test_window_positions_stop_at_max_seq_len_so_every_state_saves_and_loads(tmp_path):
    # Positions stay absolute and a model reads positions 0..max_seq_len-1 (a cache file records no
    # next_position beyond max_seq_len): raw K/V past it are refused like model.forward's tokens, the
    # cache unchanged, and shift(n, keep=sinks) is the way on
    cfg = CFG.replace(max_seq_len=24)
    model = kvref.Model.random(cfg, seed=4, backend="numpy")
    cache = model.new_cache(layout="window", window=8, sinks=2)
    kv = np.ones((cfg.n_layers, 24, cfg.n_kv_heads, cfg.head_dim), np.float32)
    cache.append(kv, kv)
    assert cache.next_position == 24 and not cache.capabilities.append(1)
    with pytest.raises(CacheFullError, match="positions are at most 23 \\(max_seq_len 24\\)"):
        cache.append(kv[:, :1], kv[:, :1])
    assert cache.next_position == 24 and cache.length == 10
    cache.save(tmp_path / "full.kvc")
    assert model.load_cache(tmp_path / "full.kvc").next_position == 24
    cache.shift(14, keep=2)
    cache.fork().append(kv[:, :14], kv[:, :14])  # a fork keeps the bound
    with pytest.raises(CacheFullError):
        cache.fork().append(kv[:, :15], kv[:, :15])
    cache.append(kv[:, :14], kv[:, :14])
    cache.save(tmp_path / "shifted.kvc")
    assert list(model.load_cache(tmp_path / "shifted.kvc").positions()) == list(cache.positions())

def test_shift_refuses_quantized_keys_and_bad_arguments_and_changes_nothing():
    model = kvref.Model.random(CFG, seed=0, backend="numpy")
    for kv in ("float16", "bfloat16", "int8"):
        cache = model.new_cache(k_dtype=kv, v_dtype="float32")
        model.forward([1, 2, 3, 4], cache)
        assert not cache.capabilities.shift(1)
        with pytest.raises(CacheError, match=f"K is stored as {kv}"):
            cache.shift(1)
        assert cache.length == 4
    ok = model.new_cache(k_dtype="float32", v_dtype="int8")
    model.forward([1, 2, 3, 4], ok)
    assert ok.capabilities.shift(2, keep=1) and not ok.capabilities.shift(4, keep=1) and not ok.capabilities.shift(0)
    with pytest.raises(CacheError, match="keep must be 1"):
        w = model.new_cache(layout="window", window=4, sinks=1)
        model.forward([1, 2, 3], w)
        w.shift(1, keep=0)


# ---- paged: forks, copy-on-write, running out of blocks ----------------------------------------------

def test_fork_shares_every_block_and_the_first_write_copies_only_the_partial_one():
    model = kvref.Model.random(CFG, seed=5, dtype="float64", backend="numpy")
    parent = model.new_cache(layout="paged", block_size=4, num_blocks=10)
    model.forward(list(range(10)), parent)  # blocks: 4 + 4 + 2 positions
    child = parent.fork()
    pool = parent.pool
    assert child.block_table == parent.block_table and pool.blocks_used == 3
    assert parent.blocks_shared == 3
    a = model.forward([20], child)
    assert pool.blocks_used == 4 and child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]  # copied on write
    b = model.forward([21], parent)  # now alone in its last block: writes in place
    assert pool.blocks_used == 4
    assert_close(a, model.forward(list(range(10)) + [20]), "float64", "child after copy-on-write")
    assert_close(b, model.forward(list(range(10)) + [21]), "float64", "parent writing in place")
    child.free()
    parent.free()
    assert pool.blocks_free == pool.num_blocks


def test_running_out_of_blocks_raises_with_the_numbers_and_changes_nothing():
    model = kvref.Model.random(CFG, seed=6, backend="numpy")
    cache = model.new_cache(layout="paged", block_size=4, num_blocks=3)
    model.forward(list(range(6)), cache)
    other = cache.fork()  # shares both blocks; one free block left
    before = (cache.block_table, cache.length, cache.keys(0).copy(), cache.pool.blocks_free)
    with pytest.raises(CacheFullError, match=r"holds 6 positions in 2 blocks of 4 and needs 2 more including a "
                                             r"copy of its shared last block; the pool has 1 free of 3"):
        model.forward(list(range(4)), cache)
    assert (cache.block_table, cache.length, cache.pool.blocks_free) == before[:2] + before[3:]
    np.testing.assert_array_equal(cache.keys(0), before[2])
    assert cache.capacity == 8 and cache.capabilities.append(2) and not cache.capabilities.append(3)
    model.forward([1, 2], cache)  # what does fit still works
    assert other.length == 6 and cache.pool.blocks_free == 0


def test_reorder_makes_beams_continue_from_the_chosen_parents():
    model = kvref.Model.random(CFG, seed=7, dtype="float64", backend="numpy")
    for layout in ({}, {"layout": "paged", "block_size": 2, "num_blocks": 64}, {"layout": "window", "window": 16}):
        beams = [model.new_cache(**layout) for _ in range(3)]
        prefixes = [[1, 2, 3], [4, 5], [6]]
        for cache, p in zip(beams, prefixes):
            model.forward(p, cache)
        old = list(beams)
        beams = reorder(beams, [2, 0, 0])
        # chosen once: moved as is; chosen twice: moved, then one fork; chosen by nobody: freed
        assert beams[0] is old[2] and beams[1] is old[0] and all(beams[2] is not c for c in old)
        assert old[1].freed and not any(b.freed for b in beams)
        for cache, parent in zip(beams, [2, 0, 0]):
            assert_close(model.forward([9], cache), model.forward(prefixes[parent] + [9]), "float64",
                         f"beam continuing {parent}")
        with pytest.raises(CacheError, match="out of range"):
            reorder(beams, [3])


def test_freed_caches_refuse_every_operation():
    model = kvref.Model.random(CFG, seed=0, backend="numpy")
    for options in ({}, {"layout": "paged"}, {"layout": "window", "window": 4}):
        cache = model.new_cache(**options)
        model.forward([1, 2], cache)
        cache.free()
        assert not cache.capabilities.fork and not cache.capabilities.truncate(0) and not cache.capabilities.append(1)
        assert not cache.capabilities.shift(1)
        for op in (cache.fork, lambda: cache.truncate(0), lambda: model.forward([1], cache), lambda: cache.save("x"),
                   lambda: cache.shift(1)):
            with pytest.raises(CacheError, match="freed"):
                op()


# ---- prefix reuse --------------------------------------------------------------------------------

@given(st.data())
def test_prefix_reuse_gives_the_logits_of_a_cold_prefill(data):
    model = kvref.Model.random(CFG, seed=data.draw(st.integers(0, 2**16)), dtype="float64", backend="numpy")
    bs = data.draw(st.integers(1, 8))
    shared = data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=40))
    first = shared + data.draw(st.lists(st.integers(0, 63), max_size=8))
    second = shared + data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=8))
    pool = model.new_cache(layout="paged", block_size=bs, num_blocks=64, prefix_reuse=True).pool
    a = pool.new_cache()
    model.forward(first, a)
    if data.draw(st.booleans()):
        a.free()  # freed blocks keep their keys until handed out again
    b = pool.new_cache()
    n = b.prefill_reuse(second)
    common = next((i for i, (x, y) in enumerate(zip(first, second)) if x != y), min(len(first), len(second)))
    assert n == min(common // bs * bs, len(second) - 1)  # every full block of the common prefix
    reused = model.forward(second[n:], b, all_logits=True)
    cold = model.forward(second, all_logits=True)[n:]
    assert_close(reused, cold, "float64", f"prefix reuse of {n} positions")
    assert b.sequence.token_ids == second


def test_prefix_reuse_needs_an_empty_sequence_in_a_reuse_pool():
    model = kvref.Model.random(CFG, seed=0, backend="numpy")
    with pytest.raises(CacheError, match="prefix reuse is off"):
        model.new_cache(layout="paged").prefill_reuse([1, 2, 3])
    cache = model.new_cache(layout="paged", prefix_reuse=True)
    model.forward([1], cache)
    with pytest.raises(CacheError, match="needs an empty sequence"):
        cache.prefill_reuse([1, 2, 3])


# ---- options, accounting, both backends ---------------------------------------------------------

@given(st.lists(st.integers(1, 9), min_size=1, max_size=5),
       st.sampled_from(["float32", "float16", "bfloat16", "int8"]), st.sampled_from(["float32", "float16", "int8"]),
       st.sampled_from([{}, {"layout": "paged", "block_size": 4}, {"layout": "window", "window": 12, "sinks": 2}]))
def test_nbytes_is_cache_bytes_plus_int8_scales_in_every_layout(chunks, k, v, layout):
    model = kvref.Model.random(CFG, seed=0, backend="numpy")
    cache = model.new_cache(k_dtype=k, v_dtype=v, group_size=8 if "int8" in (k, v) else None, **layout)
    for n in chunks:
        model.forward(list(range(n)), cache)
        L, Hkv, D = CFG.n_layers, CFG.n_kv_heads, CFG.head_dim
        scales = sum(L * cache.length * Hkv * (D // 8) * 4 for t in (k, v) if t == "int8")
        half = kvref.cache_bytes(L, cache.length, Hkv, D, k) // 2 + kvref.cache_bytes(L, cache.length, Hkv, D, v) // 2
        assert cache.nbytes == half + scales
        if k == v:
            assert cache.nbytes == kvref.cache_bytes(L, cache.length, Hkv, D, k) + scales


def test_new_cache_refuses_options_of_other_layouts_and_mismatched_pools():
    model = kvref.Model.random(CFG, seed=0, backend="numpy")
    with pytest.raises(CacheError, match="block_size does not apply to layout 'window'"):
        model.new_cache(layout="window", window=4, block_size=16)
    with pytest.raises(CacheError, match="needs window=W"):
        model.new_cache(layout="window")
    with pytest.raises(CacheError, match="window=0 must be a positive integer"):
        model.new_cache(layout="window", window=0)
    with pytest.raises(CacheError, match="num_blocks=0"):
        model.new_cache(layout="paged", num_blocks=0)
    with pytest.raises(CacheError, match="group_size=5 must be a positive divisor of head_dim=8"):
        model.new_cache(kv_dtype="int8", group_size=5)
    pool = model.new_cache(layout="paged", kv_dtype="int8").pool
    with pytest.raises(CacheError, match="the pool stores K/V as int8/int8"):
        model.new_cache(layout="paged", pool=pool, kv_dtype="float16")
    with pytest.raises(CacheError, match="another model"):
        kvref.Model.random(CFG, seed=1, backend="numpy").new_cache(layout="paged", pool=pool)
    assert model.new_cache(layout="paged", pool=pool).pool is pool


@pytest.mark.skipif(not kvref.native.available(), reason="native kernels not built")
@pytest.mark.parametrize("cfg", [CFG, LATENT_CFG], ids=["kv", "latent"])
@pytest.mark.parametrize("options", [{"layout": "paged", "block_size": 4}, {"layout": "window", "window": 40},
                                     {"kv_dtype": "int8"}, {"layout": "paged", "kv_dtype": "bfloat16"},
                                     {"k_dtype": "float16", "v_dtype": "int8"}])
def test_every_layout_and_kv_type_runs_on_the_native_backend(options, cfg):
    if cfg.latent and "v_dtype" in options:
        pytest.skip("a latent cache stores no V (tests/test_latent_attention.py checks the refusal)")
    native = kvref.Model.random(cfg, seed=8, backend="c")
    spec = kvref.Model.random(cfg, seed=8, backend="numpy")
    tokens = list(range(30))
    got = run_chunks(native, native.new_cache(**options), tokens, [20, 1, 9])
    expected = run_chunks(spec, spec.new_cache(**options), tokens, [20, 1, 9])
    # the same stored K/V through native kernels: the float32 backend tolerance, widened by one
    # quantization step where a K/V element lands on the other side of a rounding boundary
    bound = max(QUANTIZED_LOGIT_BOUNDS.get(options.get(k), 0) for k in ("kv_dtype", "k_dtype", "v_dtype"))
    np.testing.assert_allclose(got, expected, atol=FLOAT32.atol + bound * np.abs(expected).max(), rtol=FLOAT32.rtol)


def test_generation_resumes_exactly_from_a_saved_cache(tmp_path):
    model = kvref.Model.random(CFG, seed=9, backend="numpy")
    prompt = [3, 1, 4, 1, 5]
    for options in ({}, {"layout": "paged", "kv_dtype": "int8"}, {"layout": "window", "window": 6, "sinks": 1}):
        whole = list(kvref.generate(model, prompt, 12, temperature=0.9, seed=11, cache=model.new_cache(**options)))
        cache = model.new_cache(**options)
        model.forward(prompt, cache)  # the prefill: its last logits choose the first token
        cache.save(tmp_path / "c.kvc")
        resumed = list(resume(model, model.load_cache(tmp_path / "c.kvc"), 12, temperature=0.9,
                              seed=11))
        assert resumed == whole, options


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_layouts_that_claim_chunking_invariance_give_one_shot_logits_in_any_chunking(data):
    cfg = data.draw(st.one_of(configs(max_layers=2, max_seq_len=48), latent_configs(max_layers=2, max_seq_len=48)))
    if not cfg.latent:  # MLA models have no window layers
        cfg = dataclasses.replace(cfg, layer_windows=tuple(data.draw(st.one_of(st.none(), st.integers(1, 5)))
                                                            for _ in range(cfg.n_layers)))
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), dtype="float64", backend="numpy")
    tokens = data.draw(token_lists(cfg, min_size=2, max_size=30))
    expected = model.forward(tokens, model.new_cache(layout="contiguous"), all_logits=True)
    options = data.draw(st.sampled_from([{"layout": "contiguous"}, {"layout": "hybrid", "spare": 1},
                                         {"layout": "paged", "block_size": 3}]))
    cache = model.new_cache(**options)
    assert cache.chunking_invariant
    assert_close(run_chunks(model, cache, tokens, data.draw(chunkings(len(tokens)))), expected, "float64", str(options))


def test_the_streaming_window_is_not_chunking_invariant_and_says_so():
    cfg = kvref.ModelConfig(n_layers=1, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8, vocab_size=11,
                            max_seq_len=40)
    model = kvref.Model.random(cfg, seed=3, dtype="float64", backend="numpy")
    tokens = list(range(10))
    one_shot = run_chunks(model, model.new_cache(layout="window", window=3), tokens, [10])
    stepwise = run_chunks(model, model.new_cache(layout="window", window=3), tokens, [1] * 10)
    assert not kvref.cache.WindowCache.chunking_invariant
    assert np.abs(one_shot[-1] - stepwise[-1]).max() > 1e-6  # the last query saw 10 positions, then 4
