"""Batched decode: sequences of very different lengths in one execution give what each gives alone."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvref
from kvref.batch import Scheduler, forward_batch
from kvref.errors import CacheError, CacheFullError, GenerationError
from kvref.sampling import Sampler
from kvref.tolerance import assert_close
from tests.conftest import configs

CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=128)

# ragged on purpose: one token next to nearly a hundred, since positions are per sequence
LENGTHS = st.lists(st.sampled_from([1, 2, 3, 17, 50, 90]) | st.integers(1, 90), min_size=1, max_size=6)


@given(st.data())
def test_one_batched_execution_equals_each_sequence_alone(data):
    cfg = data.draw(configs(max_layers=2, max_seq_len=96))
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), dtype="float64", backend="numpy")
    lengths = data.draw(LENGTHS.map(lambda ls: [min(n, 90) for n in ls]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    history = [list(rng.integers(0, cfg.vocab_size, data.draw(st.integers(0, 5)))) for _ in lengths]
    new = [list(rng.integers(0, cfg.vocab_size, n)) for n in lengths]
    options = data.draw(st.sampled_from([{}, {"layout": "paged", "block_size": 4}, {"layout": "window", "window": 8}]))
    caches = [model.new_cache(**options) for _ in lengths]
    for cache, h in zip(caches, history):
        if h:
            model.forward(h, cache)
    batched = forward_batch(model, new, caches, all_logits=True)
    for h, n, out, cache in zip(history, new, batched, caches):
        alone = model.new_cache(**options)
        if h:
            model.forward(h, alone)
        assert_close(out, model.forward(n, alone, all_logits=True), "float64", "batched vs alone")
        assert cache.length == alone.length and cache.sequence.token_ids == alone.sequence.token_ids


def test_a_batch_in_which_one_sequence_does_not_fit_changes_no_cache():
    model = kvref.Model.random(CFG, seed=1, backend="numpy")
    pool = model.new_cache(layout="paged", block_size=4, num_blocks=5).pool
    a, b = pool.new_cache(), pool.new_cache()
    model.forward([1, 2, 3], a)
    with pytest.raises(CacheFullError):
        forward_batch(model, [[4, 5], list(range(20))], [a, b])
    assert (a.length, b.length, pool.blocks_free) == (3, 0, 4)
    with pytest.raises(CacheError, match="appears twice"):
        forward_batch(model, [[1], [2]], [a, a])
    with pytest.raises(GenerationError, match="one id list per cache"):
        forward_batch(model, [[1]], [a, b])


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_the_scheduler_selects_what_generate_selects_for_each_request_alone(backend):
    if backend == "c" and not kvref.native.available():
        pytest.skip("native kernels not built")
    dtype = "float64" if backend == "numpy" else "float32"
    model = kvref.Model.random(CFG, seed=2, dtype=dtype, backend=backend)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 64, n)) for n in (1, 90, 5, 33, 2, 60, 12, 7, 40, 3)]
    budgets = [12, 3, 20, 8, 1, 15, 6, 25, 4, 9]
    sched = Scheduler(model, max_batch=4, block_size=8)
    requests = [sched.submit(p, n, temperature=0.8 * (i % 2), seed=i) for i, (p, n) in enumerate(zip(prompts, budgets))]
    streamed = {r.id: [] for r in requests}
    for request, token in sched.stream():
        streamed[request.id].append(token)
        assert len(sched.running) <= 4
    for i, r in enumerate(requests):
        alone = list(kvref.generate(model, prompts[i], budgets[i], temperature=0.8 * (i % 2), seed=i))
        assert r.tokens == streamed[r.id] == alone and r.done and r.finish_reason == "length"
    assert sched.pool.blocks_free == sched.pool.num_blocks  # every finished request gave its blocks back


def test_a_small_pool_makes_requests_wait_their_turn_and_stop_ids_end_a_request():
    model = kvref.Model.random(CFG, seed=3, dtype="float64", backend="numpy")
    first = list(kvref.generate(model, [1, 2, 3], 6))
    sched = Scheduler(model, max_batch=8, block_size=4, num_blocks=6)  # room for one request at a time
    a = sched.submit([1, 2, 3], 6)
    b = sched.submit([4, 5, 6, 7], 6)
    c = sched.submit([1, 2, 3], 6, stop_ids=[first[2]])
    sched.step()
    assert [r.state for r in (a, b, c)] == ["running", "waiting", "waiting"]
    sched.run()
    assert a.tokens == first and c.tokens == first[:3] and c.finish_reason == "stop"
    assert b.tokens == list(kvref.generate(model, [4, 5, 6, 7], 6))
    with pytest.raises(CacheFullError, match="the pool has 6 in all"):
        sched.submit(list(range(30)), 10)
    assert sched.submit([1], 0).done


def test_prefix_reuse_in_the_scheduler_skips_the_shared_system_prompt():
    model = kvref.Model.random(CFG, seed=4, dtype="float64", backend="numpy")
    system = list(np.random.default_rng(1).integers(0, 64, 48))
    sched = Scheduler(model, max_batch=2, block_size=8, prefix_reuse=True)
    first = sched.submit(system + [1, 2], 4)
    sched.run()
    later = [sched.submit(system + [3 + i], 4) for i in range(3)]
    sched.run()
    assert first.reused == 0 and all(r.reused == 48 for r in later)
    for i, r in enumerate(later):
        assert r.tokens == list(kvref.generate(model, system + [3 + i], 4))
    assert sched.pool.blocks_free == sched.pool.num_blocks


def test_a_step_interrupted_between_its_execution_and_its_selections_neither_loses_nor_repeats_work(monkeypatch):
    model = kvref.Model.random(CFG, seed=5, backend="numpy")

    def run():
        sched = Scheduler(model, max_batch=2)
        requests = [sched.submit([1, 2, 3], 4), sched.submit([4, 5, 6, 7], 4, temperature=0.8, seed=1)]
        return sched, requests

    want = run()[0].run()
    sched, requests = run()
    select, calls = Sampler.__call__, []

    def interrupted_once(self, logits):  # Ctrl-C as the second request's first token is selected
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return select(self, logits)

    monkeypatch.setattr(Sampler, "__call__", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        sched.step()
    monkeypatch.setattr(Sampler, "__call__", select)
    assert [r.cache.sequence.token_ids for r in requests] == [[1, 2, 3], [4, 5, 6, 7]]
    assert sched.run() == want
