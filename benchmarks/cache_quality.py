"""How much a quantized KV cache changes SmolLM2's next-token distributions, per K/V type pair.

    python benchmarks/cache_quality.py [--positions 512] [--backend auto] [--json out.json]

The text is docs/kv-cache.md, tokenized with the model's tokenizer and cut to --positions tokens.
One prefill with all_logits gives the next-token logits at every position; quantized layouts read
new K/V back as stored, so this equals decoding token by token (see tests/test_cache_layouts.py).
kivi4 is the exception: an execution quantizes the K groups it completes before its queries read
them, so one prefill shows every query quantized K (the worst case), while decoding token by token
keeps each query's last positions (up to g - 1) in float16, as in generation. Its rows are measured
both ways ("prefill", and "decode": the logits of a teacher-forced token-by-token run).
Each K/V pair is compared with the float32 cache: KL(P_float32 || P_pair) in nats (mean, 99th
percentile and max over positions), top-1 agreement, and bytes per position.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kvref  # noqa: E402
from kvref.tolerance import kl_divergence  # noqa: E402

PAIRS = [  # (k_dtype, v_dtype, group_size)
    ("float16", "float16", None), ("bfloat16", "bfloat16", None),
    ("int8", "int8", 32), ("int8", "int8", 64),
    ("float16", "int8", 32), ("int8", "float16", 32), ("bfloat16", "int8", 32),
    ("kivi4", "kivi4", 32), ("float16", "kivi4", 32),
]


def text_ids(model, n):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "kv-cache.md")
    with open(path, encoding="utf-8") as f:
        ids = model.tokenizer.encode(f.read())
    if len(ids) < n:
        raise SystemExit(f"docs/kv-cache.md has only {len(ids)} tokens; ask for fewer positions")
    return ids[:n]


def measure(model, ids, pairs=PAIRS):
    """Rows of KL / top-1 / bytes for each pair against the float32 cache."""
    reference = model.forward(ids, model.new_cache(kv_dtype="float32"), all_logits=True).astype(np.float64)
    rows = []
    for k, v, g in pairs:
        cache = model.new_cache(k_dtype=k, v_dtype=v, **({"group_size": g} if g else {}))
        t0 = time.perf_counter()
        logits = model.forward(ids, cache, all_logits=True).astype(np.float64)
        seconds = time.perf_counter() - t0
        rows.append(row(k, v, cache, reference, logits, "prefill", seconds))
        if k == "kivi4":
            cache = model.new_cache(k_dtype=k, v_dtype=v, **({"group_size": g} if g else {}))
            t0 = time.perf_counter()
            logits = np.stack([model.forward([t], cache) for t in ids]).astype(np.float64)
            rows.append(row(k, v, cache, reference, logits, "decode", time.perf_counter() - t0))
    return rows


def row(k, v, cache, reference, logits, executions, seconds):
    kl = kl_divergence(reference, logits)
    return {"k": k, "v": v, "group_size": cache.group_size, "positions": len(logits), "executions": executions,
            "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)), "kl_max": float(kl.max()),
            "top1": float(np.mean(reference.argmax(-1) == logits.argmax(-1))),
            "bytes_per_position": cache.bytes_per_position, "seconds": seconds}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, default=512)
    p.add_argument("--backend", default="auto", choices=["auto", "numpy", "c"])
    p.add_argument("--json")
    args = p.parse_args(argv)
    model = kvref.load(backend=args.backend)
    ids = text_ids(model, args.positions)
    rows = measure(model, ids)
    print(f"SmolLM2-135M-Instruct, backend {model.backend}, {len(ids)} positions of docs/kv-cache.md; "
          f"float32 cache = {model.new_cache().bytes_per_position:,} bytes/position")
    print(f"{'K':<9} {'V':<9} {'group':>5} {'run':<8} {'bytes/pos':>9} {'KL mean':>9} {'KL p99':>9} {'KL max':>9} "
          f"{'top-1':>7}")
    for r in rows:
        print(f"{r['k']:<9} {r['v']:<9} {str(r['group_size'] or '-'):>5} {r['executions']:<8} "
              f"{r['bytes_per_position']:>9,} "
              f"{r['kl_mean']:>9.2e} {r['kl_p99']:>9.2e} {r['kl_max']:>9.2e} {r['top1']:>7.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
