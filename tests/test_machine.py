"""kvref.tools.machine: the K/V read timing and the BLAS thread count (the roofline's figures are checked
in a whole bench run, tests/test_bench.py)."""

import pytest

import kvref
from kvref.tools import machine

CONFIG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=32)


@pytest.mark.parametrize("layout, kv_dtype, n_arrays", [("contiguous", "float16", 2), ("contiguous", "int8", 4),
                                                       ("paged", "int8", 4)])
def test_kv_read_times_a_read_of_the_caches_own_arrays(layout, kv_dtype, n_arrays, monkeypatch):
    model = kvref.Model.random(CONFIG, seed=0)
    cache = model.new_cache(layout=layout, kv_dtype=kv_dtype)
    model.forward([1, 2, 3], cache)
    arrays = [a for _, a in cache.store.arrays()]
    assert len(arrays) == n_arrays
    if layout == "paged":
        assert cache.store is cache.pool.store
    for threads in (1, 3):
        seconds = machine.read_seconds(arrays, threads, tries=4)
        assert len(seconds) == 4 and all(s > 0 for s in seconds)
    # the rate is the stored bytes over the median read time; the read time is of kv_bytes at that rate
    seen = []
    monkeypatch.setattr(machine, "read_seconds", lambda arrays, threads: seen.extend(arrays) or [4e-3, 1e-3, 2e-3])
    stored = sum(a.nbytes for a in arrays)
    read = machine.kv_read({"ms_per_token": {"attention": 5.0}}, cache, 1000, 2)
    assert [id(a) for a in seen] == [id(a) for a in arrays]  # the cache's own arrays, not copies
    assert read["bandwidth_gb_s"] == pytest.approx(stored / 2e-3 / 1e9)
    assert read["bandwidth_range_gb_s"] == pytest.approx([stored / 4e-3 / 1e9, stored / 1e-3 / 1e9])
    assert read["read_ms"] == pytest.approx(1e3 * 1000 * 2e-3 / stored)
    assert read["ratio"] == pytest.approx(5.0 / read["read_ms"]) and read["threads"] == 2


def test_blas_threads_reads_what_it_sets():
    before = machine.blas_threads()
    if before is None:
        pytest.skip("NumPy's BLAS thread count is not reachable here")
    try:
        assert machine.blas_threads(1) == 1
    finally:
        machine.blas_threads(before)
