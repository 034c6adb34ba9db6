"""Random sequences of cache operations against a trivially correct model of what each sequence holds.

The model is a list of K/V arrays per sequence (plus its token ids). The K/V written for a position
are a fixed pseudo-random function of the token ids up to it (`fake_kv`), as a real model's are, so
prefix reuse has a well-defined right answer too. After every step the machines check that every
cache holds exactly the model's K/V (quantized once: the stored value is the codec's round trip of
what was written, whatever happened since), that the pool's reference counts equal the block tables'
entries, and at the end that freeing every sequence returns every block.
"""

import shutil
import tempfile
import zlib

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvref
from kvref.cache import reorder
from kvref.cache.pool import blocks_for
from kvref.errors import CacheError, CacheFullError
from kvref.spec.ops import rope

CFG = kvref.ModelConfig(n_layers=2, d_model=8, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=8, vocab_size=3,
                        max_seq_len=64)
MODEL = kvref.Model.random(CFG, seed=0, backend="numpy")
DTYPE_PAIRS = [("float32", "float32"), ("float32", "int8"), ("int8", "int8"), ("float16", "int8"), ("bfloat16", "float32")]
IDS = st.lists(st.integers(0, CFG.vocab_size - 1), min_size=1, max_size=7)  # 3 ids: prefixes repeat often
MAX_SEQUENCES = 6


def fake_kv(ids):
    # ids [0..p] -> K, V of position p: [L, Hkv, D] each, a deterministic function of the prefix
    rng = np.random.default_rng(zlib.crc32(np.asarray(ids, dtype="<i8").tobytes()))
    shape = (CFG.n_layers, CFG.n_kv_heads, CFG.head_dim)
    return (3 * rng.standard_normal(shape)).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


class Expected:
    """What one sequence holds: decoded K/V per position ([L, Hkv, D] each) and its token ids."""

    def __init__(self, k=(), v=(), ids=()):
        self.k, self.v, self.ids = list(k), list(v), (None if ids is None else list(ids))

    def copy(self):
        return Expected(self.k, self.v, self.ids)


class CacheMachine(RuleBasedStateMachine):
    """Shared rules; subclasses make the caches and say what a layout keeps."""

    def __init__(self):
        super().__init__()
        self.seqs = []  # [(cache, Expected)]
        self.dir = tempfile.mkdtemp(prefix="kvref-state-")
        self.saves = 0

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def written(self, ids_before, new_ids):
        # what the model holds for new positions: the codec round trip of fake_kv, computed once
        out_k, out_v, raw_k, raw_v = [], [], [], []
        for i in range(len(new_ids)):
            k, v = fake_kv(list(ids_before) + list(new_ids[: i + 1]))
            raw_k.append(k)
            raw_v.append(v)
            out_k.append(self.k_codec.roundtrip(k).astype(np.float64))
            out_v.append(self.v_codec.roundtrip(v).astype(np.float64))
        return np.stack(raw_k, axis=1), np.stack(raw_v, axis=1), out_k, out_v  # [L, T, Hkv, D] x2

    def snapshot(self, cache):
        return (cache.length, cache.next_position, [cache.read(layer) for layer in range(CFG.n_layers)])

    def assert_same(self, a, b):
        assert a[:2] == b[:2]
        for (k1, v1), (k2, v2) in zip(a[2], b[2]):
            assert np.array_equal(k1, k2) and np.array_equal(v1, v2)

    @precondition(lambda self: len(self.seqs) < MAX_SEQUENCES)
    @rule()
    def new_sequence(self):
        self.seqs.append((self.new_cache(), Expected()))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), ids=IDS)
    def append(self, data, ids):
        i = data.draw(st.integers(0, len(self.seqs) - 1))
        cache, exp = self.seqs[i]
        before = self.snapshot(cache)
        free_before = self.blocks_free()
        k, v, dk, dv = self.written(exp.ids or [], ids) if exp.ids is not None else self.written([9] * len(exp.k), ids)
        try:
            cache.append(k, v, token_ids=ids if exp.ids is not None else None)
        except CacheFullError as error:
            event("append refused: cache full")
            assert "free" in str(error) or "at most" in str(error)  # the numbers are in the message
            self.assert_same(self.snapshot(cache), before)  # the failed append changed nothing
            assert self.blocks_free() == free_before
            return
        exp.k += dk
        exp.v += dv
        if exp.ids is not None:
            exp.ids += ids

    @precondition(lambda self: self.seqs and len(self.seqs) < MAX_SEQUENCES)
    @rule(data=st.data())
    def fork(self, data):
        cache, exp = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
        self.seqs.append((cache.fork(), exp.copy()))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def truncate(self, data):
        cache, exp = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
        n = data.draw(st.integers(0, cache.next_position + 1))
        allowed = self.can_truncate(cache, exp, n)
        assert bool(cache.capabilities.truncate(n)) == allowed
        if not allowed:
            before = self.snapshot(cache)
            try:
                cache.truncate(n)
            except CacheError:
                self.assert_same(self.snapshot(cache), before)
                return
            raise AssertionError(f"truncate({n}) should have raised")
        cache.truncate(n)
        self.truncate_expected(exp, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def reorder(self, data):
        picked = data.draw(st.lists(st.integers(0, len(self.seqs) - 1), min_size=1, max_size=len(self.seqs),
                                    unique=True))
        m = len(picked)
        indices = data.draw(st.lists(st.integers(0, m - 1), min_size=1,
                                    max_size=MAX_SEQUENCES - len(self.seqs) + m))
        chosen = [self.seqs[j] for j in picked]
        caches = reorder([c for c, _ in chosen], indices)
        for c, _ in chosen:
            if all(c is not new for new in caches):
                assert c.freed
        rest = [s for j, s in enumerate(self.seqs) if j not in picked]
        self.seqs = rest + [(c, chosen[i][1].copy()) for c, i in zip(caches, indices)]

    @precondition(lambda self: len(self.seqs) > 1)  # keep one: rules need a sequence (teardown frees all)
    @rule(data=st.data())
    def free(self, data):
        cache, _ = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        cache.free()
        assert cache.freed and not cache.capabilities.fork and not cache.capabilities.truncate(0)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def save_and_load(self, data):
        j = data.draw(st.integers(0, len(self.seqs) - 1))
        cache, exp = self.seqs[j]
        path = f"{self.dir}/{self.saves}.kvc"
        self.saves += 1
        cache.save(path)
        free_before = self.blocks_free()
        try:
            loaded = self.load(path)
        except CacheFullError:
            assert self.blocks_free() == free_before  # nothing half-loaded, no block taken
            return
        cache.free()
        self.seqs[j] = (loaded, exp)

    @invariant()
    def every_cache_holds_exactly_the_models_kv(self):
        for cache, exp in self.seqs:
            kept = self.kept_positions(cache, exp)
            assert list(cache.positions()) == kept
            assert cache.nbytes == len(kept) * cache.bytes_per_position
            for layer in range(CFG.n_layers):
                k, v = cache.keys(layer), cache.values(layer)
                assert np.array_equal(k.astype(np.float64), np.array([exp.k[p][layer] for p in kept]).reshape(k.shape))
                assert np.array_equal(v.astype(np.float64), np.array([exp.v[p][layer] for p in kept]).reshape(v.shape))
            assert cache.sequence.token_ids == exp.ids

    # layout hooks
    def blocks_free(self):
        return 0

    def can_truncate(self, cache, exp, n):
        return 0 <= n <= len(exp.k)

    def truncate_expected(self, exp, n):
        del exp.k[n:], exp.v[n:]
        if n == 0:
            exp.ids = []
        elif exp.ids is not None:
            del exp.ids[n:]

    def kept_positions(self, cache, exp):
        return list(range(len(exp.k)))


class PagedMachine(CacheMachine):
    @initialize(block_size=st.integers(1, 5), num_blocks=st.integers(1, 24), dtypes=st.sampled_from(DTYPE_PAIRS),
                group_size=st.sampled_from([4, 8]))
    def make_pool(self, block_size, num_blocks, dtypes, group_size):
        group = {"group_size": group_size} if "int8" in dtypes else {}
        first = MODEL.new_cache(layout="paged", k_dtype=dtypes[0], v_dtype=dtypes[1], block_size=block_size,
                                num_blocks=num_blocks, prefix_reuse=True, **group)
        self.pool = first.pool
        self.k_codec, self.v_codec = first.k_codec, first.v_codec
        self.seqs.append((first, Expected()))

    def new_cache(self):
        return self.pool.new_cache()

    def load(self, path):
        return MODEL.load_cache(path, pool=self.pool)

    def blocks_free(self):
        return self.pool.blocks_free

    @precondition(lambda self: len(self.seqs) < MAX_SEQUENCES)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, CFG.vocab_size - 1), min_size=1, max_size=8))
    def prefix_reuse(self, data, suffix):
        known = [exp.ids for _, exp in self.seqs if exp.ids]
        base = data.draw(st.sampled_from(known)) if known and data.draw(st.booleans()) else []
        ids = base[: data.draw(st.integers(0, len(base)))] + suffix if base else suffix
        cache = self.pool.new_cache()
        n = cache.prefill_reuse(ids)
        bs = self.pool.block_size
        assert 0 <= n <= len(ids) - 1 and (n % bs == 0 or n == len(ids) - 1)
        event("prefix reuse found blocks" if n else "prefix reuse found nothing")
        _, _, dk, dv = self.written([], ids[:n]) if n else (None, None, [], [])
        self.seqs.append((cache, Expected(dk, dv, ids[:n])))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def shift(self, data):
        cache, exp = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
        n = data.draw(st.integers(1, max(1, cache.length)))
        keep = data.draw(st.integers(0, max(0, cache.length - n) + 1))
        if not cache.capabilities.shift(n, keep):
            assert cache.k_dtype != "float32" or keep + n > cache.length
            return
        free_before = self.pool.blocks_free
        event("shift")
        try:
            cache.shift(n, keep)
        except CacheFullError:
            assert self.pool.blocks_free == free_before
            return
        moved = np.array(exp.k[keep + n:], dtype=np.float32)  # [m, L, Hkv, D]
        for layer in range(CFG.n_layers):
            if len(moved):
                # RoPE rotations compose: the keys at positions p - n are the stored ones turned by -n
                moved[:, layer] = rope(moved[:, layer], np.full(len(moved), -n), CFG.rope_theta)
        exp.k = exp.k[:keep] + [m.astype(np.float64) for m in moved]
        exp.v = exp.v[:keep] + exp.v[keep + n:]
        exp.ids = None

    @invariant()
    def refcounts_equal_block_table_entries(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check([c for c, _ in self.seqs])
        for cache, _ in self.seqs:
            assert len(cache.block_table) == blocks_for(cache.length, self.pool.block_size)

    def teardown(self):
        if hasattr(self, "pool"):
            for cache, _ in self.seqs:
                cache.free()
            assert self.pool.blocks_free == self.pool.num_blocks, "a block leaked"
            assert not self.pool.refcount.any()
        super().teardown()


class ContiguousMachine(CacheMachine):
    @initialize(dtypes=st.sampled_from(DTYPE_PAIRS))
    def make_first(self, dtypes):
        self.dtypes = dtypes
        first = self.new_cache()
        self.k_codec, self.v_codec = first.k_codec, first.v_codec
        self.seqs.append((first, Expected()))

    def new_cache(self):
        return MODEL.new_cache(k_dtype=self.dtypes[0], v_dtype=self.dtypes[1], **self.group())

    def group(self):
        return {"group_size": 4} if "int8" in self.dtypes else {}

    def load(self, path):
        return MODEL.load_cache(path)


class WindowMachine(ContiguousMachine):
    @initialize(dtypes=st.sampled_from(DTYPE_PAIRS), window=st.integers(1, 6), sinks=st.integers(0, 3))
    def make_first(self, dtypes, window, sinks):
        self.window, self.sinks = window, sinks
        super().make_first(dtypes)

    def new_cache(self):
        return MODEL.new_cache(layout="window", window=self.window, sinks=self.sinks, k_dtype=self.dtypes[0],
                               v_dtype=self.dtypes[1], **self.group())

    def kept_positions(self, cache, exp):
        n = len(exp.k)  # every position ever written; the window keeps the sinks and the last W
        return sorted(set(range(min(self.sinks, n))) | set(range(max(self.sinks, n - self.window), n)))

    def can_truncate(self, cache, exp, n):
        dropped = len(exp.k) > self.sinks + self.window
        return 0 <= n <= len(exp.k) and (n == len(exp.k) or not dropped)


_STEPS = settings(stateful_step_count=30)
TestPagedCacheAgainstListsOfKV = PagedMachine.TestCase
TestPagedCacheAgainstListsOfKV.settings = _STEPS
TestContiguousCacheAgainstListsOfKV = ContiguousMachine.TestCase
TestContiguousCacheAgainstListsOfKV.settings = settings(_STEPS, max_examples=50)
TestWindowCacheAgainstListsOfKV = WindowMachine.TestCase
TestWindowCacheAgainstListsOfKV.settings = settings(_STEPS, max_examples=100)
