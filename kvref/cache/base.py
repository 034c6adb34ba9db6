"""The one interface every KV cache layout implements, its execution transaction, and the memory formula.

A cache stores, for every layer, the keys and values of the positions already processed, per kv
head; it never stores queries (a later position needs only its own query). K is stored *after*
RoPE: a key is rotated once, for the absolute position it was computed at, and read as is by every
later query. The price: moving a key to another position (a context shift) means rotating it
again by the difference, which RoPE allows because rotations compose.

An execution (prefill or decode step) is a transaction the cache hands out:

    with cache.begin(token_ids) as execution:        # room is checked (and, paged, reserved) here
        positions = execution.positions              # [T] absolute positions of the new tokens
        k_all, v_all, k_pos = execution.update(layer, k, v)   # once per layer
        execution.last_logits = logits[-1]           # committed together with the new positions
    # leaving the block normally commits: cache.length grows, the ids and last logits are recorded;
    # any exception aborts: every count, block, refcount and free list is as it was before begin

Until the commit nothing stored has changed (the contiguous and paged layouts write beyond their
length, the window stages its writes), so an abort only returns what begin reserved. A cache serves
one execution at a time: a second `begin` while one is open, from another thread or from inside
the first, raises CacheError instead of interleaving two writers. `begin_all` is the same
transaction over several caches (a batched execution): every cache reserves or none does, and all
commit or none.

What the executions recorded about the positions (the model that computed them, their token ids,
the last logits) lives in one object, `cache.sequence` (a Sequence); the layouts keep only storage,
capacity and capabilities. Operations beyond an execution (truncate, fork, shift, save, free, and
`reorder` over a list of caches) each come with a capability check (`can_truncate(n)`,
`can_fork()`, `can_shift(n)`): a layout that cannot do an operation *exactly* raises CacheError
saying why; nothing no-ops silently. `can_roll_back(n_new)` looks ahead for speculative decoding:
whether an execution of n_new positions could afterwards be truncated away again.

Code that reads and writes the stored K/V where they lie (the native path) asks `cache.storage()`
for a Storage description (the slot store, an optional block table); a layout that cannot be used in
place says why through `storage_problem()`.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..errors import CacheError, CacheFullError, ShapeError
from .quant import ELEMENT_BYTES, KIVI, Codec, KiviResidual, SlotStore, dtype_name  # noqa: F401  (ELEMENT_BYTES, dtype_name re-exported)

# K can be moved to another position (re-rotated) without rounding history a second time only when
# it is stored at least as wide as the arithmetic that rotates it.
SHIFTABLE_K_DTYPES = ("float64", "float32")


def cache_bytes(n_layers: int, n_tokens: int, n_kv_heads: int, head_dim: int, dtype="float16") -> int:
    """2 (K and V) x layers x tokens x kv heads x head_dim x bytes per element, exactly."""
    return 2 * n_layers * n_tokens * n_kv_heads * head_dim * ELEMENT_BYTES[dtype_name(dtype)]


def bytes_per_position(n_layers, n_kv_heads, head_dim, k_dtype, v_dtype=None, group_size=None) -> int:
    """Bytes one position occupies in every layer: K and V vectors per kv head, plus int8 scales."""
    k = Codec(k_dtype, head_dim, group_size)
    v = Codec(k_dtype if v_dtype is None else v_dtype, head_dim, group_size)
    return n_layers * n_kv_heads * (k.bytes_per_vector() + v.bytes_per_vector())


class Sequence:
    """What the executions recorded about one cache's positions: the session state beside the storage.

    model        fingerprint of the model whose K/V the cache holds (Model.fingerprint()); None for a
                 cache not made by a model, which Model.forward refuses
    token_ids    ids of positions 0..next_position-1 (a copy); None once some positions were not
                 computed from known ids (raw K/V appended without ids, a context shift)
    last_logits  logits [V] (read-only) of the last position of the last execution: what the next
                 token is drawn from (kvref.resume); None when no execution has run since positions
                 were removed (truncate)

    Every commit updates them together with the cache's length, so they never disagree.
    """

    def __init__(self, model=None, token_ids=(), last_logits=None):
        self.model = model
        self.replace(token_ids, last_logits)

    def __repr__(self):
        n = "unknown" if self._token_ids is None else len(self._token_ids)
        return f"Sequence(token ids: {n}, last logits: {self.last_logits is not None})"

    @property
    def token_ids(self) -> list | None:
        return None if self._token_ids is None else list(self._token_ids)

    @property
    def n_token_ids(self) -> int | None:
        """How many ids are known (None: unknown), without copying them."""
        return None if self._token_ids is None else len(self._token_ids)

    def ids(self, start: int, end: int) -> list:
        """token_ids[start:end] without copying the rest; the ids must be known."""
        return self._token_ids[start:end]

    def copy(self) -> "Sequence":
        return Sequence(self.model, self._token_ids, self.last_logits)

    def record(self, token_ids, last_logits) -> None:
        """A commit: the new positions' ids (None: unknown) and the last logits (already a private copy)."""
        if token_ids is None or self._token_ids is None:
            self._token_ids = None  # some position's id is unknown from now on
        else:
            self._token_ids.extend(token_ids)
        self.last_logits = None if last_logits is None else _readonly(last_logits)

    def replace(self, token_ids, last_logits=None) -> None:
        """Positions came from elsewhere (a saved file, an adopted prefix): their ids (None: unknown)
        and the logits of their last position (None: not known)."""
        self._token_ids = None if token_ids is None else [int(t) for t in token_ids]
        self.last_logits = None if last_logits is None else _readonly(np.array(last_logits, copy=True))

    def trim(self, n: int) -> None:
        """Positions >= n are gone (truncate): their ids go, and the last logits, which were a gone position's."""
        if n == 0:
            self._token_ids = []  # an empty cache knows the ids of all of its (no) positions
        elif self._token_ids is not None:
            del self._token_ids[n:]
        self.last_logits = None

    def forget_ids(self) -> None:
        """The K/V no longer equal a plain run of the ids (a shift): the ids stop describing them."""
        self._token_ids = None


@dataclass(frozen=True)
class Storage:
    """Where a cache's K/V lie, for code that reads and writes them in place (kvref.native).

    store        the SlotStore: k, v [L, *slots, Hkv, D] in their stored forms, int8 scales
                 [L, *slots, Hkv, D/g]; store.k_codec / v_codec name the element types and group size
    block_table  int64 [n_blocks]: position p lives in slot (block_table[p // block_size],
                 p % block_size) of slots (num_blocks, block_size); None: position p lives in slot p
    block_size   positions per block (1 without a block table)
    layer_rings  None, or one int per layer: 0 = the layer's position p lives in its slot p (through
                 the block table when there is one); R > 0 = the layer is a ring of R slots,
                 position p in its slot p % R. With rings, block_table is None and the store's arrays
                 are [1, sum of the layers' extents, Hkv, D] (scales likewise): layer l's slots follow
                 layer l-1's; a layer's extent is its R, or layer_slots for a layer without a ring
    layer_slots  slots of each layer without a ring (with layer_rings; else unused)
    k_residual   kivi4 K: float16 [L, g, Hkv, D], the K of positions past the last full group (position
                 p in row p % g; KiviResidual.rows, or an execution's staged copy); else None
    """

    store: SlotStore
    block_table: np.ndarray | None = None
    block_size: int = 1
    layer_rings: tuple | None = None
    layer_slots: int = 0
    k_residual: np.ndarray | None = None


class KVCache:
    """Interface of a KV cache for one sequence; layouts subclass it.

    length        positions whose K/V are stored
    next_position absolute position of the next new token (== length unless a layout drops positions)
    capacity      positions the cache can hold
    nbytes        bytes of the stored K/V (cache_bytes of `length` positions, plus any int8 scales)
    sequence      the Sequence: model, token ids and last logits, committed with every execution

    Layouts implement the execution hooks `_reserve`, `_write`, `_commit` (which cannot fail) and
    `_release`; the operations' `_truncate`, `_fork`, `_shift`, `_free`; the storage description
    `_storage` and `storage_problem`; the file hooks `layout_options` and `_load_rows`.
    """

    layout = "abstract"
    # Whether how an input is split into executions leaves what each query sees unchanged (prefill
    # in one chunk == any chunking == token by token, up to float rounding). True for every layout
    # that keeps what its attention may read; the StreamingLLM window is the exception: a query sees
    # what the ring held before its execution plus that execution's positions.
    chunking_invariant = True
    # Whether the layout keeps kivi4 K (quantized per channel over groups of positions, with a float16
    # residual): the contiguous and paged layouts; a ring overwrites positions inside a group.
    kivi_k = False
    # Whether every layer holds the same positions; the hybrid layout's window layers keep only their last.
    uniform_layers = True

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, *, v_dtype=None,
                 group_size=None, rope_theta=None, lock=None):
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.k_codec = Codec(dtype, head_dim, group_size)
        self.v_codec = Codec(dtype if v_dtype is None else v_dtype, head_dim, group_size)
        k, v = self.k_codec.name, self.v_codec.name
        self.dtype_name = k if k == v else f"{k}/{v}"
        if k == KIVI:
            if not self.kivi_k:
                raise CacheError(f"the {self.layout} layout cannot store kivi4 K: its groups of positions "
                                 f"would straddle what the ring overwrites; use the contiguous or paged layout "
                                 f"(or kivi4 for V only: v_dtype='kivi4')")
            # a query reads the groups its execution completed quantized: how an input is split into
            # executions changes what earlier queries of a group saw (float16 or quantized K)
            self.chunking_invariant = False
        self.rope_theta = rope_theta  # needed to re-rotate keys (shift); recorded in saved files
        self.sequence = Sequence()
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

    @property
    def bytes_per_position(self) -> int:
        return self.n_layers * self.n_kv_heads * (self.k_codec.bytes_per_vector() + self.v_codec.bytes_per_vector())

    @property
    def nbytes(self) -> int:
        return self.length * self.bytes_per_position

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def executing(self) -> bool:
        """Whether an execution is open on this cache (begun, neither committed nor aborted)."""
        return self._execution is not None and self._execution() is not None

    def positions(self) -> np.ndarray:
        """Absolute positions of the stored K/V, ascending: [length]."""
        return np.arange(self.length)

    def layer_positions(self, layer: int) -> np.ndarray:
        """The positions `layer` holds (what read(layer) returns), ascending: a suffix of positions();
        all of them but in the hybrid layout, whose window layers keep only their last ones."""
        return self.positions()

    def stats(self) -> dict:
        """Every accounting number of this cache in one dict (what `kvref memory` and benchmarks print)."""
        return {"layout": self.layout, "k_dtype": self.k_dtype, "v_dtype": self.v_dtype,
                "group_size": self.group_size, "length": self.length, "next_position": self.next_position,
                "capacity": self.capacity, "nbytes": self.nbytes, "bytes_per_position": self.bytes_per_position}

    # ---- one execution ---------------------------------------------------------------------------

    def can_append(self, n_new: int) -> bool:
        """Whether an execution of n_new positions fits now."""
        return not self._freed and n_new <= self.capacity - self.length

    def begin(self, token_ids) -> "Execution":
        """Open an execution over new positions: `token_ids` [T], or T alone when the ids are unknown.

        Checks room first (CacheFullError, before any work) and reserves what the execution needs;
        raises CacheError if another execution is open on this cache. Use the result as a context
        manager (see the module docstring), or call its commit() / abort() yourself.
        """
        ids, n_new = _new_positions(token_ids)
        with self._lock, _sigint_deferred():
            self._check_live()
            if self.executing:
                raise CacheError("an execution is already open on this cache (another thread, or a begin inside "
                                 "an execution): a cache serves one execution at a time; give each thread its "
                                 "own cache (model.new_cache(), or cache.fork())")
            reservation = self._reserve(n_new)  # raises before anything changes
            positions = np.arange(self.next_position, self.next_position + n_new)  # [T]
            execution = Execution(self, positions, ids, reservation)
            # The cache holds its open execution weakly: one dropped unfinished (an interrupt between
            # begin and the with block, a caller that forgot it) is aborted when it is collected.
            self._execution = weakref.ref(execution)
            execution._finalizer = weakref.finalize(execution, self._abandon, reservation)
            return execution

    def append(self, k, v, token_ids=None):
        """Store K/V of new positions in every layer at once: k, v [L, T, Hkv, D] (tools and tests)."""
        k, v = np.asarray(k), np.asarray(v)
        if k.ndim != 4 or k.shape[0] != self.n_layers:
            raise ShapeError(f"k has shape {k.shape}; expected [{self.n_layers}, T, {self.n_kv_heads}, {self.head_dim}]")
        if token_ids is not None and len(token_ids) != k.shape[1]:
            raise ShapeError(f"{len(token_ids)} token ids for {k.shape[1]} positions")
        with self.begin(k.shape[1] if token_ids is None else token_ids) as step:
            for layer in range(self.n_layers):
                step.update(layer, k[layer], v[layer])

    def _finish(self, execution, commit: bool) -> None:
        # the end of `execution`: commit (the checks are done; nothing here can fail) or release.
        # Ctrl-C between two of these updates would leave them half made, so SIGINT waits until the end.
        with self._lock, _sigint_deferred():
            if not execution._open:
                return
            execution._open = False
            execution._finalizer.detach()
            self._execution = None
            if commit:
                self.sequence.record(execution.token_ids, execution.last_logits)
                self._commit(execution.reservation)
            else:
                self._release(execution.reservation)

    def _abandon(self, reservation) -> None:
        # an open execution was collected without commit or abort: release what it reserved
        with self._lock, _sigint_deferred():
            self._execution = None
            self._release(reservation)

    # ---- reading ---------------------------------------------------------------------------------

    def read(self, layer: int):
        """Stored K and V of `layer` in position order, decoded: ([length, Hkv, D], [length, Hkv, D])."""
        raise NotImplementedError

    def read_raw(self, layer: int):
        """Stored (k, k_scales, v, v_scales) of `layer` in position order, as stored (scales None if float)."""
        raise NotImplementedError

    def keys(self, layer: int) -> np.ndarray:
        # -> [length, Hkv, D], read-only, decoded to K's read dtype
        if self.k_dtype == KIVI:  # groups and residual: read() assembles them
            return _readonly(self.read(layer)[0])
        k, ks, _, _ = self.read_raw(layer)
        return _readonly(self.k_codec.decode(k, ks))

    def values(self, layer: int) -> np.ndarray:
        # -> [length, Hkv, D], read-only, decoded to V's read dtype
        if self.k_dtype == KIVI:  # no rows to read raw beside kivi4 K: read() decodes both
            return _readonly(self.read(layer)[1].astype(self.v_codec.read_dtype, copy=False))
        _, _, v, vs = self.read_raw(layer)
        return _readonly(self.v_codec.decode(v, vs))

    def storage_problem(self) -> str | None:
        """Why this cache's K/V cannot be read and written in place (None when they can)."""
        return "this cache was freed" if self._freed else None

    def storage(self) -> Storage:
        """Where the K/V lie, for reading and writing in place; CacheError naming why if they cannot be."""
        problem = self.storage_problem()
        if problem is not None:
            raise CacheError(f"a {self.layout} cache cannot be used in place: {problem}")
        return self._storage()

    # ---- operations, each with its capability check -----------------------------------------------

    def can_truncate(self, n: int) -> bool:
        return not self._freed and not self.executing and self._truncate_problem(n) is None

    def truncate(self, n: int) -> None:
        """Forget every position >= n (roll back rejected tokens); afterwards next_position == n."""
        with self._lock:
            self._check_idle()
            problem = self._truncate_problem(n)
            if problem is not None:
                raise CacheError(f"cannot truncate to {n}: {problem}")
            if n < self.next_position:
                self._truncate(n)
                self.sequence.trim(n)
            elif n == 0:
                self.sequence.trim(0)  # an empty cache knows the ids of all of its (no) positions

    def can_roll_back(self, n_new: int) -> bool:
        """Whether an execution of n_new positions run now could afterwards be truncated exactly back to
        any position from today's next_position on (speculative decoding's rollback); see rollback_problem."""
        return not self._freed and not self.executing and self.rollback_problem(n_new) is None

    def rollback_problem(self, n_new: int) -> str | None:
        """Why the positions of an execution of n_new positions, run now, could not all be truncated away
        again exactly (a ring would overwrite a position the rollback needs); None when they could.
        The layouts that keep every position (contiguous, paged) always can, unless kivi4 K would
        complete a group of positions (a quantized group cannot give back its float16 K)."""
        if isinstance(n_new, bool) or not isinstance(n_new, (int, np.integer)) or n_new < 0:
            return f"n_new={n_new!r} must be an integer >= 0"
        if self.k_dtype == KIVI:
            g, end = self.k_codec.group_size, self.length + n_new
            if end // g * g > self.length:  # the execution would quantize a group holding a position after length
                return (f"the {n_new} positions would complete the kivi4 K group ending at position "
                        f"{end // g * g - 1}; truncating into a quantized group is not exact")
        return None

    def can_fork(self) -> bool:
        return not self._freed and not self.executing

    def fork(self) -> "KVCache":
        """An independent cache holding the same positions (layouts may share storage copy-on-write)."""
        with self._lock:
            self._check_idle()
            child = self._fork()
            child.sequence = self.sequence.copy()
            return child

    def can_shift(self, n: int = 1, keep: int = 0) -> bool:
        return not self._freed and not self.executing and self._shift_problem(n, keep) is None

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

    def _reserve(self, n_new: int):
        """Check room for n_new positions (CacheFullError) and reserve it; return what _release undoes."""
        raise NotImplementedError

    def _write(self, reservation, layer, k, v):
        """Store the new K/V of `layer` ([T, Hkv, D]) beside the stored ones; return (k_all, v_all, k_positions).

        k_all, v_all: [S, Hkv, D] (one dtype), k_positions: [S]. New K/V are read back as stored
        (quantized layouts included), so how an input is split into executions never changes what a
        query sees.
        """
        raise NotImplementedError

    def _commit(self, reservation) -> None:
        """Make the reserved positions part of the cache (every layer was written). Cannot fail."""
        raise NotImplementedError

    def _release(self, reservation) -> None:
        """Undo _reserve exactly: the cache (and a shared pool) are as they were before it."""

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

    def _truncate_problem(self, n):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            return f"n must be an integer, not {n!r}"
        if not 0 <= n <= self.length:
            return f"the cache holds {self.length} positions"
        if self.k_dtype == KIVI:
            return KiviResidual.truncate_problem(self.length, n, self.k_codec.group_size)
        return None

    def _shift_problem(self, n, keep):
        for name, value in (("n", n), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                return f"{name}={value!r} must be an integer >= 0"
        if n == 0:
            return "n must be at least 1"
        problem = self.shift_problem()
        if problem is not None:
            return problem
        if keep + n > self.next_position:
            return f"positions {keep}..{keep + n - 1} are not all before next_position {self.next_position}"
        return None

    def shift_problem(self) -> str | None:
        """Why this cache can never shift, whatever positions it holds (its layout, its K type, the
        RoPE it does not know); None when it can shift positions it holds (can_shift says which)."""
        if self.k_dtype not in SHIFTABLE_K_DTYPES:
            return (f"K is stored as {self.k_dtype}; rotating it again would round history a second time "
                    f"(shift needs K in {SHIFTABLE_K_DTYPES})")
        if self.rope_theta is None:
            return "the cache does not know the model's rope_theta (make it with model.new_cache)"
        return None

    def _check_live(self):
        if self._freed:
            raise CacheError("this cache was freed; make a new one with model.new_cache() or fork a live one")

    def _check_idle(self):
        self._check_live()
        if self.executing:
            raise CacheError("an execution is open on this cache; finish it (commit or abort) first")

    def _check_kv(self, layer, k, v, n_new):
        expected = (n_new, self.n_kv_heads, self.head_dim)
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.n_layers:
            raise ShapeError(f"layer {layer!r} out of range: the cache has {self.n_layers} layers")
        for name, a in (("k", k), ("v", v)):
            if not isinstance(a, np.ndarray) or a.shape != expected:
                raise ShapeError(f"{name} has shape {getattr(a, 'shape', None)}; expected [T, Hkv, D] = {list(expected)}")

    def _rerotate(self, k, n):
        # [S, Hkv, D] keys stored after RoPE at positions p -> the same keys at positions p - n
        from ..spec.ops import rope

        return rope(k, np.full(k.shape[0], -n, dtype=np.int64), self.rope_theta)


class Execution:
    """One prefill or decode step on one cache, from `cache.begin` to its commit or abort.

    positions    [T] absolute positions of the new tokens
    token_ids    their ids (None when unknown), recorded in cache.sequence at commit
    last_logits  set by the caller before the commit: the logits [V] of the last new position

    As a context manager, leaving the block normally commits and an exception aborts. commit()
    refuses (and aborts) if some layer's K/V were never written.
    """

    def __init__(self, cache: KVCache, positions, token_ids, reservation):
        self.cache = cache
        self.positions = positions
        self.token_ids = token_ids
        self.reservation = reservation
        self.last_logits = None
        self._open = True  # until the commit or the abort
        self._finalizer = None  # set by begin: aborts the execution if it is dropped unfinished
        self._written = set()  # layers whose new K/V were stored

    def __enter__(self) -> "Execution":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
        return False  # the exception goes on

    @property
    def n_new(self) -> int:
        return len(self.positions)

    def update(self, layer: int, k: np.ndarray, v: np.ndarray):
        """Store K/V of the new positions for `layer`; return (k_all, v_all, k_positions).

        k, v: [T, Hkv, D] -> k_all, v_all: [S, Hkv, D] (one dtype), k_positions: [S]: everything the
        new queries may attend to (causal masking by position is the attention's job).
        """
        self._check_open()
        self.cache._check_kv(layer, k, v, self.n_new)
        if int(layer) in self._written:  # a second write would read what the first one put in a ring
            raise CacheError(f"layer {layer}'s K/V were already written in this execution")
        out = self.cache._write(self.reservation, int(layer), k, v)
        self._written.add(int(layer))
        return out

    def write_in_place(self) -> Storage:
        """The cache's Storage with this execution's reserved slots, for a caller that writes the new
        K/V of every layer in place itself (the fused C forward): from now on every layer counts as
        written. CacheError if the layout cannot be used in place."""
        self._check_open()
        storage = self.cache.storage()
        if storage.k_residual is not None:  # written in a copy the commit adopts, so an abort changes nothing
            storage = dataclasses.replace(storage, k_residual=self.cache.residual.stage_in_place())
        self._written.update(range(self.cache.n_layers))
        return storage

    def check_complete(self) -> None:
        """CacheError unless the execution is open and every layer's K/V were written."""
        self._check_open()
        missing = sorted(set(range(self.cache.n_layers)) - self._written)
        if missing:
            raise CacheError(f"cannot commit: layers {missing} of the new positions were never written")

    def commit(self) -> None:
        """Make the new positions part of the cache, with their ids and last logits; aborts if incomplete."""
        try:
            self.check_complete()
            self._check_logits()
        except BaseException:
            self.abort()
            raise
        self.cache._finish(self, commit=True)

    def abort(self) -> None:
        """Forget this execution: the cache is exactly as it was before begin. Idempotent."""
        self.cache._finish(self, commit=False)

    def _check_open(self):
        if not self._open:
            raise CacheError("this execution has ended (committed or aborted); begin a new one")

    def _check_logits(self):
        if self.last_logits is not None:
            logits = np.array(self.last_logits, copy=True)
            if logits.ndim != 1:
                raise ShapeError(f"last_logits must be the [V] logits of one position; got shape {logits.shape}")
            self.last_logits = logits


class ExecutionGroup:
    """One batched execution over several caches: `steps[b]` is cache b's Execution.

    Every cache reserves or none does (begin_all); leaving the block normally commits every
    execution after checking all of them, with Ctrl-C held until the last, so the commit cannot stop
    part-way; an exception aborts every execution.
    """

    def __init__(self, steps: list):
        self.steps = steps

    def __enter__(self) -> list:
        return self.steps

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
        return False

    def commit(self) -> None:
        try:
            for step in self.steps:
                step.check_complete()
                step._check_logits()
        except BaseException:
            self.abort()
            raise
        with _sigint_deferred():  # no Ctrl-C between two of the commits
            for step in self.steps:
                step.cache._finish(step, commit=True)

    def abort(self) -> None:
        with _sigint_deferred():
            for step in self.steps:
                step.abort()


def begin_all(caches, token_lists) -> ExecutionGroup:
    """begin() on every cache (token_lists[b] for caches[b]); if one cannot, the others are released."""
    if len(caches) != len(token_lists):
        raise CacheError(f"one id list per cache: {len(token_lists)} lists for {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise CacheError("a cache appears twice in one batch; fork it to run two continuations")
    steps = []
    try:
        with _sigint_deferred():  # one deferral for every begin (each would install its own)
            for cache, ids in zip(caches, token_lists):
                steps.append(cache.begin(ids))
    except BaseException:
        ExecutionGroup(steps).abort()
        raise
    return ExecutionGroup(steps)


_deferring = False  # a _sigint_deferred block is open (in the main thread, the only one that defers)


@contextmanager
def _sigint_deferred():
    # Hold Ctrl-C until the block ends, then deliver it as usual. Python runs signal handlers in the
    # main thread only, so only there can a KeyboardInterrupt split the block; the handler installed
    # meanwhile just notes the signal. A block inside another one is already covered by it.
    global _deferring
    if _deferring or threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)


def _new_positions(token_ids):
    # token ids [T] -> (list of T ints, T); an int T -> (None, T): ids unknown
    if isinstance(token_ids, (int, np.integer)) and not isinstance(token_ids, bool):
        ids, n_new = None, int(token_ids)
    else:
        array = np.asarray(token_ids)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise ShapeError(f"an execution takes a 1-D sequence of token ids (or their count); got {token_ids!r}")
        ids, n_new = [int(t) for t in array], len(array)
    if n_new < 1:
        raise ShapeError(f"an execution needs at least one new position; got {n_new}")
    return ids, n_new


def reorder(caches: list, indices) -> list:
    """Beam search over a batch of caches: entry i of the result continues from caches[indices[i]].

    Returns the new list. A cache chosen once is moved as is; one chosen k > 1 times is forked k - 1
    times (a paged cache shares its blocks); caches chosen by nobody are freed. All forks are made
    before anything is freed, so a failure leaves every cache as it was.
    """
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
        raise CacheError(f"indices must be a 1-D sequence of integers; got {indices!r}")
    idx = [int(i) for i in idx]
    bad = [i for i in idx if not 0 <= i < len(caches)]
    if bad:
        raise CacheError(f"reorder index {bad[0]} is out of range for {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise CacheError("reorder needs distinct caches; the same cache appears twice")
    for i, cache in enumerate(caches):
        if cache.executing:
            raise CacheError(f"cache {i} has an open execution; finish it before reordering")
    for i in set(idx):
        if not caches[i].can_fork():
            raise CacheError(f"cache {i} cannot be forked (it was freed)")
    seen, out, forks = set(), [], []
    try:
        for i in idx:
            if i in seen:
                child = caches[i].fork()
                forks.append(child)
                out.append(child)
            else:
                seen.add(i)
                out.append(caches[i])
    except BaseException:
        for child in forks:
            child.free()
        raise
    for i, cache in enumerate(caches):
        if i not in seen:
            cache.free()
    return out


def _readonly(a):
    view = a.view()
    view.flags.writeable = False
    return view
