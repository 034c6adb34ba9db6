"""The explicit KV cache: one interface (KVCache) and its execution transaction, several layouts behind it.

    KVCache.begin     an execution (Execution); begin_all: one over several caches (ExecutionGroup)
    Sequence          what the executions recorded: model, token ids, last logits (cache.sequence)
    Storage           where the K/V lie, for code that reads them in place (cache.storage())

    ContiguousCache   one [capacity, Hkv, D] array per layer for K and V          (contiguous.py)
    PagedCache        a block table into a BlockPool shared by many sequences     (paged.py)
    BlockPool         the blocks, their refcounts and allocator (pool.py); its PrefixIndex (prefix.py)
    WindowCache       attention sinks + a ring buffer of the last W positions     (window.py)
    HybridCache       per layer: a ring for a sliding-window layer, all positions  (hybrid.py)
                      for the others (Gemma 3)

Each stores K and V as float64/float32/float16/bfloat16 or int8 with grouped scales (quant.py),
saves to a versioned file (fileformat.py), and reports its bytes (report.py).
"""

from .base import (ELEMENT_BYTES, Execution, ExecutionGroup, KVCache, Sequence, Storage, begin_all,
                   bytes_per_position, cache_bytes, dtype_name, reorder)
from .contiguous import ContiguousCache
from .hybrid import HybridCache
from .paged import PagedCache
from .pool import BlockPool, Reservation
from .prefix import PrefixIndex
from .report import layout_report, layout_rows
from .window import WindowCache

__all__ = ["ELEMENT_BYTES", "BlockPool", "ContiguousCache", "Execution", "ExecutionGroup", "HybridCache", "KVCache", "PagedCache",
           "PrefixIndex", "Reservation", "Sequence", "Storage", "WindowCache", "begin_all", "bytes_per_position",
           "cache_bytes", "dtype_name", "layout_report", "layout_rows", "reorder"]
