"""How much 8-bit activations change the next-token distributions: kvref's int8 mode and llama.cpp,
each against kvref's exact float32 forward on the same GGUF file.

    python benchmarks/activation_quality.py [--model smollm2] [--positions 512] [--json out.json]
    PYTHONPATH=. /path/to/venv-with-llama-cpp/bin/python benchmarks/activation_quality.py --model FILE.gguf

The text is docs/kv-cache.md, tokenized with the model's tokenizer and cut to --positions tokens:
one prefill with all_logits gives the next-token logits at every position (teacher forcing), for
  kvref-int8   KVREF_ACTIVATIONS=int8: every projection's input rounded to 8-bit blocks of 32
  llama.cpp    llama_cpp.Llama(..., logits_all=True), f16 K/V, its own 8-bit activation rounding
               (only where llama-cpp-python is installed)
Each is compared with kvref's exact mode (float32 activations; within the tolerance module's bound
of the NumPy spec): top-1 agreement and KL(P_exact || P_engine) in nats (mean, 99th percentile, max).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kvref  # noqa: E402
from kvref.loader import model_path  # noqa: E402
from kvref.native import fused  # noqa: E402
from kvref.tolerance import kl_divergence  # noqa: E402

from cache_quality import text_ids  # noqa: E402  (this folder: the same text, cut the same way)


def kvref_logits(model, ids, activations):
    # [T, V]: one prefill of the fused forward in the given activation mode
    forward = fused.FusedForward(model.config, model.weights, activations)
    return forward.forward(model.ops, model.config, model.weights, np.array(ids), model.new_cache(),
                           all_logits=True)


def llama_cpp_logits(path, ids, threads):
    # [T, V], or None where llama-cpp-python is not installed
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + 8, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def row(name, reference, logits):
    kl = kl_divergence(reference.astype(np.float64), logits.astype(np.float64))
    top1 = float(np.mean(reference.argmax(-1) == logits.argmax(-1)))
    return {"engine": name, "top1": top1, "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
            "kl_max": float(kl.max())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a short name or a GGUF path")
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = kvref.load(args.model, backend="c", threads=args.threads)
    ids = text_ids(model, args.positions)
    exact = kvref_logits(model, ids, "float32")
    rows = [row("kvref-int8", exact, kvref_logits(model, ids, "int8"))]
    llama = llama_cpp_logits(model_path(args.model), ids, args.threads)
    if llama is not None:
        rows.append(row("llama.cpp", exact, llama))
    print(f"{args.model}: {len(ids)} positions, against kvref's exact float32 forward")
    print(f"{'engine':<12} {'top-1':>7} {'KL mean':>9} {'KL p99':>9} {'KL max':>9}")
    for r in rows:
        print(f"{r['engine']:<12} {r['top1']:>7.1%} {r['kl_mean']:>9.4f} {r['kl_p99']:>9.4f} {r['kl_max']:>9.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "positions": len(ids), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
