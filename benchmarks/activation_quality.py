"""How much 8-bit activations change the next-token distributions: kvref's int8 mode and llama.cpp,
each against kvref's exact float32 forward on the same GGUF file, with 95% intervals.

    python benchmarks/activation_quality.py [--model smollm2] [--chunk 512] [--json out.json]
    PYTHONPATH=. /path/to/venv-with-llama-cpp/bin/python benchmarks/activation_quality.py --model FILE.gguf

The text: the first --chunk tokens of each of --files (docs/*.md pages that are not measurements;
4,096 positions by default), each chunk one prefill with every position's logits on a fresh cache
(teacher forcing), for
  kvref-int8   KVREF_ACTIVATIONS=int8: projections' inputs rounded to 8-bit blocks of 32, then
               the LM head's 32 largest logits per row recomputed at float32 (csrc/kvref.h)
  llama.cpp    llama_cpp.Llama(..., logits_all=True), f16 K/V, its own 8-bit activation rounding
               (only where llama-cpp-python is installed)
Each is compared with kvref's exact mode (float32 activations; within the tolerance module's bound
of the NumPy spec): top-1 agreement and KL(P_exact || P_engine) in nats (mean, 99th percentile, max).

Neighbouring positions' errors are correlated (one outlier token moves the next few), so the
intervals are a block bootstrap: BLOCK consecutive positions resampled together. The paired rows
count the positions where one engine's top-1 differs from the exact one and the other's does not,
and give the difference of the two engines' top-1 and KL mean with its own interval.
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
from kvref.tolerance import kl_divergence  # noqa: E402

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")
# prose, tables and code of pages this benchmark does not write to (benchmarks.md changes with its figures)
FILES = ("kv-cache.md", "cache-layouts.md", "formats.md", "conformance.md", "tokenizer.md", "architectures.md",
         "architecture.md", "fixtures.md")
BLOCK = 64  # positions resampled together by the bootstrap
RESAMPLES = 4000
ROWS = 64  # logits rows per KL slice: a Gemma 3 row is 262,144 values, 2 MiB in float64


def text_chunks(model, files, chunk):
    """[chunk] token ids from the start of each file (a shorter file gives what it has)."""
    out = []
    for name in files:
        with open(os.path.join(DOCS, name), encoding="utf-8") as f:
            out.append(model.tokenizer.encode(f.read())[:chunk])
    return out


def in_mode(model, activations, threads):
    """The same weights, their C forward in another activation mode (KVREF_ACTIVATIONS, read when a
    model is made)."""
    before = os.environ.get("KVREF_ACTIVATIONS")
    os.environ["KVREF_ACTIVATIONS"] = activations
    try:
        other = kvref.Model(model.config, model.weights, backend="c", threads=threads)
    finally:
        os.environ.pop("KVREF_ACTIVATIONS") if before is None else os.environ.update(KVREF_ACTIVATIONS=before)
    assert other.activations == activations, other.activations
    return other


class LlamaCpp:
    """llama.cpp on the same file: every position's logits of one prefill on a fresh cache."""

    def __init__(self, path, chunk, threads):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=chunk + 8, n_batch=chunk, n_threads=threads,
                                   n_threads_batch=threads, logits_all=True, verbose=False)

    def logits(self, ids):
        # [T, V]
        self.llm.reset()  # the next eval clears the cache from position 0
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)


def position_stats(exact, logits):
    # [T, V] x2 -> agree [T] bool, kl [T]
    agree = exact.argmax(-1) == logits.argmax(-1)
    kl = np.concatenate([kl_divergence(exact[i:i + ROWS].astype(np.float64), logits[i:i + ROWS].astype(np.float64))
                         for i in range(0, len(exact), ROWS)])
    return agree, kl


def block_means(values, rng):
    # [N] -> [RESAMPLES] means of resampled blocks of BLOCK positions (the last block may be shorter)
    starts = np.arange(0, len(values), BLOCK)
    sums = np.add.reduceat(values, starts)
    counts = np.diff(np.append(starts, len(values)))
    pick = rng.integers(0, len(starts), size=(RESAMPLES, len(starts)))
    return sums[pick].sum(1) / counts[pick].sum(1)


def interval(values, seed=0):
    lo, hi = np.quantile(block_means(np.asarray(values, dtype=np.float64), np.random.default_rng(seed)), [0.025, 0.975])
    return float(lo), float(hi)


def row(name, agree, kl):
    return {"engine": name, "top1": float(agree.mean()), "top1_ci": interval(agree), "kl_mean": float(kl.mean()),
            "kl_mean_ci": interval(kl), "kl_p99": float(np.quantile(kl, 0.99)), "kl_max": float(kl.max())}


def paired(a, b):
    """Engine a against engine b on the same positions: where only one of them keeps the exact top-1,
    and the differences a - b of top-1 and KL mean with their intervals."""
    (name_a, agree_a, kl_a), (name_b, agree_b, kl_b) = a, b
    d_top1 = agree_a.astype(np.float64) - agree_b
    return {"a": name_a, "b": name_b, "only_a": int(np.sum(agree_a & ~agree_b)), "only_b": int(np.sum(agree_b & ~agree_a)),
            "top1_diff": float(d_top1.mean()), "top1_diff_ci": interval(d_top1),
            "kl_diff": float((kl_a - kl_b).mean()), "kl_diff_ci": interval(kl_a - kl_b)}


def measure(model, chunks, engines):
    """engines: name -> function of ids giving [T, V] logits. -> name -> (agree [N], kl [N]) over
    every chunk's positions, against the exact float32 forward."""
    stats = {name: ([], []) for name in engines}
    for ids in chunks:
        exact = model.forward(ids, model.new_cache(), all_logits=True)  # [T, V]
        for name, logits in engines.items():
            agree, kl = position_stats(exact, logits(ids))
            stats[name][0].append(agree)
            stats[name][1].append(kl)
    return {name: (np.concatenate(a), np.concatenate(k)) for name, (a, k) in stats.items()}


def report(label, n, rows, pairs):
    print(f"{label}: {n} positions, against kvref's exact float32 forward (95% intervals, block bootstrap)")
    print(f"{'engine':<12} {'top-1':>7} {'interval':>15} {'KL mean':>9} {'interval':>17} {'KL p99':>8} {'KL max':>8}")
    for r in rows:
        (t0, t1), (k0, k1) = r["top1_ci"], r["kl_mean_ci"]
        print(f"{r['engine']:<12} {r['top1']:>7.1%} {t0:>7.1%}–{t1:<7.1%} {r['kl_mean']:>9.4f} {k0:>8.4f}–{k1:<8.4f} "
              f"{r['kl_p99']:>8.4f} {r['kl_max']:>8.4f}")
    for p in pairs:
        (t0, t1), (k0, k1) = p["top1_diff_ci"], p["kl_diff_ci"]
        print(f"{p['a']} - {p['b']}: top-1 {p['top1_diff']:+.2%} ({t0:+.2%} to {t1:+.2%}; only {p['a']} agrees at "
              f"{p['only_a']}, only {p['b']} at {p['only_b']}), KL mean {p['kl_diff']:+.4f} ({k0:+.4f} to {k1:+.4f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a short name or a GGUF path")
    parser.add_argument("--files", nargs="+", default=list(FILES), help="pages of docs/ whose starts are the text")
    parser.add_argument("--chunk", type=int, default=512, help="positions per prefill (from each file)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llama", action="store_true", help="kvref's int8 mode only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = kvref.load(args.model, backend="c", threads=args.threads)
    if model.activations != "float32":
        raise SystemExit(f"the reference must be the exact mode; this model runs {model.activations} (KVREF_ACTIVATIONS?)")
    chunks = text_chunks(model, args.files, args.chunk)
    int8 = in_mode(model, "int8", args.threads)
    engines = {"kvref-int8": lambda ids: int8.forward(ids, int8.new_cache(), all_logits=True)}
    try:
        if not args.no_llama:
            engines["llama.cpp"] = LlamaCpp(model_path(args.model), args.chunk, args.threads).logits
    except ImportError:
        print("llama-cpp-python is not installed: kvref's int8 mode only")
    stats = measure(model, chunks, engines)
    rows = [row(name, *s) for name, s in stats.items()]
    pairs = [paired(("kvref-int8", *stats["kvref-int8"]), ("llama.cpp", *stats["llama.cpp"]))] if len(stats) > 1 else []
    n = sum(map(len, chunks))
    report(args.model, n, rows, pairs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "files": args.files, "chunk": args.chunk, "positions": n, "rows": rows,
                       "paired": pairs}, f, indent=1)


if __name__ == "__main__":
    main()
