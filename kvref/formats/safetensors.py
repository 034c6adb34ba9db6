"""safetensors files: the tensor table of a file and each tensor memory-mapped from it (read), and a
file from arrays (write_file).

A .safetensors file is

    header size   uint64 little-endian: N
    header        N bytes of UTF-8 JSON: {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
                  "__metadata__": {str: str}}   (optional metadata)
    data          the tensors' bytes, little-endian, C order; offsets count from the end of the header

The file is untrusted input. The header size is checked against the file before it is read, and every
entry before any tensor is used: a known dtype, non-negative integer dims, begin <= end inside the data,
end - begin = elements x element size, and no two tensors sharing a byte. Anything wrong raises
SafetensorsError naming the file and the tensor. A checkpoint sharded over several files
(model.safetensors.index.json, "weight_map": {name: file}) is read with `Checkpoint`.

write_file lays tensors out in the order given, each right after the previous one, behind a header
padded with spaces to a multiple of 8 bytes (as the reference writer does, so every tensor of a
float32 file starts 4-byte aligned once mapped).

Reference: https://github.com/huggingface/safetensors (format section of its README).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import ModelNotFoundError, SafetensorsError
from ..limits import open_regular_file, read_json_file
from ..spec.quants import dequantize_bf16

DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
          "I8": "i1", "U8": "u1", "BOOL": "?"}
MAX_HEADER_BYTES = 100 * 2**20  # the reference implementation refuses larger headers too
MAX_DIMS = 8
HEADER_ALIGNMENT = 8


class SafetensorsFile:
    """An open .safetensors file: .tensors {name: (dtype, shape, begin, end)}, .metadata; arrays on demand."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            f = open_regular_file(self.path, "safetensors file", SafetensorsError)
        except FileNotFoundError:
            raise ModelNotFoundError(f"no safetensors file at {self.path}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise SafetensorsError(f"{self.path} is truncated: {size} bytes, the header size alone needs 8")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise SafetensorsError(f"{self.path}: a header of {n} bytes does not fit in the {size - 8} bytes "
                                       f"after its size (at most {MAX_HEADER_BYTES})")
            header = _parse_header(f.read(n), self.path)
            self.data_offset = 8 + n
            self.metadata = header.pop("__metadata__", {})
            self.tensors = _check_entries(header, size - self.data_offset, self.path)
            self._data = np.memmap(f, dtype=np.uint8, mode="r", shape=(size,)) if size > self.data_offset else None

    def array(self, name) -> np.ndarray:
        """The tensor as a read-only array of its shape: float64/32/16 and ints as stored (a view of
        the mapped file), bfloat16 widened to float32 exactly."""
        if name not in self.tensors:
            raise SafetensorsError(f"no tensor named {name!r} in {self.path}")
        dtype, shape, begin, end = self.tensors[name]
        if begin == end:
            return np.zeros(shape, dtype=np.float32 if dtype == "BF16" else DTYPES[dtype])
        raw = self._data[self.data_offset + begin:self.data_offset + end].view(np.ndarray)
        values = raw.view(DTYPES[dtype]).reshape(shape)
        return dequantize_bf16(values.reshape(-1)).reshape(shape) if dtype == "BF16" else values


class Checkpoint:
    """Every tensor of an HF checkpoint directory: model.safetensors, or the shards its index names.

    Behaves as a read-only mapping {name: array} (tensors are read on access, views of mapped files).
    """

    def __init__(self, directory):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = read_json_file(index, "safetensors index", SafetensorsError)["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, KeyError, TypeError, AttributeError) as exc:
                raise SafetensorsError(f"{index}: not a safetensors index ({exc})") from None
            if any(not isinstance(s, str) or Path(s).name != s for s in shards):
                raise SafetensorsError(f"{index}: shard names must be file names in {directory}")
        elif (directory / "model.safetensors").is_file():
            shards = ["model.safetensors"]
        else:
            raise ModelNotFoundError(f"{directory} has no model.safetensors nor model.safetensors.index.json")
        self.files = [SafetensorsFile(directory / s) for s in shards]
        self._where = {}
        for file in self.files:
            for name in file.tensors:
                if name in self._where:
                    raise SafetensorsError(f"tensor {name!r} is in both {self._where[name].path} and {file.path}")
                self._where[name] = file

    def __contains__(self, name):
        return name in self._where

    def __getitem__(self, name):
        if name not in self._where:
            raise KeyError(name)
        return self._where[name].array(name)

    def keys(self):
        return self._where.keys()


def _parse_header(text, path):
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SafetensorsError(f"{path}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header must be a JSON object, not {type(header).__name__}")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or any(not isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
    return header


def _check_entries(header, data_size, path):
    tensors = {}
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"{where} must have exactly dtype, shape and data_offsets; got {entry!r}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise SafetensorsError(f"{where} has dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)):
            raise SafetensorsError(f"{where} has shape {shape!r}; expected at most {MAX_DIMS} integers >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise SafetensorsError(f"{where} has data_offsets {offsets!r}; expected [begin, end] within the "
                                   f"{data_size} data bytes")
        nbytes = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise SafetensorsError(f"{where}: {dtype} {shape} is {nbytes} bytes, its data_offsets span "
                                   f"{offsets[1] - offsets[0]}")
        tensors[name] = (dtype, tuple(shape), offsets[0], offsets[1])
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in tensors.items() if end > begin)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise SafetensorsError(f"{path}: tensors {first!r} and {second!r} share bytes")
    return tensors


def write_file(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write {name: (dtype, array)} to `path` as one .safetensors file; dtype is a safetensors code
    ("F32", "BF16", ...) and the array holds exactly its values (a bfloat16 tensor as uint16 bits).
    Written beside `path` and renamed: an interrupted write never leaves a file that looks complete."""
    header, offset = {}, 0
    if metadata:
        if any(not isinstance(k, str) or not isinstance(v, str) for k, v in metadata.items()):
            raise SafetensorsError("safetensors __metadata__ must map strings to strings")
        header["__metadata__"] = metadata
    for name, (dtype, array) in tensors.items():
        if dtype not in DTYPES or array.dtype != np.dtype(DTYPES[dtype]):
            raise SafetensorsError(f"tensor {name!r}: a {array.dtype} array cannot be written as {dtype!r}; "
                                   f"expected one of {DTYPES}")
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % HEADER_ALIGNMENT)
    path = Path(path)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for _, array in tensors.values():
                f.write(np.ascontiguousarray(array).data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
