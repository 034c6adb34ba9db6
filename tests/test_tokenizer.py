"""The tokenizer contract: the same ids as HF `tokenizers` built from the same vocabulary and merges,
decode inverts encode, streaming decode equals decode, and SmolLM2's known prompt ids."""

import functools
import itertools
import json
import time
import tracemalloc
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvref.errors import TokenError, TokenizerError
from kvref.text import CONTROL, PRE_TOKENIZERS, UNUSED, USER_DEFINED, StreamDecoder, Tokenizer, pieces
from kvref.text.gguf import merge_pair
from kvref.text.vocab import MergeRanks, TokenTexts, token_ids
from tests.conftest import gguf_metadata, require

REFS = Path(__file__).parent / "data" / "refs" / "smollm2.json"
# Bytes SmolLM2's vocabulary has no token for (its BPE alphabet was restricted): text containing them
# cannot be encoded (HF drops them silently; kvref raises), so the comparisons leave them out.
UNENCODABLE = "\x04\x06\x13\x14\x16\x1d"
# Added to the real vocabulary for the special-token tests: a user-defined token (always matched)
# and a control token that extends another one (the longest match must win).
EXTRA_TOKENS = [("<tool_call>", USER_DEFINED), ("<|im_start|>assistant", CONTROL)]

FRAGMENTS = [
    "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'LL", "'S", "don't", "it's", " ", "  ", "   ", "\n",
    "\n\n", "\r\n", "\t", " \n ", "0", "7", "12345", "3.14", "1,000", "٣٤", "²", "Ⅻ", "½", "é", "e\u0301",
    "naïve", "Ångström", "中文", "日本語", "한국어", "Привет", "مرحبا", "😀", "👍🏽", "🇺🇸", "❤️", "\u00a0",
    "\u3000", "\u2028", "\x85", "\x1c", "\u200b", "\ufeff", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<tool_call>", "<|im_start|>assistant", "<|im_", "def f(x):\n    return x ** 2", "!!!", "...", "--", "$",
    "@user", "#tag",
]
texts = st.lists(
    st.one_of(st.text(st.characters(exclude_categories=("Cs", "Cn"), exclude_characters=UNENCODABLE),
                      max_size=12),
              st.sampled_from(FRAGMENTS)),
    max_size=24).map("".join)


def with_extra_tokens(metadata: dict) -> dict:
    return {**metadata,
            "tokenizer.ggml.tokens": [*metadata["tokenizer.ggml.tokens"], *(t for t, _ in EXTRA_TOKENS)],
            "tokenizer.ggml.token_type": [*metadata["tokenizer.ggml.token_type"],
                                          *(k for _, k in EXTRA_TOKENS)]}


# the Split pattern of Llama 3's own tokenizer.json, as HF spells it (case-insensitive group): an
# independent statement of what kvref's "llama-bpe" regex must split
LLAMA3_TOKENIZER_JSON_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def hf_pre_tokenizer(pre: str):
    """HF's equivalent of each pre-tokenizer name. smollm is the pre_tokenizer of SmolLM2's own
    tokenizer.json; gpt-2 is GPT-2's; llama-bpe is Llama 3's; default chains llama.cpp's regexes as
    isolated splits."""
    tokenizers = require("tokenizers")
    P = tokenizers.pre_tokenizers
    if pre == "smollm":
        return P.Sequence([P.Digits(individual_digits=True),
                           P.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre == "gpt-2":
        return P.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "llama-bpe":
        return P.Sequence([P.Split(tokenizers.Regex(LLAMA3_TOKENIZER_JSON_SPLIT), "isolated"),
                           P.ByteLevel(add_prefix_space=False, use_regex=False)])
    splits = [P.Split(tokenizers.Regex(r), "isolated") for r in PRE_TOKENIZERS[pre]]
    return P.Sequence([*splits, P.ByteLevel(add_prefix_space=False, use_regex=False)])


def hf_tokenizer(metadata: dict, pre: str, split_special: bool = True):
    """An HF tokenizer from the same vocabulary and merges; control tokens are its special added tokens."""
    tokenizers = require("tokenizers")
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    hf = tokenizers.Tokenizer(tokenizers.models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    hf.pre_tokenizer = hf_pre_tokenizer(pre)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.add_tokens([tokenizers.AddedToken(t, special=k == CONTROL, normalized=False)
                   for t, k in zip(tokens, types) if k in (CONTROL, USER_DEFINED)])
    hf.encode_special_tokens = not split_special
    return hf


@functools.lru_cache(maxsize=None)
def smollm_pair(pre: str = "smollm"):
    metadata = with_extra_tokens({**gguf_metadata(), "tokenizer.ggml.pre": pre})
    ours = Tokenizer.from_gguf_metadata(metadata)
    return ours, hf_tokenizer(metadata, pre), hf_tokenizer(metadata, pre, split_special=False)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf_metadata(gguf_metadata())


# ---- agreement with HF tokenizers -------------------------------------------------------------

@pytest.mark.parametrize("pre", ["smollm", "gpt-2", "llama-bpe", "default"])
@given(text=texts)
def test_encode_equals_hf_tokenizers_on_random_unicode(pre, text):
    ours, hf_special, hf_plain = smollm_pair(pre)
    assert ours.encode(text, special=True) == hf_special.encode(text, add_special_tokens=False).ids
    assert ours.encode(text) == hf_plain.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe"])
def test_encode_equals_hf_on_every_code_point(pre):
    # every code point of planes 0, 1 and 14 (planes 2-3 hold only more CJK ideographs), once, between
    # letters, digits and spaces, so every class boundary of the regexes is crossed
    ours, hf, _ = smollm_pair(pre)
    cps = [cp for cp in [*range(0x20000), *range(0xE0000, 0xE0200)]
           if not 0xD800 <= cp < 0xE000 and chr(cp) not in UNENCODABLE]
    text = "".join(f"a{chr(cp)}{chr(cp)}b {chr(cp)}1" for cp in cps)
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids


LONG_WORDS = {"one letter": "a" * 2**17, "spaces": " " * 2**17, "two letters": "ab" * 2**16,
              "random letters": "".join(np.random.default_rng(0).choice(list("abcdefghijklmnopqrstuvwxyz"), 2**17))}


@pytest.mark.parametrize("word", LONG_WORDS.values(), ids=LONG_WORDS.keys())
def test_a_word_merged_by_rounds_encodes_as_hf_tokenizers(word):
    ours, _, hf_plain = smollm_pair()
    assert len(word) >= pieces.LONG_PIECE
    assert ours.encode(word) == hf_plain.encode(word, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def by_rounds_and_by_heap():
    return Tokenizer.from_gguf_metadata(gguf_metadata()), Tokenizer.from_gguf_metadata(gguf_metadata())


@given(text=texts)
def test_merging_every_word_by_rounds_gives_the_heaps_ids_on_ordinary_text(by_rounds_and_by_heap, text):
    by_rounds, by_heap = by_rounds_and_by_heap  # each its own word cache
    with mock.patch.object(pieces, "LONG_PIECE", 2):
        got = by_rounds.encode(text, special=True)
    assert got == by_heap.encode(text, special=True)


def test_a_long_word_costs_no_more_than_ordinary_text_of_its_length():
    # BPE of one 256 KiB word is linear like the rest of encoding, not superlinear: it took 10-17x
    # the time of ordinary text of its length by the heap alone, 1-2x by rounds. A bound on the
    # algorithm, far from both (the speed itself is in docs/benchmarks.md)
    n = 2**18
    prose = " ".join(p.read_text() for p in sorted((Path(__file__).parents[1] / "docs").glob("*.md")))
    for word in ("a" * n, " " * n):
        ordinary, long_word = (Tokenizer.from_gguf_metadata(gguf_metadata()) for _ in range(2))  # cold caches
        start = time.process_time()
        ordinary.encode((prose * (n // len(prose) + 1))[:n])
        ordinary_seconds = time.process_time() - start
        start = time.process_time()
        long_word.encode(word)
        assert time.process_time() - start < 5 * ordinary_seconds


@given(ids=st.lists(st.integers(0, 49152 + len(EXTRA_TOKENS) - 1), max_size=40))
def test_decode_equals_hf_tokenizers_on_random_ids(ids):
    ours, hf, _ = smollm_pair()
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)


# ---- round trips and streaming ------------------------------------------------------------------

@given(text=texts, special=st.booleans())
def test_decode_inverts_encode(tok, text, special):
    assert tok.decode(tok.encode(text, special=special)) == text


@given(ids=st.lists(st.integers(0, 49151), max_size=40))
def test_stream_pieces_concatenate_to_decode(tok, ids):
    pieces = list(tok.decode_stream(ids))
    assert "".join(pieces) == tok.decode(ids)
    assert all(pieces)


@given(text=texts)
def test_stream_of_valid_text_never_emits_a_broken_character(tok, text):
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in tok.encode(text)] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces) or "\ufffd" in text


def test_stream_holds_back_a_character_split_across_tokens(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji's four bytes take several tokens
    decoder = StreamDecoder(tok)
    assert [decoder.push(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]
    assert decoder.flush() == ""


def test_incomplete_character_decodes_to_replacement(tok):
    partial = tok.encode("😀")[:-1]
    assert tok.decode(partial) == "\ufffd"
    assert list(tok.decode_stream(partial)) == ["\ufffd"]


# ---- the real model -------------------------------------------------------------------------------

def test_known_prompt_ids_from_the_reference_run(tok):
    refs = json.loads(REFS.read_text())
    for prompt in refs["prompts"]:
        assert tok.encode(prompt["prompt"]) == prompt["prompt_ids"]


def test_metadata_flags_and_ids(tok):
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (49152, 1, 2, False, False)
    assert tok.pre == "smollm"
    assert tok.token_text(1) == "<|im_start|>"
    assert tok.token_text(tok.encode(" the")[0]) == "Ġthe"


def test_control_tokens_are_single_ids_only_when_special(tok):
    text = "<|im_start|>user\nHi<|im_end|>\n"
    ids = tok.encode(text, special=True)
    assert ids[0] == 1 and ids[-2] == 2
    assert 1 not in tok.encode(text) and 2 not in tok.encode(text)
    assert tok.decode(ids) == tok.decode(tok.encode(text)) == text


def test_digits_are_split_one_by_one(tok):
    assert [tok.token_text(i) for i in tok.encode("x 2024")] == ["x", "Ġ", "2", "0", "2", "4"]


def test_add_special_uses_the_file_flags():
    tok = Tokenizer.from_gguf_metadata({**gguf_metadata(), "tokenizer.ggml.add_bos_token": True,
                                        "tokenizer.ggml.add_eos_token": True})
    assert tok.encode("Hi", add_special=True) == [1, *tok.encode("Hi"), 2]


def test_numpy_arrays_are_accepted():
    meta = gguf_metadata()
    arrays = {**meta, "tokenizer.ggml.tokens": np.array(meta["tokenizer.ggml.tokens"]),
              "tokenizer.ggml.merges": np.array(meta["tokenizer.ggml.merges"]),
              "tokenizer.ggml.token_type": np.array(meta["tokenizer.ggml.token_type"], dtype=np.int32),
              "tokenizer.ggml.bos_token_id": np.uint32(1), "tokenizer.ggml.add_bos_token": np.bool_(False)}
    text = "The capital of France is 12 <|im_end|>"
    assert Tokenizer.from_gguf_metadata(arrays).encode(text, special=True) == \
        Tokenizer.from_gguf_metadata(meta).encode(text, special=True)


# ---- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, words", [
    ("tokenizer.ggml.pre", "qwen3-moe", "'qwen3-moe'"),
    ("tokenizer.ggml.model", "bert", "'bert'"),
    ("tokenizer.ggml.merges", ["Ġ t", "nosuchtoken x"], "merge 1"),
    ("tokenizer.ggml.merges", ["Ġt"], "merge 0"),
    ("tokenizer.ggml.token_type", [1, 1, 3], "token_type"),
    ("tokenizer.ggml.token_type", [9] * 49152, "unknown values [9]"),
    ("tokenizer.ggml.tokens", "abc", "array of strings"),
    ("tokenizer.ggml.bos_token_id", 49152, "bos token id 49152"),
    ("tokenizer.ggml.bos_token_id", "1", "bos_token_id should be of type int"),
])
def test_bad_metadata_raises_naming_it(key, value, words):
    with pytest.raises(TokenizerError, match=words.replace("[", r"\[").replace("]", r"\]")):
        Tokenizer.from_gguf_metadata({**gguf_metadata(), key: value})


def test_missing_keys():
    meta = dict(gguf_metadata())
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata(meta)
    meta = {**gguf_metadata(), "tokenizer.ggml.add_bos_token": True}
    del meta["tokenizer.ggml.bos_token_id"]
    with pytest.raises(TokenizerError, match="add_bos_token"):
        Tokenizer.from_gguf_metadata(meta)


def test_absent_pre_means_llama_cpp_default():
    meta = dict(gguf_metadata())
    del meta["tokenizer.ggml.pre"]
    assert Tokenizer.from_gguf_metadata(meta).pre == "default"


@pytest.mark.parametrize("bad", [49152, -1, 1.0, "3", None, True])
def test_token_ids_outside_the_vocabulary_raise(tok, bad):
    with pytest.raises(TokenError):
        tok.decode([5, bad])
    with pytest.raises(TokenError):
        tok.token_text(bad)
    with pytest.raises(TokenError):
        StreamDecoder(tok).push(bad)


@pytest.mark.parametrize("text", ["a\x04b", "x\ud800"])
def test_text_the_vocabulary_cannot_represent_raises(tok, text):
    with pytest.raises(TokenizerError, match="cannot encode|surrogate"):
        tok.encode(text)


def test_encode_takes_only_str(tok):
    with pytest.raises(TokenizerError, match="bytes"):
        tok.encode(b"abc")



@functools.lru_cache(maxsize=None)
def trained_llama3_pair():
    """A byte-level BPE trained by HF tokenizers with Llama 3's pre-tokenizer on text full of what its
    regex treats specially (digit runs, contractions in any case, newline runs, punctuation), so the
    vocabulary has multi-digit and cross-class merges that another split would not reproduce."""
    tokenizers = require("tokenizers")
    rng = np.random.default_rng(0)
    words = ["I'LL", "we've", "DON'T", "it's", "IT'S", "12345", "2024", "7", "3.14159", "...\n\n", "  ", "\t", "hello",
             "Hello", "naïve", "中文", "!!\n", "a1b2", "x=10;", "\r\n", "don't"]
    corpus = ["".join(rng.choice(words, 12)) + " " + " ".join(rng.choice(words, 6)) for _ in range(400)]
    # Llama 3's tokenizer.json ignores merges for a word that is a token whole, and so does llama.cpp
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(ignore_merges=True))
    hf.pre_tokenizer = hf_pre_tokenizer("llama-bpe")
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=700, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    hf.train_from_iterator(corpus, trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    ours = Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]})
    return ours, hf, words


@given(st.data())
def test_llama_bpe_encodes_as_hf_tokenizers_with_llama3s_pre_tokenizer(data):
    ours, hf, words = trained_llama3_pair()
    text = data.draw(st.lists(st.sampled_from(words) | st.text(max_size=6), max_size=12).map("".join))
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids


# Bytes a GGUF tokenizer holds per vocabulary entry once its metadata is gone, the token texts
# included, on SmolLM2's 49,152 tokens and 48,900 merges padded with unused filler tokens to Llama 3's
# 128,256, as benchmarks/synthetic.py writes its bench files: 104 on CPython 3.11 (12.7 MiB). A filler
# is its text and bytes in two shared bytes objects, their ends, a type byte and MergeRanks' arrays
# (~45 bytes); a real token also a str, an id and an entry in the encoder's map. A str per token in a
# list and in the map, as before, came to 174 (21.3 MiB): issue 24's budget of file + cache + 60 MB
# has no room for it.
PADDED_VOCABULARY = 128_256
TOKENIZER_BYTES_PER_TOKEN = 130


def padded_metadata(copy) -> dict:
    """SmolLM2's tokenizer metadata padded with unused fillers to PADDED_VOCABULARY tokens, each
    string passed through `copy`."""
    metadata = gguf_metadata()
    tokens, types = metadata["tokenizer.ggml.tokens"], list(metadata["tokenizer.ggml.token_type"])
    fillers = range(len(tokens), PADDED_VOCABULARY)
    return {**metadata, "tokenizer.ggml.tokens": [copy(t) for t in tokens] + [f"<|filler_{i}|>" for i in fillers],
            "tokenizer.ggml.token_type": types + [UNUSED] * len(fillers),
            "tokenizer.ggml.merges": [copy(m) for m in metadata["tokenizer.ggml.merges"]]}


def test_a_gguf_tokenizer_holds_few_bytes_per_vocabulary_entry():
    tracemalloc.start()
    try:
        # every string made here, so that the ones the tokenizer keeps count
        tok = Tokenizer.from_gguf_metadata(padded_metadata(lambda s: s.encode().decode()))
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert tok.vocab_size == PADDED_VOCABULARY
    assert held / tok.vocab_size < TOKENIZER_BYTES_PER_TOKEN
    ends = (0, 1, tok.vocab_size // 2, tok.vocab_size - 1)  # the shared bytes objects, cut at their ends too
    assert [tok.token_bytes(i) for i in ends] == [tok.model.token_bytes(tok.tokens[i], tok.token_types[i]) for i in ends]


@functools.lru_cache(maxsize=None)
def padded_tokenizer():
    return Tokenizer.from_gguf_metadata(padded_metadata(str))


@given(text=texts, special=st.booleans())
def test_unused_filler_tokens_change_no_id_and_leave_the_encoders_map(tok, text, special):
    padded = padded_tokenizer()
    assert padded.encode(text, special=special) == tok.encode(text, special=special)
    assert padded.model.ids == tok.model.ids  # the fillers are looked up by nothing
    assert padded.token_text(PADDED_VOCABULARY - 1) == f"<|filler_{PADDED_VOCABULARY - 1}|>"


# Bytes per merge of MergeRanks when merges list every split of a token into two tokens, as a vocabulary
# converted from tiktoken's does (Llama 3: 280,147 merges for 128,000 tokens): a later split of a token
# is chained in three int32 arrays (12 bytes). On SmolLM2's vocabulary, every split listed (156,341
# merges): 8.3 bytes a merge on CPython 3.11; a dict of the (left, right) pairs took 50.7, and ~110 more
# for the pair's two strings where a GGUF reader cut them from the merge's text.
MERGE_BYTES = 20


def test_merges_of_every_split_of_a_token_cost_a_few_bytes_each():
    tokens = gguf_metadata()["tokenizer.ggml.tokens"]
    ids = token_ids(tokens)
    merges = [(t[:k], t[k:]) for t in tokens for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids]
    merges = [*map(merge_pair, gguf_metadata()["tokenizer.ggml.merges"]), *merges]  # the file's first
    tracemalloc.start()
    try:
        ranks = MergeRanks(iter(merges), ids, len(tokens))
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(merges) > 2 * len(tokens) and held / len(merges) < MERGE_BYTES
    first = {}
    for rank, pair in enumerate(merges):
        first.setdefault(pair, rank)
    assert all(ranks.rank(*pair) == rank for pair, rank in itertools.islice(first.items(), 0, None, 97))


@given(st.lists(st.text(max_size=8) | st.sampled_from(["\ud800", "a\udfffb", "", "\x00"])))
def test_token_texts_read_as_the_list_they_were_made_from(tokens):
    texts = TokenTexts(tokens)
    assert len(texts) == len(tokens) and list(texts) == tokens
    assert [texts[i] for i in range(-len(tokens), 0)] == tokens
    with pytest.raises(IndexError):
        texts[len(tokens)]


PARTS = ("a", "aa", "b", "ab", "ba", "aab", "bab")


@given(st.lists(st.tuples(st.sampled_from(PARTS), st.sampled_from(PARTS)), max_size=12))
def test_merge_ranks_are_the_first_rank_of_each_listed_pair_whatever_split_makes_a_token(pairs):
    # every text up to 6 letters: "aab" is "a" + "ab" and "aa" + "b", a token two splits produce;
    # "ab" is listed twice, and a later duplicate is the id the text maps to (token_ids)
    tokens = [*("".join(w) for n in range(1, 7) for w in itertools.product("ab", repeat=n)), "ab"]
    ranks = MergeRanks(pairs, token_ids(tokens), len(tokens))
    expected = {}
    for rank, pair in enumerate(pairs):
        expected.setdefault(pair, rank)
    for left in PARTS:
        for right in PARTS:
            assert ranks.rank(left, right) == expected.get((left, right))
