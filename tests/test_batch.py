"""Batched decode: sequences of very different lengths in one execution give what each gives alone."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvref
from kvref.errors import CacheError, CacheFullError, GenerationError
from kvref.generation.batch import Engine, Scheduler, StepPlan, forward_batch
from kvref.generation.sampling import Sampler
from kvref.tolerance import assert_close
from tests.conftest import configs, moe_configs

CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=128)

# ragged on purpose: one token next to nearly a hundred, since positions are per sequence
LENGTHS = st.lists(st.sampled_from([1, 2, 3, 17, 50, 90]) | st.integers(1, 90), min_size=1, max_size=6)


def every_block_free(engine):
    pool = engine.scheduler.pool
    return pool.blocks_free == pool.num_blocks


@given(st.data())
def test_one_batched_execution_equals_each_sequence_alone(data):
    # a mixture of experts too: its rows are grouped by expert across the sequences of the batch
    cfg = data.draw(configs(max_layers=2, max_seq_len=96) | moe_configs(max_layers=2, max_seq_len=96))
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
    engine = Engine(model, max_batch=4, block_size=8)
    requests = [engine.submit(p, n, temperature=0.8 * (i % 2), seed=i)
                for i, (p, n) in enumerate(zip(prompts, budgets))]
    streamed = {r.id: [] for r in requests}
    for request, token in engine.stream():
        streamed[request.id].append(token)
        assert len(engine.scheduler.running) <= 4
    for i, r in enumerate(requests):
        alone = list(kvref.generate(model, prompts[i], budgets[i], temperature=0.8 * (i % 2), seed=i))
        assert r.tokens == streamed[r.id] == alone and r.done and r.finish_reason == "length"
    assert every_block_free(engine)  # every finished request gave its blocks back


def test_a_small_pool_makes_requests_wait_their_turn_and_stop_ids_end_a_request():
    model = kvref.Model.random(CFG, seed=3, dtype="float64", backend="numpy")
    first = list(kvref.generate(model, [1, 2, 3], 6))
    engine = Engine(model, max_batch=8, block_size=4, num_blocks=6)  # room for one request at a time
    a = engine.submit([1, 2, 3], 6)
    b = engine.submit([4, 5, 6, 7], 6)
    c = engine.submit([1, 2, 3], 6, stop_ids=[first[2]])
    engine.step()
    assert [r.state for r in (a, b, c)] == ["running", "waiting", "waiting"]
    engine.run()
    assert a.tokens == first and c.tokens == first[:3] and c.finish_reason == "stop"
    assert b.tokens == list(kvref.generate(model, [4, 5, 6, 7], 6))
    with pytest.raises(CacheFullError, match="the pool has 6 in all"):
        engine.submit(list(range(30)), 10)
    assert engine.submit([1], 0).done


def test_prefix_reuse_in_the_scheduler_skips_the_shared_system_prompt():
    model = kvref.Model.random(CFG, seed=4, dtype="float64", backend="numpy")
    system = list(np.random.default_rng(1).integers(0, 64, 48))
    engine = Engine(model, max_batch=2, block_size=8, prefix_reuse=True)
    first = engine.submit(system + [1, 2], 4)
    engine.run()
    later = [engine.submit(system + [3 + i], 4) for i in range(3)]
    engine.run()
    assert first.reused == 0 and all(r.reused == 48 for r in later)
    for i, r in enumerate(later):
        assert r.tokens == list(kvref.generate(model, system + [3 + i], 4))
    assert every_block_free(engine)


def test_a_step_interrupted_between_its_execution_and_its_selections_neither_loses_nor_repeats_work(monkeypatch):
    model = kvref.Model.random(CFG, seed=5, backend="numpy")

    def run():
        engine = Engine(model, max_batch=2)
        requests = [engine.submit([1, 2, 3], 4), engine.submit([4, 5, 6, 7], 4, temperature=0.8, seed=1)]
        return engine, requests

    want = run()[0].run()
    engine, requests = run()
    select, calls = Sampler.__call__, []

    def interrupted_once(self, logits, history=()):  # Ctrl-C as the second request's first token is selected
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return select(self, logits, history)

    monkeypatch.setattr(Sampler, "__call__", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.setattr(Sampler, "__call__", select)
    assert [r.cache.sequence.token_ids for r in requests] == [[1, 2, 3], [4, 5, 6, 7]]
    assert engine.run() == want


def test_cancel_ends_a_waiting_or_running_request_and_frees_its_blocks():
    model = kvref.Model.random(CFG, seed=6, dtype="float64", backend="numpy")
    engine = Engine(model, max_batch=1, block_size=4)
    a, b = engine.submit([1, 2, 3, 4, 5], 20), engine.submit([6, 7], 20)
    engine.step()
    assert a.state == "running" and b.state == "waiting" and engine.scheduler.pool.blocks_used == 2
    engine.cancel(b)
    engine.cancel(a)
    assert (a.finish_reason, b.finish_reason) == ("cancelled", "cancelled") and not engine.pending
    assert every_block_free(engine) and len(a.tokens) == 1 and b.tokens == []
    engine.cancel(a)  # a finished request stays as it is
    assert a.finish_reason == "cancelled"


def test_a_chunked_prefill_lets_running_requests_decode_meanwhile_and_changes_no_token():
    model = kvref.Model.random(CFG, seed=7, dtype="float64", backend="numpy")
    long_prompt = list(np.random.default_rng(2).integers(0, 64, 100))
    engine = Engine(model, max_batch=4, block_size=8, prefill_chunk=16)
    short = engine.submit([1, 2, 3], 12)
    engine.step()
    long = engine.submit(long_prompt, 4)
    steps_to_first = 0
    while not long.tokens:
        before = len(short.tokens)
        engine.step()
        steps_to_first += 1
        assert len(short.tokens) == before + 1 or short.done  # the short request never waits on the prefill
    assert steps_to_first == 7  # 100 prompt positions at most 16 per step, minus the decode step's share
    engine.run()
    assert short.tokens == list(kvref.generate(model, [1, 2, 3], 12))
    assert long.tokens == list(kvref.generate(model, long_prompt, 4))


def test_preemption_frees_the_newest_request_and_recomputes_it_later_without_changing_a_token():
    model = kvref.Model.random(CFG, seed=8, dtype="float64", backend="numpy")
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, 64, n)) for n in (9, 14, 5, 11)]
    # 10 blocks of 4: every request alone fits (<= 7 blocks), all four at once do not
    engine = Engine(model, max_batch=4, block_size=4, num_blocks=10, preempt=True)
    requests = [engine.submit(p, 14, temperature=0.9, seed=i) for i, p in enumerate(prompts)]
    engine.run()
    assert engine.scheduler.preemptions > 0 and any(r.preempted for r in requests)
    for i, r in enumerate(requests):
        assert r.tokens == list(kvref.generate(model, prompts[i], 14, temperature=0.9, seed=i))
    assert every_block_free(engine)


def test_n_sequences_of_one_prompt_share_its_blocks_copy_on_write_and_sample_apart():
    model = kvref.Model.random(CFG, seed=9, dtype="float64", backend="numpy")
    prompt = list(range(1, 20))  # 19 positions: 4 full blocks of 4 and a shared partial one
    engine = Engine(model, max_batch=4, block_size=4)
    first = engine.submit(prompt, 6, temperature=1.0, seed=5, n=3)
    family = [first, *first.siblings]
    engine.step()
    assert [r.state for r in family] == ["running"] * 3
    assert engine.scheduler.pool.blocks_used == 5  # one prefill, shared
    assert all(r.cache.blocks_shared == 5 for r in family)
    engine.run()
    assert first.tokens == list(kvref.generate(model, prompt, 6, temperature=1.0, seed=5))
    for r in family[1:]:
        select = Sampler(1.0, seed=[5, r.index])
        alone, history = [], list(prompt)
        cache = model.new_cache()
        logits = model.forward(prompt, cache)
        for _ in range(6):
            alone.append(select(logits, history))
            history.append(alone[-1])
            logits = model.forward([alone[-1]], cache)
        assert r.tokens == alone
    assert len({tuple(r.tokens) for r in family}) == 3 and every_block_free(engine)
    with pytest.raises(GenerationError, match="n=5"):
        engine.submit(prompt, 2, n=5)


def test_the_pool_evicts_cached_prefix_blocks_last_and_least_recently_freed_first():
    model = kvref.Model.random(CFG, seed=10, backend="numpy")
    pool = model.new_cache(layout="paged", block_size=4, num_blocks=6, prefix_reuse=True).pool
    a, b = pool.new_cache(), pool.new_cache()
    model.forward(list(range(8)), a)  # two full blocks, indexed
    model.forward(list(range(20, 26)), b)  # one full block (indexed) and a partial one
    a_first = a.block_table[0]
    a.free()
    b.free()
    keys = pool.prefix_keys
    cached = set(keys)
    assert len(cached) == 3 and pool.blocks_cached == 3
    c = pool.new_cache()
    model.forward(list(range(40, 52)), c)  # 3 blocks: the 3 free blocks that hold no prefix
    assert not cached & set(c.block_table) and set(pool.prefix_keys) >= cached
    d = pool.new_cache()
    model.forward(list(range(60, 64)), d)  # 1 block: the least recently freed cached block, a's first
    assert d.block_table == (a_first,) and keys[a_first] not in pool.prefix_keys.values()
    assert all(pool.prefix_keys[b] == keys[b] for b in cached - {a_first})


def test_a_plan_admits_feeds_and_preempts_without_running_the_model_or_selecting(monkeypatch):
    model = kvref.Model.random(CFG, seed=11, dtype="float64", backend="numpy")
    # 4 blocks of 4: each prompt is admitted (optimistic admission), but the three need 2 + 2 + 1 blocks
    engine = Engine(model, max_batch=4, block_size=4, num_blocks=4, preempt=True)
    a, b, c = engine.submit(list(range(1, 8)), 4), engine.submit(list(range(8, 15)), 4), engine.submit([20], 4)
    monkeypatch.setattr(model, "forward", None)  # a plan that ran the model would fail
    monkeypatch.setattr(kvref.generation.batch, "forward_batch", None)
    plan = engine.scheduler.plan()
    assert isinstance(plan, StepPlan) and plan.admitted == (a, b, c) and plan.preempted == (c,)  # the newest
    assert plan.feeds == ((a, list(range(1, 8))), (b, list(range(8, 15))))
    assert a.tokens == b.tokens == [] and c.state == "waiting" and c.preempted == 1
    assert engine.scheduler.pool.blocks_used == 0  # nothing ran: no block was written
    monkeypatch.undo()
    engine.step()  # runs that plan (nothing new is admitted) and selects a first token for a and b
    assert len(a.tokens) == len(b.tokens) == 1 and engine.steps == 1


def test_the_scheduler_step_stream_and_run_still_work_deprecated_for_engine():
    model = kvref.Model.random(CFG, seed=12, dtype="float64", backend="numpy")
    sched = Scheduler(model, max_batch=2, block_size=4)
    a = sched.submit([1, 2, 3], 3)
    with pytest.warns(DeprecationWarning, match=r"Engine\(model, ...\).step\(\)"):
        assert [r for r, _ in sched.step()] == [a]
    with pytest.warns(DeprecationWarning, match="run"):
        assert sched.run() == {a.id: list(kvref.generate(model, [1, 2, 3], 3))}
    assert sched.steps == 3
