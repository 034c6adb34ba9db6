"""save/load: a versioned, self-describing file that restores a cache exactly or refuses with a clear error."""

import hashlib
import json
import os
import signal
import struct
from pathlib import Path

import numpy as np
import pytest

import kvref
from kvref.cache.fileformat import FORMAT_VERSION, MAGIC, read_cache_file
from kvref.errors import CacheError, CacheFullError
from kvref.tolerance import QUANTIZED_LOGIT_BOUNDS, assert_close

DATA = Path(__file__).parent / "data"
CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=64)
LAYOUTS = [{}, {"kv_dtype": "int8", "group_size": 4}, {"k_dtype": "bfloat16", "v_dtype": "float16"},
           {"layout": "paged", "block_size": 4, "prefix_reuse": True}, {"layout": "paged", "kv_dtype": "int8"},
           {"layout": "window", "window": 5, "sinks": 2}]


@pytest.fixture(scope="module")
def model():
    return kvref.Model.random(CFG, seed=3, backend="numpy")


@pytest.mark.parametrize("options", LAYOUTS)
def test_a_loaded_cache_continues_exactly_like_the_saved_one(model, options, tmp_path):
    cache = model.new_cache(**options)
    model.forward(list(range(13)), cache)
    cache.save(tmp_path / "c.kvc")
    loaded = model.load_cache(tmp_path / "c.kvc")
    assert type(loaded) is type(cache) and loaded.stats() == cache.stats()
    assert loaded.sequence.token_ids == cache.sequence.token_ids == list(range(13))
    np.testing.assert_array_equal(loaded.sequence.last_logits, cache.sequence.last_logits)
    for layer in range(CFG.n_layers):  # the stored bytes themselves, not a re-quantization
        for a, b in zip(loaded.read_raw(layer), cache.read_raw(layer)):
            assert (a is None and b is None) or np.array_equal(a, b)
    np.testing.assert_array_equal(model.forward([7, 8], loaded, all_logits=True),
                                  model.forward([7, 8], cache, all_logits=True))


def test_the_header_describes_everything_needed_to_rebuild_the_cache(model, tmp_path):
    cache = model.new_cache(layout="paged", k_dtype="int8", v_dtype="float16", group_size=4, block_size=4)
    model.forward([1, 2, 3, 4, 5], cache)
    cache.save(tmp_path / "c.kvc")
    raw = (tmp_path / "c.kvc").read_bytes()
    assert raw[:8] == MAGIC and struct.unpack_from("<I", raw, 8)[0] == FORMAT_VERSION
    header, arrays = read_cache_file(tmp_path / "c.kvc")
    assert header["layout"] == "paged" and header["options"]["block_size"] == 4
    assert (header["k_dtype"], header["v_dtype"], header["group_size"]) == ("int8", "float16", 4)
    assert header["rope"]["theta"] == CFG.rope_theta and header["next_position"] == 5
    assert header["model"]["config"]["n_layers"] == 2 and len(header["model"]["weights_sha256"]) == 64
    assert arrays["k"].dtype == np.int8 and arrays["k_scales"].shape == (2, 5, 2, 2)
    assert arrays["v"].dtype == np.float16 and "v_scales" not in arrays
    assert arrays["last_logits"].shape == (CFG.vocab_size,)


def test_a_paged_cache_loads_into_an_existing_pool_of_any_block_size(model, tmp_path):
    cache = model.new_cache(layout="paged", block_size=4)
    model.forward(list(range(10)), cache)
    cache.save(tmp_path / "c.kvc")
    pool = model.new_cache(layout="paged", block_size=3, num_blocks=8).pool
    loaded = model.load_cache(tmp_path / "c.kvc", pool=pool)
    assert loaded.pool is pool and len(loaded.block_table) == 4
    np.testing.assert_array_equal(model.forward([1], loaded), model.forward([1], cache))


def test_a_pool_without_room_refuses_the_load_and_keeps_its_blocks(model, tmp_path):
    cache = model.new_cache(layout="paged", block_size=4)
    model.forward(list(range(10)), cache)
    cache.save(tmp_path / "c.kvc")
    pool = model.new_cache(layout="paged", block_size=4, num_blocks=2).pool
    with pytest.raises(CacheFullError, match="needs 3 blocks of 4; the pool has 2 free of 2"):
        model.load_cache(tmp_path / "c.kvc", pool=pool)
    assert pool.blocks_free == 2 and not pool.refcount.any()


def rewrite(path, mutate_header=None, mutate_body=None, fix_checksum=True):
    """Edit a saved file (header JSON or raw bytes) and, by default, make its checksum right again."""
    data = bytearray(path.read_bytes()[:-32])
    if mutate_header:
        size = struct.unpack_from("<Q", data, 12)[0]
        header = json.loads(data[20:20 + size])
        mutate_header(header)
        text = json.dumps(header, sort_keys=True).encode()
        room = min(a["offset"] for a in json.loads(data[20:20 + size])["arrays"]) - 20  # zero padding follows
        assert len(text) <= room
        struct.pack_into("<Q", data, 12, len(text))
        data[20:20 + room] = text.ljust(room, b"\0")
    if mutate_body:
        mutate_body(data)
    digest = hashlib.sha256(data).digest() if fix_checksum else path.read_bytes()[-32:]
    path.write_bytes(bytes(data) + digest)


def set_in(keys, value):
    def mutate(h):
        for k in keys[:-1]:
            h = h[k]
        h[keys[-1]] = value
    return mutate


BAD_FILES = {
    "a flipped bit": (lambda p: rewrite(p, mutate_body=lambda d: d.__setitem__(-5, d[-5] ^ 1), fix_checksum=False),
                      "corrupt or truncated: its sha256 checksum does not match"),
    "cut short": (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated or corrupt"),
    "empty": (lambda p: p.write_bytes(b""), "truncated: 0 bytes"),
    "another file type": (lambda p: p.write_bytes(b"GGUF" + bytes(100)), "not a kvref KV cache"),
    "a future version": (lambda p: rewrite(p, mutate_body=lambda d: struct.pack_into("<I", d, 8, 2)),
                         "format version 2; this kvref reads version 1"),
    "another architecture": (lambda p: rewrite(p, set_in(["model", "config_sha256"], "0" * 64)),
                             "saved for another model architecture"),
    "other weights": (lambda p: rewrite(p, set_in(["model", "weights_sha256"], "0" * 64)),
                      "model with other weights"),
    "another rope theta": (lambda p: rewrite(p, set_in(["rope", "theta"], 500.0)), "rope_theta=500.0"),
    "a shape that lies": (lambda p: rewrite(p, lambda h: h["arrays"][1].update(shape=[2, 9, 2, 8])),
                          "cannot take"),
    "an array past the end": (lambda p: rewrite(p, lambda h: h["arrays"][2].update(offset=10**9)),
                              "outside the data"),
    "an unknown layout": (lambda p: rewrite(p, set_in(["layout"], "ring")), "unknown layout 'ring'"),
    "a wrong dtype": (lambda p: rewrite(p, set_in(["k_dtype"], "float16")), "the pool stores K/V as float32/float32"),
    "positions out of order": (lambda p: rewrite(p, mutate_body=_swap_positions), "positions"),
}


def _swap_positions(data):
    size = struct.unpack_from("<Q", data, 12)[0]
    entry = json.loads(data[20:20 + size])["arrays"][0]
    o = entry["offset"]
    data[o:o + 16] = data[o + 8:o + 16] + data[o:o + 8]


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_corrupt_or_mismatched_file_is_refused_with_a_clear_error(model, tmp_path, name):
    cache = model.new_cache(layout="paged", block_size=4)
    model.forward(list(range(6)), cache)
    path = tmp_path / "c.kvc"
    cache.save(path)
    damage, message = BAD_FILES[name]
    damage(path)
    pool = model.new_cache(layout="paged", block_size=4, num_blocks=4).pool
    with pytest.raises(CacheError, match=message):
        model.load_cache(path, pool=pool)
    assert pool.blocks_free == 4  # nothing half-loaded into the pool


def test_a_cache_from_another_model_is_refused(model, tmp_path):
    cache = model.new_cache()
    model.forward([1, 2, 3], cache)
    cache.save(tmp_path / "c.kvc")
    with pytest.raises(CacheError, match="model with other weights"):
        kvref.Model.random(CFG, seed=4, backend="numpy").load_cache(tmp_path / "c.kvc")
    with pytest.raises(CacheError, match="another model architecture"):
        kvref.Model.random(CFG.replace(n_layers=3), seed=3, backend="numpy").load_cache(tmp_path / "c.kvc")
    with pytest.raises(CacheError, match="cannot read cache file"):
        model.load_cache(tmp_path / "missing.kvc")


def test_a_header_whose_dtype_disagrees_with_the_stored_array_is_refused(model, tmp_path):
    cache = model.new_cache()
    model.forward([1, 2, 3], cache)
    cache.save(tmp_path / "c.kvc")
    rewrite(tmp_path / "c.kvc", set_in(["k_dtype"], "float16"))
    with pytest.raises(CacheError, match="array 'k' is float32; float16 is stored as float16"):
        model.load_cache(tmp_path / "c.kvc")


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_files_saved_before_the_sequence_moved_off_the_cache_load_and_resume(layout):
    """tests/data/cache_v1_*.kvc were written by kvref at 97f87de, when the token ids and last logits
    were attributes of the cache; the file format (version 1) did not change, so they load into
    cache.sequence and generation resumes where a fresh run of the same ids is.

    The files were written on another machine, whose BLAS summed in another order: their logits match a
    recomputation here within the float32 rule, not bit for bit (an int8 element at a rounding boundary
    may also land one step away: the int8 cache's bound covers that). The greedy tokens agree: the
    smallest top-2 margin of the 5 steps is 0.033, far above either bound's effect on these logits."""
    small = kvref.ModelConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=24, vocab_size=20,
                              max_seq_len=40)
    model = kvref.Model.random(small, seed=21, backend="numpy")
    loaded = model.load_cache(DATA / f"cache_v1_{layout}.kvc")
    assert loaded.layout == layout and loaded.sequence.token_ids == [1, 2, 3, 4, 5, 6, 7]
    options = {"layout": "paged", "block_size": 4, "kv_dtype": "int8"} if layout == "paged" else {}
    fresh = model.new_cache(**options)
    model.forward([1, 2, 3, 4, 5, 6], fresh)
    logits = model.forward([7], fresh)
    if layout == "paged":
        bound = QUANTIZED_LOGIT_BOUNDS["int8"] * np.abs(logits).max()
        np.testing.assert_allclose(loaded.sequence.last_logits, logits, rtol=0, atol=bound)
    else:
        assert_close(loaded.sequence.last_logits, logits, "float32", "a file written on another machine")
    assert list(kvref.resume(model, loaded, 5)) == list(kvref.resume(model, fresh, 5))


# ---- hostile files (issue 16): every field checked before it sizes anything ---------------------------

def resave(path, edit):
    """Read a saved file, let edit(header, arrays) change anything (arrays: name -> ndarray), and write it
    back well-formed: offsets, sizes and checksum made right again, so only the edit is wrong."""
    header, arrays = read_cache_file(path)
    edit(header, arrays)
    offset = 4096  # past any header these tests write
    header["arrays"] = []
    for name, a in arrays.items():
        header["arrays"].append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape), "offset": offset,
                                 "nbytes": a.nbytes})
        offset += -(-a.nbytes // 64) * 64
    write_raw(path, json.dumps(header).encode(), arrays.values())


def write_raw(path, text, arrays=()):
    body = bytearray(MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(text)) + text)
    assert not arrays or len(body) <= 4096
    body += bytes(max(4096 - len(body), 0))
    for a in arrays:
        body += bytes(-len(body) % 64) + np.ascontiguousarray(a).tobytes()
    Path(path).write_bytes(bytes(body) + hashlib.sha256(body).digest())


@pytest.fixture
def saved(model, tmp_path):
    cache = model.new_cache(layout="paged", block_size=4)
    model.forward([1, 2, 3], cache)
    cache.save(tmp_path / "c.kvc")
    return tmp_path / "c.kvc"


def refused(model, path, message):
    with pytest.raises(CacheError, match=message):
        model.load_cache(path)


def test_only_a_regular_file_is_read_never_a_device_fifo_or_directory(model, tmp_path, saved):
    (tmp_path / "zero").symlink_to("/dev/zero")  # was read whole: 2.9 GB in 3 s
    refused(model, tmp_path / "zero", "is not a regular file")
    refused(model, tmp_path, "is not a regular file")
    os.mkfifo(tmp_path / "fifo")  # with no writer, opening it to read blocked forever
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading a FIFO blocked"))
    signal.alarm(5)
    try:
        refused(model, tmp_path / "fifo", "is not a regular file")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    (tmp_path / "link.kvc").symlink_to(saved)  # a symlink to a regular file is that file
    assert model.load_cache(tmp_path / "link.kvc").length == 3


@pytest.mark.parametrize("text, message", [
    (b"[" * 100_000 + b"]" * 100_000, "nests JSON deeper than 32 levels"),  # was RecursionError
    (b'{"arrays": 5}', "'arrays' lists at most 8 arrays"),
    (b'{"arrays": [7]}', "bad array entry 7"),
    (b'{"arrays": [{"name": "k", "dtype": "float32", "shape": "abc", "offset": 4096, "nbytes": 0}]}',
     "shape 'abc'"),
    (b'{"arrays": [{"name": "k", "dtype": "float32", "shape": [2.5], "offset": 4096, "nbytes": 0}]}',
     r"dimension of array 'k'=2.5 \(float\) must be an integer"),
    (b'{"arrays": [{"name": "k", "dtype": ["f4"], "shape": [], "offset": 4096, "nbytes": 4}]}', "dtype \\['f4'\\]"),
    # np.prod(shape, int64) wrapped to 0 for this shape, which passed the size check
    (b'{"arrays": [{"name": "k", "dtype": "float32", "shape": [4611686018427387904, 4], "offset": 4096, '
     b'"nbytes": 0}]}', "cannot take 0 bytes"),
    (b'{"arrays": [{"name": "k", "dtype": "float32", "shape": [1], "offset": 1e300, "nbytes": 4}]}',
     "offset of array 'k'=1e\\+300 \\(float\\)"),
    (b'{"arrays": [], "x": NaN', "cannot be read as JSON"),
    (b"\xff\xfe", "cannot be read as JSON"),
])
def test_a_malformed_header_is_refused_naming_the_field(model, tmp_path, text, message):
    write_raw(tmp_path / "c.kvc", text)
    refused(model, tmp_path / "c.kvc", message)


def set_header(keys, value):
    def edit(header, arrays):
        set_in(keys, value)(header)
    return edit


@pytest.mark.parametrize("edit, message", [
    (set_header(["options", "num_blocks"], 2 * 10**7),
     r"options.num_blocks=20000000 must be an integer in \[1, 1048576\]"),
    (set_header(["options", "num_blocks"], 2e7), r"options.num_blocks=20000000.0 \(float\) must be an integer"),
    # 2**26 positions of 256 bytes: 16 GiB, over the memory budget
    (lambda h, a: h["options"].update(num_blocks=2**20, block_size=64), "16.0 GiB .* more than the 4 GiB"),
    (set_header(["options", "block_size"], 10**12),
     r"options.block_size=1000000000000 must be an integer in \[1, 64\]"),
    (set_header(["options", "block_size"], "4"), r"options.block_size='4' \(str\) must be an integer"),
    (set_header(["options", "prefix_reuse"], "yes"), "prefix_reuse is 'yes'; expected true or false"),
    (set_header(["options"], [1]), "'options' and 'rope' must be objects"),
    (set_header(["model"], "me"), "'model' must be an object"),
    (set_header(["length"], "3"), r"length='3' \(str\) must be an integer"),
    (set_header(["length"], 10**20), r"length=100000000000000000000 must be an integer in \[0, 64\]"),
    (set_header(["next_position"], 2), r"next_position=2 must be an integer in \[3, 64\]"),
    (set_header(["group_size"], True), r"group_size=True \(bool\) must be an integer"),
    (set_header(["k_dtype"], ["float32"]), "k_dtype is \\['float32'\\]; expected one of"),
    (set_header(["layout"], {"a": 1}), "unknown layout {'a': 1}"),
    (lambda h, a: a["token_ids"].__setitem__(1, 64), r"token_ids holds ids outside the vocabulary \[0, 64\)"),
    (lambda h, a: a["token_ids"].__setitem__(1, -1), "token_ids holds ids outside the vocabulary"),
    (lambda h, a: a["last_logits"].__setitem__(5, np.nan), "last_logits must be finite float32 or float64"),
    (lambda h, a: a["last_logits"].__setitem__(5, np.inf), "with non-finite values"),
    (lambda h, a: a.update(last_logits=a["last_logits"].astype(np.int8)), "they are int8"),
    (lambda h, a: a.update(last_logits=a["last_logits"][:10]), r"'last_logits' is \(10,\); expected shape \(64,\)"),
    (lambda h, a: a.update(extra=np.zeros(1)), "array name 'extra' is unknown"),
])
def test_every_header_field_and_loaded_value_is_checked(model, saved, edit, message):
    resave(saved, edit)
    refused(model, saved, message)


def test_window_and_capacity_options_are_bounded_by_max_seq_len(model, tmp_path):
    cache = model.new_cache(layout="window", window=5)
    model.forward([1, 2, 3], cache)
    cache.save(tmp_path / "w.kvc")
    resave(tmp_path / "w.kvc", set_header(["options", "window"], 2**40))
    refused(model, tmp_path / "w.kvc", r"options.window=1099511627776 must be an integer in \[1, 64\]")
    cache = model.new_cache(capacity=8)
    model.forward([1, 2, 3], cache)
    cache.save(tmp_path / "c.kvc")
    resave(tmp_path / "c.kvc", set_header(["options", "capacity"], 2**40))  # lowered to max_seq_len
    assert model.load_cache(tmp_path / "c.kvc").capacity == CFG.max_seq_len
    resave(tmp_path / "c.kvc", set_header(["options", "capacity"], -1))
    refused(model, tmp_path / "c.kvc", r"options.capacity=-1 must be an integer")


def test_a_file_longer_than_its_header_says_is_refused_before_it_is_read(model, saved):
    saved.write_bytes(saved.read_bytes() + bytes(1000))
    refused(model, saved, "truncated or corrupt: it has")


def test_a_round_trip_through_resave_loads(model, saved):
    # guards the tests above: resave alone leaves a loadable file, so each refusal is the edit's doing
    resave(saved, lambda h, a: None)
    assert model.load_cache(saved).sequence.token_ids == [1, 2, 3]


def test_a_file_larger_than_any_cache_of_the_model_is_refused_before_it_is_read(model, tmp_path):
    # a sparse file and a header describing it: regular and consistent, but no cache of this model is
    # that large, so its 2**40 bytes are never read
    k = {"name": "k", "dtype": "float32", "shape": [2**38], "offset": 4096, "nbytes": 2**40}
    text = json.dumps({"arrays": [k]}).encode()
    path = tmp_path / "huge.kvc"
    write_raw(path, text)
    with open(path, "r+b") as f:
        f.truncate(4096 + 2**40 + 32)
    try:
        refused(model, path, "has 1,099,511,631,904 bytes; a cache of this model takes at most")
    finally:
        path.unlink()  # pytest keeps the last runs' temporary folders
