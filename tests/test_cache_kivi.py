"""kivi4 K/V (KIVI, 4-bit): the codec, its groups of positions and float16 residual in the contiguous
and paged layouts, and the operations that stay exact (or refuse)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import kvref
from kvref import native
from kvref.cache.quant import NIBBLE_MAX, Codec, dequantize_uint4, pack_nibbles, quantize_uint4, unpack_nibbles
from kvref.errors import CacheError
from kvref.spec import decoder
from kvref.tolerance import FLOAT32, KIVI4_KV_ROUNDING, QUANTIZED_LOGIT_BOUNDS, UNDERFLOW_SLACK
from tests.conftest import chunkings, fill_interleaved

if native.available():  # the native section's bound (tests/test_native.py skips itself without the module)
    from tests.test_native import assert_within, attention_bound

G = 8  # a small group: tests cross several group boundaries in a few dozen positions
CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64, vocab_size=64,
                        max_seq_len=96)
ELEMENTS = st.floats(-1e4, 1e4, width=32)


def model(seed=0, dtype="float32", backend="numpy"):
    return kvref.Model.random(CFG, seed=seed, dtype=dtype, backend=backend)


def run_chunks(m, cache, tokens, sizes):
    out, start = [], 0
    for n in sizes:
        out.append(m.forward(tokens[start:start + n], cache, all_logits=True))
        start += n
    return np.concatenate(out) if out else np.zeros((0, CFG.vocab_size))


def tokens_of(draw, lo=1, hi=60):
    return draw(st.lists(st.integers(0, CFG.vocab_size - 1), min_size=lo, max_size=hi))


def kivi_cache(m, paged_block=None):
    if paged_block is None:
        return m.new_cache(kv_dtype="kivi4", group_size=G)
    return m.new_cache(layout="paged", kv_dtype="kivi4", group_size=G, block_size=paged_block)


# ---- the codec ------------------------------------------------------------------------------------

@given(hnp.arrays(np.uint8, hnp.array_shapes(max_dims=3).map(lambda s: (*s, 8)), elements=st.integers(0, 15)))
def test_nibbles_pack_two_per_byte_and_unpack_to_the_same_levels(q):
    packed = pack_nibbles(q)
    assert packed.shape == (*q.shape[:-1], 4)
    np.testing.assert_array_equal(packed & 15, q[..., 0::2])  # element 2i in the low nibble
    np.testing.assert_array_equal(unpack_nibbles(packed), q)


@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=5).map(lambda s: (*s, 16)), elements=ELEMENTS),
       st.sampled_from([2, 4, 8, 16]))
def test_per_token_error_is_at_most_half_a_step_and_the_group_min_is_exact(x, group):
    data, params = quantize_uint4(x, group)
    assert data.dtype == np.uint8 and params.shape == (*x.shape[:-1], 16 // group, 2)
    groups = x.reshape(*x.shape[:-1], 16 // group, group)
    scale, zero = params[..., 0], params[..., 1]
    np.testing.assert_array_equal(zero, groups.min(-1))
    out = dequantize_uint4(data, params, group).reshape(groups.shape)
    err = np.abs(out - groups)
    # rint: half a step, plus the float32 rounding of (x - zero) / scale and of q * scale + zero
    bound = scale[..., None] * KIVI4_KV_ROUNDING + np.abs(groups).max(-1, keepdims=True) * FLOAT32.rtol + UNDERFLOW_SLACK
    assert np.all(err <= bound)
    assert np.all(unpack_nibbles(data) <= NIBBLE_MAX)


@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3).map(lambda n: n * 2), st.integers(1, 3),
                                        st.sampled_from([2, 8])), elements=ELEMENTS))
def test_per_channel_groups_take_min_and_max_over_positions_not_elements(x):
    codec = Codec("kivi4", x.shape[-1], 2)
    data, params = codec.encode_channels(x)  # groups of 2 positions
    n = x.shape[0] // 2
    assert data.shape == (x.shape[0], x.shape[1], x.shape[2] // 2) and params.shape == (n, x.shape[1], 2, x.shape[2])
    groups = x.reshape(n, 2, *x.shape[1:])  # [n, g, Hkv, D]
    np.testing.assert_array_equal(params[..., 1, :], groups.min(1))
    err = np.abs(codec.decode_channels(data, params).reshape(groups.shape) - groups)
    bound = (params[:, None, ..., 0, :] * KIVI4_KV_ROUNDING + np.abs(groups).max(1, keepdims=True) * FLOAT32.rtol
             + UNDERFLOW_SLACK)
    assert np.all(err <= bound)


def test_a_constant_group_is_stored_exactly_and_bytes_count_nibbles_and_pairs():
    data, params = quantize_uint4(np.full((1, 8), 3.5, np.float32), 8)
    assert params[0, 0, 0] == 0 and not data.any()
    np.testing.assert_array_equal(dequantize_uint4(data, params, 8), np.full((1, 8), 3.5, np.float32))
    # D/2 bytes of nibbles + one (scale, zero) float32 pair per group: per token (V), per channel per g
    # positions (K) — the same per position when the two groups are equal
    assert Codec("kivi4", 64).bytes_per_vector() == 32 + 2 * 2 * 4
    with pytest.raises(CacheError, match="group_size=7"):
        Codec("kivi4", 64, 7)


# ---- the layouts ----------------------------------------------------------------------------------

def expected_keys(m, tokens, sizes):
    """What a kivi4 cache holds for every layer: each full group quantized per channel from the float16
    K, the rest float16 (the K themselves come from a float32 cache: same model, same executions)."""
    reference = m.new_cache()
    run_chunks(m, reference, tokens, sizes)
    codec = Codec("kivi4", CFG.head_dim, G)
    out = []
    for layer in range(CFG.n_layers):
        k = reference.keys(layer).astype(np.float16)
        q = len(k) // G * G
        out.append(np.concatenate([codec.decode_channels(*codec.encode_channels(k[:q])), k[q:].astype(np.float32)]))
    return out


@given(st.data())
def test_stored_k_is_the_float16_residual_until_its_group_fills_whatever_the_chunking(data):
    # the first layer's K do not depend on the cache; later layers' do (their input went through
    # attention over stored K/V), so only layer 0 is compared with a float32 reference
    m = model(data.draw(st.integers(0, 2**16)))
    tokens = tokens_of(data.draw)
    cache = kivi_cache(m, data.draw(st.sampled_from([None, G, 2 * G])))
    sizes = data.draw(chunkings(len(tokens)))
    run_chunks(m, cache, tokens, sizes)
    np.testing.assert_array_equal(cache.keys(0), expected_keys(m, tokens, sizes)[0])


@given(st.data())
def test_paged_equals_contiguous_exactly_in_any_chunking(data):
    m = model(data.draw(st.integers(0, 2**16)), dtype="float64")
    tokens = tokens_of(data.draw)
    sizes = data.draw(chunkings(len(tokens)))
    contiguous, paged = kivi_cache(m), kivi_cache(m, data.draw(st.sampled_from([G, 2 * G, 3 * G])))
    np.testing.assert_array_equal(run_chunks(m, paged, tokens, sizes), run_chunks(m, contiguous, tokens, sizes))
    for layer in range(CFG.n_layers):
        np.testing.assert_array_equal(paged.keys(layer), contiguous.keys(layer))
        np.testing.assert_array_equal(paged.values(layer), contiguous.values(layer))
    assert paged.nbytes == contiguous.nbytes


@given(st.data())
def test_kivi4_moves_logits_by_at_most_the_stated_bound(data):
    m = model(data.draw(st.integers(0, 2**16)))
    tokens = tokens_of(data.draw, 8, 48)
    reference = m.forward(tokens, m.new_cache(), all_logits=True)
    got = m.forward(tokens, kivi_cache(m), all_logits=True)
    scale = np.abs(reference).max(axis=-1)  # [T]
    assert np.all(np.abs(got - reference).max(axis=-1) <= QUANTIZED_LOGIT_BOUNDS["kivi4"] * scale + FLOAT32.atol)


@given(st.data())
def test_truncate_is_exact_where_allowed_and_refused_inside_a_quantized_group(data):
    m = model(data.draw(st.integers(0, 2**16)), dtype="float64")
    tokens = tokens_of(data.draw, 2)
    more = tokens_of(data.draw, 1, 12)
    block = data.draw(st.sampled_from([None, G]))
    cache = kivi_cache(m, block)
    sizes = data.draw(chunkings(len(tokens)))
    run_chunks(m, cache, tokens, sizes)
    n = data.draw(st.integers(0, len(tokens)))
    exact = n % G == 0 or n >= len(tokens) // G * G
    assert bool(cache.capabilities.truncate(n)) == exact
    if not exact:
        keys = cache.keys(0).copy()
        with pytest.raises(CacheError, match="already quantized"):
            cache.truncate(n)
        assert cache.length == len(tokens)
        np.testing.assert_array_equal(cache.keys(0), keys)  # nothing changed
        return
    cache.truncate(n)
    # the same executions, never extended past n (a query never sees a later position, and the
    # groups they complete before n are the same)
    fresh = kivi_cache(m, block)
    run_chunks(m, fresh, tokens[:n], cut(sizes, n))
    np.testing.assert_array_equal(m.forward(more, cache, all_logits=True), m.forward(more, fresh, all_logits=True))


def cut(sizes, n):
    # the chunk sizes of the first n positions
    out, start = [], 0
    for size in sizes:
        if start < n:
            out.append(min(size, n - start))
        start += size
    return out


@given(st.data())
def test_roll_back_capability_promises_exact_truncation_to_every_position_of_the_execution(data):
    m = model(data.draw(st.integers(0, 2**16)))
    tokens = tokens_of(data.draw, 1, 30)
    cache = kivi_cache(m, data.draw(st.sampled_from([None, G])))
    m.forward(tokens, cache)
    n_new = data.draw(st.integers(1, 2 * G))
    promised = bool(cache.capabilities.roll_back(n_new))
    before = len(tokens)
    m.forward(tokens_of(data.draw, n_new, n_new), cache)
    allowed = all(cache.capabilities.truncate(p) for p in range(before, before + n_new + 1))
    assert promised == allowed


@given(st.data())
def test_fork_continues_like_the_parent_and_never_touches_it(data):
    m = model(data.draw(st.integers(0, 2**16)), dtype="float64")
    tokens, more = tokens_of(data.draw, 1, 40), tokens_of(data.draw, 1, 20)
    parent = kivi_cache(m, data.draw(st.sampled_from([None, G])))
    m.forward(tokens, parent)
    keys = [parent.keys(layer).copy() for layer in range(CFG.n_layers)]
    child = parent.fork()
    a = m.forward(more, child, all_logits=True)
    for layer in range(CFG.n_layers):
        np.testing.assert_array_equal(parent.keys(layer), keys[layer])
    np.testing.assert_array_equal(m.forward(more, parent, all_logits=True), a)


def test_prefix_reuse_adopts_whole_groups_and_equals_the_same_executions():
    m = model(3, dtype="float64")
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 64, 2 * 2 * G + 3).tolist()
    pool = m.new_cache(layout="paged", kv_dtype="kivi4", group_size=G, block_size=2 * G, num_blocks=32,
                       prefix_reuse=True).pool
    m.forward(shared + [1, 2], pool.new_cache())
    b = pool.new_cache()
    n = b.prefill_reuse(shared + [5])
    assert n == 4 * G  # two full blocks
    reused = m.forward((shared + [5])[n:], b, all_logits=True)
    cold = pool.new_cache()
    m.forward(shared[:n], cold)
    np.testing.assert_array_equal(reused, m.forward((shared + [5])[n:], cold, all_logits=True))


def test_layouts_and_operations_that_cannot_keep_kivi4_k_refuse_clearly(tmp_path):
    m = model()
    for options in ({"layout": "window", "window": 8}, {"layout": "hybrid"}):
        with pytest.raises(CacheError, match="cannot store kivi4 K"):
            m.new_cache(kv_dtype="kivi4", **options)
    window = m.new_cache(layout="window", window=8, k_dtype="float16", v_dtype="kivi4")  # V per token: fine
    m.forward([1, 2, 3], window)
    with pytest.raises(CacheError, match="multiple of the kivi4 group"):
        m.new_cache(layout="paged", kv_dtype="kivi4", group_size=G, block_size=G + 1)
    cache = kivi_cache(m)
    m.forward(list(range(2 * G + 1)), cache)
    with pytest.raises(CacheError, match="cannot be saved"):
        cache.save(tmp_path / "c.kvc")
    with pytest.raises(CacheError, match="K is stored as kivi4"):
        cache.shift(1)
    with pytest.raises(CacheError, match="read\\(\\) decodes it"):
        cache.read_raw(0)


def test_the_native_backend_runs_kivi4_on_the_decoded_kv_within_the_kivi4_bound():
    tokens = list(range(3 * G + 2))
    reference = model().forward(tokens, all_logits=True)
    native = model(backend="c")
    scale = np.abs(reference).max(axis=-1)[:, None]
    for options in ({}, {"layout": "paged", "block_size": G}):
        got = native.forward(tokens, native.new_cache(kv_dtype="kivi4", group_size=G, **options), all_logits=True)
        assert np.all(np.abs(got - reference) <= QUANTIZED_LOGIT_BOUNDS["kivi4"] * scale + FLOAT32.atol)


# ---- the native kernels ---------------------------------------------------------------------------

def native_ops():
    if not native.available():
        pytest.skip(native.unavailable_reason())
    from kvref.native import ops

    return ops


@st.composite
def kivi_caches(draw):
    """(cache, layer, q, q_positions): a contiguous or paged cache with kivi4 K and/or V (the other
    float16), group g in {2, 8, 16, 32, D}, filled in random chunks so that some K is in the float16
    residual; a paged sequence shares its pool with another, so its blocks are out of order."""
    from kvref.cache import BlockPool, ContiguousCache

    L, Hkv, G, T = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 6))
    D = draw(st.sampled_from([2, 16, 32, 64, 96, 128, 320]))  # 320: past the AVX-512 kernels' 256
    k_dtype, v_dtype = draw(st.sampled_from([("kivi4", "kivi4"), ("kivi4", "float16"), ("float16", "kivi4")]))
    g = draw(st.sampled_from([x for x in (2, 8, 16, 32, D) if D % x == 0 and x <= 256]))
    S = draw(st.integers(0, 600))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        cache, others = ContiguousCache(L, Hkv, D, S + 3, k_dtype, v_dtype=v_dtype, group_size=g), []
    else:
        bs = g * draw(st.integers(1, 3))
        pool = BlockPool(L, Hkv, D, num_blocks=2 * (S // bs + 2), block_size=bs, k_dtype=k_dtype, v_dtype=v_dtype,
                         group_size=g)
        cache, others = pool.new_cache(), [pool.new_cache()]
    fill_interleaved(cache, others, S, rng)
    q = rng.standard_normal((T, Hkv * G, D)).astype(np.float32)
    q_pos = rng.integers(-2, S + 2, size=T) if draw(st.booleans()) else np.arange(S - T, S)
    return cache, draw(st.integers(0, L - 1)), q, q_pos


@given(kivi_caches(), st.data())
def test_native_attention_reading_kivi4_in_place_equals_attention_over_the_decoded_kv(case, data):
    ops = native_ops()
    isa, threads = data.draw(st.sampled_from(ops.supported_isas())), data.draw(st.sampled_from([1, 2]))
    cache, layer, q, q_pos = case
    got = ops.kernels(threads, isa).cache_attention(q, q_pos, cache, layer)
    k, v = (np.ascontiguousarray(a, np.float32) for a in cache.read(layer))  # the spec's decode
    k_pos = np.arange(cache.length)
    want = ops.kernels(threads, isa).attention(q, k, v, q_pos, k_pos)
    # the kernels decode in registers (q * scale + zero, possibly fused) and sum in their own order
    assert_within(got, want, 2 * attention_bound(q, k, v, q_pos, k_pos), what=f"{cache.stats()} {isa}")
    np.testing.assert_array_equal(got, ops.kernels(3 - threads, isa).cache_attention(q, q_pos, cache, layer))


@pytest.mark.parametrize("D", [16, 64, 128])
def test_native_kivi4_attention_reads_nothing_past_the_end_of_the_stored_arrays(D):
    from kvref.cache import ContiguousCache
    from tests.conftest import guarded_copy

    ops = native_ops()
    L, Hkv, S = 2, 2, 70  # 2 full groups of 32 and 6 residual positions (D = 16: groups of 16)
    cache = ContiguousCache(L, Hkv, D, S, "kivi4")
    rng = np.random.default_rng(D)
    cache.append(rng.standard_normal((L, S, Hkv, D)), rng.standard_normal((L, S, Hkv, D)))
    q = rng.standard_normal((1, 3 * Hkv, D)).astype(np.float32)
    for isa in ops.supported_isas():
        want = ops.kernels(1, isa).cache_attention(q, [S - 1], cache, L - 1)
        for name, a in cache.store.arrays():
            setattr(cache.store, name, guarded_copy(a))
        cache.residual.rows = guarded_copy(cache.residual.rows)
        np.testing.assert_array_equal(ops.kernels(1, isa).cache_attention(q, [S - 1], cache, L - 1), want)


@given(st.data())
def test_the_fused_forward_writes_the_bytes_the_cache_layout_writes(data):
    # layer 0's K/V do not depend on attention, so the C forward and the layouts' encoding meet byte
    # for byte there (later layers' inputs differ by the kernels' rounding)
    ops = native_ops()
    isa = data.draw(st.sampled_from(ops.supported_isas()))
    m = kvref.Model.random(kvref.ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=64,
                                             vocab_size=64, max_seq_len=128), seed=data.draw(st.integers(0, 99)),
                           backend="c")
    m.ops = ops.kernels(1, isa)
    tokens = tokens_of(data.draw, 1, 100)
    sizes = data.draw(chunkings(len(tokens)))
    block = data.draw(st.sampled_from([None, G, 4 * G]))
    fused, layered = kivi_cache(m, block), kivi_cache(m, block)
    assert m.executor(fused).name == "native"
    start = 0
    for n in sizes:
        m.forward(tokens[start:start + n], fused)  # the C forward
        decoder.forward(m.ops, m.config, m.weights, tokens[start:start + n], layered)  # kernel by kernel
        start += n
    np.testing.assert_array_equal(fused.keys(0), layered.keys(0))
    np.testing.assert_array_equal(fused.values(0), layered.values(0))
    live = len(tokens) % G
    np.testing.assert_array_equal(fused.residual.rows[0, :live], layered.residual.rows[0, :live])
