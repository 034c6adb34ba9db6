import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvref.errors import SamplingError
from kvref.generation.sampling import (Sampler, apply_penalties, check_penalties, check_sampling, greedy, sample,
                                       sampling_probs)
from kvref.tolerance import FLOAT64_KERNEL, SAMPLING_FREQUENCY_ATOL
from tests.conftest import require

logit_arrays = arrays(np.float64, st.integers(2, 40), elements=st.floats(-20, 20, allow_nan=False))


@given(logit_arrays)
def test_greedy_is_argmax_and_temperature_zero_is_greedy(logits):
    assert greedy(logits) == int(np.argmax(logits))
    assert sample(logits, np.random.default_rng(0), temperature=0.0, top_k=1, top_p=0.1) == int(np.argmax(logits))


@given(logit_arrays, st.integers(0, 2**32), st.floats(0.1, 3.0))
def test_sampling_with_the_same_seed_is_reproducible(logits, seed, temperature):
    draws = [[sample(logits, rng, temperature, top_p=0.9) for _ in range(10)]
             for rng in (np.random.default_rng(seed), np.random.default_rng(seed))]
    assert draws[0] == draws[1]


@given(logit_arrays, st.integers(1, 10), st.integers(0, 1000))
def test_top_k_never_picks_outside_the_k_most_likely(logits, k, seed):
    rng = np.random.default_rng(seed)
    ranked = np.argsort(-logits, kind="stable")[:k]
    for _ in range(20):
        assert sample(logits, rng, 1.0, top_k=k) in set(ranked.tolist())


@given(logit_arrays, st.floats(0.01, 1.0), st.integers(0, 1000))
def test_top_p_never_picks_outside_the_smallest_set_reaching_p(logits, p, seed):
    probs = sampling_probs(logits, 1.0)
    order = np.argsort(-logits, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[mass_before < p].tolist())
    kept = sampling_probs(logits, 1.0, top_p=p)
    assert set(np.flatnonzero(kept).tolist()) <= nucleus
    rng = np.random.default_rng(seed)
    for _ in range(20):
        assert sample(logits, rng, 1.0, top_p=p) in nucleus


@given(logit_arrays, st.floats(0.0, 1.0))
def test_min_p_keeps_exactly_tokens_with_at_least_min_p_times_the_top_probability(logits, min_p):
    probs = sampling_probs(logits, 1.0)
    kept = sampling_probs(logits, 1.0, min_p=min_p)
    np.testing.assert_array_equal(kept > 0, probs >= min_p * probs.max())
    np.testing.assert_allclose(kept.sum(), 1.0, rtol=FLOAT64_KERNEL.rtol)


def test_sampling_follows_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    rng = np.random.default_rng(0)
    counts = np.bincount([sample(logits, rng, 1.0) for _ in range(20000)], minlength=3) / 20000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=SAMPLING_FREQUENCY_ATOL)


@given(logit_arrays, st.integers(0, 2**32), st.floats(0.1, 3.0), st.sampled_from([None, 3]),
       st.sampled_from([None, 0.8]))
def test_a_sampler_draws_what_sample_draws_from_a_generator_seeded_alike(logits, seed, temperature, top_k, top_p):
    select = Sampler(temperature, top_k=top_k, top_p=top_p, seed=seed)
    rng = np.random.default_rng(seed)
    assert [select(logits) for _ in range(10)] == [sample(logits, rng, temperature, top_k, top_p) for _ in range(10)]


@given(logit_arrays, st.integers(0, 2**32))
def test_samplers_made_alike_select_alike_and_each_call_draws_on(logits, seed):
    a, b = Sampler(1.0, seed=seed), Sampler(1.0, seed=seed)
    assert [a(logits) for _ in range(8)] == [b(logits) for _ in range(8)]
    assert Sampler(seed=seed)(logits) == greedy(logits)  # temperature 0 by default: greedy


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_k=0), "top_k=0"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(min_p=-0.1), "min_p=-0.1"),
])
def test_bad_sampling_parameters_raise_sampling_error(kwargs, message):
    with pytest.raises(SamplingError, match=message):
        check_sampling(**kwargs)
    with pytest.raises(SamplingError, match=message):  # a Sampler checks its settings when made
        Sampler(**kwargs)


# ---- penalties -------------------------------------------------------------------------------------

penalty_cases = st.tuples(logit_arrays, st.lists(st.integers(0, 39), max_size=30), st.floats(0.1, 3.0),
                          st.floats(-2, 2), st.floats(-2, 2))


def direct_penalties(logits, previous, repetition, frequency, presence):
    """The definitions token by token: transformers' / llama.cpp's repetition penalty, then OpenAI's /
    llama.cpp's frequency and presence penalties."""
    out = [float(x) for x in logits]
    for token in set(t for t in previous if t < len(out)):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        out[token] -= previous.count(token) * frequency + presence
    return out


@given(penalty_cases)
def test_penalties_equal_their_definitions_computed_token_by_token(case):
    logits, previous, repetition, frequency, presence = case
    previous = [t for t in previous if t < logits.size]
    got = apply_penalties(logits, previous, repetition, frequency, presence)
    np.testing.assert_allclose(got, direct_penalties(logits, previous, repetition, frequency, presence),
                               rtol=FLOAT64_KERNEL.rtol, atol=FLOAT64_KERNEL.atol)


@given(penalty_cases)
def test_repetition_penalty_equals_transformers_logits_processor(case):
    transformers, torch = require("transformers"), require("torch")
    logits, previous, repetition, _, _ = case
    previous = [t for t in previous if t < logits.size] or [0]
    theirs = transformers.RepetitionPenaltyLogitsProcessor(repetition)(
        torch.tensor([previous]), torch.tensor(logits[None], dtype=torch.float64))
    np.testing.assert_allclose(apply_penalties(logits, previous, repetition), theirs[0].numpy(),
                               rtol=FLOAT64_KERNEL.rtol, atol=FLOAT64_KERNEL.atol)


@given(logit_arrays, st.lists(st.integers(0, 1), min_size=1, max_size=20), st.integers(0, 8))
def test_a_sampler_penalizes_only_the_last_penalty_last_n_tokens_of_the_history(logits, history, last_n):
    history = [t * (logits.size - 1) for t in history]  # tokens 0 and V-1
    select = Sampler(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.3, penalty_last_n=last_n)
    counted = history[len(history) - last_n:] if last_n else []
    assert select(logits, history) == greedy(apply_penalties(logits, counted, 1.7, 0.4, 0.3))
    every = Sampler(frequency_penalty=0.4, penalty_last_n=None)  # None: the whole history
    assert every(logits, history) == greedy(apply_penalties(logits, history, 1.0, 0.4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 must be > 0"),
    (dict(repetition_penalty=-1.1), "repetition_penalty=-1.1"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty=nan must be a finite number"),
    (dict(presence_penalty="1"), "presence_penalty='1'"),
    (dict(penalty_last_n=-1), "penalty_last_n=-1"),
])
def test_bad_penalties_raise_sampling_error(kwargs, message):
    with pytest.raises(SamplingError, match=message):
        check_penalties(**kwargs)
    with pytest.raises(SamplingError, match=message):
        Sampler(**kwargs)
