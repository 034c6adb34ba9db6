"""The sliding-window cache: the first `sinks` positions plus a ring buffer of the last `window`.

StreamingLLM's observation: a model keeps attending to the first few positions (attention sinks)
however long the text, so keeping them with a window of recent positions holds quality steady at a
fixed memory cost. Positions stay absolute (RoPE scores depend only on offsets, so a key rotated for
position p stays right); `next_position` keeps counting while `length` is the number stored.

    slots:  [ s0 s1 s2 s3 | r0  r1  r2  r3  r4  r5 ]      sinks = 4, window = 6
    holds:  [ p0 p1 p2 p3 | p12 p13 p8  p9  p10 p11 ]     after 14 positions; head = 2 (next write -> r2)

    stored positions: 0..3 and 8..13; next_position = 14; length = 10

What an execution sees: the positions the cache held before it, plus its own new positions (each
query causally). A decode step therefore attends to the sinks, the last `window` positions and
itself; after the execution the ring keeps only the last `window`. New K/V are staged until the
commit, so a failed execution overwrites nothing; for the same reason the native path cannot write
them in place (`cache.capabilities.in_place`), and runs this layout kernel by kernel on the decoded K/V.

A ring that has dropped a position cannot be rolled back (`truncate`) to an earlier state: the
dropped positions would be needed again. Positions never reach the model's max_seq_len (an append
past it raises CacheFullError, as a contiguous cache's would): `shift(n, keep=sinks)` closes the gap
between the sinks and the ring by renumbering the ring (keys rotated back by n), so generation can
continue past max_seq_len, as StreamingLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import CacheError, CacheFullError
from .base import KVCache
from .quant import SlotStore
from .registry import LayoutOptions, option, register


@dataclass(frozen=True)
class WindowOptions(LayoutOptions):
    window: int | None = option(file_high="max_seq_len")  # W: recent positions the ring keeps (required)
    sinks: int = option(0, low=0, file_high="max_seq_len")  # first positions kept for good

    def __post_init__(self):
        if self.window is None:
            raise CacheError("layout 'window' needs window=W, the number of recent positions it keeps")
        super().__post_init__()

    def positions(self):
        return self.window + self.sinks


@register
class WindowCache(KVCache):
    layout = "window"
    Options = WindowOptions
    chunking_invariant = False  # a long execution sees more than the ring keeps between executions

    @classmethod
    def create(cls, shape, codecs, options):
        return cls(shape.n_layers, shape.n_kv_heads, shape.head_dim, options.window, options.sinks, codecs.k.name,
                   v_dtype=codecs.v.name, group_size=codecs.group_size, rope_theta=shape.rope_theta,
                   latent_dim=shape.latent_dim,
                   max_positions=shape.max_seq_len)

    @classmethod
    def position_bytes(cls, shape, codecs):
        return codecs.bytes_per_position(shape.n_layers, shape.n_kv_heads)  # a ring slot in every layer

    def __init__(self, n_layers, n_kv_heads, head_dim, window, sinks=0, dtype="float32", *, v_dtype=None,
                 group_size=None, rope_theta=None, latent_dim=None, max_positions=None):
        WindowOptions(window=window, sinks=sinks)  # checks them
        super().__init__(n_layers, n_kv_heads, head_dim, dtype, v_dtype=v_dtype, group_size=group_size,
                         rope_theta=rope_theta, latent_dim=latent_dim)
        self.window, self.sinks = int(window), int(sinks)
        # The model's max_seq_len (None: unbounded): positions stay absolute, so the ring holds fewer
        # positions than that but next_position never passes it; shift renumbers to go on, as Model.forward
        # and the cache file format expect (no position of a model's cache is >= max_seq_len).
        self.max_positions = max_positions
        # slots 0..sinks-1 hold positions 0..sinks-1; slots sinks.. are the ring
        self.store = SlotStore(n_layers, (self.sinks + self.window,), n_kv_heads, head_dim, self.k_codec,
                               self.v_codec)
        self._n_sinks = 0  # sink slots filled
        self._n_ring = 0  # ring slots filled: positions next-n_ring .. next-1
        self._head = 0  # ring slot (0..window-1) the next ring position is written to
        self._next = 0  # next absolute position

    # ---- accounting ----------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._n_sinks + self._n_ring

    @property
    def next_position(self) -> int:
        return self._next

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    @property
    def allocated_nbytes(self) -> int:
        return self.store.allocated_nbytes

    def positions(self):
        return np.concatenate([np.arange(self._n_sinks), np.arange(self._next - self._n_ring, self._next)])

    def stats(self):
        return {**super().stats(), "window": self.window, "sinks": self.sinks}

    def _slots(self):
        # storage slots of the stored positions, in position order: [length]
        ring = (self._head - self._n_ring + np.arange(self._n_ring)) % self.window
        return np.concatenate([np.arange(self._n_sinks), self.sinks + ring])

    # ---- one execution -------------------------------------------------------------------------------

    def _append_problem(self, n_new):
        # the ring makes room by dropping its oldest positions; only the model's positions run out
        if self._freed:
            return "this cache was freed"
        if self.max_positions is not None and self._next + n_new > self.max_positions:
            return (f"cannot append {n_new} positions: the next position is {self._next} and positions are at "
                    f"most {self.max_positions - 1} (max_seq_len {self.max_positions}); shift(n, keep={self.sinks}) "
                    "renumbers the ring to go on")
        return None

    def _reserve(self, n_new):
        problem = self._append_problem(n_new)
        if problem is not None:
            raise CacheFullError(problem)
        return n_new, {}  # the ring has room; the layers' encoded K/V are staged here

    def _write(self, reservation, layer, k, v):
        T, staged = reservation
        new = (*self.k_codec.encode(k), *self.v_codec.encode(v))  # encoded once, written at the commit
        staged[layer] = new
        k_old, v_old = self.store.read(layer, self._slots())  # [length, Hkv, D] in position order
        k_new, v_new = self.store.decode_raw(new)  # [T, Hkv, D], read back as stored
        positions = np.concatenate([self.positions(), np.arange(self._next, self._next + T)])
        k_all, v_all = np.concatenate([k_old, k_new]), np.concatenate([v_old, v_new])
        return k_all.astype(k_new.dtype, copy=False), v_all.astype(v_new.dtype, copy=False), positions

    def _commit(self, reservation):
        n_new, staged = reservation
        new = np.arange(self._next, self._next + n_new)
        to_sinks = np.flatnonzero(new < self.sinks)  # only while the sinks are not yet filled
        to_ring = np.flatnonzero(new >= self.sinks)[-self.window:]  # earlier ones would be dropped anyway
        ring_slots = self.sinks + (self._head + np.arange(len(to_ring))) % self.window
        rows = np.concatenate([to_sinks, to_ring])
        slots = np.concatenate([new[to_sinks], ring_slots])
        for layer in range(self.n_layers):
            self.store.write_raw(layer, slots, tuple(None if a is None else a[rows] for a in staged[layer]))
        self._n_sinks += len(to_sinks)
        self._head = (self._head + len(to_ring)) % self.window
        self._n_ring = min(self._n_ring + len(to_ring), self.window)
        self._next += n_new

    def _storage_problem(self):
        return super()._storage_problem() or (
            "the window stages new K/V until the commit (so an abort can keep the ring) and keeps its "
            "positions in a ring; it is read through read() and run kernel by kernel")

    # ---- reading -------------------------------------------------------------------------------------

    def read(self, layer):
        return self.store.read(layer, self._slots())

    def read_raw(self, layer):
        return self.store.read_raw(layer, self._slots())

    # ---- operations ----------------------------------------------------------------------------------

    def _truncate_problem(self, n):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            return f"n must be an integer, not {n!r}"
        if not 0 <= n <= self._next:
            return f"the cache's next position is {self._next}"
        if n < self._next and self.length != self._next:
            return (f"the window has dropped positions {self._n_sinks}..{self._next - self._n_ring - 1}; going "
                    f"back to position {n} would need positions it no longer holds")
        return None

    def _rollback_problem(self, n_new):
        problem = super()._rollback_problem(n_new)
        if problem is None and self._next + n_new > self.sinks + self.window:
            problem = (f"the window holds {self.sinks} sinks + {self.window} ring positions; {n_new} positions from "
                       f"position {self._next} would make the ring drop positions, after which it cannot truncate")
        return problem

    def _truncate(self, n):
        if n == self._next:
            return
        # nothing was dropped: sinks hold 0..n_sinks-1 and the ring holds sinks..next-1 in order
        n_ring = max(0, n - self.sinks)
        self._head = (self._head - (self._n_ring - n_ring)) % self.window
        self._n_ring = n_ring
        self._n_sinks = min(self._n_sinks, n)
        self._next = n

    def _shift_problem(self, n=None, keep=0):
        problem = super()._shift_problem(n, keep)
        if problem is None and n is not None and keep != self.sinks:
            problem = f"a window keeps exactly its {self.sinks} sink positions, so keep must be {self.sinks}"
        return problem

    def _shift(self, n, keep):
        oldest = self._next - self._n_ring
        dropped = max(0, min(self._n_ring, keep + n - oldest))  # ring positions in keep..keep+n-1
        self._n_ring -= dropped  # the oldest ring slots simply become free
        ring = self._slots()[self._n_sinks:]
        for layer in range(self.n_layers):
            k, ks, v, vs = self.store.read_raw(layer, ring)  # copies
            self.store.write_raw(layer, ring, (self._rerotate(k, n, layer).astype(k.dtype), ks, v, vs))
        self._next -= n

    def _fork(self):
        child = WindowCache(self.n_layers, self.n_kv_heads, self.head_dim, self.window, self.sinks, self.k_dtype,
                            v_dtype=self.v_dtype, group_size=self.group_size, rope_theta=self.rope_theta,
                            latent_dim=self.latent_dim,
                            max_positions=self.max_positions)
        for name, a in self.store.arrays():
            getattr(child.store, name)[...] = a
        child._n_sinks, child._n_ring, child._head, child._next = self._n_sinks, self._n_ring, self._head, self._next
        return child

    def _free(self):
        self.store = None
        self._n_sinks = self._n_ring = 0

    def layout_options(self):
        return {"window": self.window, "sinks": self.sinks}

    def _check_saved_positions(self, positions, next_position):
        # sinks 0..n_sinks-1, then the last positions before next_position, at most W of them
        n_sinks = int(np.sum(positions < self.sinks))
        ring = positions[n_sinks:]
        expected = np.concatenate([np.arange(n_sinks), np.arange(next_position - len(ring), next_position)])
        if (len(ring) > self.window or not np.array_equal(positions, expected)
                or (len(ring) and n_sinks != self.sinks)):
            raise CacheError(f"the saved positions are not sinks 0..{self.sinks - 1} followed by the last "
                             f"<= {self.window} positions before {next_position}")

    def _load_rows(self, positions, next_position, raw_layers):
        positions = np.asarray(positions)
        n_sinks = int(np.sum(positions < self.sinks))
        ring = positions[n_sinks:]
        slots = np.concatenate([np.arange(n_sinks), self.sinks + np.arange(len(ring))])
        for layer, raw in enumerate(raw_layers):
            self.store.write_raw(layer, slots, raw)
        self._n_sinks, self._n_ring = n_sinks, len(ring)
        self._head = len(ring) % self.window
        self._next = int(next_position)
