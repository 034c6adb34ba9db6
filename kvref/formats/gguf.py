"""GGUF reader: metadata, tensor table, and tensor bytes memory-mapped from the file.

A GGUF file (v2 and v3 share one layout; all little-endian) is

    header        magic b"GGUF", uint32 version, uint64 tensor count, uint64 metadata count
    metadata      key (string), uint32 value type, value               x metadata count
    tensor infos  name (string), uint32 n_dims, uint64 dims[n_dims],
                  uint32 ggml type, uint64 offset                      x tensor count
    padding       to `general.alignment` (default 32)
    tensor data   each tensor at data start + its offset (a multiple of the alignment)

where a string is a uint64 byte length and UTF-8 bytes, and an array is a uint32 item type, a uint64
count and the items. dims are innermost first (dims[0] is the length of a row); kvref reports shapes in
NumPy order, the reverse, so a weight is (N, K) = (out, in).

The file is untrusted input. Every length and count is checked against the bytes that remain before
anything is read or allocated, and every tensor against the file size, the alignment and the other
tensors; anything wrong raises GGUFError naming the byte offset, key or tensor.

Metadata values come back as plain Python values: int, float, bool, str. Arrays of numbers or bools
become 1-D NumPy arrays (owned copies, little-endian dtype of the file's item type); arrays of strings
or of arrays become lists.

Reference: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import enum
import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import GGUFError, ModelNotFoundError, ShapeError
from ..limits import open_regular_file
from ..spec import quants
from ..spec.ggml import BLOCK_LAYOUT, GGMLType, QuantizedTensor, row_nbytes

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MIN_ALIGNMENT = 8  # the GGUF spec: "must be a multiple of 8"; so F32 and F16 tensors start aligned
MAX_DIMS = 4  # GGML_MAX_DIMS: ggml tensors have at most 4 dimensions
MAX_ARRAY_NESTING = 8  # arrays of arrays deeper than this are rejected: bounds the recursion
MAX_ELEMENTS = 2**63 - 1  # ggml counts elements in an int64


class ValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# scalar value type -> (NumPy dtype, struct format) of its little-endian encoding; a bool is one byte, 0 or 1
_SCALARS = {
    ValueType.UINT8: ("<u1", "<B"), ValueType.INT8: ("<i1", "<b"),
    ValueType.UINT16: ("<u2", "<H"), ValueType.INT16: ("<i2", "<h"),
    ValueType.UINT32: ("<u4", "<I"), ValueType.INT32: ("<i4", "<i"),
    ValueType.UINT64: ("<u8", "<Q"), ValueType.INT64: ("<i8", "<q"),
    ValueType.FLOAT32: ("<f4", "<f"), ValueType.FLOAT64: ("<f8", "<d"),
    ValueType.BOOL: ("<u1", "<B"),
}
_SCALAR_DTYPES = {t: np.dtype(dtype) for t, (dtype, _) in _SCALARS.items()}
_SCALAR_STRUCTS = {t: struct.Struct(fmt) for t, (_, fmt) in _SCALARS.items()}
_U64 = _SCALAR_STRUCTS[ValueType.UINT64]

# Fewest bytes one value of a type can take; a count n of such values needs n times this.
_MIN_VALUE_BYTES = {**{t: dt.itemsize for t, dt in _SCALAR_DTYPES.items()},
                    ValueType.STRING: 8,          # the length
                    ValueType.ARRAY: 4 + 8}       # item type and count
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLType
    shape: tuple  # NumPy order: reversed GGUF dims, rows last; a weight is (N, K)
    offset: int  # absolute byte offset of the tensor's data in the file
    nbytes: int


class _Cursor:
    """Reads little-endian values at a moving position, checking each read against the file size."""

    def __init__(self, buf):
        self.buf = buf  # memoryview of the whole file
        self.size = len(buf)
        self.pos = 0

    def remaining(self):
        return self.size - self.pos

    def take(self, n, what):
        # Advance past n bytes and return where they start; refuses before anything is read.
        if n > self.remaining():
            raise GGUFError(f"truncated file: {what} at byte {self.pos} needs {n} bytes, "
                            f"only {self.remaining()} remain (file size {self.size})")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, vtype, what):
        start = self.take(_SCALAR_DTYPES[vtype].itemsize, what)
        return _SCALAR_STRUCTS[vtype].unpack_from(self.buf, start)[0]

    def u32(self, what):
        return self.scalar(ValueType.UINT32, what)

    def u64(self, what):
        return self.scalar(ValueType.UINT64, what)

    def count(self, min_item_bytes, what):
        # A count whose items could not fit in the rest of the file is refused before any loop or allocation.
        at = self.pos
        n = self.u64(what)
        if n * min_item_bytes > self.remaining():
            raise GGUFError(f"{what} is {n} at byte {at}, but the {self.remaining()} bytes left in the file "
                            f"hold at most {self.remaining() // min_item_bytes}")
        return n

    def string(self, what):
        # Written out rather than built on count() and take(): a vocabulary is ~10**5 strings, and
        # the message text is only formatted on error.
        at = self.take(8, what)
        n = _U64.unpack_from(self.buf, at)[0]
        start = self.pos
        if n > self.size - start:
            raise GGUFError(f"{what} at byte {at} has byte length {n}, "
                            f"but only {self.size - start} bytes remain (file size {self.size})")
        self.pos = start + n
        try:
            return str(self.buf[start:self.pos], "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what} at byte {start} is not valid UTF-8 ({e.reason} at byte {start + e.start})") from None

    def value_type(self, what):
        at = self.pos
        code = self.u32(what)
        try:
            return ValueType(code)
        except ValueError:
            raise GGUFError(f"unknown value type {code} for {what} at byte {at}") from None


def _read_value(cur, vtype, what, depth=0):
    if vtype == ValueType.STRING:
        return cur.string(what)
    if vtype == ValueType.ARRAY:
        return _read_array(cur, what, depth + 1)
    at = cur.pos
    value = cur.scalar(vtype, what)
    if vtype == ValueType.BOOL:
        if value > 1:
            raise GGUFError(f"{what} at byte {at} is a bool stored as {value}, expected 0 or 1")
        return bool(value)
    return value


def _read_array(cur, what, depth):
    if depth > MAX_ARRAY_NESTING:
        raise GGUFError(f"{what} at byte {cur.pos} nests arrays deeper than {MAX_ARRAY_NESTING} levels")
    item_type = cur.value_type(f"item type of {what}")
    n = cur.count(_MIN_VALUE_BYTES[item_type], f"item count of {what}")
    if item_type in _SCALAR_DTYPES:
        return _read_numeric_array(cur, item_type, n, what)
    if item_type == ValueType.STRING:
        return [cur.string(what) for _ in range(n)]
    return [_read_value(cur, item_type, what, depth) for _ in range(n)]


def _read_numeric_array(cur, item_type, n, what):
    dtype = _SCALAR_DTYPES[item_type]
    start = cur.take(n * dtype.itemsize, what)
    # A copy: metadata stays valid after the file is closed and pins no part of the mapping.
    items = np.frombuffer(cur.buf, dtype=dtype, count=n, offset=start).copy()
    if item_type == ValueType.BOOL:
        if np.any(items > 1):
            raise GGUFError(f"{what} at byte {start} holds a bool that is not 0 or 1")
        return items.view(np.bool_)
    return items


def _read_header(cur):
    start = cur.take(4, "magic")
    magic = bytes(cur.buf[start:start + 4])
    if magic != MAGIC:
        raise GGUFError(f"not a GGUF file: magic at byte 0 is {magic!r}, expected {MAGIC!r}")
    version = cur.u32("version")
    if version == 1:
        raise GGUFError("GGUF version 1 (32-bit counts, 2023) is not supported; "
                        "convert the file to version 3 with a current llama.cpp")
    if version not in SUPPORTED_VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
            raise GGUFError("big-endian GGUF files are not supported (version field at byte 4 is byte-swapped)")
        raise GGUFError(f"unsupported GGUF version {version} at byte 4; supported: {SUPPORTED_VERSIONS}")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.count(_MIN_KV_BYTES, "metadata count")
    return version, n_tensors, n_kv


def _read_metadata(cur, n_kv):
    metadata = {}
    for i in range(n_kv):
        at = cur.pos
        key = cur.string(f"key of metadata entry #{i}")
        if key in metadata:
            raise GGUFError(f"duplicate metadata key {key!r} at byte {at}")
        vtype = cur.value_type(f"value type of {key!r}")
        if key == "general.alignment" and vtype != ValueType.UINT32:
            raise GGUFError(f"'general.alignment' at byte {at} has type {vtype.name}, expected UINT32")
        metadata[key] = _read_value(cur, vtype, f"value of {key!r}")
    return metadata


def _alignment(metadata):
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment < MIN_ALIGNMENT or alignment & (alignment - 1):
        raise GGUFError(f"'general.alignment' is {alignment}, expected a power of two of at least {MIN_ALIGNMENT} "
                        "(the GGUF spec requires a multiple of 8)")
    return alignment


def _read_tensor_info(cur, index):
    # -> (name, ggml_type, shape, offset relative to the data start, nbytes), checked in itself
    name = cur.string(f"name of tensor #{index}")
    at = cur.pos
    n_dims = cur.u32(f"n_dims of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"tensor {name!r} has n_dims {n_dims} at byte {at}, expected 1..{MAX_DIMS}")
    dims = [cur.u64(f"dim {j} of tensor {name!r}") for j in range(n_dims)]
    at = cur.pos
    type_id = cur.u32(f"type of tensor {name!r}")
    try:
        ggml_type = GGMLType(type_id)
    except ValueError:
        raise GGUFError(f"tensor {name!r} has unknown ggml type id {type_id} at byte {at}") from None
    offset = cur.u64(f"offset of tensor {name!r}")
    n_elements = math.prod(dims)
    if n_elements == 0:
        raise GGUFError(f"tensor {name!r} has dims {dims}: a dimension of 0 (an empty tensor) is not supported")
    if n_elements > MAX_ELEMENTS:
        raise GGUFError(f"tensor {name!r} has dims {dims} whose product {n_elements} overflows int64")
    block_values, block_bytes = BLOCK_LAYOUT[ggml_type]
    if dims[0] % block_values:
        raise GGUFError(f"tensor {name!r} of type {ggml_type.name} has rows of {dims[0]} values, "
                        f"not a multiple of its block size {block_values}")
    nbytes = n_elements // block_values * block_bytes
    return name, ggml_type, tuple(reversed(dims)), offset, nbytes


def _read_tensor_infos(cur, n_tensors):
    entries = []
    seen = set()
    for i in range(n_tensors):
        at = cur.pos
        entry = _read_tensor_info(cur, i)
        if entry[0] in seen:
            raise GGUFError(f"duplicate tensor name {entry[0]!r} at byte {at}")
        seen.add(entry[0])
        entries.append(entry)
    return entries


def _place_tensors(entries, data_offset, file_size, alignment):
    # Turn relative offsets into TensorInfos once each tensor is known to lie inside the file, aligned,
    # and apart from every other tensor.
    data_size = max(0, file_size - data_offset)
    tensors = {}
    for name, ggml_type, shape, rel, nbytes in entries:
        if rel % alignment:
            raise GGUFError(f"tensor {name!r} has offset {rel}, not a multiple of the alignment {alignment}")
        if rel > data_size or nbytes > data_size - rel:
            raise GGUFError(f"tensor {name!r} ({nbytes} bytes at data offset {rel}, file byte {data_offset + rel}) "
                            f"extends past the end of the file ({file_size} bytes)")
        tensors[name] = TensorInfo(name, ggml_type, shape, data_offset + rel, nbytes)
    placed = sorted(tensors.values(), key=lambda t: t.offset)
    for before, after in zip(placed, placed[1:]):
        if after.offset < before.offset + before.nbytes:
            raise GGUFError(f"tensors {before.name!r} (bytes {before.offset}..{before.offset + before.nbytes}) "
                            f"and {after.name!r} (from byte {after.offset}) overlap")
    return tensors


class GGUFFile:
    """An open GGUF file: .version, .metadata, .tensors, .alignment, .data_offset; tensor bytes on demand.

    Tensor bytes are never copied: raw() returns read-only views of the memory-mapped file. Views stay
    valid after close(), which only drops this object's reference to the mapping.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self._data = _map_file(self.path)  # uint8 [file size], read-only
        try:
            with memoryview(self._data) as buf:
                self._parse(_Cursor(buf))
        except BaseException:
            self.close()
            raise

    def _parse(self, cur):
        self.version, n_tensors, n_kv = _read_header(cur)
        self.metadata = _read_metadata(cur, n_kv)
        self.alignment = _alignment(self.metadata)
        if n_tensors * _MIN_TENSOR_INFO_BYTES > cur.remaining():
            raise GGUFError(f"tensor count is {n_tensors} (byte 8), but the {cur.remaining()} bytes left after "
                            f"the metadata hold at most {cur.remaining() // _MIN_TENSOR_INFO_BYTES} tensor infos")
        entries = _read_tensor_infos(cur, n_tensors)
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = _place_tensors(entries, self.data_offset, cur.size, self.alignment)

    def header(self):
        """Read-only uint8 view of the bytes before the tensor data (header, metadata, tensor table), all
        parsed when the file was opened."""
        if self._data is None:
            raise GGUFError(f"{self.path} is closed")
        return self._data[:self.data_offset].view(np.ndarray)

    def close(self):
        self._data = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _info(self, name):
        if self._data is None:
            raise GGUFError(f"{self.path} is closed")
        if name not in self.tensors:
            raise GGUFError(f"no tensor named {name!r} in {self.path}")
        return self.tensors[name]

    def raw(self, name):
        """Read-only uint8 view of a tensor's bytes: [*shape[:-1], row_nbytes], i.e. [rows, row_nbytes] for a matrix."""
        info = self._info(name)
        rows = info.shape[:-1]
        data = self._data[info.offset:info.offset + info.nbytes].view(np.ndarray)
        return data.reshape(*rows, row_nbytes(info.ggml_type, info.shape[-1]))

    def quantized(self, name):
        """A matrix as stored: QuantizedTensor(ggml_type, (N, K), uint8 [N, row_nbytes] view), or a mixture's
        stack of X of them, (X, N, K) and uint8 [X, N, row_nbytes]."""
        info = self._info(name)
        if len(info.shape) not in (2, 3):
            raise ShapeError(f"tensor {name!r} has shape {info.shape}; a QuantizedTensor is a 2-D (N, K) matrix "
                             "or a 3-D (X, N, K) stack of experts")
        return QuantizedTensor(info.ggml_type, info.shape, self.raw(name))

    def dequantize(self, name):
        """A tensor as float32 of its NumPy shape (for F32 tensors, a read-only view of the file)."""
        info = self._info(name)
        if info.ggml_type not in quants.DEQUANTIZERS:
            raise GGUFError(f"tensor {name!r} has type {info.ggml_type.name}, which kvref cannot dequantize")
        return quants.dequantize(info.ggml_type, self.raw(name), info.shape)


def _map_file(path):
    # Memory-maps the whole file read-only; refuses files too short to hold a header before mapping
    # (an empty file cannot be mapped at all).
    try:
        f = open_regular_file(path, "GGUF file", GGUFError)  # a FIFO would block, a device never end
    except FileNotFoundError:
        raise ModelNotFoundError(f"no GGUF file at {path}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 4 + 4 + 8 + 8:
            raise GGUFError(f"truncated file: {path} has {size} bytes, a GGUF header needs 24")
        return np.memmap(f, dtype=np.uint8, mode="r", shape=(size,))
