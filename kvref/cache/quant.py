"""How K and V are stored: the element codecs, and the slot store every layout keeps its K/V in.

A codec turns the float K or V of new positions into the stored form once, when they are written,
and turns the stored form back into floats when they are read. History is never re-encoded: every
layout copies stored bytes as they are (a fork, a copy-on-write, a save) and only ever decodes them.

    float64, float32, float16   stored as that NumPy type, read as is (no copy)
    bfloat16                    stored as the upper 16 bits of the float32 (uint16), rounded to nearest
                                even; read back as float32 (exact: bfloat16 is a prefix of float32)
    int8                        symmetric, one float32 scale per `group_size` consecutive elements along
                                head_dim: scale = max|x| / 127, q = rint(x / scale); read as q * scale
    kivi4                       4-bit in the KIVI manner (Liu et al. 2024): unsigned nibbles,
                                asymmetric (min/max -> scale, zero), two per byte (element 2i in the low
                                nibble of byte i); K per channel over a group of `group_size`
                                consecutive positions (K has outlier channels), V per token over
                                `group_size` consecutive elements along head_dim. Read as q * scale + zero.
                                K of positions whose group has not filled yet (the residual) stays in
                                float16 beside the store until the group completes (KiviResidual).

Shapes (legend in kvref/spec/ops.py):  data [..., Hkv, D],  scales [..., Hkv, D / group_size];
kivi4: data [..., Hkv, D/2] uint8; V params [..., Hkv, D/g, 2], a (scale, zero) float32 pair per group;
K params [..., Hkv, 2, D] per group of positions: the D channels' scales, then their zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import CacheError, DTypeError, ShapeError

# bytes per stored element; bfloat16 has no NumPy dtype, so sizes are looked up by name
ELEMENT_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "kivi4": 0.5}
KV_DTYPES = ("float64", "float32", "float16", "bfloat16", "int8", "kivi4")
GROUPED_DTYPES = ("int8", "kivi4")  # the codecs with a group_size
KIVI = "kivi4"
# K can be moved to another position (re-rotated) without rounding history a second time only when
# it is stored at least as wide as the arithmetic that rotates it.
SHIFTABLE_K_DTYPES = ("float64", "float32")
SCALE_DTYPE = np.dtype(np.float32)  # one per int8 group; 4 bytes
INT8_MAX = 127  # symmetric range [-127, 127]: -128 is never produced, so negation is exact
NIBBLE_MAX = 15  # unsigned 4-bit levels 0..15
RESIDUAL_DTYPE = np.dtype(np.float16)  # KIVI keeps the unfilled K group in half precision
KIVI_MAX_GROUP = 256  # positions of a K group the native kernels quantize at once (csrc/internal.h)


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
        if self.name in GROUPED_DTYPES:
            g = default_group_size(head_dim) if group_size is None else group_size
            if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g <= 0 or head_dim % g:
                raise CacheError(f"group_size={g!r} must be a positive divisor of head_dim={head_dim}")
            if self.name == KIVI and (head_dim % 2 or g > KIVI_MAX_GROUP):
                raise CacheError(f"kivi4 packs two elements per byte and groups at most {KIVI_MAX_GROUP} "
                                 f"positions: head_dim={head_dim} must be even and group_size={g} <= {KIVI_MAX_GROUP}")
            self.group_size = int(g)
        else:
            self.group_size = None
        self.storage_dtype = np.dtype({"bfloat16": "uint16", KIVI: "uint8"}.get(self.name, self.name))
        # stored elements per head vector: two nibbles share a byte
        self.stored_dim = self.head_dim // 2 if self.name == KIVI else self.head_dim
        # what a read returns: float types as stored; bfloat16, int8 and kivi4 widen to float32
        self.read_dtype = np.dtype(self.name if self.name in ("float64", "float32", "float16") else "float32")

    @property
    def has_scales(self) -> bool:
        return self.group_size is not None

    @property
    def n_groups(self) -> int:
        return self.head_dim // self.group_size if self.has_scales else 0

    @property
    def scale_width(self) -> int:
        """Scale entries per group: int8 a scale; kivi4 a (scale, zero) pair."""
        return 2 if self.name == KIVI else 1

    def bytes_per_vector(self) -> int:
        """Bytes of one stored head vector: D elements plus its scales. For kivi4 (K or V alike) that is
        D/2 bytes of nibbles plus (scale, zero) per group of g: per token for V, and for K the D pairs of
        a group of g positions shared by its g positions (the float16 residual, at most g - 1 positions,
        is not counted)."""
        return self.stored_dim * self.storage_dtype.itemsize + self.n_groups * self.scale_width * SCALE_DTYPE.itemsize

    @property
    def groups_positions(self) -> bool:
        """Whether, as K, this codec quantizes groups of positions together (kivi4: per channel over
        group_size positions, the unfilled group kept in float16 in a KiviResidual): such a K needs a
        layout that keeps whole groups, and is truncated exactly only where no quantized group is cut."""
        return self.name == KIVI

    def truncate_problem(self, length: int, n: int) -> str | None:
        """As K: why truncating `length` positions to n would not be exact (None when it would): a group
        that is already quantized cannot give back its float16 K."""
        if not self.groups_positions:
            return None
        g = self.group_size
        if n % g and n < length // g * g:
            return (f"positions {n // g * g}..{n // g * g + g - 1} form a kivi4 K group that is already "
                    f"quantized; only a truncation to a multiple of {g} or to {length // g * g} or later is exact")
        return None

    def rollback_problem(self, length: int, n_new: int) -> str | None:
        """As K: why an execution of n_new positions after `length` could not be truncated away again
        exactly (it would complete a group, quantizing positions after length); None when it could."""
        if not self.groups_positions:
            return None
        g, end = self.group_size, length + n_new
        if end // g * g > length:
            return (f"the {n_new} positions would complete the kivi4 K group ending at position "
                    f"{end // g * g - 1}; truncating into a quantized group is not exact")
        return None

    def describe(self) -> str:
        return f"{self.name}/g{self.group_size}" if self.has_scales else self.name

    def encode(self, x):
        # [..., D] float -> (data [..., D] storage dtype, scales [..., D/g] float32 or None)
        if self.name == "bfloat16":
            return to_bfloat16(x), None
        if self.name == "int8":
            return quantize_int8(x, self.group_size)
        if self.name == KIVI:  # per token (V); K goes through encode_channels
            return quantize_uint4(x, self.group_size)
        return np.asarray(x).astype(self.storage_dtype, copy=False), None

    def decode(self, data, scales):
        # (data [..., D], scales [..., D/g] or None) -> [..., D] in read_dtype; float types: no copy
        if self.name == "bfloat16":
            return from_bfloat16(data)
        if self.name == "int8":
            return dequantize_int8(data, scales, self.group_size)
        if self.name == KIVI:
            return dequantize_uint4(data, scales, self.group_size)
        return data

    def encode_channels(self, x):
        """kivi4 K: [n*g, ..., D] (n whole groups of g positions) -> (data [n*g, ..., D/2] uint8,
        params [n, ..., 2, D] float32): each channel of each group gets its own scale and zero."""
        x = np.asarray(x, dtype=np.float32)
        g = self.group_size
        groups = np.moveaxis(x.reshape(-1, g, *x.shape[1:]), 1, -1)  # [n, ..., D, g]
        q, params = quantize_uint4_levels(groups)  # [n, ..., D, g], [n, ..., D, 2]
        return pack_nibbles(np.moveaxis(q, -1, 1).reshape(x.shape)), np.swapaxes(params, -1, -2).copy()

    def decode_channels(self, data, params):
        """kivi4 K: (data [n*g, ..., D/2], params [n, ..., 2, D]) -> [n*g, ..., D] float32."""
        q = unpack_nibbles(data).astype(np.float32)  # [n*g, ..., D]
        n = params.shape[0]
        q = q.reshape(n, self.group_size, *q.shape[1:])  # [n, g, ..., D]
        return (q * params[:, None, ..., 0, :] + params[:, None, ..., 1, :]).reshape(-1, *q.shape[2:])

    def roundtrip(self, x):
        """What a read returns for x after it was written: decode(encode(x))."""
        return self.decode(*self.encode(x))


def kv_codecs(k_dtype, v_dtype, head_dim: int, group_size=None, latent_dim=None) -> tuple:
    """(K codec, V codec) of a cache storing head vectors of head_dim elements; v_dtype None: K's type.

    latent_dim (MLA's kv_lora_rank R): a latent cache. Its K is the latent key [c_kv ; k_rope] and V is
    not stored (a V codec of no elements): a query reads V as K's first R elements. int8 then means the
    latent key in groups of group_size along its whole width, scales beside it, and V is the same bytes:
    so a group never straddles the end of c_kv (group_size divides R), and V has no type of its own.
    """
    if latent_dim is None:
        v = k_dtype if v_dtype is None else v_dtype
        return Codec(k_dtype, head_dim, group_size), Codec(v, head_dim, group_size)
    if v_dtype not in (None, k_dtype):
        raise CacheError(f"a latent (MLA) cache stores no V, only the latent key whose first {latent_dim} values "
                         f"V is read from: give kv_dtype or k_dtype, not v_dtype={v_dtype!r}")
    if dtype_name(k_dtype) == KIVI:
        raise CacheError("kivi4 quantizes K per channel over positions and V per position; a latent key is both "
                         "at once, so a latent (MLA) cache cannot store kivi4 (use int8)")
    if group_size is None and dtype_name(k_dtype) in GROUPED_DTYPES:
        group_size = default_group_size(math.gcd(latent_dim, head_dim))
    k = Codec(k_dtype, head_dim, group_size)
    if k.has_scales and latent_dim % k.group_size:
        raise CacheError(f"group_size={k.group_size} must divide kv_lora_rank={latent_dim} too: V is the latent "
                         "key's first kv_lora_rank values and reads their int8 groups")
    return k, Codec(k_dtype, 0, group_size)


@dataclass(frozen=True)
class Codecs:
    """The stored forms of K and V a cache is made with (kvref.cache.make).

    request   what the caller asked for: (K type, V type, group size or None); None when the model's
              default was taken, which a sequence added to an existing pool leaves to the pool
    """

    k: Codec
    v: Codec
    request: tuple | None = None

    @classmethod
    def named(cls, k_dtype, v_dtype, head_dim: int, group_size=None, asked: bool = True,
              latent_dim=None) -> "Codecs":
        """Codecs for the K and V type names; group_size applies to the grouped types only. asked:
        whether the caller named them (False: the model's default). latent_dim: a latent cache (kv_codecs)."""
        if group_size is not None and not set(GROUPED_DTYPES) & {k_dtype, v_dtype}:
            raise CacheError(f"group_size={group_size!r} applies to int8 K/V and kivi4; these are {k_dtype}/{v_dtype}")
        request = (k_dtype, v_dtype, group_size) if asked else None
        return cls(*kv_codecs(k_dtype, v_dtype, head_dim, group_size, latent_dim), request)

    @property
    def group_size(self) -> int | None:
        """Elements per int8 scale along head_dim (None when neither K nor V is grouped)."""
        return self.k.group_size or self.v.group_size

    def bytes_per_position(self, n_layers: int, n_kv_heads: int) -> int:
        """Bytes one position occupies in every layer: K and V vectors per kv head, plus their scales."""
        return n_layers * n_kv_heads * (self.k.bytes_per_vector() + self.v.bytes_per_vector())


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
    safe = np.where(scales > 0, _finite_or_one(scales), np.float32(1))[..., None]
    q = _levels(np.rint(groups / safe), scales, -INT8_MAX, INT8_MAX, np.int8)
    return q.reshape(x.shape), scales


def dequantize_int8(q, scales, group_size: int):
    # (q [..., D] int8, scales [..., D/g] float32) -> [..., D] float32
    D = q.shape[-1]
    groups = q.reshape(*q.shape[:-1], D // group_size, group_size).astype(np.float32)
    return (groups * scales[..., None]).reshape(q.shape)


def quantize_uint4_levels(groups):
    # [..., n] -> (q [..., n] uint8 levels 0..15, params [..., 2] float32 (scale, zero)) over the last axis:
    # zero = min, scale = (max - min) / 15, q = rint((x - zero) / scale): the min is stored exactly
    lo = np.min(groups, axis=-1)
    scale = ((np.max(groups, axis=-1) - lo) / np.float32(NIBBLE_MAX)).astype(np.float32)
    # a constant group has scale 0 and stores zeros; dividing by 1 there avoids 0/0
    safe = np.where(scale > 0, _finite_or_one(scale), np.float32(1))[..., None]
    shift = np.where(np.isfinite(scale), lo, np.float32(0))[..., None]
    q = _levels(np.rint((groups - shift) / safe), scale, 0, NIBBLE_MAX, np.uint8)
    return q, np.stack([scale, lo], axis=-1).astype(np.float32)


def _finite_or_one(scales):
    return np.where(np.isfinite(scales), scales, np.float32(1))


def _levels(r, scales, low, high, dtype):
    # [..., n/g, g] rounded values -> stored levels. A group holding a NaN or an infinity has a NaN or
    # infinite scale, so it decodes to NaN whatever its levels (0 * inf and q * NaN are NaN): it stores
    # zeros, as csrc/kvcache.c does, where a cast of its NaN quotients would be undefined (and warns)
    return np.where(np.isfinite(scales)[..., None], np.clip(r, low, high), 0).astype(dtype)


def quantize_uint4(x, group_size: int):
    # [..., D] -> (q [..., D/2] uint8 nibbles, params [..., D/g, 2] float32); per token, groups along D
    x = np.asarray(x, dtype=np.float32)
    D = x.shape[-1]
    if D % group_size:
        raise ShapeError(f"head_dim {D} is not a multiple of group_size {group_size}")
    q, params = quantize_uint4_levels(x.reshape(*x.shape[:-1], D // group_size, group_size))
    return pack_nibbles(q.reshape(x.shape)), params


def dequantize_uint4(data, params, group_size: int):
    # (q [..., D/2] uint8 nibbles, params [..., D/g, 2] float32) -> [..., D] float32
    q = unpack_nibbles(data).astype(np.float32)
    groups = q.reshape(*q.shape[:-1], q.shape[-1] // group_size, group_size)
    return (groups * params[..., 0:1] + params[..., 1:2]).reshape(q.shape)


def pack_nibbles(q):
    # [..., D] levels 0..15 -> [..., D/2] uint8: element 2i in the low nibble of byte i, 2i + 1 in the high
    q = np.asarray(q, dtype=np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_nibbles(data):
    # [..., D/2] uint8 -> [..., D] uint8 levels 0..15
    data = np.asarray(data, dtype=np.uint8)
    return np.stack([data & np.uint8(15), data >> np.uint8(4)], axis=-1).reshape(*data.shape[:-1], 2 * data.shape[-1])


def readable_pair(k, v):
    """K and V in one dtype (the native attention needs them equal): the wider of the two read dtypes."""
    common = np.result_type(k.dtype, v.dtype)
    return k.astype(common, copy=False), v.astype(common, copy=False)


class SlotStore:
    """K and V of every layer at a grid of storage slots, in their stored forms.

    k, v          [L, *slots, Hkv, D]        storage dtype of each codec (kivi4: [L, *slots, Hkv, D/2])
    k_scales ...  [L, *slots, Hkv, D/g]      float32, only for int8 (else None); kivi4 V: [..., D/g, 2]
    kivi4 K       k_scales [L, *group slots, Hkv, 2, D]: the slots' last axis in groups of g (the group
                  of slot (..., s) is (..., s // g)); the layouts keep the K of an unfilled group in a
                  KiviResidual and write whole groups (write_k_groups)

    `slots` is (capacity,) for the contiguous and window layouts and (num_blocks, block_size) for the
    paged pool, so a kernel can address a position as [layer, block, offset] with no gather.
    A slot index is anything NumPy accepts for the slot axes (a slice, an array, a tuple of arrays).
    """

    def __init__(self, n_layers, slots: tuple, n_kv_heads, head_dim, k_codec: Codec, v_codec: Codec):
        self.k_codec, self.v_codec = k_codec, v_codec
        shape = (n_layers, *slots, n_kv_heads)
        # zeros, not empty: untouched pages are never materialised, and nothing reads unwritten slots.
        # NumPy asks for transparent huge pages on arrays this large, and each layer fills from its
        # first slot, so a short run makes a 2 MiB page resident per layer in K and in V (~130 MiB
        # more for a short run on SmolLM2); 4 KiB pages would avoid that, but decode at 4K positions
        # measured ~10% slower with them.
        self.k = np.zeros((*shape, k_codec.stored_dim), dtype=k_codec.storage_dtype)
        self.v = np.zeros((*shape, v_codec.stored_dim), dtype=v_codec.storage_dtype)
        if k_codec.name == KIVI:
            groups = (n_layers, *slots[:-1], -(-slots[-1] // k_codec.group_size), n_kv_heads, 2, head_dim)
            self.k_scales = np.zeros(groups, dtype=SCALE_DTYPE)
        else:
            self.k_scales = self._scales(k_codec, shape)
        self.v_scales = self._scales(v_codec, shape)

    @staticmethod
    def _scales(codec, shape):
        if not codec.has_scales:
            return None
        width = (2,) if codec.name == KIVI else ()
        return np.zeros((*shape, codec.n_groups, *width), dtype=SCALE_DTYPE)

    @property
    def allocated_nbytes(self) -> int:
        return sum(a.nbytes for a in (self.k, self.v, self.k_scales, self.v_scales) if a is not None)

    @property
    def per_channel_k(self) -> bool:
        """Whether K is kivi4: written a whole group of positions at a time, through a KiviResidual."""
        return self.k_codec.name == KIVI

    def write(self, layer, index, k, v):
        """Encode K/V of new positions ([*index shape, Hkv, D]) once and store them at `index`."""
        self.write_raw(layer, index, (*self.k_codec.encode(k), *self.v_codec.encode(v)))

    def write_v(self, layer, index, v):
        """Encode V of new positions ([*index shape, Hkv, D]) once and store it at `index`."""
        data, scales = self.v_codec.encode(v)
        self.v[layer][index] = data
        if scales is not None:
            self.v_scales[layer][index] = scales

    def write_k_groups(self, layer, index, group_index, k):
        """kivi4 K of whole groups of positions: k [n*g, Hkv, D] at slots `index` ([n*g]), the groups'
        (scale, zero) per channel at group slots `group_index` ([n]); encoded once."""
        data, params = self.k_codec.encode_channels(k)
        self.k[layer][index] = data
        self.k_scales[layer][group_index] = params

    def read_k_groups(self, layer, index, group_index):
        """kivi4 K of whole groups, decoded: [n*g, Hkv, D] float32 (indices as write_k_groups)."""
        return self.k_codec.decode_channels(self.k[layer][index], self.k_scales[layer][group_index])

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
        if self.k_scales is not None:
            out.append(("k_scales", self.k_scales))
        if self.v_scales is not None:
            out.append(("v_scales", self.v_scales))
        return out


# why a kivi4 K cache has no rows to read raw (read() decodes it)
KIVI_NO_ROWS = "kivi4 K is stored per group of positions (and a float16 residual), not row by row: read() decodes it"


class KiviResidual:
    """kivi4 K of the positions whose group of g positions has not filled yet, kept in float16.

    rows [L, g, Hkv, D] float16: position p >= length // g * g at row p % g (length % g rows are live).
    An execution's `write` quantizes every group its positions complete into the store (from the
    float16 K, so a group is encoded the same however its positions were split into executions) and
    stages the rest; `commit` adopts the staged rows, `abort` drops them, so until the commit the
    rows are as they were. The K a query reads is the store's groups then these rows (`read_k`).

    A layout maps positions to slots and group numbers to group slots: `slots(p [n])` and
    `groups(i [n])` return store indices (contiguous: themselves; paged: through the block table).
    """

    def __init__(self, n_layers, group_size, n_kv_heads, head_dim):
        self.group_size = group_size
        self.rows = np.zeros((n_layers, group_size, n_kv_heads, head_dim), dtype=RESIDUAL_DTYPE)
        self.staged = {}  # layer -> rows [r, Hkv, D] an open execution leaves behind
        self.staged_rows = None  # or all rows [L, g, Hkv, D], staged for a write in place

    def copy(self) -> "KiviResidual":
        child = KiviResidual(self.rows.shape[0], self.group_size, *self.rows.shape[2:])
        child.rows[...] = self.rows
        return child

    def write(self, store, layer, start, k, v, slots, groups):
        # K/V [T, Hkv, D] of positions start..start+T-1 into the store and the staged rows
        g, end = self.group_size, start + len(k)
        q0, q1 = start // g * g, end // g * g  # first unquantized position before and after
        pending = np.concatenate([self.rows[layer, :start - q0], k.astype(RESIDUAL_DTYPE)])  # [end - q0, Hkv, D]
        store.write_v(layer, slots(np.arange(start, end)), v)
        if q1 > q0:
            store.write_k_groups(layer, slots(np.arange(q0, q1)), groups(np.arange(q0 // g, q1 // g)),
                                 pending[:q1 - q0])
        self.staged[layer] = pending[q1 - q0:]

    def read_k(self, store, layer, end, slots, groups):
        # -> [end, Hkv, D] float32: the groups before end // g * g, then the residual (staged if written)
        g = self.group_size
        q = end // g * g
        rows = self.staged[layer] if layer in self.staged else self.rows[layer, :end - q]
        quantized = store.read_k_groups(layer, slots(np.arange(q)), groups(np.arange(q // g)))
        return np.concatenate([quantized, rows.astype(np.float32)])

    def read(self, store, layer, end, slots, groups):
        # -> (k, v) [end, Hkv, D] each, one dtype, decoded
        p = slots(np.arange(end))
        v = store.v_codec.decode(store.v[layer][p], _at(store.v_scales, layer, p))
        return readable_pair(self.read_k(store, layer, end, slots, groups), v)

    def stage_in_place(self):
        """A copy of the rows for a caller that writes every layer's new K in place (the native
        forward, which quantizes the groups it completes itself); the commit adopts it."""
        self.staged_rows = self.rows.copy()
        return self.staged_rows

    def commit(self):
        if self.staged_rows is not None:
            self.rows[...] = self.staged_rows
        for layer, rows in self.staged.items():
            self.rows[layer, :len(rows)] = rows
        self.abort()

    def abort(self):
        self.staged.clear()
        self.staged_rows = None

def _at(a, layer, index):
    return None if a is None else a[layer][index]
