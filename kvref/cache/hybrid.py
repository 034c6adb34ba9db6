"""The hybrid cache: each layer keeps what its attention can still read.

Gemma 3 attends over a sliding window on most layers (position p sees p-W+1..p) and over every
position on the rest. A window layer never reads a key more than W-1 positions back again, so this
layout gives each window layer a ring of R = W + spare slots and each other layer `capacity` slots,
as the contiguous layout does:

    global layer  slots 0 .. capacity-1      position p in slot p
    window layer  slots 0 .. R-1 (a ring)    position p in slot p % R; holds the last <= R positions

    Gemma 3 270M at 32K positions: 3 global layers x 32,768 + 15 window layers x (512 + 64) slots,
    5.5x fewer than 18 x 32,768 (kvref memory -m gemma3-270m prints it for any length and dtype).

The layers' slot ranges lie one after another in one SlotStore [1, sum of extents, Hkv, D]; the
native path reads and writes them in place (Storage.layer_rings).

An execution writes its new K/V straight into their slots, window rings included. A ring slot may
still hold a committed position, so `begin` first copies the slots the execution will overwrite;
an abort copies them back, leaving the cache exactly as it was. While it writes T new positions,
a ring still holds every key the new queries can see once the queries are attended in passes of at
most spare + 1 positions (each pass written, then attended), which is how the native forward runs
them; the spec decoder reads the held keys before writing and attends all T at once.

What the layout can do exactly, and what it refuses:
  - continue from the cache, prefix reuse within the held positions, fork, save/load: exact;
  - truncate to n: exact while every window layer still holds positions n-W+1..n-1, that is when
    nothing was dropped yet, n >= next_position - 1 - spare, or n == 0; refused otherwise (the
    dropped keys would be needed again: recompute instead);
  - shift (a context shift): refused; layers with different RoPE bases cannot be renumbered by one
    rotation, and a window model does not need to forget the start of its context to go on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import CacheError, CacheFullError
from .base import KVCache
from .contiguous import ContiguousOptions
from .quant import SlotStore
from .registry import option, register
from .storage import Storage

DEFAULT_SPARE = 64  # ring slots beyond each window: rollback depth and positions per in-place pass


def ring_sizes(layer_windows, spare: int, capacity: int) -> tuple:
    """Each layer's ring: W + spare slots for a window layer, 0 (every position, in capacity slots)
    for a global layer, and for a window layer whose ring would not be smaller than the capacity."""
    return tuple(w + spare if w is not None and w + spare < capacity else 0 for w in layer_windows)


def positions_held(layer_windows, tokens: int, spare: int = DEFAULT_SPARE) -> list:
    """Positions each layer holds after `tokens` positions in a hybrid cache of capacity `tokens`."""
    return [min(tokens, ring) if ring else tokens for ring in ring_sizes(layer_windows, spare, tokens)]


@dataclass(frozen=True)
class HybridOptions(ContiguousOptions):
    spare: int = option(DEFAULT_SPARE, low=0, file_high="max_seq_len")  # ring slots beyond each window


@register
class HybridCache(KVCache):
    layout = "hybrid"
    Options = HybridOptions
    uniform_layers = False

    @classmethod
    def create(cls, shape, codecs, options):
        windows = shape.layer_windows or (None,) * shape.n_layers
        return cls(shape.n_layers, shape.n_kv_heads, shape.head_dim, options.capacity_for(shape, codecs, cls), windows,
                   codecs.k.name, v_dtype=codecs.v.name, group_size=codecs.group_size, rope_theta=shape.rope_theta,
                   latent_dim=shape.latent_dim,
                   spare=options.spare)

    @classmethod
    def position_bytes(cls, shape, codecs):
        # counted in every layer: a window layer's ring may hold as many positions as the capacity
        # (its window from the model file), so counting only the global layers could pass a cache
        # far over the budget
        return codecs.bytes_per_position(shape.n_layers, shape.n_kv_heads)

    def __init__(self, n_layers, n_kv_heads, head_dim, capacity, layer_windows, dtype="float32", *,
                 v_dtype=None, group_size=None, rope_theta=None, latent_dim=None, spare=DEFAULT_SPARE):
        if capacity is None:
            raise CacheError("a hybrid cache needs capacity=, the positions its global layers hold")
        HybridOptions(capacity=capacity, spare=spare)  # checks them
        windows = tuple(layer_windows)
        if len(windows) != n_layers or any(w is not None and (isinstance(w, bool) or not isinstance(
                w, (int, np.integer)) or w < 1) for w in windows):
            raise CacheError(f"layer_windows={layer_windows!r} must give each of {n_layers} layers None or a "
                             "window >= 1")
        super().__init__(n_layers, n_kv_heads, head_dim, dtype, v_dtype=v_dtype, group_size=group_size,
                         rope_theta=rope_theta, latent_dim=latent_dim)
        self._capacity, self.spare, self.windows = int(capacity), int(spare), windows
        self.rings = ring_sizes(windows, self.spare, self._capacity)
        extents = [r or self._capacity for r in self.rings]
        self._offsets = np.concatenate([[0], np.cumsum(extents)[:-1]]).astype(np.int64)
        self.store = SlotStore(1, (int(sum(extents)),), n_kv_heads, head_dim, self.k_codec, self.v_codec)
        self._next = 0
        self._start = [0] * n_layers  # oldest position a ring layer still holds (before next - R)

    # ---- accounting ----------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._next  # the global layers hold every position; window layers a suffix of them

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def nbytes(self) -> int:
        per_row = self.n_kv_heads * (self.k_codec.bytes_per_vector() + self.v_codec.bytes_per_vector())
        return per_row * sum(len(self.layer_positions(layer)) for layer in range(self.n_layers))

    @property
    def allocated_nbytes(self) -> int:
        return self.store.allocated_nbytes

    def layer_positions(self, layer: int) -> np.ndarray:
        ring = self.rings[layer]
        start = max(self._start[layer], self._next - ring) if ring else 0
        return np.arange(start, self._next)

    def stats(self):
        held = [len(self.layer_positions(layer)) for layer in range(self.n_layers)]
        return {**super().stats(), "layer_windows": list(self.windows), "layer_rings": list(self.rings),
                "spare": self.spare, "layer_positions_held": held}

    def _slots(self, layer, positions):
        # storage rows of `positions` in `layer`: [n]
        ring = self.rings[layer]
        return self._offsets[layer] + (positions % ring if ring else positions)

    # ---- one execution -------------------------------------------------------------------------------

    def _reserve(self, n_new):
        free = self._capacity - self._next
        if n_new > free:
            raise CacheFullError(f"cannot append {n_new} positions: the cache holds {self._next} of "
                                 f"{self._capacity} ({free} free)")
        undo = []  # ring slots this execution overwrites, as they are now: an abort writes them back
        for layer, ring in enumerate(self.rings):
            if ring:
                rows = self._slots(layer, np.arange(self._next, self._next + min(n_new, ring)))
                undo.append((rows, tuple(None if a is None else a.copy() for a in self.store.read_raw(0, rows))))
        return n_new, undo

    def _write(self, reservation, layer, k, v):
        n_new, _ = reservation
        new = np.arange(self._next, self._next + n_new)  # [T]
        if not self.rings[layer]:
            end = self._next + n_new
            self.store.write(0, self._slots(layer, new), k, v)
            k_all, v_all = self.store.read(0, slice(self._offsets[layer], self._offsets[layer] + end))
            return k_all, v_all, np.arange(end)
        held = self.layer_positions(layer)
        k_old, v_old = self.store.read(0, self._slots(layer, held))  # copies, read before the ring turns
        raw = (*self.k_codec.encode(k), *self.v_codec.encode(v))
        k_new, v_new = self.store.decode_raw(raw)  # [T, Hkv, D], read back as stored
        last = slice(max(0, n_new - self.rings[layer]), n_new)  # earlier ones would be overwritten at once
        self.store.write_raw(0, self._slots(layer, new[last]), tuple(None if a is None else a[last] for a in raw))
        k_all, v_all = np.concatenate([k_old, k_new]), np.concatenate([v_old, v_new])
        return k_all.astype(k_new.dtype, copy=False), v_all.astype(v_new.dtype, copy=False), np.concatenate([held, new])

    def _commit(self, reservation):
        self._next += reservation[0]

    def _release(self, reservation):
        for rows, raw in reservation[1]:
            self.store.write_raw(0, rows, raw)

    def _storage(self):
        return Storage(self.store, layer_rings=self.rings, layer_slots=self._capacity)

    # ---- reading -------------------------------------------------------------------------------------

    def read(self, layer):
        return self.store.read(0, self._slots(layer, self.layer_positions(layer)))

    def read_raw(self, layer):
        return self.store.read_raw(0, self._slots(layer, self.layer_positions(layer)))

    # ---- operations ----------------------------------------------------------------------------------

    def _truncate_problem(self, n):
        problem = super()._truncate_problem(n)
        if problem is not None or n == 0:
            return problem  # going back to empty is always exact
        for layer, window in enumerate(self.windows):
            held = self.layer_positions(layer)
            if self.rings[layer] and len(held) and held[0] > max(0, n - window + 1):
                return (f"layer {layer} keeps positions {held[0]}..{held[-1]} of its window of {window}; going "
                        f"back to position {n} would need position {max(0, n - window + 1)} again (a hybrid "
                        f"cache rolls back at most spare + 1 = {self.spare + 1} positions once its rings are full)")
        return None

    def _rollback_problem(self, n_new):
        problem = super()._rollback_problem(n_new)
        if problem is not None or self._next == 0:
            return problem  # going back to empty is always exact
        for layer, (ring, window) in enumerate(zip(self.rings, self.windows)):
            if not ring:
                continue  # the layer keeps every position
            # after the execution the ring holds from `oldest` on; truncating back to next needs next - W + 1
            oldest = max(self._start[layer], self._next + n_new - ring)
            if oldest > max(0, self._next - window + 1):
                return (f"layer {layer}'s ring of {ring} slots (window {window}) would overwrite position "
                        f"{oldest - 1}, which a rollback to position {self._next} needs (at most spare + 1 = "
                        f"{self.spare + 1} positions roll back once the rings are full)")
        return None

    def _truncate(self, n):
        for layer, ring in enumerate(self.rings):
            if ring:  # what the ring holds below n stays; a layer may hold nothing (window 1)
                self._start[layer] = min(n, max(self._start[layer], self._next - ring)) if n else 0
        self._next = n

    def _shift_problem(self, n=None, keep=0):
        return ("a hybrid cache does not shift: its window layers never run out of room, and its layers' "
                "keys may be rotated with different RoPE bases")

    def _fork(self):
        child = HybridCache(self.n_layers, self.n_kv_heads, self.head_dim, self._capacity, self.windows,
                            self.k_dtype, v_dtype=self.v_dtype, group_size=self.group_size,
                            rope_theta=self.rope_theta, latent_dim=self.latent_dim, spare=self.spare)
        for name, a in self.store.arrays():
            getattr(child.store, name)[...] = a  # stored bytes, never re-encoded
        child._next, child._start = self._next, list(self._start)
        return child

    def _free(self):
        self.store = None

    def layout_options(self):
        return {"capacity": self._capacity, "spare": self.spare}

    def _load_rows(self, positions, next_position, raw_layers):
        self._check_rows_fit(len(positions))
        starts = [next_position - len(raw[0]) for raw in raw_layers]
        for layer, (ring, window, start) in enumerate(zip(self.rings, self.windows, starts)):
            # a ring holds at most its R last positions and at least those the next query reads
            lowest, highest = (next_position - min(next_position, ring), max(0, next_position - window + 1)) if ring else (0, 0)
            if not lowest <= start <= highest:
                raise CacheError(f"layer {layer} has saved positions {start}..{next_position - 1}; its "
                                 f"{'ring' if ring else 'slots'} must hold from a position in {lowest}..{highest} on")
        for layer, (raw, start) in enumerate(zip(raw_layers, starts)):
            self.store.write_raw(0, self._slots(layer, np.arange(start, next_position)), raw)
        self._start, self._next = starts, int(next_position)
