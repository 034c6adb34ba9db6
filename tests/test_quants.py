"""The spec dequantizers: bit-exact against the `gguf` package's (an independent implementation), and
known blocks built by hand that pin down the layouts (nibble order, the Q3_K high-bit rule, ...).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.errors import DTypeError, ShapeError
from kvref.spec.ggml import BLOCK_LAYOUT, GGMLType
from kvref.spec import quants
from tests.conftest import require

FORMATS = list(quants.DEQUANTIZERS)

# Byte offsets of the float16 fields (d, m, dmin) in each block: a second statement of the layouts,
# used to make the scales finite.
F16_FIELDS = {
    GGMLType.F16: [0], GGMLType.Q8_0: [0], GGMLType.Q4_0: [0], GGMLType.Q4_1: [0, 2], GGMLType.Q5_0: [0],
    GGMLType.Q5_1: [0, 2], GGMLType.Q2_K: [80, 82], GGMLType.Q3_K: [108], GGMLType.Q4_K: [0, 2],
    GGMLType.Q5_K: [0, 2], GGMLType.Q6_K: [208],
}


def with_finite_scales(ggml_type, blocks):
    # float16 exponent all ones is inf/NaN: clear its top bit there, leaving every finite value as it is
    blocks = blocks.copy()
    for at in F16_FIELDS.get(ggml_type, []):
        bits = blocks[:, at:at + 2].view("<u2")
        blocks[:, at:at + 2] = np.where(bits & 0x7C00 == 0x7C00, bits & ~np.uint16(0x4000), bits).view(np.uint8)
    if ggml_type == GGMLType.BF16:
        bits = blocks.view("<u2")
        blocks = np.where(bits & 0x7F80 == 0x7F80, bits & ~np.uint16(0x4000), bits).view(np.uint8)
    if ggml_type == GGMLType.F32:
        bits = blocks.view("<u4")
        blocks = np.where(bits & 0x7F800000 == 0x7F800000, bits & ~np.uint32(0x40000000), bits).view(np.uint8)
    return blocks


def reference(ggml_type, blocks):
    # [n, block_bytes] -> [n, block_values] float32, by the gguf package
    gguf = require("gguf")
    out = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(int(ggml_type)))
    return np.asarray(out, dtype=np.float32).reshape(blocks.shape[0], -1)


def random_blocks(ggml_type, n_blocks, seed):
    block_bytes = BLOCK_LAYOUT[ggml_type][1]
    return np.random.default_rng(seed).integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
@settings(max_examples=30)
@given(data=st.data())
def test_dequantize_equals_gguf_bit_for_bit_on_random_blocks(ggml_type, data):
    n_blocks = data.draw(st.integers(1, 8))
    block_bytes = BLOCK_LAYOUT[ggml_type][1]
    raw = data.draw(st.binary(min_size=n_blocks * block_bytes, max_size=n_blocks * block_bytes))
    blocks = with_finite_scales(ggml_type, np.frombuffer(raw, dtype=np.uint8).reshape(n_blocks, block_bytes))
    actual = quants.DEQUANTIZERS[ggml_type](blocks)
    assert actual.dtype == np.float32 and actual.shape == (n_blocks, BLOCK_LAYOUT[ggml_type][0])
    np.testing.assert_array_equal(actual.view(np.uint32), reference(ggml_type, blocks).view(np.uint32))


@pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)
def test_dequantize_equals_gguf_on_many_unrestricted_blocks(ggml_type):
    # Any bytes at all, inf and NaN scales included: the same values at the same places.
    blocks = random_blocks(ggml_type, 4096, seed=int(ggml_type))
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(quants.DEQUANTIZERS[ggml_type](blocks), reference(ggml_type, blocks))


def f16_bytes(*values):
    return list(np.array(values, dtype="<f2").view(np.uint8))


def test_q4_0_low_nibbles_are_the_first_half_of_the_block():
    # d = 0.5; byte j holds value j (low nibble) and value j + 16 (high nibble), each stored + 8
    qs = [(j % 16) | ((15 - j % 16) << 4) for j in range(16)]
    block = np.array([f16_bytes(0.5) + qs], dtype=np.uint8)
    expected = 0.5 * (np.concatenate([np.arange(16), 15 - np.arange(16)]) - 8)
    np.testing.assert_array_equal(quants.dequantize_q4_0(block), [expected])


def test_q4_1_adds_the_min():
    block = np.array([f16_bytes(0.25, -1.0) + [0x10] * 16], dtype=np.uint8)  # values 0 (x16), then 1 (x16)
    np.testing.assert_array_equal(quants.dequantize_q4_1(block), [[-1.0] * 16 + [-0.75] * 16])


def test_q5_0_high_bits_come_from_the_uint32_qh_bit_by_value_index():
    qh = (1 << 31 | 1).to_bytes(4, "little")  # values 0 and 31 get bit 4
    block = np.array([f16_bytes(1.0) + list(qh) + [0] * 16], dtype=np.uint8)
    expected = np.full(32, -16.0)
    expected[[0, 31]] = 0.0
    np.testing.assert_array_equal(quants.dequantize_q5_0(block), [expected])


def test_q8_0_is_signed_bytes_times_d():
    block = np.array([f16_bytes(2.0) + list(np.arange(-16, 16, dtype=np.int8).view(np.uint8))], dtype=np.uint8)
    np.testing.assert_array_equal(quants.dequantize_q8_0(block), [2.0 * np.arange(-16, 16)])


def test_q3_k_a_clear_high_bit_subtracts_four():
    # scales all 1 (stored 33: low nibble 1, high bits 2), d = 1, low bits all 3
    hmask = [0xFF] * 16 + [0x00] * 16  # values v with v % 32 < 16 keep bit set; the others clear
    qs = [0xFF] * 64
    scales = [0x11] * 8 + [0xAA] * 4
    block = np.array([hmask + qs + scales + f16_bytes(1.0)], dtype=np.uint8)
    expected = np.where(np.arange(256) % 32 < 16, 3.0, -1.0)
    np.testing.assert_array_equal(quants.dequantize_q3_k(block), [expected])


def test_q6_k_sub_block_scales_are_signed():
    ql, qh = [0x11] * 128, [0x00] * 64  # every value stored 1, so q = 1 - 32 = -31
    scales = list(np.array([1, -1] * 8, dtype=np.int8).view(np.uint8))
    block = np.array([ql + qh + scales + f16_bytes(0.5)], dtype=np.uint8)
    expected = np.repeat(0.5 * np.array([1, -1] * 8), 16) * -31
    np.testing.assert_array_equal(quants.dequantize_q6_k(block), [expected])


def test_bf16_is_the_top_half_of_a_float32():
    block = np.array([[0x80, 0x3F], [0xC0, 0xC0]], dtype=np.uint8)  # 0x3F80, 0xC0C0
    np.testing.assert_array_equal(quants.dequantize_bf16(block), [[1.0], [-6.0]])


def test_dequantize_reshapes_rows_of_blocks_to_the_tensor_shape():
    blocks = with_finite_scales(GGMLType.Q4_K, random_blocks(GGMLType.Q4_K, 6, seed=1))  # 2 x 3 rows of 256
    out = quants.dequantize(GGMLType.Q4_K, blocks.reshape(2, 3, 144), (2, 3, 256))
    assert out.shape == (2, 3, 256) and out.dtype == np.float32
    np.testing.assert_array_equal(out.reshape(6, 256), quants.dequantize_q4_k(blocks))


def test_dequantize_refuses_what_it_cannot_do():
    with pytest.raises(DTypeError, match="no dequantizer for tensor type Q8_K"):
        quants.dequantize(GGMLType.Q8_K, np.zeros(292, np.uint8), (256,))
    with pytest.raises(ShapeError, match="multiple of 32 values"):
        quants.dequantize(GGMLType.Q4_0, np.zeros(18, np.uint8), (1, 16))
    with pytest.raises(ShapeError, match="needs 36 uint8 bytes, got 18"):
        quants.dequantize(GGMLType.Q4_0, np.zeros(18, np.uint8), (1, 64))
    with pytest.raises(ShapeError, match="dtype float32"):
        quants.dequantize(GGMLType.F32, np.zeros(1, np.float32), (1,))


def test_mxfp4_codes_are_e2m1_values_times_the_power_of_two_scale_low_nibbles_first():
    # e = 129: scale 2**(129 - 127) = 4 on the E2M1 values (ggml: doubled values, halved scale)
    block = np.array([[129] + [0x10 * (15 - j) + j for j in range(16)]], dtype=np.uint8)
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    expected = 4 * np.array(e2m1 + e2m1[::-1], dtype=np.float32)  # low nibbles j, then high nibbles 15 - j
    np.testing.assert_array_equal(quants.dequantize(GGMLType.MXFP4, block, (32,)), expected)
    subnormal = quants.dequantize_mxfp4(np.array([[0] + [0x77] * 16], dtype=np.uint8))  # e = 0: 2**-128 x 12
    assert subnormal[0, 0] == np.float32(12 * 2.0 ** -128) and subnormal[0, 0] > 0
