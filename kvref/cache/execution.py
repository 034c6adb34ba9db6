"""One execution (a prefill or decode step) as a transaction on a cache, and one over several caches.

    with cache.begin(token_ids) as execution:        # room is checked (and, paged, reserved) here
        positions = execution.positions              # [T] absolute positions of the new tokens
        k_all, v_all, k_pos = execution.update(layer, k, v)   # once per layer
        execution.last_logits = logits[-1]           # committed together with the new positions
    # leaving the block normally commits: cache.length grows, the ids and last logits are recorded;
    # any exception aborts: every count, block, refcount and free list is as it was before begin

`begin_all` is the same transaction over several caches (a batched execution): every cache reserves
or none does, and all commit or none.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from ..errors import CacheError, ShapeError
from .interrupts import sigint_deferred
from .storage import Storage

FREED = "this cache was freed; make a new one with model.new_cache() or fork a live one"
ENDED = "this execution has ended (committed or aborted); begin a new one"


class Transactional:
    """The execution half of KVCache (which inherits it): begin and append, their commit and abort,
    and the hooks a layout implements for them (_reserve, _write, _commit, _release)."""

    @property
    def executing(self) -> bool:
        """Whether an execution is open on this cache (begun, neither committed nor aborted)."""
        return self._execution is not None and self._execution() is not None

    def begin(self, token_ids) -> "Execution":
        """Open an execution over new positions: `token_ids` [T], or T alone when the ids are unknown.

        Checks room first (CacheFullError, before any work) and reserves what the execution needs;
        raises CacheError if another execution is open on this cache. Use the result as a context
        manager (see the module docstring), or call its commit() / abort() yourself.
        """
        # token ids [T] -> a list of T Python ints; an int T -> None (ids unknown)
        if isinstance(token_ids, (int, np.integer)) and not isinstance(token_ids, bool):
            ids, n_new = None, int(token_ids)
        else:
            array = np.asarray(token_ids)
            if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
                raise ShapeError(f"an execution takes a 1-D sequence of token ids (or their count); got {token_ids!r}")
            ids, n_new = array.tolist(), len(array)
        if n_new < 1:
            raise ShapeError(f"an execution needs at least one new position; got {n_new}")
        with self._lock, sigint_deferred():
            if self._freed:
                raise CacheError(FREED)
            if self._execution is not None and self._execution() is not None:  # self.executing, inlined: every step
                raise CacheError("an execution is already open on this cache (another thread, or a begin inside "
                                 "an execution): a cache serves one execution at a time; give each thread its "
                                 "own cache (model.new_cache(), or cache.fork())")
            reservation = self._reserve(n_new)  # raises before anything changes
            start = self.next_position
            positions = np.arange(start, start + n_new)  # [T]
            execution = Execution(self, positions, ids, reservation)
            # The cache holds its open execution weakly: one dropped unfinished (an interrupt between
            # begin and the with block, a caller that forgot it) is aborted when it is collected.
            self._execution = weakref.ref(execution)
            execution._finalizer = weakref.finalize(execution, self._abandon, reservation)
            return execution

    def append(self, k, v, token_ids=None):
        """Store K/V of new positions in every layer at once: k, v [L, T, Hkv, D] (tools and tests); a latent
        cache takes v=None."""
        k = np.asarray(k)
        v = None if v is None else np.asarray(v)
        if k.ndim != 4 or k.shape[0] != self.n_layers:
            raise ShapeError(f"k has shape {k.shape}; expected [{self.n_layers}, T, {self.n_kv_heads}, {self.head_dim}]")
        if token_ids is not None and len(token_ids) != k.shape[1]:
            raise ShapeError(f"{len(token_ids)} token ids for {k.shape[1]} positions")
        with self.begin(k.shape[1] if token_ids is None else token_ids) as step:
            for layer in range(self.n_layers):
                step.update(layer, k[layer], None if v is None else v[layer])

    def _finish(self, execution, commit: bool) -> None:
        # the end of `execution`: commit (the checks are done; nothing here can fail) or release.
        # Ctrl-C between two of these updates would leave them half made, so SIGINT waits until the end.
        with self._lock, sigint_deferred():
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
        with self._lock, sigint_deferred():
            self._execution = None
            self._release(reservation)


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


    def _check_kv(self, layer, k, v, n_new):
        expected = (n_new, self.n_kv_heads, self.head_dim)
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.n_layers:
            raise ShapeError(f"layer {layer!r} out of range: the cache has {self.n_layers} layers")
        if self.latent_dim is not None and v is not None:
            raise ShapeError(f"a latent (MLA) cache stores no V: pass v=None (V is K's first {self.latent_dim} values)")
        if self.latent_dim is None and v is None:
            raise ShapeError("v is None; only a latent (MLA) cache takes no V")
        for name, a in (("k", k), ("v", v)) if v is not None else (("k", k),):
            if not isinstance(a, np.ndarray) or a.shape != expected:
                raise ShapeError(f"{name} has shape {getattr(a, 'shape', None)}; expected [T, Hkv, D] = {list(expected)}")



class Execution:
    """One prefill or decode step on one cache, from `cache.begin` to its commit or abort.

    positions    [T] absolute positions of the new tokens
    token_ids    their ids (None when unknown), recorded in cache.sequence at commit
    last_logits  set by the caller before the commit: the logits [V] of the last new position

    As a context manager, leaving the block normally commits and an exception aborts. commit()
    refuses (and aborts) if some layer's K/V were never written.
    """

    def __init__(self, cache, positions, token_ids, reservation):
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
        A latent (MLA) cache: k the latent keys [T, 1, R + Dr], v None; v_all is k_all's first R values
        [S, 1, R], a view: the V no layout stores.
        """
        if not self._open:
            raise CacheError(ENDED)
        cache = self.cache
        cache._check_kv(layer, k, v, self.n_new)
        if int(layer) in self._written:  # a second write would read what the first one put in a ring
            raise CacheError(f"layer {layer}'s K/V were already written in this execution")
        if cache.latent_dim is not None:
            v = k[..., :0]  # [T, 1, 0]: the layouts store a V of no elements
        k_all, v_all, k_positions = cache._write(self.reservation, int(layer), k, v)
        self._written.add(int(layer))
        if cache.latent_dim is not None:
            v_all = k_all[..., :cache.latent_dim]
        return k_all, v_all, k_positions

    def write_in_place(self) -> Storage:
        """The cache's Storage with this execution's reserved slots, for a caller that writes the new
        K/V of every layer in place itself (the fused C forward): from now on every layer counts as
        written. CacheError if the layout cannot be used in place."""
        if not self._open:
            raise CacheError(ENDED)
        storage = self.cache.storage()
        if storage.k_residual is not None:  # written in a copy the commit adopts, so an abort changes nothing
            storage = dataclasses.replace(storage, k_residual=self.cache.residual.stage_in_place())
        self._written.update(range(self.cache.n_layers))
        return storage

    def check_complete(self) -> None:
        """CacheError unless the execution is open and every layer's K/V were written; ShapeError unless
        last_logits, if set, are the [V] logits of one position (then kept as a private read-only copy)."""
        if not self._open:
            raise CacheError(ENDED)
        missing = sorted(set(range(self.cache.n_layers)) - self._written)
        if missing:
            raise CacheError(f"cannot commit: layers {missing} of the new positions were never written")
        if self.last_logits is not None:
            logits = np.array(self.last_logits, copy=True)
            if logits.ndim != 1:
                raise ShapeError(f"last_logits must be the [V] logits of one position; got shape {logits.shape}")
            logits.flags.writeable = False  # what cache.sequence hands out
            self.last_logits = logits

    def commit(self) -> None:
        """Make the new positions part of the cache, with their ids and last logits; aborts if incomplete."""
        try:
            self.check_complete()
        except BaseException:
            self.abort()
            raise
        self.cache._finish(self, commit=True)

    def abort(self) -> None:
        """Forget this execution: the cache is exactly as it was before begin. Idempotent."""
        self.cache._finish(self, commit=False)


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
        except BaseException:
            self.abort()
            raise
        with sigint_deferred():  # no Ctrl-C between two of the commits
            for step in self.steps:
                step.cache._finish(step, commit=True)

    def abort(self) -> None:
        with sigint_deferred():
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
        with sigint_deferred():  # one deferral for every begin (each would install its own)
            for cache, ids in zip(caches, token_lists):
                steps.append(cache.begin(ids))
    except BaseException:
        ExecutionGroup(steps).abort()
        raise
    return ExecutionGroup(steps)

