"""A minimal GGUF writer for the tests: small valid files, and the pieces to assemble broken ones.

Test-only; the package reads GGUF and never writes it. Dims are given in GGUF order (innermost first).
"""

import struct

from kvref.formats.gguf import ValueType as V

_FORMATS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
            V.UINT64: "<Q", V.INT64: "<q", V.FLOAT32: "<f", V.FLOAT64: "<d", V.BOOL: "<B"}


def u32(n):
    return struct.pack("<I", n)


def u64(n):
    return struct.pack("<Q", n)


def string(s):
    # str, or bytes taken as they are (to write invalid UTF-8)
    data = s.encode() if isinstance(s, str) else s
    return u64(len(data)) + data


def value(vtype, v):
    """The encoding of one value; an array is given as (item_type, items)."""
    if vtype == V.STRING:
        return string(v)
    if vtype == V.ARRAY:
        item_type, items = v
        return u32(item_type) + u64(len(items)) + b"".join(value(item_type, x) for x in items)
    return struct.pack(_FORMATS[vtype], v)


def kv(key, vtype, v):
    return string(key) + u32(vtype) + value(vtype, v)


def header(n_tensors, n_kv, version=3, magic=b"GGUF"):
    return magic + u32(version) + u64(n_tensors) + u64(n_kv)


def tensor_info(name, dims, type_id, offset):
    return string(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(type_id) + u64(offset)


def assemble(kvs, infos, data=b"", alignment=32, version=3, n_kv=None, n_tensors=None):
    """A file from encoded pieces: header, metadata entries, tensor infos, padding, tensor data.

    The counts default to the number of pieces; pass them to lie about it.
    """
    head = header(len(infos) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv, version)
    head += b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data


def gguf_bytes(metadata, tensors, version=3):
    """A valid file. metadata: {key: (vtype, value)}; tensors: {name: (ggml_type, dims, data bytes)}.

    Tensors are laid out in order, each at the next aligned offset; nothing follows the last one, so
    cutting any byte off the end breaks the file.
    """
    alignment = metadata.get("general.alignment", (V.UINT32, 32))[1]
    infos, data = [], bytearray()
    for name, (ggml_type, dims, tensor_bytes) in tensors.items():
        data += bytes(-len(data) % alignment)
        infos.append(tensor_info(name, dims, ggml_type, len(data)))
        data += tensor_bytes
    kvs = [kv(key, vtype, v) for key, (vtype, v) in metadata.items()]
    return assemble(kvs, infos, bytes(data), alignment, version)
