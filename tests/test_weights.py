"""kvref.weights: release_pages drops a mapped file's pages from the resident set and nothing else."""

import numpy as np

from kvref.weights import release_pages


def rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_release_pages_drops_a_mapped_files_pages_and_keeps_its_values(tmp_path):
    values = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    values.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensor = mapped[4096 + 100:]  # a tensor starting inside a page
    assert int(tensor.sum(dtype=np.uint64)) == int(values[4096 + 100:].sum(dtype=np.uint64))  # every page read
    before = rss_file_kib()
    release_pages(tensor)
    assert before - rss_file_kib() >= 15 << 10  # ~16 MiB fewer file pages resident
    np.testing.assert_array_equal(tensor, values[4096 + 100:])  # and read back unchanged


def test_release_pages_leaves_arrays_that_are_not_a_mapped_file_alone():
    owned = np.arange(1 << 20, dtype=np.uint8)
    from_bytes = np.frombuffer(bytes(range(256)) * 4096, dtype=np.uint8)
    for a in (owned, owned[10:], from_bytes):
        copy = a.copy()
        release_pages(a)
        np.testing.assert_array_equal(a, copy)
