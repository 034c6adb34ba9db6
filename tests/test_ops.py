"""The spec kernels: each checked against its definition written out the long way."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvref.spec import ops
from kvref.tolerance import (FLOAT16_SUM_RTOL, FLOAT32_KERNEL_RTOL, FLOAT64_ATTENTION, FLOAT64_KERNEL,
                             ROPE_OFFSET_RTOL, UNDERFLOW_SLACK)

finite = st.floats(-30, 30, allow_nan=False, width=64)


@given(arrays(np.float64, st.tuples(st.integers(1, 5), st.integers(1, 9)), elements=finite))
def test_softmax_rows_sum_to_one_and_match_the_definition(x):
    p = ops.softmax(x)
    expected = np.exp(x) / np.exp(x).sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(p, expected, rtol=FLOAT64_KERNEL.rtol, atol=FLOAT64_KERNEL.atol)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=FLOAT64_KERNEL.rtol, atol=0)


def test_softmax_subtracts_the_row_max_so_huge_scores_do_not_overflow():
    p = ops.softmax(np.array([[1000.0, 1001.0], [-1000.0, -1001.0]], dtype=np.float32))
    assert np.all(np.isfinite(p))
    np.testing.assert_allclose(p[0], [1 / (1 + np.e), np.e / (1 + np.e)], rtol=FLOAT32_KERNEL_RTOL, atol=0)


def test_softmax_of_a_fully_masked_row_is_all_zeros():
    p = ops.softmax(np.array([[-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 0.0]]))
    np.testing.assert_array_equal(p[0], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(p[1], [0.5, 0.0, 0.5], rtol=FLOAT64_KERNEL.rtol, atol=0)


def test_softmax_accumulates_float16_scores_in_float32():
    x = np.full((1, 4096), 1.0, dtype=np.float16)  # a float16 sum of 4096 ones would stall at 2048
    p = ops.softmax(x)
    assert p.dtype == np.float16
    np.testing.assert_allclose(p.astype(np.float64).sum(), 1.0, rtol=FLOAT16_SUM_RTOL, atol=0)


def test_attention_with_every_key_hidden_returns_zeros():
    q = np.ones((1, 2, 4))
    k = v = np.ones((3, 1, 4))
    out = ops.attention(q, k, v, q_positions=np.array([0]), k_positions=np.array([5, 6, 7]))
    np.testing.assert_array_equal(out, np.zeros((1, 2, 4)))


def test_softmax_of_a_row_holding_nan_or_plus_inf_is_all_nan_never_zeros():
    # issue 16: `where=total > 0` turned such a row into zeros, hiding the bad score
    p = ops.softmax(np.array([[0.0, np.nan, 1.0], [np.inf, 0.0, -np.inf], [-np.inf, -np.inf, -np.inf]]))
    assert np.isnan(p[:2]).all()
    np.testing.assert_array_equal(p[2], 0.0)


def test_attention_makes_a_head_nan_for_any_non_finite_score_it_sees_even_minus_inf():
    # q . k = -inf at a seen key must not pass for a masked key (probability 0)
    q = np.ones((2, 2, 4))
    k = np.ones((3, 1, 4))
    v = np.arange(12.0).reshape(3, 1, 4)
    for bad in (np.nan, np.inf, -np.inf):
        k[1, 0, 2] = bad
        out = ops.attention(q, k, v, q_positions=np.array([0, 2]), k_positions=np.arange(3))
        assert np.isfinite(out[0]).all()  # position 0 sees key 0 only
        assert np.isnan(out[1]).all()


def test_attention_makes_an_element_nan_for_a_non_finite_value_element_it_sees_only():
    q = np.ones((2, 1, 4))
    k = np.ones((3, 1, 4))
    v = np.ones((3, 1, 4))
    v[2, 0, 1], v[1, 0, 3] = np.inf, np.nan
    out = ops.attention(q, k, v, q_positions=np.array([1, 2]), k_positions=np.arange(3))
    np.testing.assert_array_equal(out[0, 0], [1.0, 1.0, 1.0, np.nan])  # position 1 does not see key 2's inf
    np.testing.assert_array_equal(np.isnan(out[1, 0]), [False, True, False, True])  # NaN, never +inf
    np.testing.assert_array_equal(out[1, 0, [0, 2]], 1.0)


def test_attention_never_multiplies_an_unseen_keys_value_by_zero():
    # the masked product: 0 x NaN at a key a query does not see once made its output NaN
    q = np.ones((1, 2, 4))
    k = np.ones((2, 1, 4))
    v = np.stack([np.full((1, 4), 2.0), np.full((1, 4), np.nan)])
    k[1] = np.nan
    out = ops.attention(q, k, v, q_positions=np.array([0]), k_positions=np.array([0, 1]))
    np.testing.assert_array_equal(out, np.full((1, 2, 4), 2.0))


@given(st.data())
def test_gqa_attention_equals_per_head_attention_on_the_shared_kv_head(data):
    Hkv = data.draw(st.integers(1, 3))
    G = data.draw(st.integers(1, 4))
    D = 2 * data.draw(st.integers(1, 8))
    T = data.draw(st.integers(1, 6))
    S0 = data.draw(st.integers(0, 6))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    q = rng.standard_normal((T, Hkv * G, D))
    k = rng.standard_normal((S0 + T, Hkv, D))
    v = rng.standard_normal((S0 + T, Hkv, D))
    q_pos, k_pos = np.arange(S0, S0 + T), np.arange(S0 + T)
    out = ops.attention(q, k, v, q_pos, k_pos)
    for t in range(T):
        for h in range(Hkv * G):
            kv = h // G  # the kv head this query head reads
            seen = slice(0, S0 + t + 1)  # causal: keys up to and including the query position
            w = np.exp(k[seen, kv] @ q[t, h] / np.sqrt(D))
            expected = (w / w.sum()) @ v[seen, kv]
            np.testing.assert_allclose(out[t, h], expected, rtol=FLOAT64_ATTENTION.rtol, atol=FLOAT64_ATTENTION.atol)


@given(st.integers(0, 500), st.integers(0, 500), st.integers(-40, 40), st.integers(1, 16))
def test_rope_score_depends_only_on_the_position_offset(m, n, shift, half_dim):
    D = 2 * half_dim
    rng = np.random.default_rng(m * 1000 + n)
    q = rng.standard_normal((1, 1, D))
    k = rng.standard_normal((1, 1, D))
    shift = max(shift, -min(m, n))  # positions stay >= 0

    def score(pq, pk):
        return float(np.sum(ops.rope(q, np.array([pq]), 10000.0) * ops.rope(k, np.array([pk]), 10000.0)))

    assert abs(score(m, n) - score(m + shift, n + shift)) <= ROPE_OFFSET_RTOL * (1 + abs(score(m, n)))


def test_rope_rotates_adjacent_pairs_and_keeps_their_norm():
    x = np.arange(1, 9, dtype=np.float64).reshape(1, 1, 8)
    y = ops.rope(x, np.array([3]), 10000.0)
    pairs_in = x.reshape(4, 2)
    pairs_out = y.reshape(4, 2)
    np.testing.assert_allclose(np.linalg.norm(pairs_out, axis=1), np.linalg.norm(pairs_in, axis=1),
                               rtol=FLOAT64_KERNEL.rtol)
    # pair 0 turns by position * theta**0 = 3 radians
    c, s = np.cos(3.0), np.sin(3.0)
    np.testing.assert_allclose(pairs_out[0], [1 * c - 2 * s, 1 * s + 2 * c], rtol=FLOAT64_KERNEL.rtol)
    np.testing.assert_array_equal(ops.rope(x, np.array([0]), 10000.0), x)  # position 0: identity


def test_rms_norm_gives_unit_root_mean_square_before_the_gain():
    x = np.random.default_rng(0).standard_normal((3, 10)) * 7
    y = ops.rms_norm(x, np.ones(10), eps=0.0)
    np.testing.assert_allclose(np.sqrt(np.mean(y**2, axis=-1)), 1.0, rtol=FLOAT64_KERNEL.rtol)
    np.testing.assert_allclose(ops.rms_norm(x, np.full(10, 2.0), 0.0), 2 * y, rtol=FLOAT64_KERNEL.rtol)


def test_swiglu_is_silu_of_gate_times_up_and_never_overflows():
    gate = np.array([-1000.0, -1.0, 0.0, 1.0, 1000.0], dtype=np.float32)
    with np.errstate(all="raise"):
        out = ops.swiglu(gate, np.full(5, 2.0, dtype=np.float32))
    with np.errstate(over="ignore"):  # the textbook formula overflows at -1000; the kernel must not
        expected = 2 * gate / (1 + np.exp(-gate.astype(np.float64)))
    np.testing.assert_allclose(out, expected, rtol=FLOAT32_KERNEL_RTOL, atol=UNDERFLOW_SLACK)


def test_swiglu_oai_clamps_the_gate_above_and_up_both_ways_then_adds_one_to_up():
    gate = np.array([-1000.0, -1.0, 0.0, 3.0, 7.0, 50.0], dtype=np.float64)
    up = np.array([-50.0, -1.0, 2.0, 8.0, -7.5, 0.5], dtype=np.float64)
    with np.errstate(all="raise"):
        out = ops.swiglu_oai(gate, up)
    g, u = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    with np.errstate(over="ignore"):
        expected = g / (1 + np.exp(-1.702 * g)) * (u + 1)
    np.testing.assert_allclose(out, expected, rtol=FLOAT64_KERNEL.rtol, atol=UNDERFLOW_SLACK)
    assert np.isnan(ops.swiglu_oai(np.array([np.nan]), np.array([1.0]))).all()  # the clamp keeps a NaN
    assert np.isnan(ops.swiglu_oai(np.array([1.0]), np.array([np.nan]))).all()


@given(st.integers(1, 5), st.integers(0, 40), st.sampled_from([None, 3]), st.integers(0, 2**32 - 1))
def test_attention_with_sinks_is_plain_attention_times_the_mass_the_keys_keep(T, S, window, seed):
    # a sink logit joins the denominator only: each head's output is the sinkless output times
    # Z / (Z + exp(sink)), Z the sum of exp(score) over the keys its query sees (0 when it sees none)
    rng = np.random.default_rng(seed)
    H, Hkv, D = 4, 2, 6
    q, k, v = rng.standard_normal((T, H, D)), rng.standard_normal((S, Hkv, D)), rng.standard_normal((S, Hkv, D))
    q_pos, k_pos = np.arange(S - T, S) if S >= T else np.arange(T), np.arange(S)
    sinks = 2 * rng.standard_normal(H)
    kh = k[:, np.arange(H) // 2]  # [S, H, D]
    scores = np.einsum("thd,shd->ths", q, kh) / np.sqrt(D)
    seen = (k_pos[None] <= q_pos[:, None]) & ((k_pos[None] > q_pos[:, None] - window) if window else True)
    z = np.where(seen[:, None, :], np.exp(scores), 0).sum(axis=-1)  # [T, H]
    plain = ops.attention(q, k, v, q_pos, k_pos, window=window) if S else np.zeros((T, H, D))
    with_sinks = ops.attention(q, k, v, q_pos, k_pos, window=window, sinks=sinks) if S else np.zeros((T, H, D))
    expected = plain * (z / (z + np.exp(sinks)))[..., None]
    np.testing.assert_allclose(with_sinks, expected, rtol=FLOAT64_ATTENTION.rtol, atol=FLOAT64_ATTENTION.atol)


def test_a_non_finite_sink_logit_makes_its_head_nan_like_a_non_finite_score():
    q, k, v = np.ones((1, 2, 4)), np.ones((3, 1, 4)), np.ones((3, 1, 4))
    out = ops.attention(q, k, v, [2], np.arange(3), sinks=np.array([np.inf, 0.0]))
    assert np.isnan(out[0, 0]).all() and np.isfinite(out[0, 1]).all()
