"""How K and V are stored: the element codecs, and the slot store every layout keeps its K/V in.

A codec turns the float K or V of new positions into the stored form once, when they are written,
and turns the stored form back into floats when they are read. History is never re-encoded: every
layout copies stored bytes as they are (a fork, a copy-on-write, a save) and only ever decodes them.

    float64, float32, float16   stored as that NumPy type, read as is (no copy)
    bfloat16                    stored as the upper 16 bits of the float32 (uint16), rounded to nearest
                                even; read back as float32 (exact: bfloat16 is a prefix of float32)
    int8                        symmetric, one float32 scale per `group_size` consecutive elements along
                                head_dim: scale = max|x| / 127, q = rint(x / scale); read as q * scale

Shapes (legend in kvref/spec/ops.py):  data [..., Hkv, D],  scales [..., Hkv, D / group_size].
"""

from __future__ import annotations

import numpy as np

from ..errors import CacheError, DTypeError, ShapeError

# bytes per stored element; bfloat16 has no NumPy dtype, so sizes are looked up by name
ELEMENT_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
KV_DTYPES = ("float64", "float32", "float16", "bfloat16", "int8")
SCALE_DTYPE = np.dtype(np.float32)  # one per int8 group; 4 bytes
INT8_MAX = 127  # symmetric range [-127, 127]: -128 is never produced, so negation is exact


def dtype_name(dtype) -> str:
    """Normalise a dtype given as a name or a NumPy dtype to its name in ELEMENT_BYTES."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in ELEMENT_BYTES:
        raise DTypeError(f"dtype {dtype!r} is not supported; expected one of {sorted(ELEMENT_BYTES)}")
    return name


def default_group_size(head_dim: int) -> int:
    """32 elements per int8 scale when head_dim allows it (llama.cpp's Q8_0 block), else all of D."""
    return 32 if head_dim % 32 == 0 else head_dim


class Codec:
    """The stored form of one of K or V: element type and, for int8, the group size of its scales."""

    def __init__(self, name, head_dim: int, group_size: int | None = None):
        self.name = dtype_name(name)
        if self.name not in KV_DTYPES:
            raise DTypeError(f"K/V cannot be stored as {self.name!r}; expected one of {KV_DTYPES}")
        self.head_dim = int(head_dim)
        if self.name == "int8":
            g = default_group_size(head_dim) if group_size is None else group_size
            if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g <= 0 or head_dim % g:
                raise CacheError(f"group_size={g!r} must be a positive divisor of head_dim={head_dim}")
            self.group_size = int(g)
        else:
            self.group_size = None
        self.storage_dtype = np.dtype({"bfloat16": "uint16"}.get(self.name, self.name))
        # what a read returns: float types as stored; bfloat16 and int8 widen to float32
        self.read_dtype = np.dtype(self.name if self.name in ("float64", "float32", "float16") else "float32")

    @property
    def has_scales(self) -> bool:
        return self.group_size is not None

    @property
    def n_groups(self) -> int:
        return self.head_dim // self.group_size if self.has_scales else 0

    def bytes_per_vector(self) -> int:
        """Bytes of one stored head vector: D elements plus its scales."""
        return self.head_dim * ELEMENT_BYTES[self.name] + self.n_groups * SCALE_DTYPE.itemsize

    def describe(self) -> str:
        return f"int8/g{self.group_size}" if self.has_scales else self.name

    def encode(self, x):
        # [..., D] float -> (data [..., D] storage dtype, scales [..., D/g] float32 or None)
        if self.name == "bfloat16":
            return to_bfloat16(x), None
        if self.name == "int8":
            return quantize_int8(x, self.group_size)
        return np.asarray(x).astype(self.storage_dtype, copy=False), None

    def decode(self, data, scales):
        # (data [..., D], scales [..., D/g] or None) -> [..., D] in read_dtype; float types: no copy
        if self.name == "bfloat16":
            return from_bfloat16(data)
        if self.name == "int8":
            return dequantize_int8(data, scales, self.group_size)
        return data

    def roundtrip(self, x):
        """What a read returns for x after it was written: decode(encode(x))."""
        return self.decode(*self.encode(x))


def to_bfloat16(x):
    # [...] float -> [...] uint16: the upper half of the float32 bits, rounded to nearest, ties to even.
    # Inputs wider than float32 are first rounded to float32 (the native compute type).
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    # NaN must stay NaN: rounding could carry a NaN payload into the exponent (-> inf); keep it quiet
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x0040), rounded)
    return rounded.astype(np.uint16)


def from_bfloat16(u):
    # [...] uint16 -> [...] float32, exactly
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def quantize_int8(x, group_size: int):
    # [..., D] -> (q [..., D] int8, scales [..., D/g] float32); symmetric, one scale per group
    x = np.asarray(x, dtype=np.float32)
    D = x.shape[-1]
    if D % group_size:
        raise ShapeError(f"head_dim {D} is not a multiple of group_size {group_size}")
    groups = x.reshape(*x.shape[:-1], D // group_size, group_size)  # [..., D/g, g]
    amax = np.max(np.abs(groups), axis=-1)  # [..., D/g]
    scales = (amax / np.float32(INT8_MAX)).astype(np.float32)
    # an all-zero group has scale 0 and stores zeros; dividing by 1 there avoids 0/0
    safe = np.where(scales > 0, scales, np.float32(1))[..., None]
    q = np.clip(np.rint(groups / safe), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q.reshape(x.shape), scales


def dequantize_int8(q, scales, group_size: int):
    # (q [..., D] int8, scales [..., D/g] float32) -> [..., D] float32
    D = q.shape[-1]
    groups = q.reshape(*q.shape[:-1], D // group_size, group_size).astype(np.float32)
    return (groups * scales[..., None]).reshape(q.shape)


def readable_pair(k, v):
    """K and V in one dtype (the native attention needs them equal): the wider of the two read dtypes."""
    common = np.result_type(k.dtype, v.dtype)
    return k.astype(common, copy=False), v.astype(common, copy=False)


class SlotStore:
    """K and V of every layer at a grid of storage slots, in their stored forms.

    k, v          [L, *slots, Hkv, D]        storage dtype of each codec
    k_scales ...  [L, *slots, Hkv, D/g]      float32, only for int8 (else None)

    `slots` is (capacity,) for the contiguous and window layouts and (num_blocks, block_size) for the
    paged pool, so a kernel can address a position as [layer, block, offset] with no gather.
    A slot index is anything NumPy accepts for the slot axes (a slice, an array, a tuple of arrays).
    """

    def __init__(self, n_layers, slots: tuple, n_kv_heads, head_dim, k_codec: Codec, v_codec: Codec):
        self.k_codec, self.v_codec = k_codec, v_codec
        shape = (n_layers, *slots, n_kv_heads, head_dim)
        # zeros, not empty: untouched pages are never materialised, and nothing reads unwritten slots
        self.k = np.zeros(shape, dtype=k_codec.storage_dtype)
        self.v = np.zeros(shape, dtype=v_codec.storage_dtype)
        self.k_scales = self._scales(k_codec, shape)
        self.v_scales = self._scales(v_codec, shape)

    @staticmethod
    def _scales(codec, shape):
        return np.zeros((*shape[:-1], codec.n_groups), dtype=SCALE_DTYPE) if codec.has_scales else None

    @property
    def allocated_nbytes(self) -> int:
        return sum(a.nbytes for a in (self.k, self.v, self.k_scales, self.v_scales) if a is not None)

    def write(self, layer, index, k, v):
        """Encode K/V of new positions ([*index shape, Hkv, D]) once and store them at `index`."""
        self.write_raw(layer, index, (*self.k_codec.encode(k), *self.v_codec.encode(v)))

    def write_raw(self, layer, index, raw):
        """Store already encoded (k, k_scales, v, v_scales) at `index` (nothing is re-encoded)."""
        k, ks, v, vs = raw
        self.k[layer][index] = k
        self.v[layer][index] = v
        if ks is not None:
            self.k_scales[layer][index] = ks
        if vs is not None:
            self.v_scales[layer][index] = vs

    def read_raw(self, layer, index):
        """(k, k_scales, v, v_scales) at `index`, stored forms, as copies or views."""
        return (self.k[layer][index], _at(self.k_scales, layer, index),
                self.v[layer][index], _at(self.v_scales, layer, index))

    def read(self, layer, index):
        """Decoded K and V at `index`, in one common dtype: [*index shape, Hkv, D] each."""
        k, ks, v, vs = self.read_raw(layer, index)
        return readable_pair(self.k_codec.decode(k, ks), self.v_codec.decode(v, vs))

    def decode_raw(self, raw):
        k, ks, v, vs = raw
        return readable_pair(self.k_codec.decode(k, ks), self.v_codec.decode(v, vs))

    def copy_slots(self, dst, src):
        """Copy every layer's stored K/V (and scales) from slot index `src` to `dst`, bytes as they are."""
        for a in (self.k, self.v, self.k_scales, self.v_scales):
            if a is not None:
                a[:, dst] = a[:, src]

    def arrays(self):
        """(name, array) of every stored array, for the file format and for accounting."""
        out = [("k", self.k), ("v", self.v)]
        out += [(n, a) for n, a in (("k_scales", self.k_scales), ("v_scales", self.v_scales)) if a is not None]
        return out


def _at(a, layer, index):
    return None if a is None else a[layer][index]
