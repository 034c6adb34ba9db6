"""The explicit KV cache: one interface (KVCache) and its execution transaction, several layouts behind it.

    KVCache               the interface                                                    (base.py)
    KVCache.begin         an execution (Execution); begin_all: one over several caches     (execution.py)
                          (ExecutionGroup), Ctrl-C held while it commits                    (interrupts.py)
    KVCache.capabilities  what the cache can do exactly, or why not                         (capabilities.py)
    Sequence              what the executions recorded: model, token ids, last logits       (sequence.py)
                          (cache.sequence)
    Storage               where the K/V lie, for code that reads them in place (cache.storage()) (storage.py)
    reorder               beam search over a batch of caches                                 (reordering.py)

    ContiguousCache       one [capacity, Hkv, D] array per layer for K and V                 (contiguous.py)
    PagedCache            a block table into a BlockPool shared by many sequences            (paged.py)
    BlockPool             the blocks, their refcounts and allocator (pool.py); its PrefixIndex  (prefix.py)
    WindowCache           attention sinks + a ring buffer of the last W positions            (window.py)
    HybridCache           per layer: a ring for a sliding-window layer, all positions        (hybrid.py)
                          for the others (Gemma 3)

Each layout registers itself by name (registry.py): `make(shape, codecs, layout, **options)` builds
one for a model described by a CacheShape (shape.py), and a new layout is one new file. Each stores
K and V as float64/float32/float16/bfloat16 or int8 with grouped scales (quant.py), saves to a
versioned file (fileformat.py), and reports its bytes (report.py).
"""

from .base import KVCache
from .contiguous import ContiguousCache
from .execution import Execution, ExecutionGroup, begin_all
from .hybrid import HybridCache
from .paged import PagedCache
from .pool import BlockPool, Reservation
from .prefix import PrefixIndex
from .quant import ELEMENT_BYTES, Codecs, dtype_name
from .registry import LayoutOptions, layout_names, make, register, unregister
from .reordering import reorder
from .report import layout_report, layout_rows
from .sequence import Sequence
from .shape import CacheShape, bytes_per_position, cache_bytes
from .storage import Storage
from .window import WindowCache

__all__ = ["ELEMENT_BYTES", "BlockPool", "CacheShape", "Codecs", "ContiguousCache", "Execution", "ExecutionGroup",
           "HybridCache", "KVCache", "LayoutOptions", "PagedCache", "PrefixIndex", "Reservation", "Sequence", "Storage",
           "WindowCache", "begin_all", "bytes_per_position", "cache_bytes", "dtype_name", "layout_names",
           "layout_report", "layout_rows", "make", "register", "reorder", "unregister"]
