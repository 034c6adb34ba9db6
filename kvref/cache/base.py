"""The one interface every KV cache layout implements.

A cache stores, for every layer, the keys and values of the positions already processed, per kv
head; it never stores queries (a later position needs only its own query). K is stored *after*
RoPE: a key is rotated once, for the absolute position it was computed at, and read as is by every
later query. The price: moving a key to another position (a context shift) means rotating it
again by the difference, which RoPE allows because rotations compose.

An execution (prefill or decode step) is a transaction the cache hands out (`cache.begin`,
execution.py). Until the commit nothing stored has changed (the contiguous and paged layouts write
beyond their length, the window stages its writes), so an abort only returns what begin reserved.
A cache serves one execution at a time: a second `begin` while one is open, from another thread or
from inside the first, raises CacheError instead of interleaving two writers.

What the executions recorded about the positions (the model that computed them, their token ids,
the last logits) lives in one object, `cache.sequence` (a Sequence, sequence.py); the layouts keep
only storage, capacity and capabilities. Operations beyond an execution (truncate, fork, shift,
save, free, and `reorder` over a list of caches) are answered beforehand by one value,
`cache.capabilities` (capabilities.py): a layout that cannot do an operation *exactly* raises
CacheError saying why, the reason the capabilities give; nothing no-ops silently.

Code that reads and writes the stored K/V where they lie (the native path) asks `cache.storage()`
for a Storage description (storage.py); a layout that cannot be used in place says why
(`cache.capabilities.in_place`).
"""

from __future__ import annotations

import threading

import numpy as np

from ..errors import CacheError, ShapeError
from ..moved import moved_names
from . import execution, quant, reordering, shape
from .capabilities import Capable
from .execution import FREED, Transactional
from .quant import Codec, Codecs
from .sequence import Sequence, readonly
from .storage import Storage

__getattr__ = moved_names(__name__, {  # moved out when base.py was split by job (issue 26)
    "ExecutionGroup": ("kvref.cache.ExecutionGroup", lambda: execution.ExecutionGroup),
    "begin_all": ("kvref.cache.begin_all", lambda: execution.begin_all),
    "reorder": ("kvref.cache.reorder", lambda: reordering.reorder),
    "cache_bytes": ("kvref.cache.cache_bytes", lambda: shape.cache_bytes),
    "bytes_per_position": ("kvref.cache.bytes_per_position", lambda: shape.bytes_per_position),
    "ELEMENT_BYTES": ("kvref.cache.ELEMENT_BYTES", lambda: quant.ELEMENT_BYTES),
    "dtype_name": ("kvref.cache.dtype_name", lambda: quant.dtype_name),
})


class KVCache(Transactional, Capable):
    """Interface of a KV cache for one sequence; layouts subclass it.

    length        positions whose K/V are stored
    next_position absolute position of the next new token (== length unless a layout drops positions)
    capacity      positions the cache can hold
    nbytes        bytes of the stored K/V (cache_bytes of `length` positions, plus any int8 scales)
    sequence      the Sequence: model, token ids and last logits, committed with every execution

    Layouts declare the classmethods `create` and `position_bytes` (registry.py) and implement the
    execution hooks `_reserve`, `_write`, `_commit` (which cannot fail) and `_release`; the operations'
    `_truncate`, `_fork`, `_shift`, `_free`; the storage description `_storage`; the file hooks
    `layout_options` and `_load_rows`; and the capability hooks of Capable (`_truncate_problem`,
    `_rollback_problem`, `_shift_problem`, `_storage_problem`, ...) where the layout's answers differ
    from the defaults.
    """

    layout = "abstract"
    # Whether how an input is split into executions leaves what each query sees unchanged (prefill
    # in one chunk == any chunking == token by token, up to float rounding). True for every layout
    # that keeps what its attention may read; the StreamingLLM window is the exception: a query sees
    # what the ring held before its execution plus that execution's positions.
    chunking_invariant = True
    # Whether the layout keeps every position of a group of positions, as a K codec that quantizes
    # such groups needs (kivi4): the contiguous and paged layouts; a ring overwrites positions in a group.
    keeps_groups = False
    # Whether every layer holds the same positions; the hybrid layout's window layers keep only their last.
    uniform_layers = True

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, *, v_dtype=None,
                 group_size=None, rope_theta=None, latent_dim=None, lock=None):
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        # MLA: K is the latent key [c_kv ; k_rope] and V, never stored, is its first latent_dim values
        self.latent_dim = latent_dim
        self.k_codec, self.v_codec = quant.kv_codecs(dtype, v_dtype, head_dim, group_size, latent_dim)
        k, v = self.k_codec.name, self.v_codec.name
        self.dtype_name = k if k == v else f"{k}/{v}"
        if self.k_codec.groups_positions:
            if not self.keeps_groups:
                raise CacheError(f"the {self.layout} layout cannot store {k} K: its groups of positions "
                                 f"would straddle what the ring overwrites; use the contiguous or paged layout "
                                 f"(or {k} for V only: v_dtype={k!r})")
            # a query reads the groups its execution completed quantized: how an input is split into
            # executions changes what earlier queries of a group saw (float16 or quantized K)
            self.chunking_invariant = False
        # needed to re-rotate keys (shift), recorded in saved files: one base, or one per layer (None for a
        # NoPE layer, kvref.cache.CacheShape)
        self.rope_theta = rope_theta
        self.sequence = Sequence()
        # what runs executions on this cache (kvref.executor), set by the model the first time it is given
        # this cache; opaque here, and it never changes what the cache stores
        self.executor = None
        self._freed = False
        self._execution = None  # weak reference to the open execution, if any
        # guards the open execution and every change of the bookkeeping; caches sharing storage
        # (the sequences of one block pool) share one lock
        self._lock = threading.RLock() if lock is None else lock

    # ---- accounting -----------------------------------------------------------------------------

    @property
    def k_dtype(self) -> str:
        return self.k_codec.name

    @property
    def v_dtype(self) -> str:
        return self.v_codec.name

    @property
    def group_size(self) -> int | None:
        """Elements per int8 scale along head_dim (None when neither K nor V is int8)."""
        return self.k_codec.group_size or self.v_codec.group_size

    @property
    def length(self) -> int:
        raise NotImplementedError

    @property
    def next_position(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        raise NotImplementedError

    @classmethod
    def position_bytes(cls, shape, codecs: Codecs) -> int:
        """Bytes one position takes in a cache of this layout for a model of `shape` (a CacheShape) storing
        `codecs`: what the memory budget multiplies by the positions asked for (CacheShape.check_budget)
        and cache.bytes_per_position. Each layout declares its own."""
        raise NotImplementedError

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position occupies: the layout's position_bytes for this cache (a layout whose layers
        hold different positions counts its nbytes layer by layer)."""
        # the shape of what this cache holds: max_seq_len plays no part in a position's bytes
        held = shape.CacheShape(self.n_layers, self.n_kv_heads, self.head_dim, max_seq_len=self.capacity,
                                latent_dim=self.latent_dim)
        return self.position_bytes(held, Codecs(self.k_codec, self.v_codec))

    @property
    def nbytes(self) -> int:
        return self.length * self.bytes_per_position

    @property
    def freed(self) -> bool:
        return self._freed


    def positions(self) -> np.ndarray:
        """Absolute positions of the stored K/V, ascending: [length]."""
        return np.arange(self.length)

    def layer_positions(self, layer: int) -> np.ndarray:
        """The positions `layer` holds (what read(layer) returns), ascending: a suffix of positions();
        all of them but in the hybrid layout, whose window layers keep only their last ones."""
        return self.positions()

    def stats(self) -> dict:
        """Every accounting number of this cache in one dict (what `kvref memory` and benchmarks print)."""
        return {"layout": self.layout, "k_dtype": self.k_dtype, "v_dtype": self.v_dtype, "latent_dim": self.latent_dim,
                "group_size": self.group_size, "length": self.length, "next_position": self.next_position,
                "capacity": self.capacity, "nbytes": self.nbytes, "bytes_per_position": self.bytes_per_position}

    # ---- reading ---------------------------------------------------------------------------------

    def read(self, layer: int):
        """Stored K and V of `layer` in position order, decoded: ([length, Hkv, D], [length, Hkv, D])."""
        raise NotImplementedError

    def read_raw(self, layer: int):
        """Stored (k, k_scales, v, v_scales) of `layer` in position order, as stored (scales None if float)."""
        raise NotImplementedError

    def keys(self, layer: int) -> np.ndarray:
        # -> [length, Hkv, D], read-only, decoded to K's read dtype
        if self.k_codec.groups_positions:  # groups and residual: read() assembles them
            return readonly(self.read(layer)[0])
        k, ks, _, _ = self.read_raw(layer)
        return readonly(self.k_codec.decode(k, ks))

    def values(self, layer: int) -> np.ndarray:
        # -> [length, Hkv, D], read-only, decoded to V's read dtype; a latent cache: K's first latent_dim values
        if self.latent_dim is not None:
            return self.keys(layer)[..., :self.latent_dim]
        if self.k_codec.groups_positions:  # no rows to read raw beside such a K: read() decodes both
            return readonly(self.read(layer)[1].astype(self.v_codec.read_dtype, copy=False))
        _, _, v, vs = self.read_raw(layer)
        return readonly(self.v_codec.decode(v, vs))

    def storage(self) -> Storage:
        """Where the K/V lie, for reading and writing in place; CacheError naming why if they cannot be."""
        problem = self._storage_problem()
        if problem is not None:
            raise CacheError(f"a {self.layout} cache cannot be used in place: {problem}")
        return self._storage()

    # ---- operations: each refuses what cache.capabilities refuses, with the same reason ----------

    def truncate(self, n: int, last_logits=None) -> None:
        """Forget every position >= n (roll back rejected tokens); afterwards next_position == n.

        last_logits: the logits [V] of position n - 1 when the caller has them (speculative decoding
        computed them while verifying a draft), recorded as cache.sequence.last_logits so generation
        can resume from the cache; None: the last logits are unknown after a truncation below
        next_position, and kept as they are at n == next_position.
        """
        with self._lock:
            self._check_idle()
            problem = self._truncate_problem(n)
            if problem is not None:
                raise CacheError(f"cannot truncate to {n}: {problem}")
            if last_logits is not None:
                last_logits = self._checked_logits(n, last_logits)
            if n < self.next_position:
                self._truncate(n)
                self.sequence.trim(n)
            elif n == 0:
                self.sequence.trim(0)  # an empty cache knows the ids of all of its (no) positions
            if last_logits is not None:
                self.sequence.last_logits = last_logits

    def fork(self) -> "KVCache":
        """An independent cache holding the same positions (layouts may share storage copy-on-write)."""
        with self._lock:
            self._check_idle()
            child = self._fork()
            child.sequence = self.sequence.copy()
            child.executor = self.executor  # the same layout and K/V types
            return child

    def shift(self, n: int, keep: int = 0) -> None:
        """Context shift: drop positions keep..keep+n-1 and move every later position down by n.

        Kept keys after the gap are rotated again by -n (RoPE rotations compose), so the cache then
        holds what a model that never saw the dropped positions would read at the new positions, up to
        float rounding of one extra rotation. Needs K stored as float32/float64 (SHIFTABLE_K_DTYPES):
        a narrower K would be rounded a second time, which no layout ever does to history.
        """
        with self._lock:
            self._check_idle()
            problem = self._shift_problem(n, keep)
            if problem is not None:
                raise CacheError(f"cannot shift by {n} after {keep} kept positions: {problem}")
            self._shift(n, keep)
            self.sequence.forget_ids()  # the kept K/V now differ from a plain prefill of the kept ids

    def free(self) -> None:
        """Release the storage (a paged cache returns its blocks to the pool); the cache is unusable after."""
        with self._lock:
            if self._freed:
                return
            self._check_idle()
            self._free()
            self._freed = True

    def save(self, path) -> None:
        """Write this cache and its sequence to `path` in the versioned kvref format (kvref/cache/fileformat.py).

        The file names the model it belongs to (sequence.model, given by Model.new_cache);
        model.load_cache(path) refuses any other model.
        """
        from .fileformat import save_cache

        with self._lock:
            self._check_idle()
            save_cache(self, path)

    def layout_options(self) -> dict:
        """Layout parameters a saved file records so that loading makes the same layout."""
        return {}

    def load_rows(self, positions, next_position, raw_layers) -> None:
        """Fill an empty cache from saved rows: positions [n], raw_layers[l] = (k, ks, v, vs) [n, ...]."""
        with self._lock:
            self._check_idle()
            if self.next_position:
                raise CacheError(f"rows load into an empty cache; this one is at position {self.next_position}")
            self._check_saved_positions(np.asarray(positions), int(next_position))
            if self.uniform_layers and any(len(raw[0]) != len(positions) for raw in raw_layers):
                raise CacheError(f"every layer of a {self.layout} cache holds the same positions; the rows "
                                 "given differ between layers")
            self._load_rows(positions, next_position, raw_layers)

    # ---- hooks for the layouts ---------------------------------------------------------------------

    def _storage(self) -> Storage:
        raise NotImplementedError

    def _load_rows(self, positions, next_position, raw_layers) -> None:
        raise NotImplementedError

    def _check_saved_positions(self, positions, next_position) -> None:
        """CacheError unless this layout can hold exactly `positions` [n] with that next position: by
        default positions 0..n-1, with next_position n (only a layout that drops positions differs)."""
        if next_position != len(positions) or not np.array_equal(positions, np.arange(next_position)):
            raise CacheError(f"a {self.layout} cache holds positions 0..length-1 and next_position == length")

    def _check_rows_fit(self, n: int) -> None:
        if n > self.capacity:
            raise CacheError(f"{n} saved positions do not fit: the {self.layout} cache made for them holds "
                             f"{self.capacity}")

    def _checked_logits(self, n, last_logits):
        # logits [V] of position n - 1 -> a read-only copy; ShapeError/CacheError before anything changes
        logits = np.array(last_logits, copy=True)
        if logits.ndim != 1:
            raise ShapeError(f"last_logits must be the [V] logits of one position; got shape {logits.shape}")
        if n == 0:
            raise CacheError("truncating to 0 leaves no position whose logits last_logits could be")
        return readonly(logits)

    def _check_idle(self):
        if self._freed:
            raise CacheError(FREED)
        if self.executing:
            raise CacheError("an execution is open on this cache; finish it (commit or abort) first")

    def _rerotate(self, k, n, layer):
        # [S, Hkv, D] keys of `layer` stored after RoPE at positions p -> the same keys at positions p - n.
        # A NoPE layer's keys (base None in a per-layer rope_theta: SmolLM3) carry no position: as they are.
        # A latent key rotates only its k_rope part: c_kv carries no position, and RoPE never touched it.
        from ..spec.ops import rope

        theta = self.rope_theta[layer] if isinstance(self.rope_theta, tuple) else self.rope_theta
        if theta is None:
            return k
        back = np.full(k.shape[0], -n, dtype=np.int64)
        if self.latent_dim is None:
            return rope(k, back, theta)
        return np.concatenate([k[..., :self.latent_dim], rope(k[..., self.latent_dim:], back, theta)], axis=-1)
