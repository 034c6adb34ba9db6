"""kvref/limits.py and what it bounds: each number a model file supplies is type-checked and bounded
before it sizes anything, and every refusal is a KVRefError naming what was wrong (issue 16's
reproducers for model files, token ids and the default cache; cache files: tests/test_cache_file.py;
chat templates: tests/test_chat.py; the fuzz harnesses: tests/fuzz/)."""

import os
import time

import numpy as np
import pytest

import kvref
from kvref.errors import CacheError, GGUFError, KVRefError, TokenError, TokenizerError
from kvref.formats.gguf import ValueType as V
from kvref.errors import ConfigError
from kvref.limits import CONFIG_CEILINGS, bounded_float, bounded_int, bounded_json, read_json_file

from tests.gguf_writer import tiny_model

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("value", [3, np.int64(3), np.uint8(3)])
def test_bounded_int_takes_python_and_numpy_integers_as_python_ints(value):
    assert bounded_int(value, "x", 1, 3) == 3 and type(bounded_int(value, "x", 1, 3)) is int


@pytest.mark.parametrize("value, message", [
    (True, r"x=True \(bool\)"), (np.bool_(True), r"x=np.True_ \(bool\)"), (3.0, r"x=3.0 \(float\)"),
    ("3", r"x='3' \(str\)"), (np.array([3]), r"x=array\(\[3\]\) \(ndarray\)"), (None, r"x=None"),
    (0, r"x=0 must be an integer in \[1, 3\]"), (4, r"x=4 must be"), (2**64, r"x=18446744073709551616"),
    (list(range(1000)), r"x=\[0, 1, 2, .*\.\.\. \(list\)"),  # a long value is shown short
])
def test_bounded_int_refuses_everything_else_naming_value_and_range(value, message):
    with pytest.raises(ConfigError, match=message):
        bounded_int(value, "x", 1, 3)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "1", True, [1.0], None, 10**400])
def test_bounded_float_takes_positive_finite_numbers_only(value):
    with pytest.raises(ConfigError, match="x="):
        bounded_float(value, "x")
    assert bounded_float(np.float32(0.5), "x") == 0.5 and bounded_float(-2, "x", positive=False) == -2.0


def test_bounded_json_counts_depth_outside_strings_only():
    assert bounded_json(b'{"a": "[[[[[[", "b": "\\"[[[["}', "x", ConfigError, max_depth=1) == {
        "a": "[[[[[[", "b": '"[[[['}
    assert bounded_json(b"[[1]]", "x", ConfigError, max_depth=2) == [[1]]
    with pytest.raises(ConfigError, match="nests JSON deeper than 2 levels"):
        bounded_json(b"[[[1]]]", "x", ConfigError, max_depth=2)
    with pytest.raises(ConfigError, match="deeper than 32"):
        bounded_json(b"[" * 10**6, "x", ConfigError)  # json.loads alone: RecursionError


def test_read_json_file_reads_regular_files_within_its_size(tmp_path):
    (tmp_path / "a.json").write_text('{"a": 1}')
    assert read_json_file(tmp_path / "a.json", "x", ConfigError) == {"a": 1}
    with pytest.raises(ConfigError, match="has 8 bytes; at most 4 are read"):
        read_json_file(tmp_path / "a.json", "x", ConfigError, max_bytes=4)
    os.mkfifo(tmp_path / "fifo.json")
    for name in ("fifo.json", "."):
        with pytest.raises(ConfigError, match="is not a regular file"):
            read_json_file(tmp_path / name, "x", ConfigError)
    with pytest.raises(FileNotFoundError):  # callers decide what a missing file means
        read_json_file(tmp_path / "none.json", "x", ConfigError)


def load_tiny(tmp_path, **kwargs):
    path = tmp_path / "m.gguf"
    path.write_bytes(tiny_model(**kwargs))
    return kvref.load(path, backend="numpy")


def refused(tmp_path, message, error=GGUFError, **kwargs):
    start = time.perf_counter()
    with pytest.raises(error, match=message):
        load_tiny(tmp_path, **kwargs)
    assert time.perf_counter() - start < 2  # was 24.5 s and 2.2 GB for block_count 2**31-1


def test_the_tiny_model_loads_and_chats(tmp_path):
    # guards the refusals below: the same file without the edit is a working model
    model = load_tiny(tmp_path)
    assert model.config.n_layers == 2 and model.chat_template.startswith("{% for")
    assert len(list(kvref.generate(model, model.text.chat_ids(CHAT), max_new_tokens=3))) == 3


@pytest.mark.parametrize("entry, message", [
    ((V.UINT32, 2**31 - 1), r"block_count=2147483647 must be an integer in \[1, 1024\]"),
    ((V.FLOAT32, 3e38), r"block_count=3.* \(float\) must be an integer"),
    ((V.FLOAT32, float("nan")), r"block_count=nan \(float\) must be an integer"),
    ((V.FLOAT32, 2.7), r"block_count=2.7.* \(float\) must be an integer"),  # was read as 2
    ((V.STRING, "2"), r"block_count='2' \(str\) must be an integer"),  # was read as 2
    ((V.BOOL, True), r"block_count=True \(bool\) must be an integer"),  # was read as 1
    ((V.ARRAY, (V.UINT32, [2, 2])), r"block_count=array\(\[2, 2\].* must be an integer"),
    ((V.UINT32, 3), "block_count=3, but the tensors present are those of 2 layers numbered 0..1"),
    ((V.UINT32, 1), "block_count=1, but the tensors present are those of 2 layers"),
])
def test_block_count_is_checked_for_type_range_and_the_blocks_present(tmp_path, entry, message):
    refused(tmp_path, message, metadata={"llama.block_count": entry})


@pytest.mark.parametrize("key, entry, message", [
    ("llama.attention.head_count", (V.UINT64, 2**40), r"head_count=1099511627776 must be an integer in \[1, 1024\]"),
    ("llama.attention.head_count_kv", (V.INT32, -1), r"head_count_kv=-1 must be an integer"),
    ("llama.embedding_length", (V.STRING, "8"), r"embedding_length='8' \(str\) must be an integer"),
    ("llama.feed_forward_length", (V.UINT64, 2**63), r"feed_forward_length=9223372036854775808 must be an integer"),
    ("llama.vocab_size", (V.UINT64, 2**32), r"vocab_size=4294967296 must be an integer in \[1, 16777216\]"),
    ("llama.context_length", (V.UINT64, 2**64 - 1), r"context_length=18446744073709551615 must be an integer"),
    ("llama.context_length", (V.UINT64, 2**31), r"context_length=2147483648 must be an integer in \[1, 1073741824\]"),
    ("llama.attention.key_length", (V.UINT32, 2**20), r"key_length=1048576 must be an integer in \[1, 4096\]"),
    ("llama.rope.freq_base", (V.STRING, "1e4"), r"freq_base='1e4' \(str\) must be a number"),
    ("llama.rope.freq_base", (V.FLOAT64, float("inf")), "freq_base=inf must be a positive finite number"),
    ("llama.attention.layer_norm_rms_epsilon", (V.FLOAT32, float("nan")), "epsilon=nan must be a positive finite"),
    ("llama.rope.scaling.type", (V.ARRAY, (V.UINT8, [1])), "rope.scaling.type=.* must be a string"),
    ("general.architecture", (V.ARRAY, (V.UINT8, [1])), "architecture .* is not supported"),
])
def test_every_architecture_number_is_type_checked_and_bounded(tmp_path, key, entry, message):
    refused(tmp_path, message, metadata={key: entry})


@pytest.mark.parametrize("key, entry, message", [
    # found by tests/fuzz: float(), int() of arrays, NaN and inf escaped as TypeError, ValueError, OverflowError
    ("general.sampling.top_k", (V.ARRAY, (V.INT32, [40, 40])), r"top_k=array\(\[40, 40\].* must be an integer"),
    ("general.sampling.top_k", (V.FLOAT32, float("nan")), r"top_k=nan \(float\) must be an integer"),
    ("general.sampling.top_k", (V.FLOAT64, float("inf")), r"top_k=inf \(float\) must be an integer"),
    ("general.sampling.temp", (V.ARRAY, (V.STRING, ["a"])), r"temp=\['a'\] \(list\) must be a number"),
    ("general.sampling.temp", (V.STRING, "0.7"), r"temp='0.7' \(str\) must be a number"),
    ("general.sampling.top_p", (V.FLOAT32, float("nan")), "top_p=nan must be a finite number"),
    ("general.sampling.penalty_last_n", (V.UINT64, 2**40), r"penalty_last_n=1099511627776 must be an integer"),
])
def test_sampling_defaults_in_the_file_are_type_checked(tmp_path, key, entry, message):
    refused(tmp_path, message, kvref.ConfigError, metadata={key: entry})


def test_a_missing_vocab_size_falls_back_to_the_tokens_and_is_bounded_the_same_way(tmp_path):
    assert load_tiny(tmp_path, drop=["llama.vocab_size"]).config.vocab_size == 262
    refused(tmp_path, "the length of tokenizer.ggml.tokens", drop=["llama.vocab_size", "tokenizer.ggml.tokens"])


def test_the_default_cache_of_a_huge_context_is_refused_by_the_memory_budget(tmp_path):
    # context_length 2**25..2**64 made the default new_cache()/generate() raise a raw MemoryError
    model = load_tiny(tmp_path, context=CONFIG_CEILINGS["max_seq_len"])  # 2**30 positions x 64 bytes: 64 GiB
    for make in (model.new_cache, lambda: model.new_cache(layout="paged"),
                 lambda: list(kvref.generate(model, [1, 2], max_new_tokens=2)), lambda: kvref.Conversation(model)):
        with pytest.raises(CacheError, match=r"the default cache of 1,073,741,824 positions would take 64.0 GiB"):
            make()
    cache = model.new_cache(capacity=32)  # the caller's own number is the caller's
    assert len(list(kvref.generate(model, [1, 2], max_new_tokens=2, cache=cache))) == 2


def test_a_chat_template_that_is_not_a_string_is_refused_at_load(tmp_path):
    # a numeric-array tokenizer.chat_template raised ValueError in the chat ids and Conversation
    refused(tmp_path, "a chat template .* is a string; this one is ndarray", TokenizerError,
            metadata={"tokenizer.chat_template": (V.ARRAY, (V.UINT8, [1, 2]))})


@pytest.mark.parametrize("ids", [[[1, 2], [3]], [[1], 2], None, [1.5], ["a"], [], [[1, 2]], object()])
def test_token_ids_that_are_not_a_flat_list_of_ints_are_a_token_error(tmp_path, ids):
    model = load_tiny(tmp_path)
    with pytest.raises(TokenError):
        model.forward(ids, model.new_cache())
    with pytest.raises(TokenError):
        list(kvref.generate(model, ids, max_new_tokens=1))


@pytest.mark.parametrize("ids", [None, 5, "ab", b"ab", np.array(3), [None], [1.5], [-1], [10**6], [np.nan]])
def test_decode_of_anything_but_token_ids_is_a_token_error(tmp_path, ids):
    tokenizer = load_tiny(tmp_path).tokenizer
    with pytest.raises(TokenError):
        tokenizer.decode(ids)
    with pytest.raises(KVRefError):
        list(tokenizer.decode_stream(ids))


def test_a_cache_the_machine_cannot_allocate_is_a_cache_error(tmp_path, monkeypatch):
    from kvref.cache import ContiguousCache

    def no_memory(*args, **kwargs):
        raise MemoryError

    model = load_tiny(tmp_path)
    monkeypatch.setattr(ContiguousCache, "create", classmethod(no_memory))
    with pytest.raises(CacheError, match="not enough memory for the K/V arrays"):
        model.new_cache(capacity=8)


def test_layer_counts_are_read_from_tensor_names_without_converting_huge_numbers():
    from kvref.limits import check_layer_count

    names = ["blk.0.a", "blk.1.a", "blk.1.b", "output.weight", "blk." + "9" * 5000 + ".a"]  # int() refuses 4301+
    check_layer_count(2, names, "blk.", "n", ConfigError)
    with pytest.raises(ConfigError, match="n=3, but the tensors present are those of 2 layers numbered 0..1"):
        check_layer_count(3, names, "blk.", "n", ConfigError)
    with pytest.raises(ConfigError, match="n=1, but the tensors present are those of 0 layers$"):
        check_layer_count(1, ["x"], "blk.", "n", ConfigError)
