"""An execution is a transaction (kvref/cache/execution.py): it commits everything together or nothing.

Every path runs through `cache.begin`: the spec decoder, the batched decoder (one group
transaction over every cache) and the fused C forward. Interrupting any of them mid-way leaves the
cache, its sequence and a shared block pool exactly as they were. A cache serves one model and one
execution at a time; a model serves any number of threads, each with its own cache.
"""

import dataclasses
import os
import signal
import threading
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvref
from kvref import native
from kvref.cache import begin_all, reorder
from kvref.errors import BackendError, CacheError, CacheFullError, ShapeError
from kvref.executor import SpecExecutor
from kvref.generation.batch import forward_batch

CFG = kvref.ModelConfig(n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, vocab_size=40, max_seq_len=64)
BACKENDS = ["numpy", "c"] if native.available() else ["numpy"]
LAYOUTS = [{}, {"layout": "paged", "block_size": 4}, {"layout": "window", "window": 6, "sinks": 1}]
LAYOUT_IDS = ["contiguous", "paged", "window"]


class StopAtLayer:
    """A kernel set that raises `error` when the decoder reaches a layer's attention for the n-th time."""

    def __init__(self, ops, n, error=KeyboardInterrupt):
        self.ops, self.n, self.error = ops, n, error

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def attention(self, *args, **kwargs):
        self.n -= 1
        if self.n < 0:
            raise self.error("interrupted inside a layer")
        return self.ops.attention(*args, **kwargs)


def pool_state(pool):
    # everything a reservation may touch: refcounts, the free list in order, the prefix index
    return pool.refcount.copy(), pool.free_list, pool.prefix_keys


def cache_state(cache):
    seq = cache.sequence
    raw = [[None if a is None else a.copy() for a in cache.read_raw(layer)] for layer in range(cache.n_layers)]
    table = cache.block_table if cache.layout == "paged" else None
    logits = None if seq.last_logits is None else seq.last_logits.copy()
    return cache.length, cache.next_position, table, list(seq.token_ids or []), logits, raw


def assert_same_state(a, b):
    assert a[:4] == b[:4]
    assert (a[4] is None) == (b[4] is None) and (a[4] is None or np.array_equal(a[4], b[4]))
    for layer_a, layer_b in zip(a[5], b[5]):
        for x, y in zip(layer_a, layer_b):
            assert (x is None and y is None) or np.array_equal(x, y)


@contextmanager
def stopping(model, caches, n_attention_calls, error=KeyboardInterrupt):
    """Executions on `caches` run the shared decoder over the model's kernels raising inside a layer (the
    spec executor over StopAtLayer, bound to each cache as a model binds one), then their own again."""
    bound = [model.executor(c) for c in caches]  # each cache checked and bound first, as an execution does
    stop = SpecExecutor(StopAtLayer(model.ops, n_attention_calls, error), model, "the test stops it inside a layer")
    for c in caches:
        c.executor = stop
    try:
        yield
    finally:
        for c, executor in zip(caches, bound):
            c.executor = executor


def interrupt(model, caches, run, n_attention_calls, error=KeyboardInterrupt):
    """Run `run()` with executions on `caches` raising inside a layer; the error must come out."""
    with stopping(model, caches, n_attention_calls, error), pytest.raises(error):
        run()


# ---- the reproduction of the issue: Ctrl-C in a layer of a paged execution ------------------------

PATHS = [(path, backend) for path in ("spec", "batched", "fused") for backend in BACKENDS
         if path != "fused" or backend == "c"]  # the fused C forward is the native backend's


@pytest.mark.parametrize("path, backend", PATHS)
def test_ctrl_c_inside_a_layer_leaves_the_paged_pool_unchanged(path, backend):
    model = kvref.Model.random(CFG, seed=1, backend=backend)
    a = model.new_cache(layout="paged", block_size=4, num_blocks=6)
    b = model.new_cache(layout="paged", pool=a.pool)
    model.forward([1, 2, 3, 4, 5], a)  # 2 blocks, the second one part full
    sibling = a.fork()  # shares both blocks: a's next write copies the second one
    before, pool_before = cache_state(a), pool_state(a.pool)
    new = [6, 7, 8, 9, 10, 11]
    if path == "fused":
        model.fused.fail_at_layer(1)
        with pytest.raises(BackendError, match="injected"):
            model.forward(new, a)
    elif path == "spec":
        interrupt(model, [a], lambda: model.forward(new, a), 1)
    else:
        interrupt(model, [a, b], lambda: forward_batch(model, [new, [3]], [a, b]), 3)
    assert_same_state(cache_state(a), before)
    for x, y in zip(pool_state(a.pool), pool_before):
        assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
    a.pool.check([a, b, sibling])
    assert not a.executing and not b.executing
    # the blocks went back: the sibling can take every free block, and `a` continues as if never interrupted
    fresh = model.new_cache(layout="paged", block_size=4, num_blocks=6)
    model.forward([1, 2, 3, 4, 5], fresh)
    np.testing.assert_array_equal(model.forward(new, a), model.forward(new, fresh))
    a.free()
    room = sibling.capacity - sibling.length  # its own part block and every free block of the pool
    model.forward([i % CFG.vocab_size for i in range(room)], sibling)
    assert room == 3 + 4 * 4 and sibling.pool.blocks_free == 0


@pytest.mark.parametrize("options", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_interrupted_execution_commits_nothing_on_every_layout(options, backend):
    model = kvref.Model.random(CFG, seed=2, backend=backend)
    cache, twin = model.new_cache(**options), model.new_cache(**options)
    for c in (cache, twin):
        model.forward([3, 1, 4, 1, 5, 9, 2], c)
    before = cache_state(cache)
    interrupt(model, [cache], lambda: model.forward([6, 5, 3], cache), 2)
    assert_same_state(cache_state(cache), before)
    np.testing.assert_array_equal(model.forward([6, 5, 3], cache), model.forward([6, 5, 3], twin))
    assert_same_state(cache_state(cache), cache_state(twin))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_commits_all_or_none(backend):
    model = kvref.Model.random(CFG, seed=3, backend=backend)
    roomy, tight = model.new_cache(), model.new_cache(capacity=4)
    model.forward([1, 2], roomy)
    model.forward([1, 2, 3], tight)
    states = [cache_state(c) for c in (roomy, tight)]
    with pytest.raises(CacheFullError, match="cannot append 2 positions"):
        forward_batch(model, [[5], [6, 7]], [roomy, tight])  # the second has no room: neither begins
    interrupt(model, [roomy, tight], lambda: forward_batch(model, [[5], [6]], [roomy, tight]), 4)  # layer 2 of 3
    for c, s in zip((roomy, tight), states):
        assert_same_state(cache_state(c), s)
        assert not c.executing


class InterruptedCommit(kvref.ContiguousCache):
    """A cache that receives a real SIGINT (Ctrl-C) in the middle of every commit and of every abort."""

    def _commit(self, reservation):
        os.kill(os.getpid(), signal.SIGINT)
        super()._commit(reservation)

    def _release(self, reservation):
        os.kill(os.getpid(), signal.SIGINT)
        super()._release(reservation)


def interrupted_commit_cache(model):
    cache = InterruptedCommit(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, 16)
    cache.sequence.model = model.fingerprint()
    return cache


def test_ctrl_c_during_a_commit_waits_until_length_ids_and_logits_are_all_updated(ctrl_c):
    model = kvref.Model.random(CFG, seed=4, backend="numpy")
    cache = interrupted_commit_cache(model)
    done = threading.Event()
    other = threading.Thread(target=done.wait)  # another thread alive: the OS may hand it the signal
    other.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            model.forward([1, 2, 3], cache)
    finally:
        done.set()
        other.join()
    # the interrupt came after the commit, not between its updates
    assert cache.length == 3 and cache.sequence.token_ids == [1, 2, 3] and cache.sequence.last_logits is not None
    assert not cache.executing
    with pytest.raises(KeyboardInterrupt):
        cache.begin([4]).abort()
    assert cache.length == 3 and not cache.executing


def test_a_process_that_ignores_ctrl_c_still_ignores_it_during_and_after_a_commit():
    model = kvref.Model.random(CFG, seed=4, backend="numpy")
    cache = interrupted_commit_cache(model)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job starts
    try:
        model.forward([1, 2, 3], cache)  # the SIGINT sent inside the commit is not turned into an error
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert cache.length == 3 and not cache.executing


def test_ctrl_c_during_a_batched_commit_commits_every_sequence(ctrl_c):
    model = kvref.Model.random(CFG, seed=4, backend="numpy")
    a, b = interrupted_commit_cache(model), model.new_cache()
    with pytest.raises(KeyboardInterrupt):
        forward_batch(model, [[1, 2], [3]], [a, b])
    assert (a.length, b.length) == (2, 1) and not a.executing and not b.executing


def test_ctrl_c_while_begin_reserves_leaks_nothing(ctrl_c):
    model = kvref.Model.random(CFG, seed=4, backend="numpy")
    a = model.new_cache(layout="paged", block_size=4, num_blocks=6)
    model.forward([1, 2, 3, 4, 5], a)
    sibling = a.fork()
    free = a.pool.free_list
    copy_slots = a.pool.store.copy_slots

    def copy_then_interrupt(dst, src):  # Ctrl-C while begin copies the shared block
        copy_slots(dst, src)
        os.kill(os.getpid(), signal.SIGINT)

    a.pool.store.copy_slots = copy_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        model.forward([6], a)
    a.pool.store.copy_slots = copy_slots
    assert not a.executing and a.length == 5 and a.pool.free_list == free
    a.pool.check([a, sibling])


def test_ctrl_c_while_a_batch_begins_releases_every_cache_once_all_have_begun(ctrl_c):
    # begin_all holds Ctrl-C over all the begins (each begin's own deferral sits inside it): the
    # signal arrives after the last one, and the group is released whole.
    model = kvref.Model.random(CFG, seed=4, backend="numpy")
    a = model.new_cache(layout="paged", block_size=4, num_blocks=8)
    model.forward([1, 2, 3, 4, 5], a)
    sibling, b = a.fork(), a.pool.new_cache()
    free = a.pool.free_list
    copy_slots, begin_b, begun = a.pool.store.copy_slots, b.begin, []

    def copy_then_interrupt(dst, src):  # Ctrl-C while a's begin copies the shared block
        copy_slots(dst, src)
        os.kill(os.getpid(), signal.SIGINT)

    def begin(ids):
        begun.append(len(ids))
        return begin_b(ids)

    a.pool.store.copy_slots, b.begin = copy_then_interrupt, begin
    with pytest.raises(KeyboardInterrupt):
        forward_batch(model, [[6], [7, 8]], [a, b])
    a.pool.store.copy_slots = copy_slots
    assert begun == [2]  # the signal waited for b's begin
    assert not a.executing and not b.executing and (a.length, b.length) == (5, 0)
    assert a.pool.free_list == free and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    a.pool.check([a, sibling, b])


def test_an_execution_dropped_unfinished_is_aborted():
    model = kvref.Model.random(CFG, seed=4, backend="numpy")
    cache = model.new_cache(layout="paged", block_size=4)
    free = cache.pool.free_list
    cache.begin([1, 2, 3, 4, 5])  # reserves two blocks, then nobody holds the execution
    assert not cache.executing and cache.pool.free_list == free
    model.forward([1], cache)
    assert cache.length == 1


# ---- the execution object -------------------------------------------------------------------------

def test_an_execution_commits_length_ids_and_last_logits_together():
    model = kvref.Model.random(CFG, seed=4, backend="numpy")
    cache = model.new_cache()
    logits = model.forward([7, 8, 9], cache)
    seq = cache.sequence
    assert cache.length == 3 and seq.token_ids == [7, 8, 9] and np.array_equal(seq.last_logits, logits)
    assert seq.model is model.fingerprint()
    step = cache.begin([10])
    assert cache.executing and list(step.positions) == [3]
    step.abort()
    assert cache.length == 3 and seq.token_ids == [7, 8, 9] and np.array_equal(seq.last_logits, logits)


def test_a_commit_with_a_layer_never_written_is_refused_and_aborts():
    model = kvref.Model.random(CFG, seed=5, backend="numpy")
    cache = model.new_cache()
    k = np.zeros((2, CFG.n_kv_heads, CFG.head_dim), np.float32)
    with pytest.raises(CacheError, match=r"layers \[1, 2\] of the new positions were never written"):
        with cache.begin([1, 2]) as step:
            step.update(0, k, k)
    assert cache.length == 0 and not cache.executing
    with pytest.raises(CacheError, match="this execution has ended"):
        step.update(1, k, k)


def test_one_execution_at_a_time_on_a_cache():
    model = kvref.Model.random(CFG, seed=6, backend="numpy")
    cache = model.new_cache(layout="paged", block_size=4)
    step = cache.begin([1, 2])
    for operation in (lambda: cache.begin([3]), lambda: model.forward([3], cache), cache.fork,
                      lambda: cache.truncate(0), cache.free, lambda: cache.shift(1)):
        with pytest.raises(CacheError, match="execution is (already )?open"):
            operation()
    assert not cache.capabilities.fork and not cache.capabilities.truncate(0)
    step.abort()
    model.forward([3], cache)
    assert cache.length == 1


def test_a_copied_block_stays_ours_until_the_commit():
    # while a's execution is open, its sibling frees the block a copied and a third sequence takes a
    # block: a's abort must bring back a's own table and K/V, untouched by the third sequence
    model = kvref.Model.random(CFG, seed=6, backend="numpy")
    a = model.new_cache(layout="paged", block_size=4, num_blocks=4)
    model.forward([1, 2, 3, 4, 5, 6], a)
    b = a.fork()
    before = cache_state(a)
    execution = a.begin([7])  # copies the shared part block
    b.truncate(4)
    c = model.new_cache(layout="paged", pool=a.pool)
    model.forward([9] * c.capacity, c)  # every block it can get
    execution.abort()
    assert_same_state(cache_state(a), before)
    a.pool.check([a, b, c])


def test_aborts_in_any_order_bring_the_free_list_back_in_order():
    model = kvref.Model.random(CFG, seed=6, backend="numpy")
    a = model.new_cache(layout="paged", block_size=4, num_blocks=8)
    b = model.new_cache(layout="paged", pool=a.pool)
    free = a.pool.free_list
    first, second = a.begin([1, 2, 3, 4, 5]), b.begin([6])
    first.abort()
    second.abort()
    assert a.pool.free_list == free


def test_reorder_refuses_a_batch_with_an_open_execution_and_changes_nothing():
    model = kvref.Model.random(CFG, seed=6, backend="numpy")
    a = model.new_cache(layout="paged", block_size=4)
    b, c = model.new_cache(layout="paged", pool=a.pool), model.new_cache(layout="paged", pool=a.pool)
    for cache in (a, b, c):
        model.forward([1, 2, 3], cache)
    free = a.pool.free_list
    execution = c.begin([8])
    with pytest.raises(CacheError, match="cache 2 has an open execution"):
        reorder([a, b, c], [0, 0, 0])
    execution.abort()
    assert not b.freed and a.pool.free_list == free
    a.pool.check([a, b, c])


def test_begin_all_refuses_a_cache_twice_and_releases_what_it_began():
    model = kvref.Model.random(CFG, seed=7, backend="numpy")
    a, b = model.new_cache(), model.new_cache(capacity=1)
    with pytest.raises(CacheError, match="appears twice"):
        begin_all([a, a], [[1], [2]])
    with pytest.raises(CacheFullError):
        begin_all([a, b], [[1], [2, 3]])
    assert not a.executing and not b.executing


@pytest.mark.parametrize("token_ids", [[], [[1, 2]], 0, [1.5]])
def test_begin_refuses_what_is_not_a_list_of_new_ids(token_ids):
    cache = kvref.Model.random(CFG, seed=7, backend="numpy").new_cache()
    with pytest.raises(ShapeError):
        cache.begin(token_ids)
    assert not cache.executing


# ---- one model per cache ----------------------------------------------------------------------------

@pytest.mark.parametrize("options", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_filled_by_another_model_is_refused(options, backend):
    a = kvref.Model.random(CFG, seed=8, backend=backend)
    b = kvref.Model.random(CFG, seed=9, backend=backend)
    cache = b.new_cache(**options)
    b.forward([1, 2, 3], cache)
    with pytest.raises(CacheError, match="belongs to another model"):
        a.forward([4], cache)
    with pytest.raises(CacheError, match="belongs to another model"):
        forward_batch(a, [[4]], [cache])
    with pytest.raises(CacheError, match="belongs to another model"):
        list(kvref.generate(a, [4], 2, cache=cache))
    assert cache.length == 3
    same = kvref.Model(b.config, b.weights, backend=backend)  # the same config and weights: the same model
    same.forward([4], cache)
    assert cache.length == 4


def test_a_cache_not_made_by_a_model_is_refused_by_model_forward():
    model = kvref.Model.random(CFG, seed=8, backend="numpy")
    bare = kvref.ContiguousCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, 8)
    with pytest.raises(CacheError, match="not made by a model"):
        model.forward([1], bare)


# ---- threads ------------------------------------------------------------------------------------------

def run_threads(n, target):
    errors, threads = [], []

    def wrapped(i):
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    for i in range(n):
        threads.append(threading.Thread(target=wrapped, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.parametrize("options", LAYOUTS + [{"layout": "paged", "shared_pool": True}],
                         ids=LAYOUT_IDS + ["paged-shared-pool"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_four_threads_on_one_model_each_with_its_own_cache_get_what_each_gets_alone(options, backend):
    model = kvref.Model.random(CFG, seed=10, backend=backend)
    options = dict(options)
    shared = options.pop("shared_pool", False)
    pool = model.new_cache(layout="paged", num_blocks=4 * 16).pool if shared else None
    prompts = [[(7 * i + j) % CFG.vocab_size for j in range(5 + 3 * i)] for i in range(4)]

    def new_cache():
        return model.new_cache(layout="paged", pool=pool) if shared else model.new_cache(**options)

    alone = [list(kvref.generate(model, p, 12, cache=new_cache())) for p in prompts]
    got = [None] * 4
    errors = run_threads(4, lambda i: got.__setitem__(i, list(kvref.generate(model, prompts[i], 12,
                                                                             cache=new_cache()))))
    assert not errors and got == alone
    if shared:
        pool.check()


@pytest.mark.parametrize("options", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_threads_on_one_cache_never_corrupt_it(options, backend):
    model = kvref.Model.random(CFG, seed=11, backend=backend)
    cache = model.new_cache(**options)
    refused = []

    def decode(i):
        for step in range(15):
            try:
                model.forward([(3 * i + step) % CFG.vocab_size], cache)
            except CacheError as exc:
                assert "already open" in str(exc)
                refused.append(exc)

    assert not run_threads(2, decode)
    assert len(cache.sequence.token_ids) + len(refused) == 30
    # whatever interleaving happened, the cache holds exactly what replaying its committed ids gives
    replay = model.new_cache(**options)
    for token in cache.sequence.token_ids:
        model.forward([token], replay)
    assert_same_state(cache_state(cache), cache_state(replay))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_thread_meets_an_open_execution_with_a_clear_error(backend):
    model = kvref.Model.random(CFG, seed=12, backend=backend)
    cache = model.new_cache()
    model.forward([1, 2], cache)
    before = cache_state(cache)
    with cache.begin([3]) as step:  # held open by this thread
        errors = run_threads(1, lambda i: model.forward([4], cache))
        assert len(errors) == 1 and isinstance(errors[0], CacheError) and "already open" in str(errors[0])
        for layer in range(CFG.n_layers):
            k = np.zeros((1, CFG.n_kv_heads, CFG.head_dim), np.float32)
            step.update(layer, k, k)
    assert cache.length == 3 and cache.sequence.token_ids == [1, 2, 3]
    assert cache.sequence.last_logits is None  # this execution computed none
    cache.truncate(2)
    assert_same_state(cache_state(cache), (*before[:4], None, before[5]))


# ---- the stateful test: interrupt anywhere, then check that nothing happened --------------------------

SMALL = kvref.ModelConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=24, vocab_size=20,
                          max_seq_len=40)
# the hybrid layout needs sliding-window layers: the same model with a window of 3 on its first layer
WINDOWED = dataclasses.replace(SMALL, layer_windows=(3, None))
MODELS = {backend: kvref.Model.random(SMALL, seed=13, backend=backend) for backend in BACKENDS}
WINDOWED_MODELS = {backend: kvref.Model.random(WINDOWED, seed=13, backend=backend) for backend in BACKENDS}
LAYOUT_OPTIONS = {"contiguous": {"capacity": 24}, "paged": {"layout": "paged", "block_size": 4, "num_blocks": 9},
                  "window": {"layout": "window", "window": 5, "sinks": 1},
                  "hybrid": {"layout": "hybrid", "capacity": 24, "spare": 1}}
IDS = st.lists(st.integers(0, SMALL.vocab_size - 1), min_size=1, max_size=9)
REFUSED = (CacheFullError, kvref.ContextOverflowError)


class InterruptMachine(RuleBasedStateMachine):
    """Caches and never-interrupted twins receive the same executions; the caches are also interrupted at
    random layers of random executions (spec, batched and fused paths). After every interruption the
    cache and its pool must be exactly as before, and after every step each cache equals its twin:
    same block table, same stored bytes, same sequence, same logits for every execution."""

    layout = None  # set by each subclass below

    @initialize(backend=st.sampled_from(BACKENDS), kv_dtype=st.sampled_from(["float32", "float16", "bfloat16", "int8"]))
    def setup(self, backend, kv_dtype):
        layout = self.layout
        models = WINDOWED_MODELS if layout == "hybrid" else MODELS
        self.model = models[backend]
        self.options = dict(LAYOUT_OPTIONS[layout], kv_dtype=kv_dtype)
        self.caches, self.twins = [self.model.new_cache(**self.options)], [self.model.new_cache(**self.options)]
        event(f"{layout} {kv_dtype} {backend}")

    def sibling(self, cache):
        # a new sequence beside `cache`: in the same pool for a paged cache
        if cache.layout == "paged":
            return self.model.new_cache(layout="paged", pool=cache.pool)
        return self.model.new_cache(**self.options)

    def pick(self, data):
        return data.draw(st.integers(0, len(self.caches) - 1))

    @precondition(lambda self: len(self.caches) < 4)
    @rule(data=st.data(), fork=st.booleans())
    def add_sequence(self, data, fork):
        i = self.pick(data)
        if fork and self.caches[i].capabilities.fork:
            self.caches.append(self.caches[i].fork())
            self.twins.append(self.twins[i].fork())
        else:
            self.caches.append(self.sibling(self.caches[i]))
            self.twins.append(self.sibling(self.twins[i]))

    @rule(data=st.data(), ids=IDS)
    def execute(self, data, ids):
        i = self.pick(data)
        got, want = self.both(lambda c: self.model.forward(ids, c, all_logits=True), self.caches[i], self.twins[i])
        assert type(got) is type(want)
        if isinstance(got, np.ndarray):
            np.testing.assert_array_equal(got, want)

    @rule(data=st.data())
    def execute_batch(self, data):
        chosen = data.draw(st.lists(st.integers(0, len(self.caches) - 1), min_size=1, max_size=3, unique=True))
        ids = [data.draw(IDS) for _ in chosen]
        got = _attempt(lambda: forward_batch(self.model, ids, [self.caches[i] for i in chosen], all_logits=True))
        want = _attempt(lambda: forward_batch(self.model, ids, [self.twins[i] for i in chosen], all_logits=True))
        assert type(got) is type(want)
        if isinstance(got, list):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)

    @rule(data=st.data(), ids=IDS, path=st.sampled_from(["spec", "batched", "fused"]))
    def interrupted_execution(self, data, ids, path):
        i = self.pick(data)
        cache = self.caches[i]
        if path == "fused" and self.model.executor(cache).name != "native":
            path = "spec"
        before = [cache_state(c) for c in self.caches]
        pool = pool_state(cache.pool) if cache.layout == "paged" else None
        layer = data.draw(st.integers(0, SMALL.n_layers - 1))
        if path == "fused":
            self.model.fused.fail_at_layer(layer)
            outcome = _attempt(lambda: self.model.forward(ids, cache))
            self.model.fused.fail_at_layer(-1)  # disarm if the execution was refused before C ran
        elif path == "spec":
            outcome = self.with_stop([cache], layer, lambda: self.model.forward(ids, cache))
        else:
            j = self.pick(data)
            caches = [cache] if j == i else [cache, self.caches[j]]
            feeds = [ids, data.draw(IDS)][:len(caches)]
            outcome = self.with_stop(caches, layer * len(caches) + len(caches) - 1,
                                     lambda: forward_batch(self.model, feeds, caches))
        assert isinstance(outcome, (Interrupted, BackendError, *REFUSED)), outcome
        event(f"{path}: {type(outcome).__name__}")
        for c, b in zip(self.caches, before):
            assert_same_state(cache_state(c), b)
            assert not c.executing
        if pool is not None:
            refcount, free, keys = pool_state(cache.pool)
            assert np.array_equal(refcount, pool[0]) and free == pool[1]
            assert keys.items() <= pool[2].items()  # a prefix key of a free block handed out is gone for good

    @rule(data=st.data())
    def truncate(self, data):
        i = self.pick(data)
        n = data.draw(st.integers(0, self.caches[i].next_position))
        if self.caches[i].capabilities.truncate(n):
            self.caches[i].truncate(n)
            self.twins[i].truncate(n)

    def with_stop(self, caches, n_attention_calls, run):
        with stopping(self.model, caches, n_attention_calls, Interrupted):
            return _attempt(run)

    def both(self, run, cache, twin):
        return _attempt(lambda: run(cache)), _attempt(lambda: run(twin))

    @invariant()
    def every_cache_equals_its_never_interrupted_twin(self):
        for cache, twin in zip(getattr(self, "caches", []), getattr(self, "twins", [])):
            assert_same_state(cache_state(cache), cache_state(twin))
        if getattr(self, "caches", None) and self.caches[0].layout == "paged":
            self.caches[0].pool.check(self.caches)


class Interrupted(BaseException):
    """Stands for KeyboardInterrupt inside hypothesis (which gives a real one special treatment)."""


def _attempt(run):
    # the result, or the exception an execution may end with
    try:
        return run()
    except (Interrupted, BackendError, *REFUSED) as exc:
        return exc


def interrupt_test_case(layout):
    machine = type(f"InterruptMachine_{layout}", (InterruptMachine,), {"layout": layout})
    machine.TestCase.settings = settings(max_examples=200, stateful_step_count=25, deadline=None)
    return machine.TestCase


test_interrupting_any_execution_at_any_layer_changes_nothing_contiguous = interrupt_test_case("contiguous")
test_interrupting_any_execution_at_any_layer_changes_nothing_paged = interrupt_test_case("paged")
test_interrupting_any_execution_at_any_layer_changes_nothing_window = interrupt_test_case("window")
test_interrupting_any_execution_at_any_layer_changes_nothing_hybrid = interrupt_test_case("hybrid")
