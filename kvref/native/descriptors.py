"""Descriptors of K/V arrays for C (csrc/kvref.h, kvref_kv): a cache's storage, or plain arrays, checked
before any pointer is taken (dtype, shape, contiguity, alignment, block ids in range), so C never reads
past what NumPy holds. The fused forward and the native attention kernel take them.
"""

from __future__ import annotations

import math

import numpy as np

from ..cache.quant import KIVI, RESIDUAL_DTYPE, SCALE_DTYPE
from ..errors import CacheError
from ._kvref import ffi, lib

#: K/V storage types (kvref.cache codec names) the native kernels read, and write, in place
KV_TYPES = {"float32": lib.KVREF_TYPE_F32, "float16": lib.KVREF_TYPE_F16, "bfloat16": lib.KVREF_TYPE_BF16,
            "int8": lib.KVREF_TYPE_I8, "kivi4": lib.KVREF_TYPE_KIVI4}
_I64 = np.dtype(np.int64)


class KVDescriptor:
    """A kvref_kv descriptor (csrc/kvref.h) and the arrays it points into, kept alive with it.
    Without rings the arrays are [L, *slots, Hkv, D]; with layer_ring (int64 [L]) they are
    [1, sum of extents, Hkv, D] and n_slots is the extent of a layer without a ring. kivi4 K/V hold
    D / 2 bytes a vector (head_dim says D) and kivi4 K its float16 residual rows (k_residual). v_dim: the
    values' width Dv, each V vector's first Dv elements (None: D); a latent cache's V is its K."""

    def __init__(self, k, v, k_scales, v_scales, k_type, v_type, group_size, block_table=None, block_size=1,
                 layer_ring=None, n_slots=None, head_dim=None, k_residual=None, v_dim=None):
        L, Hkv = k.shape[0] if layer_ring is None else layer_ring.shape[0], k.shape[-2]
        D = k.shape[-1] if head_dim is None else head_dim
        self._keep = []  # what the descriptor points into, pinned with us
        for a in (k, v, k_scales, v_scales, block_table, layer_ring, k_residual):
            self._keep.append(ffi.NULL if a is None else ffi.from_buffer(a, require_writable=a.flags.writeable))
        d = self.ptr = ffi.new("kvref_kv *")
        d.k, d.v = self._keep[0], self._keep[1]
        d.k_scales, d.v_scales = ffi.cast("float *", self._keep[2]), ffi.cast("float *", self._keep[3])
        d.k_type, d.v_type, d.group_size = k_type, v_type, group_size or 0
        d.n_layers, d.n_kv_heads, d.head_dim = L, Hkv, D
        d.n_slots = math.prod(k.shape[1:-2]) if n_slots is None else n_slots
        d.block_table = ffi.cast("const int64_t *", self._keep[4])
        d.n_blocks = 0 if block_table is None else block_table.shape[0]
        d.block_size = block_size
        d.layer_ring = ffi.cast("const int64_t *", self._keep[5])
        d.k_residual = ffi.cast("uint16_t *", self._keep[6])
        d.v_dim = 0 if v_dim is None else v_dim


def in_place_problem(cache) -> str | None:
    """Why the native kernels cannot read and write `cache`'s K/V where they lie (None when they can):
    the layout's own answer (cache.capabilities.in_place), or a K/V type the kernels do not read."""
    problem = cache.capabilities.in_place.reason
    if problem is None and (cache.k_dtype not in KV_TYPES or cache.v_dtype not in KV_TYPES):
        problem = f"K/V are stored as {cache.dtype_name}; the native kernels read {tuple(KV_TYPES)} in place"
    return problem


def cache_descriptor(cache, storage=None, checked=False, kept=None) -> KVDescriptor:
    """The kvref_kv of a cache's storage (cache.storage(), or `storage`: an open execution's, reserved
    blocks included), every array checked; CacheError if C cannot use it in place. `checked`: the caller
    knows in_place_problem(cache) is None (fixed for a cache's life: the native executor asked when it
    was chosen); the arrays are checked all the same.

    kept: a weakref.WeakKeyDictionary {slot store: KVDescriptor} the caller keeps from one call to the
    next (the fused forward). A descriptor is reused while the storage has no block table and no kivi4
    residual (both change every execution) and describes the same array objects, each still writeable,
    and the same rings tuple: a contiguous or hybrid cache's on every step. The descriptor keeps those
    objects alive, so no other object can take their ids; it goes when the store does (cache.free())."""
    problem = None if checked else in_place_problem(cache)
    if problem is not None:
        raise CacheError(f"the native kernels cannot use this {cache.layout} cache in place: {problem}")
    storage = cache.storage() if storage is None else storage
    store, source = storage.store, None
    ring_tuple, layer_slots = storage.layer_rings, storage.layer_slots
    if (kept is not None and storage.block_table is None and storage.k_residual is None
            and (ring_tuple is None or type(ring_tuple) is tuple) and type(layer_slots) is int):
        stored = (store.k, store.v, store.k_scales, store.v_scales)
        source = (*map(id, stored), id(ring_tuple), layer_slots)
        kv = kept.get(store)
        for a in stored:
            if a is not None and not a.flags.writeable:
                kv = None  # made read-only since: checked (and refused) below
        if kv is not None and kv.source == source:
            return kv
    L, Hkv, D, slots = cache.n_layers, cache.n_kv_heads, cache.head_dim, store.k.shape[1:-2]
    rings = _layer_rings(storage, L)
    layers = L if rings is None else 1
    if rings is not None:
        slots = (int(sum(r if r > 0 else storage.layer_slots for r in rings.tolist())),)
    arrays = store.arrays()
    if storage.k_residual is not None:
        arrays.append(("k_residual", storage.k_residual))
    for name, a in arrays:
        dtype, shape = _stored_shape(store, name, (layers, *slots, Hkv), D)
        if (a.shape != shape or a.dtype != dtype or not a.flags.c_contiguous or not a.flags.aligned
                or not a.flags.writeable):
            raise CacheError(f"cache {name} must be a writeable C-contiguous {dtype} array of shape {shape}; got "
                             f"{a.dtype} {a.shape}, strides {a.strides}, writeable={a.flags.writeable}")
    table = storage.block_table
    if table is not None:
        n_blocks = store.k.shape[1]
        if (table.dtype != _I64 or table.ndim != 1 or storage.block_size != store.k.shape[2]
                or (table.size and (table.min() < 0 or table.max() >= n_blocks))):
            raise CacheError(f"block table must be int64 ids in [0, {n_blocks}) of blocks of {store.k.shape[2]}")
        table = np.require(table, requirements=["C", "A"])  # C reads int64s: contiguous and aligned
    group = store.k_codec.group_size or store.v_codec.group_size
    v, v_scales, v_codec = store.v, store.v_scales, store.v_codec
    if cache.latent_dim is not None:  # MLA: no V is stored; it is the latent key's first latent_dim values
        v, v_scales, v_codec = store.k, store.k_scales, store.k_codec
    kv = KVDescriptor(store.k, v, store.k_scales, v_scales, KV_TYPES[store.k_codec.name],
                      KV_TYPES[v_codec.name], group, table, storage.block_size, rings,
                      None if rings is None else storage.layer_slots, D, storage.k_residual, cache.latent_dim)
    if source is not None:
        kv.source, kv.ring_tuple = source, ring_tuple  # the tuple kept alive: its id is in source
        kept[store] = kv
    return kv


def _stored_shape(store, name, grid, D):
    """(dtype, shape) a slot store's array `name` must have; grid = (layers, *slots, Hkv)."""
    codec = store.v_codec if name.startswith("v") else store.k_codec
    if name in ("k", "v"):
        return codec.storage_dtype, (*grid, codec.stored_dim)
    g = codec.group_size
    if name == "k_residual":  # kivi4 K: the unfilled group's float16 rows
        return RESIDUAL_DTYPE, (grid[0], g, grid[-1], D)
    if codec.name == KIVI and name == "k_scales":  # per group of g slots: scales [D], then zeros [D]
        return SCALE_DTYPE, (*grid[:-2], -(-grid[-2] // g), grid[-1], 2, D)
    return SCALE_DTYPE, (*grid, codec.n_groups, *((2,) if codec.name == KIVI else ()))


def _layer_rings(storage, n_layers):
    """Storage.layer_rings as int64 [n_layers] (None without rings), checked; CacheError otherwise."""
    rings = storage.layer_rings
    if rings is None:
        return None
    slots = storage.layer_slots
    if (storage.block_table is not None or len(rings) != n_layers
            or any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0 for r in rings)
            or isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 0):
        raise CacheError(f"layer_rings={rings!r} must be {n_layers} ints >= 0 (without a block table) and "
                         f"layer_slots={slots!r} an int >= 0")
    return np.array(rings, dtype=_I64)


def ring_positions(ring, written) -> np.ndarray:
    """The position each slot of a ring of `ring` slots holds after positions 0 .. written-1 were
    written (slot j: the last p < written with p % ring == j): int64 [min(ring, written)]."""
    j = np.arange(min(ring, written), dtype=_I64)
    return j + ring * ((written - 1 - j) // ring)
