"""kvref.generation.stop: one StopCondition ends kvref.generate, the batch Scheduler and the server alike."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvref
from kvref.errors import GenerationError
from kvref.generation.batch import Engine
from kvref.generation.stop import StopCondition
from kvref.generation.stream import TextStream
from tests.test_generate import CFG, with_letters


def letters(tokens) -> str:
    return "".join(chr(ord("a") + t % 26) for t in tokens)


@given(st.integers(0, 2**16), st.integers(1, 3), st.integers(1, 3))
def test_generate_and_the_batch_engine_end_at_the_same_token_of_a_stop_string(seed, length, n):
    model = with_letters(kvref.Model.random(CFG, seed=seed % 7, dtype="float64"))
    free = list(kvref.generate(model, [1, 2], 16, ignore_eos=True))
    stop = letters(free)[6:6 + length]
    config = kvref.GenerationConfig(max_new_tokens=16, stop=(stop,), ignore_eos=True)
    alone = list(kvref.generate(model, [1, 2], config=config))
    engine = Engine(model, max_batch=4)
    first = engine.submit([1, 2], 16, n=n, stop=StopCondition(model.tokenizer, config, text=True))
    texts = {id(r): "" for r in (first, *first.siblings)}
    for request, _ in engine.stream():
        texts[id(request)] += request.new_text + (request.stop.flush() if request.done else "")
    for request in (first, *first.siblings):  # greedy: every sequence of n is the same one
        assert request.tokens == alone and request.finish_reason == "stop"
        assert texts[id(request)] == TextStream(model.tokenizer, [stop]).text(alone)


def test_ids_alone_are_checked_without_decoding_unless_the_text_is_wanted():
    model = with_letters(kvref.Model.random(CFG))
    config = kvref.GenerationConfig(stop_ids={5})
    quiet, talking = StopCondition(model.tokenizer, config), StopCondition(model.tokenizer, config, text=True)
    assert quiet.stream is None and quiet.push(3) == "" and not quiet.ended
    assert talking.push(3) == "d" and not talking.ended
    assert quiet.ends_after(5) and talking.ends_after(5)
    assert StopCondition(model.tokenizer, config).end_ids == {0, 5}  # the model's EOS too


def test_a_fresh_condition_for_a_sibling_starts_over():
    model = with_letters(kvref.Model.random(CFG))
    stop = StopCondition(model.tokenizer, kvref.GenerationConfig(stop=("bc",)))
    assert not stop.ends_after(1) and stop.ends_after(2)
    sibling = stop.fresh()
    assert not sibling.ended and not sibling.ends_after(2)


def test_nothing_follows_the_end_and_stop_strings_need_a_tokenizer():
    stop = StopCondition.of_ids([7])
    assert stop.ends_after(7)
    with pytest.raises(GenerationError, match="has ended"):
        stop.push(1)
    with pytest.raises(GenerationError, match="stop strings need a tokenizer"):
        StopCondition(None, kvref.GenerationConfig(stop=("x",)))


def test_the_scheduler_takes_a_stop_condition_or_stop_ids_not_both():
    engine = Engine(kvref.Model.random(CFG), max_batch=2)
    with pytest.raises(GenerationError, match="stop= takes a StopCondition"):
        engine.submit([1, 2], 4, stop_ids=[3], stop=StopCondition.of_ids([4]))
    with pytest.raises(GenerationError, match="stop= takes a StopCondition"):
        engine.submit([1, 2], 4, stop=[4])
    request = engine.submit([1, 2], 4, stop_ids=[3])
    assert request.stop_ids == {3}
