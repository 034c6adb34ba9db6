"""Dequantization of GGML tensor types: one function per format, written as the definition of its block.

Every function takes the raw blocks of a tensor, uint8 [n_blocks, block_bytes] as BLOCK_LAYOUT in
kvref.spec.ggml gives them, and returns float32 [n_blocks, block_values]. Multi-byte fields are
little-endian. The arithmetic is done in float32 in the order ggml's reference (dequantize_row_*) uses,
so results are bit-identical to ggml's and to the `gguf` package's.

Two packing patterns recur:
- Nibbles: a run of 16 bytes holds 32 values; the low nibbles are values 0..15, the high nibbles
  values 16..31 (not interleaved).
- K-quant bit planes: a run of 32 bytes holds 32 * 8 // bits values; bits 0.. of bytes 0..31 are
  values 0..31, the next bits of the same bytes are values 32..63, and so on.
_unpack splits bytes into fields in exactly this order.

The K-quants use super-blocks of QK_K = 256 values made of 16 or 8 sub-blocks, each with its own
small integer scale (and min), which the super-block's float16 d (and dmin) scale in turn.

Reference: ggml/src/ggml-quants.c (block_* structs in ggml-common.h).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import DTypeError, ShapeError
from .ggml import BLOCK_LAYOUT, QK_K, GGMLType


def _f16(field):
    # [n_blocks, 2] uint8 -> [n_blocks, 1] float32
    return field.view("<f2").astype(np.float32)


def _unpack(packed, bits):
    # [..., m] uint8 -> [..., 8 // bits, m]: field i of every byte, lowest bits first
    shifts = np.arange(0, 8, bits, dtype=np.uint8)[:, None]  # [8 // bits, 1]
    return (packed[..., None, :] >> shifts) & np.uint8((1 << bits) - 1)


# ---- plain floats: a "block" is one value ----

def dequantize_f32(blocks):
    # [n, 4] -> [n, 1]; a view of the input where the host is little-endian
    return blocks.view("<f4").astype(np.float32, copy=False)


def dequantize_f16(blocks):
    # [n, 2] -> [n, 1]
    return _f16(blocks)


def dequantize_bf16(blocks):
    # [n, 2] -> [n, 1]; bfloat16 is the upper half of a float32
    return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32)


# ---- 32-value blocks ----

def dequantize_q8_0(blocks):
    # [n, 34] -> [n, 32]
    d = _f16(blocks[:, 0:2])                      # [n, 1] scale
    q = blocks[:, 2:34].view(np.int8)             # [n, 32] signed 8-bit values
    return q.astype(np.float32) * d


def dequantize_q4_0(blocks):
    # [n, 18] -> [n, 32]
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])                      # [n, 1] scale
    q = _unpack(blocks[:, 2:18], 4).reshape(n, 32)  # [n, 32] 4-bit values 0..15
    return d * (q.astype(np.int8) - np.int8(8)).astype(np.float32)


def dequantize_q4_1(blocks):
    # [n, 20] -> [n, 32]
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])                      # [n, 1] scale
    m = _f16(blocks[:, 2:4])                      # [n, 1] min (the value of q = 0)
    q = _unpack(blocks[:, 4:20], 4).reshape(n, 32)  # [n, 32] 4-bit values 0..15
    return d * q.astype(np.float32) + m


def _q5_values(qh, qs):
    # [n, 4], [n, 16] -> [n, 32] 5-bit values 0..31
    n = qs.shape[0]
    high = np.unpackbits(qh, axis=-1, bitorder="little")  # [n, 32] bit j of the uint32 qh: 5th bit of value j
    low = _unpack(qs, 4).reshape(n, 32)                  # [n, 32] low 4 bits, nibble order
    return low | (high << np.uint8(4))


def dequantize_q5_0(blocks):
    # [n, 22] -> [n, 32]
    d = _f16(blocks[:, 0:2])                      # [n, 1] scale
    q = _q5_values(blocks[:, 2:6], blocks[:, 6:22])  # [n, 32] values 0..31
    return d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def dequantize_q5_1(blocks):
    # [n, 24] -> [n, 32]
    d = _f16(blocks[:, 0:2])                      # [n, 1] scale
    m = _f16(blocks[:, 2:4])                      # [n, 1] min
    q = _q5_values(blocks[:, 4:8], blocks[:, 8:24])  # [n, 32] values 0..31
    return d * q.astype(np.float32) + m


# MXFP4 (OCP microscaling FP4, gpt-oss's experts): each 4-bit code is an E2M1 float (sign, 2-bit exponent,
# 1-bit mantissa) and the block shares one E8M0 scale, a power of two. ggml stores each value doubled, so
# that it is an integer, and halves the scale to match: value = 2**(e - 128) * MXFP4_VALUES[code].
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def e8m0_half(e):
    # uint8 [...] -> float32 [...]: 2**(e - 128), exact (e = 0 and 1 give float32 subnormals)
    return np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)


def dequantize_mxfp4(blocks):
    # [n, 17] -> [n, 32]
    n = blocks.shape[0]
    d = e8m0_half(blocks[:, 0:1])                 # [n, 1] the block's power-of-two scale
    q = _unpack(blocks[:, 1:17], 4).reshape(n, 32)  # [n, 32] E2M1 codes, nibble order
    return d * MXFP4_VALUES[q]                    # a power of two times a small integer: exact


# ---- K-quants: 256-value super-blocks ----

def dequantize_q2_k(blocks):
    # [n, 84] -> [n, 256]; 16 sub-blocks of 16 values
    n = blocks.shape[0]
    scales = blocks[:, 0:16]                      # [n, 16] per sub-block: low nibble scale, high nibble min
    qs = blocks[:, 16:80].reshape(n, 2, 32)       # two halves of 128 values, 2-bit planes
    d = _f16(blocks[:, 80:82])                    # [n, 1] scale of the scales
    dmin = _f16(blocks[:, 82:84])                 # [n, 1] scale of the mins
    q = _unpack(qs, 2).reshape(n, 16, 16)         # [n, 16 sub-blocks, 16] values 0..3
    dl = (d * (scales & np.uint8(0x0F)).astype(np.float32))[:, :, None]  # [n, 16, 1]
    ml = (dmin * (scales >> np.uint8(4)).astype(np.float32))[:, :, None]  # [n, 16, 1]
    return (dl * q.astype(np.float32) - ml).reshape(n, QK_K)


def dequantize_q3_k(blocks):
    # [n, 110] -> [n, 256]; 16 sub-blocks of 16 values
    n = blocks.shape[0]
    hmask = blocks[:, 0:32]                       # [n, 32] 1-bit planes: the 3rd bit of each value
    qs = blocks[:, 32:96].reshape(n, 2, 32)       # two halves of 128 values, 2-bit planes: the low 2 bits
    packed = blocks[:, 96:108]                    # [n, 12] sixteen 6-bit scales
    d = _f16(blocks[:, 108:110])                  # [n, 1] scale of the scales
    # Low 4 bits of scale i: nibble (i // 8) of byte i % 8; high 2 bits: bits 2*(i // 4).. of byte 8 + i % 4.
    low = _unpack(packed[:, 0:8], 4).reshape(n, 16)
    high = _unpack(packed[:, 8:12], 2).reshape(n, 16)
    scales = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)  # [n, 16] signed -32..31
    q_low = _unpack(qs, 2).reshape(n, 16, 16).astype(np.int8)      # [n, 16, 16] values 0..3
    q_high = _unpack(hmask, 1).reshape(n, 16, 16).astype(np.int8)  # [n, 16, 16] bits 0..1
    # A clear high bit subtracts 4 (values -4..3); a set one leaves the low bits alone.
    q = q_low - (np.int8(1) - q_high) * np.int8(4)
    dl = (d * scales.astype(np.float32))[:, :, None]  # [n, 16, 1]
    return (dl * q.astype(np.float32)).reshape(n, QK_K)


def _scales_mins_k4(packed):
    # [n, 12] -> [n, 8], [n, 8]: eight 6-bit scales and eight 6-bit mins (get_scale_min_k4)
    # Sub-blocks 0..3 keep scale and min whole in the low 6 bits of bytes 0..3 and 4..7; sub-blocks
    # 4..7 take their low 4 bits from the nibbles of bytes 8..11 and their top 2 bits from the spare
    # top bits of bytes 0..3 (scales) and 4..7 (mins).
    lo_sc, lo_m, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    six = np.uint8(0x3F)
    scales = np.concatenate([lo_sc & six, (hi & np.uint8(0x0F)) | ((lo_sc >> np.uint8(6)) << np.uint8(4))], axis=1)
    mins = np.concatenate([lo_m & six, (hi >> np.uint8(4)) | ((lo_m >> np.uint8(6)) << np.uint8(4))], axis=1)
    return scales, mins


def dequantize_q4_k(blocks):
    # [n, 144] -> [n, 256]; 8 sub-blocks of 32 values
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])                      # [n, 1] scale of the scales
    dmin = _f16(blocks[:, 2:4])                   # [n, 1] scale of the mins
    scales, mins = _scales_mins_k4(blocks[:, 4:16])  # [n, 8] each
    qs = blocks[:, 16:144].reshape(n, 4, 32)      # 4 runs of 32 bytes, each two sub-blocks as nibbles
    q = _unpack(qs, 4).reshape(n, 8, 32)          # [n, 8 sub-blocks, 32] values 0..15
    dl = (d * scales.astype(np.float32))[:, :, None]  # [n, 8, 1]
    ml = (dmin * mins.astype(np.float32))[:, :, None]  # [n, 8, 1]
    return (dl * q.astype(np.float32) - ml).reshape(n, QK_K)


def dequantize_q5_k(blocks):
    # [n, 176] -> [n, 256]; 8 sub-blocks of 32 values
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])                      # [n, 1] scale of the scales
    dmin = _f16(blocks[:, 2:4])                   # [n, 1] scale of the mins
    scales, mins = _scales_mins_k4(blocks[:, 4:16])  # [n, 8] each
    qh = blocks[:, 16:48]                         # [n, 32] 1-bit planes: the 5th bit of each value
    qs = blocks[:, 48:176].reshape(n, 4, 32)      # the low 4 bits, as in Q4_K
    q_low = _unpack(qs, 4).reshape(n, 8, 32)
    q_high = _unpack(qh, 1).reshape(n, 8, 32)
    q = q_low | (q_high << np.uint8(4))           # [n, 8, 32] values 0..31
    dl = (d * scales.astype(np.float32))[:, :, None]  # [n, 8, 1]
    ml = (dmin * mins.astype(np.float32))[:, :, None]  # [n, 8, 1]
    return (dl * q.astype(np.float32) - ml).reshape(n, QK_K)


def dequantize_q6_k(blocks):
    # [n, 210] -> [n, 256]; 16 sub-blocks of 16 values
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)       # per half of 128 values: low 4 bits, nibbles of 64 bytes
    qh = blocks[:, 128:192].reshape(n, 2, 32)     # per half: high 2 bits, 2-bit planes of 32 bytes
    scales = blocks[:, 192:208].view(np.int8)     # [n, 16] signed 8-bit sub-block scales
    d = _f16(blocks[:, 208:210])                  # [n, 1] scale of the scales
    q_low = _unpack(ql, 4).reshape(n, 2, 4, 32)   # [n, half, 4 runs, 32]
    q_high = _unpack(qh, 2)                       # [n, half, 4 runs, 32]
    q = (q_low | (q_high << np.uint8(4))).astype(np.int8) - np.int8(32)  # values -32..31
    dl = (d * scales.astype(np.float32))[:, :, None]  # [n, 16, 1]
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


DEQUANTIZERS = {
    GGMLType.F32: dequantize_f32,
    GGMLType.F16: dequantize_f16,
    GGMLType.BF16: dequantize_bf16,
    GGMLType.Q8_0: dequantize_q8_0,
    GGMLType.Q4_0: dequantize_q4_0,
    GGMLType.Q4_1: dequantize_q4_1,
    GGMLType.Q5_0: dequantize_q5_0,
    GGMLType.Q5_1: dequantize_q5_1,
    GGMLType.Q2_K: dequantize_q2_k,
    GGMLType.Q3_K: dequantize_q3_k,
    GGMLType.Q4_K: dequantize_q4_k,
    GGMLType.Q5_K: dequantize_q5_k,
    GGMLType.Q6_K: dequantize_q6_k,
    GGMLType.MXFP4: dequantize_mxfp4,
}


def dequantize(ggml_type, data, shape):
    """Raw tensor bytes (rows of blocks, as stored) -> float32 array of `shape` (NumPy order, rows last)."""
    ggml_type = GGMLType(ggml_type)
    if ggml_type not in DEQUANTIZERS:
        supported = ", ".join(t.name for t in DEQUANTIZERS)
        raise DTypeError(f"no dequantizer for tensor type {ggml_type.name}; supported: {supported}")
    shape = tuple(int(s) for s in shape)
    block_values, block_bytes = BLOCK_LAYOUT[ggml_type]
    if not shape or shape[-1] % block_values:
        raise ShapeError(f"{ggml_type.name} rows must hold a multiple of {block_values} values, got shape {shape}")
    n_bytes = math.prod(shape) // block_values * block_bytes
    if data.dtype != np.uint8 or data.size != n_bytes:
        raise ShapeError(f"{ggml_type.name} tensor of shape {shape} needs {n_bytes} uint8 bytes, "
                         f"got {data.size} of dtype {data.dtype}")
    blocks = data.reshape(-1, block_bytes)        # [n_blocks, block_bytes]
    return DEQUANTIZERS[ggml_type](blocks).reshape(shape)
