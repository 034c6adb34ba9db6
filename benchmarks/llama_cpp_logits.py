"""kvref's logits beside llama.cpp's at every position of a fixed list of token ids, on GGUF files.

    PYTHONPATH=. /work/llama-venv/bin/python benchmarks/llama_cpp_logits.py FILE.gguf...

For files whose tokenizer cannot encode the conformance suite's text (the tiny random models
tests/test_families.py writes with `write_gguf`: a toy vocabulary): both engines run the same ids,
llama.cpp (llama-cpp-python, logits_all, its own K/V cache and kernels) and kvref's NumPy spec, and the
largest |difference| of the logits and the top-1 agreement are printed per file.
"""

from __future__ import annotations

import sys

import numpy as np

import kvref

IDS = [3, 17, 42, 8, 8, 60, 1, 29, 33, 5, 12, 47, 19, 100, 250, 7]  # every id below 300


def compare(path):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_threads=2, verbose=False)
    llm.eval(IDS)
    theirs = np.array(llm.scores[:len(IDS)], dtype=np.float64)  # [T, V]
    ours = kvref.load(path, backend="numpy").forward(IDS, all_logits=True).astype(np.float64)  # [T, V]
    return float(np.abs(theirs - ours).max()), float(np.abs(ours).max()), float(
        (theirs.argmax(-1) == ours.argmax(-1)).mean())


if __name__ == "__main__":
    for path in sys.argv[1:]:
        diff, largest, top1 = compare(path)
        print(f"{path}: max |diff| {diff:.2g} (logits up to {largest:.2g}), top-1 agreement {top1:.0%}")
