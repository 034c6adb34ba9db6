"""Generation: cached == uncached, the token-history / cache-length boundary, stopping, errors."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvref
from kvref.errors import CacheFullError, ContextOverflowError, GenerationError, TokenError
from kvref.generation.sampling import apply_penalties, greedy
from kvref.generation.stream import TextStream
from tests.conftest import configs, token_lists
from tests.test_stream import ByteTokens

CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=40)


@given(st.data())
def test_greedy_generation_with_and_without_the_cache_yields_identical_tokens(data):
    cfg = data.draw(configs(max_seq_len=64))
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), dtype="float64")
    prompt = data.draw(token_lists(cfg, max_size=24))
    n = data.draw(st.integers(1, 16))
    cached = list(kvref.generate(model, prompt, n, use_cache=True))
    uncached = list(kvref.generate(model, prompt, n, use_cache=False))
    assert cached == uncached
    assert len(cached) == n


@given(st.integers(0, 2**16), st.floats(0.5, 2.0), st.integers(1, 20))
def test_seeded_sampling_with_and_without_the_cache_yields_identical_tokens(seed, temperature, top_k):
    model = kvref.Model.random(CFG, seed=3, dtype="float64")
    kw = dict(temperature=temperature, top_k=top_k, seed=seed)
    cached = list(kvref.generate(model, [1, 2, 3], 12, use_cache=True, **kw))
    assert cached == list(kvref.generate(model, [1, 2, 3], 12, use_cache=False, **kw))
    assert cached == list(kvref.generate(model, [1, 2, 3], 12, use_cache=True, **kw))  # reproducible


@given(st.integers(1, 10), st.integers(1, 12))
def test_after_each_decode_step_the_token_history_is_one_longer_than_the_cache(prompt_len, n):
    model = kvref.Model.random(CFG, seed=0)
    cache = model.new_cache()
    history = list(range(1, prompt_len + 1))
    for token in kvref.generate(model, history, n, cache=cache):
        history.append(token)
        # the token just selected has no K/V yet: it becomes the next execution's input
        assert len(history) == cache.length + 1
    assert cache.length == prompt_len + n - 1


def test_generation_stops_after_yielding_a_stop_id():
    model = kvref.Model.random(CFG, seed=0, dtype="float64")
    free = list(kvref.generate(model, [1, 2], 20))
    stop = free[5]
    first = free.index(stop)
    assert list(kvref.generate(model, [1, 2], 20, stop_ids=[stop])) == free[: first + 1]


def test_generation_continues_a_cache_across_turns_like_a_chat():
    model = kvref.Model.random(CFG, seed=2, dtype="float64")
    cache = model.new_cache()
    turn1 = list(kvref.generate(model, [1, 2, 3], 4, cache=cache))
    # the last selected token has no K/V: the next turn starts by feeding it with the new prompt
    turn2 = list(kvref.generate(model, [turn1[-1], 9, 10], 4, cache=cache))
    fresh = list(kvref.generate(model, [1, 2, 3] + turn1 + [9, 10], 4, use_cache=False))
    assert turn2 == fresh


def test_generation_checks_everything_before_the_first_token():
    model = kvref.Model.random(CFG)
    with pytest.raises(ContextOverflowError, match="max_seq_len=40"):
        kvref.generate(model, [1] * 30, 12)  # 30 + 11 positions > 40: refused before any work
    assert len(list(kvref.generate(model, [1] * 30, 11))) == 11  # exactly 40 positions: fine
    with pytest.raises(CacheFullError, match="free of 8"):
        kvref.generate(model, [1] * 4, 6, cache=model.new_cache(capacity=8))
    with pytest.raises(TokenError):
        kvref.generate(model, [64], 3)
    with pytest.raises(GenerationError, match="max_new_tokens=-1"):
        kvref.generate(model, [1], -1)
    with pytest.raises(GenerationError, match="use_cache=False"):
        kvref.generate(model, [1], 2, use_cache=False, cache=model.new_cache())


def test_executions_record_new_recomputed_and_cached_positions():
    model = kvref.Model.random(CFG)
    with_cache, without = [], []
    list(kvref.generate(model, [1, 2, 3], 4, executions=with_cache))
    list(kvref.generate(model, [1, 2, 3], 4, use_cache=False, executions=without))
    assert [(e.new, e.recomputed, e.cached) for e in with_cache] == [
        (range(0, 3), range(0, 0), range(0, 0)),
        (range(3, 4), range(0, 0), range(0, 3)),
        (range(4, 5), range(0, 0), range(0, 4)),
        (range(5, 6), range(0, 0), range(0, 5))]
    assert [(e.new, e.recomputed, e.cached) for e in without] == [
        (range(0, 3), range(0, 0), range(0, 0)),
        (range(3, 4), range(0, 3), range(0, 0)),
        (range(4, 5), range(0, 4), range(0, 0)),
        (range(5, 6), range(0, 5), range(0, 0))]
    # the same new positions either way; the cache turns recomputation into reads
    assert sum(e.computed for e in with_cache) == 6 and sum(e.computed for e in without) == 3 + 4 + 5 + 6
    assert np.sum([e.projection_flops for e in without]) > np.sum([e.projection_flops for e in with_cache])


def with_letters(model):
    """The model with a stand-in tokenizer: token i is one letter (i % 26), token 0 is EOS."""
    tokenizer = ByteTokens(bytes([ord("a") + i % 26]) for i in range(model.config.vocab_size))
    tokenizer.eos_ids = frozenset({0})
    model.tokenizer = tokenizer
    return model


def test_generation_stops_at_the_models_end_ids_unless_told_to_ignore_them():
    model = with_letters(kvref.Model.random(CFG, seed=0, dtype="float64"))
    free = list(kvref.generate(model, [1, 2], 20, ignore_eos=True))
    model.tokenizer.eos_ids = frozenset({free[4]})
    assert list(kvref.generate(model, [1, 2], 20)) == free[:free.index(free[4]) + 1]
    assert list(kvref.generate(model, [1, 2], 20, ignore_eos=True)) == free
    assert list(kvref.generate(model, [1, 2], 20, ignore_eos=True, stop_ids=[free[4]])) == free[:free.index(free[4]) + 1]


@given(st.integers(0, 2**16), st.integers(1, 3))
def test_generation_ends_with_the_token_that_completes_a_stop_string(seed, length):
    model = with_letters(kvref.Model.random(CFG, seed=seed % 7, dtype="float64"))
    free = list(kvref.generate(model, [1, 2], 16, temperature=1.0, seed=seed, ignore_eos=True))
    text = "".join(chr(ord("a") + t % 26) for t in free)
    stop = text[6:6 + length]
    stopped = list(kvref.generate(model, [1, 2], 16, temperature=1.0, seed=seed, ignore_eos=True, stop=[stop]))
    assert stopped == free[:text.index(stop) + length]
    assert TextStream(model.tokenizer, [stop]).text(stopped) == text[:text.index(stop)]


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(GenerationError, match="stop strings need a tokenizer"):
        kvref.generate(kvref.Model.random(CFG), [1], 4, stop=["x"])


@given(st.integers(0, 2**16), st.floats(0.5, 2.0), st.floats(-1, 1), st.floats(-1, 1), st.sampled_from([None, 0, 3]))
def test_penalized_generation_selects_the_argmax_of_penalized_logits_with_and_without_the_cache(
        seed, repetition, frequency, presence, last_n):
    model = kvref.Model.random(CFG, seed=seed % 5, dtype="float64")
    kw = dict(repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence,
              penalty_last_n=last_n)
    cached = list(kvref.generate(model, [1, 2, 3], 10, **kw))
    assert cached == list(kvref.generate(model, [1, 2, 3], 10, use_cache=False, **kw))
    history = [1, 2, 3]
    for token in cached:  # the direct computation: full logits, the penalties over the window, argmax
        counted = history if last_n is None else history[len(history) - last_n:] if last_n else []
        assert token == greedy(apply_penalties(model.forward(history), counted, repetition, frequency, presence))
        history.append(token)


def test_penalties_count_the_positions_a_continued_cache_holds():
    model = kvref.Model.random(CFG, seed=2, dtype="float64")
    cache = model.new_cache()
    turn1 = list(kvref.generate(model, [1, 2, 3], 4, cache=cache))
    kw = dict(frequency_penalty=1.5, penalty_last_n=None)
    turn2 = list(kvref.generate(model, [turn1[-1], 9], 6, cache=cache, **kw))
    assert turn2 == list(kvref.generate(model, [1, 2, 3] + turn1 + [9], 6, use_cache=False, **kw))


def test_generate_takes_settings_by_keyword_only_and_names_unknown_ones():
    model = kvref.Model.random(CFG)
    with pytest.raises(GenerationError, match="unknown generation setting top_n"):
        kvref.generate(model, [1], 4, top_n=3)
    with pytest.raises(TypeError):
        kvref.generate(model, [1], 4, 0.5)
    with pytest.raises(GenerationError, match="config= takes a GenerationConfig"):
        kvref.generate(model, [1], 4, config={"temperature": 0.5})


def test_overflow_shift_goes_past_the_cache_and_starts_as_plain_generation():
    model = kvref.Model.random(CFG, seed=7)
    prompt = [5, 9, 2, 7]
    with pytest.raises(CacheFullError):  # the default: checked before the first token
        kvref.generate(model, prompt, 30, cache=model.new_cache(capacity=12), ignore_eos=True)
    cache = model.new_cache(capacity=12)
    shifted = list(kvref.generate(model, prompt, 30, cache=cache, overflow="shift", ignore_eos=True))
    assert len(shifted) == 30 and cache.length <= cache.capacity
    # until the cache first fills (12 positions: the prompt and 9 tokens), it is plain generation
    plain = list(kvref.generate(model, prompt, 30, cache=model.new_cache(), ignore_eos=True))
    assert shifted[:9] == plain[:9] and shifted != plain


def test_overflow_shift_is_refused_where_keys_cannot_be_re_rotated_and_unknown_modes_are_named():
    model = kvref.Model.random(CFG, seed=7)
    with pytest.raises(kvref.CacheError, match="shift"):
        kvref.generate(model, [1, 2], 5, cache=model.new_cache(kv_dtype="float16"), overflow="shift")
    with pytest.raises(GenerationError, match="overflow='wrap' is unknown"):
        kvref.generate(model, [1, 2], 5, overflow="wrap")
