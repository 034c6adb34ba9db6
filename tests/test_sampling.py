import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvref.errors import SamplingError
from kvref.sampling import Sampler, check_sampling, greedy, sample, sampling_probs
from kvref.tolerance import FLOAT64_KERNEL, SAMPLING_FREQUENCY_ATOL

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
