"""cache.capabilities: one value answers what a cache can do, with the reason the operation refuses."""

import warnings

import numpy as np
import pytest

import kvref
from kvref.cache.capabilities import Can
from kvref.errors import CacheError, ShapeError

CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=32)


@pytest.fixture(scope="module")
def model():
    return kvref.Model.random(CFG, seed=2, backend="numpy")


def test_a_refused_operation_raises_the_reason_its_capability_gives(model):
    window = model.new_cache(layout="window", window=3, sinks=1)
    model.forward(list(range(8)), window)
    can = window.capabilities.truncate(2)
    assert not can and "dropped positions" in can.reason
    with pytest.raises(CacheError) as refused:
        window.truncate(2)
    assert can.reason in str(refused.value)
    shift = model.new_cache(kv_dtype="float16").capabilities.shift()
    assert not shift and "K is stored as float16" in shift.reason
    assert model.new_cache().capabilities.shift() and model.new_cache().capabilities.fork == Can()


def test_a_freed_cache_can_do_nothing_and_says_so(model):
    cache = model.new_cache()
    cache.free()
    caps = cache.capabilities
    answers = [caps.fork, caps.save, caps.in_place, caps.shift(1), caps.append(1), caps.truncate(0), caps.roll_back(1)]
    assert [a.reason for a in answers] == ["this cache was freed"] * len(answers)


def test_save_capability_refuses_kivi4_and_a_cache_no_model_made(model):
    assert model.new_cache().capabilities.save
    assert "cannot be saved" in model.new_cache(kv_dtype="kivi4").capabilities.save.reason
    assert "not made by model.new_cache()" in kvref.cache.ContiguousCache(2, 2, 8, 4).capabilities.save.reason


@pytest.mark.parametrize("old, new", [
    (lambda c: c.can_append(3), lambda c: bool(c.capabilities.append(3))),
    (lambda c: c.can_truncate(1), lambda c: bool(c.capabilities.truncate(1))),
    (lambda c: c.can_roll_back(2), lambda c: bool(c.capabilities.roll_back(2))),
    (lambda c: c.can_fork(), lambda c: bool(c.capabilities.fork)),
    (lambda c: c.can_shift(1, 0), lambda c: bool(c.capabilities.shift(1, 0))),
    (lambda c: c.rollback_problem(-1), lambda c: c.capabilities.roll_back(-1).reason),
    (lambda c: c.shift_problem(), lambda c: c.capabilities.shift().reason),
    (lambda c: c.storage_problem(), lambda c: c.capabilities.in_place.reason),
])
def test_the_old_can_and_problem_methods_warn_and_agree_with_capabilities(model, old, new):
    cache = model.new_cache(layout="window", window=4, kv_dtype="float16")
    model.forward([1, 2, 3], cache)
    with pytest.warns(DeprecationWarning, match="deprecated; use cache.capabilities"):
        answer = old(cache)
    assert answer == new(cache)


def test_truncate_records_the_last_logits_it_is_given(model):
    cache = model.new_cache()
    model.forward([5, 6, 7, 8], cache)
    logits = model.forward([5, 6, 7], model.new_cache())
    cache.truncate(3, last_logits=logits)
    assert cache.next_position == 3 and cache.sequence.token_ids == [5, 6, 7]
    np.testing.assert_array_equal(cache.sequence.last_logits, logits)
    assert not cache.sequence.last_logits.flags.writeable
    cache.truncate(2)
    assert cache.sequence.last_logits is None  # not given: the logits of position 1 are unknown


def test_truncate_with_bad_last_logits_changes_nothing(model):
    cache = model.new_cache()
    logits = model.forward([5, 6, 7, 8], cache)
    with pytest.raises(ShapeError, match=r"last_logits must be the \[V\] logits of one position"):
        cache.truncate(2, last_logits=np.zeros((2, CFG.vocab_size)))
    with pytest.raises(CacheError, match="truncating to 0 leaves no position"):
        cache.truncate(0, last_logits=logits)
    assert cache.next_position == 4 and cache.sequence.token_ids == [5, 6, 7, 8]
    np.testing.assert_array_equal(cache.sequence.last_logits, logits)


def test_moved_module_names_warn_where_they_are_now():
    with pytest.warns(DeprecationWarning, match="kvref.cache.base.reorder is deprecated; use kvref.cache.reorder"):
        from kvref.cache.base import reorder
    assert reorder is kvref.cache.reorder
    with pytest.warns(DeprecationWarning, match="kvref.model.LAYOUTS"):
        from kvref.model import LAYOUTS
    assert LAYOUTS == ("auto", *kvref.cache.layout_names())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kvref.cache.begin_all and kvref.cache.reorder  # the new names do not warn
