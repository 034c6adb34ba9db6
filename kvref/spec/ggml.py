"""GGML tensor types: what a quantized block is, and the quantized tensor the kernels take.

A quantized tensor is a sequence of blocks; each block encodes `block_values` consecutive values of
one row in `block_bytes` bytes (BLOCK_LAYOUT). A row of K values therefore takes
K / block_values * block_bytes bytes, and rows are stored one after another (the matrix is [N, K],
out x in, like every weight in kvref). The type ids are GGML's, as GGUF files store them.

This is the spec's description of the weights: kvref.spec.quants defines each block's values,
the GGUF reader (kvref.formats) hands out QuantizedTensors, and the native kernels read them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30
    MXFP4 = 39


QK_K = 256  # values per super-block of the K-quants

# type -> (values per block, bytes per block)
BLOCK_LAYOUT = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.F64: (1, 8),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q8_1: (32, 4 + 4 + 32),
    GGMLType.Q2_K: (QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    GGMLType.Q3_K: (QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    GGMLType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    GGMLType.Q8_K: (QK_K, 4 + QK_K + QK_K // 16 * 2),
    GGMLType.MXFP4: (32, 1 + 16),
}


def row_nbytes(ggml_type: GGMLType, n_values: int) -> int:
    """Bytes of one row of n_values (a whole number of blocks)."""
    block_values, block_bytes = BLOCK_LAYOUT[ggml_type]
    return n_values // block_values * block_bytes


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight matrix kept exactly as the file stores it: raw blocks, row after row.

    Its values are kvref.spec.quants.dequantize(ggml_type, data, shape).

    data: uint8 [N, row_nbytes] (usually a read-only view into the memory-mapped file)
    shape: (N, K) logical values, out x in
    A mixture's stack of X experts' matrices (LayerWeights.experts_*) is one such tensor, as GGUF stores
    it: shape (X, N, K), data uint8 [X, N, row_nbytes].
    """

    ggml_type: GGMLType
    shape: tuple
    data: np.ndarray
