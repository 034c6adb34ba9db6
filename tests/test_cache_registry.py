"""Layouts register themselves: a new layout is its own file (here, this test) and nothing else."""

from dataclasses import dataclass

import numpy as np
import pytest

import kvref
from kvref.cache import ContiguousCache, LayoutOptions, layout_names, register, unregister
from kvref.cache.registry import option
from kvref.conformance.kvref_engine import LAYOUTS
from kvref.errors import CacheError

CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=32)


@dataclass(frozen=True)
class ToyOptions(LayoutOptions):
    rows: int | None = option(file_high="max_seq_len")  # an option no other layout has

    def positions(self):
        return self.rows  # what a saved file asks for: the memory budget bounds it


class ToyCache(ContiguousCache):
    """A contiguous cache under a name of its own, sized by `rows` (default 8)."""

    layout = "toy"
    Options = ToyOptions
    copies = 1  # how many times a position's K/V are kept (a test raises it to see the budget follow)

    @classmethod
    def create(cls, shape, codecs, options):
        return cls(shape.n_layers, shape.n_kv_heads, shape.head_dim, options.rows or 8, codecs.k.name,
                   v_dtype=codecs.v.name, group_size=codecs.group_size, rope_theta=shape.rope_theta)

    @classmethod
    def position_bytes(cls, shape, codecs):
        return cls.copies * codecs.bytes_per_position(shape.n_layers, shape.n_kv_heads)

    def layout_options(self):
        return {"rows": self.capacity}


@pytest.fixture
def toy():
    register(ToyCache)
    yield ToyCache
    unregister("toy")


@pytest.fixture(scope="module")
def model():
    return kvref.Model.random(CFG, seed=1, backend="numpy")


def test_a_registered_layout_is_made_saved_and_loaded_through_the_model(model, toy, tmp_path):
    cache = model.new_cache(layout="toy", rows=12, kv_dtype="int8", group_size=4)
    assert type(cache) is ToyCache and cache.capacity == 12 and "toy" in layout_names()
    plain = model.new_cache(kv_dtype="int8", group_size=4)
    np.testing.assert_array_equal(model.forward([3, 1, 4, 1, 5], cache), model.forward([3, 1, 4, 1, 5], plain))
    cache.save(tmp_path / "toy.kvc")
    loaded = model.load_cache(tmp_path / "toy.kvc")
    assert type(loaded) is ToyCache and loaded.stats() == cache.stats()
    np.testing.assert_array_equal(model.forward([9], loaded), model.forward([9], cache))


def test_the_memory_budget_counts_a_position_as_its_layout_declares(model, toy, tmp_path, monkeypatch):
    cache = model.new_cache(layout="toy", rows=12)
    per_position = CFG.n_layers * CFG.n_kv_heads * 2 * CFG.head_dim * 4  # float32 K and V
    assert cache.bytes_per_position == per_position and cache.stats()["bytes_per_position"] == per_position
    cache.save(tmp_path / "toy.kvc")
    monkeypatch.setattr(kvref.cache.shape, "DEFAULT_CACHE_BUDGET", 12 * per_position)
    assert model.load_cache(tmp_path / "toy.kvc").capacity == 12  # 12 positions: within the budget
    monkeypatch.setattr(ToyCache, "copies", 2)  # a layout keeping each position twice says so
    assert model.new_cache(layout="toy", rows=12).bytes_per_position == 2 * per_position
    with pytest.raises(CacheError, match="more than the"):
        model.load_cache(tmp_path / "toy.kvc")


def test_a_layouts_options_are_checked_and_foreign_ones_refused(model, toy):
    with pytest.raises(CacheError, match="rows=0 must be a positive integer"):
        model.new_cache(layout="toy", rows=0)
    with pytest.raises(CacheError, match=r"window does not apply to layout 'toy'; its options are \('rows',\)"):
        model.new_cache(layout="toy", window=4)


def test_an_unregistered_layout_can_no_longer_be_made_or_loaded(model, tmp_path):
    register(ToyCache)
    try:
        cache = model.new_cache(layout="toy")
        model.forward([1, 2], cache)
        cache.save(tmp_path / "toy.kvc")
    finally:
        unregister("toy")
    assert "toy" not in layout_names()
    with pytest.raises(CacheError, match="cache layout 'toy' is not available"):
        model.new_cache(layout="toy")
    with pytest.raises(CacheError, match="unknown layout 'toy'"):
        model.load_cache(tmp_path / "toy.kvc")


def test_a_name_is_registered_once():
    with pytest.raises(CacheError, match="'contiguous' is already registered"):
        register(ContiguousCache)


def test_the_conformance_suite_runs_every_registered_layout():
    assert set(LAYOUTS) == set(layout_names()) == {"contiguous", "hybrid", "paged", "window"}


def test_the_names_the_registry_replaces_warn_and_still_answer(model):
    with pytest.warns(DeprecationWarning, match="Model.check_cache_budget is deprecated"):
        model.check_cache_budget(CFG.max_seq_len, "float32", "float32")
    with pytest.warns(DeprecationWarning, match="fileformat.LAYOUT_OPTIONS is deprecated"):
        from kvref.cache.fileformat import LAYOUT_OPTIONS
    assert LAYOUT_OPTIONS["window"] == ("window", "sinks")
