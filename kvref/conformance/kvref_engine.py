"""The kvref adapter: a Model on either backend, with one cache layout: the suite's own control.

Sequences are caches made by the model. The paged layout runs every sequence in one BlockPool with
prefix reuse on, and frees each sequence's blocks when the check is done with it: later sequences
get blocks that earlier ones wrote (never freshly zeroed ones), so a block-table bug cannot hide
behind zeros.
"""

from __future__ import annotations

import os
import weakref

from ..cache import layout_names
from ..generation.batch import forward_batch
from .engine import Engine, Refused, Rows

LAYOUTS = layout_names()
BLOCK_SIZE = 16  # the paged layout's default block size: the suite puts chunk boundaries at its multiples
POOL_SEQUENCES = 8  # sequences of max_positions the pool holds at once (the batch check runs 3, fork 2)


class KVRefEngine(Engine):
    name = "kvref"

    def __init__(self, model, layout: str = "contiguous", max_positions: int = 256, kv_dtype=None,
                 block_size: int = BLOCK_SIZE):
        self.model = model
        self.layout = layout
        self.max_positions = min(max_positions, model.config.max_seq_len)
        self.kv_dtype = kv_dtype
        # float32 bounds for float32 arithmetic on float32 K/V; narrower K/V or the int8 activation
        # mode (KVREF_ACTIVATIONS=int8) round as llama.cpp does: the quantized bounds
        exact = kv_dtype in (None, "float32", "float64") and model.activations in (None, "float32")
        self.precision = "float32" if exact else "quantized"
        self.options = self._options(block_size)
        self.pool = None
        probe = self.new_sequence()
        caps = {"incremental", "full_logits", "batch", "save_restore", "fork", "rollback", "sliding_window"}
        if layout == "paged":
            caps.add("prefix_cache")
        if probe.capabilities.shift() and layout in ("contiguous", "paged"):
            caps.add("context_shift")
        self.free(probe)
        self.capabilities = frozenset(caps)
        import shutil  # here, not with the CLI: shutil and tempfile load bz2, lzma and random (~0.5 MiB)
        import tempfile

        self._saved = tempfile.mkdtemp(prefix="kvref-conformance-")
        # the saved caches go with the engine, whether or not close() is called
        self._remove_saved = weakref.finalize(self, shutil.rmtree, self._saved, True)

    def _options(self, block_size):
        # the layout's options, sized to what the suite runs; the StreamingLLM window is sized to keep
        # every position the suite uses: dropping positions is its design, not a conformance question
        n = self.max_positions
        if self.layout == "paged":
            return {"layout": "paged", "block_size": block_size, "prefix_reuse": True,
                    "num_blocks": POOL_SEQUENCES * -(-n // block_size)}
        if self.layout == "window":
            return {"layout": "window", "window": n, "sinks": 4}
        return {"layout": self.layout, "capacity": n}

    @property
    def label(self) -> str:
        return f"kvref ({self.layout} layout)"

    def describe(self) -> dict:
        return {"engine": "kvref", "backend": self.model.backend, "layout": self.layout,
                "kv_dtype": self.kv_dtype or self.model.dtype, "activations": self.model.activations or "float32",
                "bounds": self.precision, "cache options": {
                    k: v for k, v in self.options.items() if k != "layout"}}

    def new_sequence(self):
        if self.layout == "paged" and self.pool is not None:
            return self.model.new_cache(layout="paged", pool=self.pool)
        cache = self.model.new_cache(kv_dtype=self.kv_dtype, **self.options)
        if self.layout == "paged":
            self.pool = cache.pool
        return cache

    def forward(self, seq, ids, last_only=False) -> Rows:
        return Rows.from_logits(self.model.forward(list(ids), seq, all_logits=not last_only))

    def free(self, seq) -> None:
        seq.free()

    def close(self) -> None:
        self._remove_saved()

    def forward_batch(self, seqs, id_lists) -> list:
        out = forward_batch(self.model, [list(ids) for ids in id_lists], list(seqs), all_logits=True)
        return [Rows.from_logits(logits) for logits in out]

    def prefill_cached(self, ids):
        seq = self.new_sequence()
        reused = seq.prefill_reuse(list(ids))
        return seq, self.forward(seq, list(ids)[reused:]), reused

    def prefill_cold(self, ids):
        # a sequence of its own pool, so nothing indexed elsewhere can be adopted
        seq = self.model.new_cache(kv_dtype=self.kv_dtype, **{**self.options, "prefix_reuse": False}) \
            if self.layout == "paged" else self.new_sequence()
        return seq, self.forward(seq, ids)

    def save(self, seq):
        path = os.path.join(self._saved, f"{id(seq)}-{seq.length}.kvc")
        seq.save(path)
        return path

    def restore(self, state):
        return self.model.load_cache(state, pool=self.pool) if self.layout == "paged" else self.model.load_cache(state)

    def last_rows(self, seq):
        logits = seq.sequence.last_logits
        return None if logits is None else Rows.from_logits(logits)

    def fork(self, seq):
        return seq.fork()

    def rollback(self, seq, n: int) -> None:
        if not seq.capabilities.truncate(n):
            raise Refused(f"the {self.layout} cache cannot truncate to {n}")
        seq.truncate(n)

    def shift(self, seq, n: int, keep: int) -> None:
        seq.shift(n, keep)
