"""The explicit KV cache: one interface (KVCache), several layouts behind it."""

from .base import ELEMENT_BYTES, KVCache, cache_bytes, dtype_name
from .contiguous import ContiguousCache

__all__ = ["ELEMENT_BYTES", "KVCache", "ContiguousCache", "cache_bytes", "dtype_name"]
