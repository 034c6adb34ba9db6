"""The one interface every KV cache layout implements, and the memory formula.

A cache stores, for every layer, the keys and values of the positions already processed, per kv
head; it never stores queries (a later position needs only its own query). K is stored *after*
RoPE: a key is rotated once, for the absolute position it was computed at, and read as is by every
later query. The price: moving a key to another position (a context shift) means rotating it
again by the difference, which RoPE allows because rotations compose.

An execution (prefill or decode step) uses the interface in three moves:

    positions = cache.next_positions(T)      # checks room first: a full cache fails before any work
    k_all, v_all, k_pos = cache.update(layer, k_new, v_new)   # once per layer
    cache.advance(T)                          # commit: only now does cache.length grow

`update` writes the new K/V beside what is stored and returns everything the new queries may attend
to; until `advance`, the stored length is unchanged, so an execution that fails halfway leaves the
cache as it was. Occupancy is bookkeeping (`length`), never inferred from the stored values.
"""

from __future__ import annotations

import numpy as np

from ..errors import CacheFullError, DTypeError, ShapeError

# bytes per stored element; bfloat16 has no NumPy dtype, so sizes are looked up by name
ELEMENT_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


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


def cache_bytes(n_layers: int, n_tokens: int, n_kv_heads: int, head_dim: int, dtype="float16") -> int:
    """2 (K and V) x layers x tokens x kv heads x head_dim x bytes per element, exactly."""
    return 2 * n_layers * n_tokens * n_kv_heads * head_dim * ELEMENT_BYTES[dtype_name(dtype)]


class KVCache:
    """Interface of a KV cache for one sequence; layouts subclass it.

    length        positions whose K/V are stored
    next_position absolute position of the next new token (== length unless a layout drops positions)
    capacity      positions the cache can hold
    nbytes        bytes of the stored K/V (cache_bytes of `length` positions, plus any scales)
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype):
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype_name = dtype_name(dtype)

    @property
    def length(self) -> int:
        raise NotImplementedError

    @property
    def next_position(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return cache_bytes(self.n_layers, self.length, self.n_kv_heads, self.head_dim, self.dtype_name)

    def next_positions(self, n_new: int) -> np.ndarray:
        """Absolute positions of `n_new` new tokens; raises CacheFullError if they do not fit."""
        free = self.capacity - self.length
        if n_new > free:
            raise CacheFullError(
                f"cannot append {n_new} positions: the cache holds {self.length} of {self.capacity} "
                f"({free} free)")
        return np.arange(self.next_position, self.next_position + n_new)  # [T]

    def update(self, layer: int, k: np.ndarray, v: np.ndarray):
        """Store K/V of the new positions for `layer`; return (k_all, v_all, k_positions).

        k, v: [T, Hkv, D] -> k_all, v_all: [S, Hkv, D], k_positions: [S]
        """
        raise NotImplementedError

    def advance(self, n_new: int) -> None:
        """Commit the `n_new` positions written by `update` in every layer."""
        raise NotImplementedError

    def _check_kv(self, layer, k, v):
        expected = (self.n_kv_heads, self.head_dim)
        if not 0 <= layer < self.n_layers:
            raise ShapeError(f"layer {layer} out of range: the cache has {self.n_layers} layers")
        for name, a in (("k", k), ("v", v)):
            if a.ndim != 3 or a.shape[1:] != expected:
                raise ShapeError(f"{name} has shape {a.shape}; expected [T, {expected[0]}, {expected[1]}]")
        if k.shape != v.shape:
            raise ShapeError(f"k shape {k.shape} != v shape {v.shape}")
