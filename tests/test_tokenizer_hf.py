"""Hugging Face tokenizer.json directories: the same ids as HF `tokenizers` loading the same file, for
the byte-level pipeline (Qwen's Split regex and NFC) and the SentencePiece-style ones (Llama 2's
legacy normalizers, Metaspace, Gemma's); the GGUF `qwen2` pre-tokenizer against the same vocabulary
without NFC, as llama.cpp reads it; kvref.load(directory) gets the tokenizer, chat template and EOS ids."""

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import kvref
from kvref.errors import TokenizerError
from kvref.text import Tokenizer
from tests.conftest import require
from tests.tokenizer_oracles import corpus, sentencepiece_bpe, trained_model

# Qwen 2's Split pattern as its tokenizer.json spells it
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FRAGMENTS = [" ", "  ", "   ", "\n", "\n\n", "\r\n", "\t", "0", "12345", "é", "e\u0301", "cafe\u0301", "Å", "A\u030a",
             "ﬁ", "中文", "😀", "👍🏽", "Привет", "don't", "I'LL", "<|im_start|>", "<|im_end|>", "<think>", "<s>",
             "</s>", "▁", "def f(x):\n    return x"]
texts = st.lists(st.one_of(st.text(st.characters(exclude_categories=("Cs", "Cn")), max_size=10),
                           st.sampled_from(FRAGMENTS)), max_size=16).map("".join)


def save(hf, config=None, generation=None) -> Path:
    directory = Path(tempfile.mkdtemp(prefix="kvref-tok-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)  # the functions caching these outlive any fixture
    hf.save(str(directory / "tokenizer.json"))
    for name, value in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        if value is not None:
            (directory / name).write_text(json.dumps(value))
    return directory


@functools.lru_cache(maxsize=None)
def qwen_style(nfc: bool = True):
    """A byte-level BPE trained with Qwen 2's pre-tokenizer (and NFC), Qwen's special tokens and a
    non-special added token; saved as a checkpoint's tokenizer files."""
    tokenizers = require("tokenizers")
    P = tokenizers.pre_tokenizers
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.normalizer = tokenizers.normalizers.NFC() if nfc else None
    hf.pre_tokenizer = P.Sequence([P.Split(tokenizers.Regex(QWEN2_SPLIT), "isolated"),
                                   P.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, initial_alphabet=P.ByteLevel.alphabet(),
                                             show_progress=False)
    hf.train_from_iterator(corpus(np.random.default_rng(1)), trainer)
    hf.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    hf.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=False)])
    directory = save(hf, {"eos_token": "<|im_end|>", "chat_template": CHATML},
                     {"eos_token_id": [hf.token_to_id("<|im_end|>"), hf.token_to_id("<|endoftext|>")]})
    plain = tokenizers.Tokenizer.from_str(hf.to_str())
    plain.encode_special_tokens = True
    return Tokenizer.from_hf_directory(directory), hf, plain, directory


@given(text=texts)
def test_byte_level_tokenizer_json_encodes_as_hf_tokenizers_with_qwen_split_and_nfc(text):
    ours, hf, plain, _ = qwen_style()
    assert ours.encode(text, special=True) == hf.encode(text, add_special_tokens=False).ids
    assert ours.encode(text) == plain.encode(text, add_special_tokens=False).ids


@given(data=st.data())
def test_byte_level_tokenizer_json_decodes_as_hf_tokenizers(data):
    ours, hf, _, _ = qwen_style()
    ids = data.draw(st.lists(st.integers(0, ours.vocab_size - 1), max_size=30))
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)


def test_merges_as_strings_read_as_pairs():
    ours, hf, _, directory = qwen_style()
    spec = json.loads((directory / "tokenizer.json").read_text())
    assert isinstance(spec["model"]["merges"][0], list)
    spec["model"]["merges"] = [" ".join(m) for m in spec["model"]["merges"]]
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    text = "Ångström naïve 12345 don't\n\n中文"
    assert Tokenizer.from_hf_directory(directory).encode(text) == ours.encode(text) == hf.encode(text).ids


@given(text=texts)
def test_gguf_qwen2_pre_tokenizer_encodes_as_hf_without_nfc(text):
    # llama.cpp applies no normalizer to a GGUF file; the same vocabulary in a tokenizer.json with NFC
    ours_dir, hf, _, _ = qwen_style(nfc=False)
    ours_gguf = gguf_twin(ours_dir)
    assert ours_gguf.encode(text, special=True) == hf.encode(text, add_special_tokens=False).ids


def gguf_twin(tok: Tokenizer) -> Tokenizer:
    """The same vocabulary and merges as GGUF metadata with the qwen2 pre-tokenizer."""
    spec = json.loads(qwen_style(nfc=False)[1].to_str())["model"]
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": list(tok.tokens),
        "tokenizer.ggml.token_type": tok.token_types, "tokenizer.ggml.merges": [" ".join(m) for m in spec["merges"]]})


def test_nfc_is_applied_for_tokenizer_json_and_not_for_gguf():
    ours_dir = qwen_style(nfc=True)[0]
    ours_gguf = gguf_twin(qwen_style(nfc=False)[0])
    assert ours_dir.encode("cafe\u0301") == ours_dir.encode("café")
    assert ours_gguf.encode("cafe\u0301") != ours_gguf.encode("café")
    assert ours_gguf.decode(ours_gguf.encode("cafe\u0301")) == "cafe\u0301"


def test_added_tokens_special_only_with_special_non_special_always():
    ours, hf, _, _ = qwen_style()
    im_start, think = hf.token_to_id("<|im_start|>"), hf.token_to_id("<think>")
    assert ours.encode("<|im_start|>x<think>", special=True) == [im_start, *ours.encode("x"), think]
    assert im_start not in ours.encode("<|im_start|>") and ours.encode("<think>") == [think]


# ---- SentencePiece-style tokenizer.json ---------------------------------------------------------------

def sentencepiece_pipeline(kind: str):
    """Llama 2's legacy pipeline (Prepend + Replace normalizers, Strip decoder), transformers v5's
    LlamaTokenizer (Metaspace "first"), Metaspace splitting words ("always"), Gemma's (Replace only,
    a no-op Split on " ")."""
    tokenizers = require("tokenizers")
    n, p, d = tokenizers.normalizers, tokenizers.pre_tokenizers, tokenizers.decoders
    hf, _ = sentencepiece_bpe(np.random.default_rng(0))
    strip = d.Sequence([d.Replace("▁", " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0)])
    if kind == "metaspace-first":
        hf.normalizer, hf.pre_tokenizer = None, p.Metaspace("▁", prepend_scheme="first", split=False)
    elif kind == "metaspace-always-split":
        hf.normalizer, hf.pre_tokenizer = None, p.Metaspace("▁", prepend_scheme="always", split=True)
        hf.decoder = d.Sequence([d.Metaspace("▁", prepend_scheme="always"), d.ByteFallback(), d.Fuse()])
    elif kind == "gemma":
        hf.normalizer, hf.pre_tokenizer = n.Replace(" ", "▁"), p.Split(" ", "merged_with_previous")
        hf.decoder = d.Sequence([d.Replace("▁", " "), d.ByteFallback(), d.Fuse()])
    if kind != "metaspace-always-split" and kind != "gemma":
        hf.decoder = strip
    hf.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return hf


@functools.lru_cache(maxsize=None)
def sentencepiece_pair(kind: str):
    tokenizers = require("tokenizers")
    hf = sentencepiece_pipeline(kind)
    plain = tokenizers.Tokenizer.from_str(hf.to_str())
    plain.encode_special_tokens = True
    return Tokenizer.from_hf_directory(save(hf, {"eos_token": "</s>"})), hf, plain


KINDS = ["legacy", "metaspace-first", "metaspace-always-split", "gemma"]


@pytest.mark.parametrize("kind", KINDS)
@given(text=texts)
def test_sentencepiece_tokenizer_json_encodes_as_hf_tokenizers(kind, text):
    ours, hf, plain = sentencepiece_pair(kind)
    assert ours.encode(text, special=True, add_special=True) == hf.encode(text).ids
    assert ours.encode(text) == plain.encode(text, add_special_tokens=False).ids


@st.composite
def id_runs(draw):
    """Up to 30 ids of the SentencePiece vocabulary (420 tokens, bytes <0x00>..<0xFF> at 3..258): mostly
    pieces, byte tokens mostly as a whole character's UTF-8 bytes and now and then any id alone (a list
    of uniform ids is nearly always an invalid byte run, which the test must skip)."""
    piece = st.integers(259, 419).map(lambda i: [i])
    character = st.characters(codec="utf-8").map(lambda c: [3 + b for b in c.encode()])
    anything = st.integers(0, 419).map(lambda i: [i])
    return [i for p in draw(st.lists(st.one_of(piece, piece, piece, piece, character, anything), max_size=15))
            for i in p][:30]


@pytest.mark.parametrize("kind", KINDS)
@given(ids=id_runs())
def test_sentencepiece_tokenizer_json_decodes_as_hf_tokenizers_where_bytes_form_utf8(kind, ids):
    ours, hf, _ = sentencepiece_pair(kind)
    assert all(ours.token_text(3 + b) == f"<0x{b:02X}>" for b in (0, 255))  # id_runs' byte ids
    # HF's Metaspace decoder drops every "▁" character of the first token (none from a byte token);
    # kvref, like the Strip decoder and llama.cpp, the first space of the text: such a first token is left out
    while kind == "metaspace-always-split" and ids and (
            ours.token_text(ids[0]).startswith("<0x") or "▁" in ours.token_text(ids[0])[1:]):
        ids = ids[1:]
    text = ours.decode(ids)
    assume("\ufffd" not in text)  # HF's ByteFallback writes one U+FFFD per byte token of an invalid run
    assert text == hf.decode(ids, skip_special_tokens=False)


# ---- kvref.load(directory) ----------------------------------------------------------------------------

def test_kvref_load_reads_the_tokenizer_chat_template_and_eos_ids_of_a_checkpoint(tmp_path):
    from tests.test_families import hf_model

    ours, hf, _, directory = qwen_style()
    hf_model("qwen3", vocab_size=ours.vocab_size).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    model = kvref.load(tmp_path)
    im_end, eot = hf.token_to_id("<|im_end|>"), hf.token_to_id("<|endoftext|>")
    assert (model.tokenizer.eos_id, model.tokenizer.eos_ids) == (im_end, {im_end, eot})
    ids = model.text.chat_ids([{"role": "user", "content": "Hi"}])
    assert ids == hf.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n").ids
    assert model.forward(ids, model.new_cache()).shape == (ours.vocab_size,)


# ---- what is refused ----------------------------------------------------------------------------------

def edited(change) -> Path:
    _, hf, _, directory = qwen_style()
    spec = json.loads(hf.to_str())
    change(spec)
    target = Path(tempfile.mkdtemp(prefix="kvref-tok-"))
    atexit.register(shutil.rmtree, target, ignore_errors=True)
    (target / "tokenizer.json").write_text(json.dumps(spec))
    return target


@pytest.mark.parametrize("change, words", [
    (lambda s: s["model"].update(type="Unigram"), "model type 'Unigram'"),
    (lambda s: s.update(pre_tokenizer={"type": "Whitespace"}), "pre-tokenizer .*Whitespace"),
    (lambda s: s.update(normalizer={"type": "Lowercase"}), "normalizer .*Lowercase"),
    (lambda s: s["model"]["merges"].append(["nosuchtoken", "x"]), "merge .* should join two vocabulary tokens"),
    (lambda s: s["model"]["merges"].append("a b c"), "should be 'left right'"),
    (lambda s: s["added_tokens"][0].update(lstrip=True), "sets lstrip"),
    (lambda s: s["added_tokens"][0].update(normalized=True), "normalized = true"),
    (lambda s: s["added_tokens"][0].update(id=10**6), "no token for ids"),
    (lambda s: s["model"].update(dropout=0.1), "dropout"),
    (lambda s: s.update(decoder={"type": "WordPiece"}), "decoder .*WordPiece"),
    (lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True), "add_prefix_space"),
    (lambda s: s.update(post_processor="abc"), "post_processor should be an object"),
    (lambda s: s.update(post_processor={"type": "TemplateProcessing", "single": [1]}), "must be a list of"),
    (lambda s: s["pre_tokenizer"]["pretokenizers"][0].update(pattern="abc"), "pre-tokenizer .* is not supported"),
    (lambda s: s["pre_tokenizer"]["pretokenizers"][0].update(pattern={"Regex": "(("}), "not a valid regex"),
])
def test_unsupported_or_malformed_tokenizer_json_raises_naming_it(change, words):
    with pytest.raises(TokenizerError, match=words):
        Tokenizer.from_hf_directory(edited(change))


@pytest.mark.parametrize("name, content, words", [
    ("generation_config.json", {"eos_token_id": "x"}, "eos_token_id should be an int"),
    ("generation_config.json", {"eos_token_id": [10**6]}, "outside the vocabulary"),
    ("tokenizer_config.json", {"eos_token": "<nosuch>"}, "eos_token '<nosuch>' is not a token"),
    ("tokenizer_config.json", {"add_bos_token": True}, "add_bos_token is true but"),
    ("tokenizer_config.json", "[", "cannot be read as JSON"),
])
def test_bad_config_files_raise_naming_them(name, content, words):
    directory = edited(lambda s: None)
    (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(TokenizerError, match=words):
        Tokenizer.from_hf_directory(directory)


def test_a_directory_without_tokenizer_json_has_no_tokenizer(tmp_path):
    assert Tokenizer.from_hf_directory(tmp_path) is None

