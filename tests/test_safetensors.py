"""The safetensors reader: what the reference writer writes reads back exactly; a malformed file is a
SafetensorsError naming the problem, never a crash or a wrong tensor."""

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvref.errors import KVRefError, ModelNotFoundError, SafetensorsError
from kvref.formats.safetensors import Checkpoint, SafetensorsFile, write_file
from tests.conftest import require

require("safetensors")
from safetensors.numpy import save_file  # noqa: E402 - the reference writer, once the oracle is known to be there

ARRAYS = st.sampled_from([np.float32, np.float16, np.float64, np.int64]).flatmap(
    lambda dtype: st.lists(st.integers(0, 4), min_size=0, max_size=3).map(
        lambda shape: np.array(np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape) * dtype(1.5))))


@given(st.dictionaries(st.text("abcxyz._", min_size=1, max_size=8), ARRAYS, min_size=1, max_size=4))
def test_what_the_reference_writer_writes_reads_back_exactly(tmp_path_factory, tensors):
    path = tmp_path_factory.mktemp("st") / "t.safetensors"
    save_file(tensors, str(path), metadata={"format": "np"})
    f = SafetensorsFile(path)
    assert set(f.tensors) == set(tensors) and f.metadata == {"format": "np"}
    for name, a in tensors.items():
        got = f.array(name)
        assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a)


def test_bfloat16_widens_to_the_same_float32():
    bits = np.array([0x3F80, 0xC2F7, 0x0001, 0x7F80], dtype="<u2")  # 1.0, -123.5, a subnormal, inf
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    expected = (bits.astype(np.uint32) << 16).view(np.float32).reshape(2, 2)
    np.testing.assert_array_equal(read(header, bits.tobytes()).array("w"), expected)


def read(header, data=b"", size=None, tmp=[]):  # noqa: B006 - one scratch folder for the module
    import atexit
    import shutil
    import tempfile
    from pathlib import Path

    if not tmp:
        tmp.append(Path(tempfile.mkdtemp(prefix="kvref-st-")))
        atexit.register(shutil.rmtree, tmp[0], True)  # removed when the test process ends
    path = tmp[0] / "f.safetensors"
    path.write_bytes(struct.pack("<Q", len(header) if size is None else size) + header + data)
    return SafetensorsFile(path)


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("header, data, size, message", [
    (b"", b"", 10**6, "does not fit"),
    (b"{not json", b"", None, "not JSON"),
    (b"[1, 2]", b"", None, "must be a JSON object"),
    (json.dumps({"w": entry(dtype="F8")}).encode(), bytes(8), None, "dtype 'F8'"),
    # found by tests/fuzz: an unhashable dtype raised TypeError
    (json.dumps({"w": entry(dtype=["F32"])}).encode(), bytes(8), None, r"dtype \['F32'\]"),
    (json.dumps({"w": entry(dtype={"a": 1})}).encode(), bytes(8), None, "dtype {'a': 1}"),
    (json.dumps({"w": entry(shape=(-1,))}).encode(), bytes(8), None, "shape"),
    (json.dumps({"w": entry(offsets=(0, 16))}).encode(), bytes(8), None, "within the 8 data bytes"),
    (json.dumps({"w": entry(offsets=(4, 0))}).encode(), bytes(8), None, "data_offsets"),
    (json.dumps({"w": entry(shape=(3,))}).encode(), bytes(8), None, "is 12 bytes"),
    (json.dumps({"w": entry(), "v": entry()}).encode(), bytes(8), None, "share bytes"),
    (json.dumps({"w": {"dtype": "F32", "shape": [2]}}).encode(), bytes(8), None, "exactly dtype, shape"),
    (json.dumps({"__metadata__": {"a": 1}}).encode(), b"", None, "__metadata__"),
])
def test_a_malformed_file_is_refused_by_name(header, data, size, message):
    with pytest.raises(SafetensorsError, match=message):
        read(header, data, size)


def test_only_a_regular_file_is_read(tmp_path):
    os.mkfifo(tmp_path / "fifo.safetensors")  # with no writer, opening it would block
    (tmp_path / "zero.safetensors").symlink_to("/dev/zero")
    for name in ("fifo.safetensors", "zero.safetensors"):
        with pytest.raises(SafetensorsError, match="is not a regular file"):
            SafetensorsFile(tmp_path / name)


def test_a_truncated_or_missing_file_is_refused(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="truncated"):
        SafetensorsFile(tmp_path / "short.safetensors")
    with pytest.raises(ModelNotFoundError):
        SafetensorsFile(tmp_path / "none.safetensors")
    with pytest.raises(ModelNotFoundError, match="no model.safetensors"):
        Checkpoint(tmp_path)


def test_a_sharded_checkpoint_reads_every_shard_and_refuses_an_index_that_escapes(tmp_path):
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "one.safetensors"))
    save_file({"b": np.zeros(2, np.float32)}, str(tmp_path / "two.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}))
    checkpoint = Checkpoint(tmp_path)
    assert set(checkpoint.keys()) == {"a", "b"} and checkpoint["a"].tolist() == [1, 1, 1]
    index.write_text(json.dumps({"weight_map": {"a": "../one.safetensors"}}))
    with pytest.raises(SafetensorsError, match="file names"):
        Checkpoint(tmp_path)


@given(st.binary(max_size=200), st.integers(0, 300))
def test_random_bytes_never_escape_as_anything_but_a_kvref_error(body, size):
    try:
        read(body, b"", size)
    except KVRefError:
        pass


@given(st.dictionaries(st.text("abcxyz._", min_size=1, max_size=8), ARRAYS, min_size=1, max_size=4),
       st.booleans())
def test_what_write_file_writes_the_reference_reader_and_ours_read_back_exactly(tmp_path_factory, tensors, bf16):
    from safetensors.numpy import load_file

    codes = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
             np.dtype(np.int64): "I64"}
    path = tmp_path_factory.mktemp("st") / "t.safetensors"
    entries = {name: (codes[a.dtype], a) for name, a in tensors.items()}
    if bf16:  # bfloat16 bits of float32 values that bfloat16 holds exactly
        entries["bf16"] = ("BF16", np.array([0x3F80, 0xC2F7, 0x0001], dtype="<u2"))
    write_file(path, entries, {"format": "pt"})
    assert (8 + struct.unpack("<Q", path.read_bytes()[:8])[0]) % 8 == 0  # every tensor starts 8-byte aligned
    reference = load_file(str(path)) if not bf16 else {}  # safetensors.numpy has no bfloat16
    f = SafetensorsFile(path)
    assert f.metadata == {"format": "pt"}
    for name, a in tensors.items():
        assert np.array_equal(f.array(name), a) and f.array(name).dtype == a.dtype
        assert not reference or np.array_equal(reference[name], a)
    if bf16:
        np.testing.assert_array_equal(f.array("bf16"), np.array([1.0, -123.5, 2.0 ** -133], np.float32))


def test_write_file_refuses_an_array_that_is_not_its_dtype_and_leaves_no_file(tmp_path):
    with pytest.raises(SafetensorsError, match="float64 array cannot be written as 'F32'"):
        write_file(tmp_path / "t.safetensors", {"w": ("F32", np.zeros(3))})
    assert list(tmp_path.iterdir()) == []
