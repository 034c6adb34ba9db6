"""What the cache layouts save on SmolLM2: memory, prefill work, and time per generated token.

    python benchmarks/cache_layouts.py [--backend auto] [--only memory,prefix,batch,long] [--json out.json]

memory   bytes per position of real caches after a 512-token prefill, against the formula
         (2 x layers x kv heads x head_dim x bytes, + int8 scales), and what each layout holds
prefix   a shared 512-token system prompt + a 16-token question: cold prefill vs prefix reuse
         (the paged pool indexes the system prompt's blocks after the first request)
batch    8 requests (prompts of 8..200 tokens, --new-tokens each, greedy) through the
         continuous-batching Engine with max_batch=8, against the same requests one after
         another (Engine max_batch=1, the same code path; and kvref.generate, Model.forward's path);
         then decode steps alone: 8 prefilled sequences, one batched step vs 8 single steps
long     decode steps at 4,096 cached positions: contiguous float32, float16, bfloat16 and int8 K/V,
         paged (block 16) float16 and int8

Timings are medians of --repeat runs, wall clock, on whatever else the machine is doing: the
header prints the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kvref  # noqa: E402
from kvref.cache import cache_bytes  # noqa: E402
from kvref.generation.batch import Engine, forward_batch  # noqa: E402

MEMORY_LAYOUTS = [
    ("contiguous", {"kv_dtype": "float32"}), ("contiguous", {"kv_dtype": "float16"}),
    ("contiguous", {"kv_dtype": "bfloat16"}), ("contiguous", {"kv_dtype": "int8"}),
    ("contiguous", {"k_dtype": "float16", "v_dtype": "int8"}),
    ("paged", {"kv_dtype": "float16", "block_size": 16}), ("paged", {"kv_dtype": "int8", "block_size": 16}),
    ("paged", {"kv_dtype": "float16", "block_size": 48}),
    ("window", {"kv_dtype": "float16", "window": 256, "sinks": 4}),
]


def timed(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def text_ids(model, n, offset=0):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "kv-cache.md")
    with open(path, encoding="utf-8") as f:
        ids = model.tokenizer.encode(f.read())
    ids = (ids * (1 + (n + offset) // len(ids)))[offset:offset + n]
    return ids


def memory(model, tokens=512):
    c = model.config
    ids = text_ids(model, tokens)
    rows = []
    for layout, options in MEMORY_LAYOUTS:
        cache = model.new_cache(layout=layout, **options)
        model.forward(ids, cache)
        k, v = cache.k_dtype, cache.v_dtype
        formula = (cache_bytes(c.n_layers, 1, c.n_kv_heads, c.head_dim, k)
                   + cache_bytes(c.n_layers, 1, c.n_kv_heads, c.head_dim, v)) // 2
        scales = sum(c.n_layers * c.n_kv_heads * (c.head_dim // cache.group_size) * 4
                     for t in (k, v) if t == "int8")
        held = cache.allocated_nbytes if layout == "paged" else cache.nbytes
        rows.append({"layout": layout, "options": options, "k": k, "v": v, "group_size": cache.group_size,
                     "bytes_per_position": cache.nbytes // cache.length, "formula": formula + scales,
                     "scales_per_position": scales, "positions": tokens, "positions_held": cache.length,
                     "bytes_held": held, "ratio_to_float32": held / (tokens * cache_bytes(c.n_layers, 1, c.n_kv_heads,
                                                                                           c.head_dim, "float32"))})
    return rows


def prefix(model, repeat, system_tokens=512, question_tokens=16):
    system = text_ids(model, system_tokens)
    questions = [text_ids(model, question_tokens, offset=1000 + 37 * i) for i in range(repeat + 1)]
    pool = model.new_cache(layout="paged", prefix_reuse=True, num_blocks=256).pool
    first = pool.new_cache()
    model.forward(system + questions[0], first)  # the first request indexes the system prompt's blocks
    first.free()
    cold_times, warm_times, reused = [], [], []
    for q in questions[1:]:
        cold = model.new_cache(layout="paged", num_blocks=64)
        t0 = time.perf_counter()
        a = model.forward(system + q, cold)
        cold_times.append(time.perf_counter() - t0)
        warm = pool.new_cache()
        t0 = time.perf_counter()
        n = warm.prefill_reuse(system + q)
        b = model.forward((system + q)[n:], warm)
        warm_times.append(time.perf_counter() - t0)
        reused.append(n)
        assert np.argmax(a) == np.argmax(b)
        warm.free()
    cold_s, warm_s = statistics.median(cold_times), statistics.median(warm_times)
    return {"system_tokens": system_tokens, "question_tokens": question_tokens, "reused_positions": reused[0],
            "cold_seconds": cold_s, "reuse_seconds": warm_s, "saved_seconds": cold_s - warm_s,
            "speedup": cold_s / warm_s}


def batch(model, repeat, n_requests=8, new_tokens=64):
    rng = np.random.default_rng(0)
    prompts = [text_ids(model, int(n), offset=int(rng.integers(0, 2000))) for n in
               np.linspace(8, 200, n_requests).astype(int)]

    def scheduled(max_batch):
        engine = Engine(model, max_batch=max_batch)
        for p in prompts:
            engine.submit(p, new_tokens)
        out = engine.run()
        return out, engine.steps

    def one_by_one():
        return [list(kvref.generate(model, p, new_tokens)) for p in prompts]

    results = {}
    for name, fn in (("batched_8", lambda: scheduled(8)), ("scheduler_1", lambda: scheduled(1)),
                     ("generate_sequential", one_by_one)):
        seconds = timed(fn, repeat)
        results[name] = {"seconds": seconds, "tokens_per_second": n_requests * new_tokens / seconds}
    # decode steps alone (prompts already prefilled): one batched step for all 8 vs 8 single steps
    caches = [model.new_cache(layout="paged", num_blocks=64) for _ in prompts]
    for cache, p in zip(caches, prompts):
        model.forward(p, cache)
    steps = 4

    def decode_batched():
        for _ in range(steps):
            forward_batch(model, [[13]] * len(caches), caches)

    def decode_one_by_one():
        for cache in caches:
            for _ in range(steps):
                model.forward([13], cache)
    for name, fn in (("decode_batched_8", decode_batched), ("decode_one_by_one", decode_one_by_one)):
        seconds = timed(fn, repeat)
        results[name] = {"seconds": seconds, "tokens_per_second": len(caches) * steps / seconds}
    batched, _ = scheduled(8)
    alone = one_by_one()
    results["same_tokens_as_alone"] = sum(batched[i] == alone[i] for i in range(n_requests))
    results["requests"], results["new_tokens"] = n_requests, new_tokens
    results["prompt_lengths"] = [len(p) for p in prompts]
    return results


# every K/V type contiguous, and the paged layout (block 16) with float16 and int8
LONG_CACHES = [("contiguous", "float32"), ("contiguous", "float16"), ("contiguous", "bfloat16"),
               ("contiguous", "int8"), ("paged", "float16"), ("paged", "int8")]


def long_context(model, repeat, context=4096, steps=8):
    ids = text_ids(model, context)
    base = model.new_cache(kv_dtype="float32")
    t0 = time.perf_counter()
    for start in range(0, context, 512):
        model.forward(ids[start:start + 512], base)
    fill = time.perf_counter() - t0
    k = np.stack([base.read(layer)[0] for layer in range(model.config.n_layers)])  # [L, S, Hkv, D]
    v = np.stack([base.read(layer)[1] for layer in range(model.config.n_layers)])
    rows = []
    for layout, kv in LONG_CACHES:
        extra = {"num_blocks": -(-(context + steps) // 16)} if layout == "paged" else {}
        cache = model.new_cache(layout=layout, kv_dtype=kv, **extra)
        cache.append(k, v)  # the same K/V, encoded once as this type
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for i in range(steps):
                model.forward([ids[i]], cache)
            times.append((time.perf_counter() - t0) / steps)
            cache.truncate(context)  # back to 4,096 positions, outside the timing
        seconds = statistics.median(times)
        rows.append({"layout": layout, "kv_dtype": kv, "context": context, "ms_per_token": 1000 * seconds,
                     "tokens_per_second": 1 / seconds, "kv_bytes_read": cache.nbytes})
    return {"fill_seconds": fill, "rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=["auto", "numpy", "c"])
    p.add_argument("--only", default="memory,prefix,batch,long")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens each batch request generates")
    p.add_argument("--json")
    args = p.parse_args(argv)
    model = kvref.load(backend=args.backend)
    parts = set(args.only.split(","))
    print(f"SmolLM2-135M-Instruct, backend {model.backend}, load average {os.getloadavg()[0]:.2f}")
    out = {"backend": model.backend}
    if "memory" in parts:
        out["memory"] = memory(model)
        print(f"\nmemory after a 512-token prefill (float32 = {46080:,} bytes/position)")
        print(f"{'layout':<11} {'K':<9} {'V':<9} {'bytes/pos':>9} {'formula':>9} {'held':>10} {'vs f32':>7}")
        for r in out["memory"]:
            extra = {k: v for k, v in r["options"].items() if k not in ("kv_dtype", "k_dtype", "v_dtype")}
            name = r["layout"] + ("" if not extra else " " + ",".join(f"{k}={v}" for k, v in extra.items()))
            print(f"{name:<11} {r['k']:<9} {r['v']:<9} {r['bytes_per_position']:>9,} {r['formula']:>9,} "
                  f"{r['bytes_held'] / 2**20:>7.2f} MiB {r['ratio_to_float32']:>6.1%}")
    if "prefix" in parts:
        r = out["prefix"] = prefix(model, args.repeat)
        print(f"\nprefix reuse: {r['system_tokens']}-token system prompt + {r['question_tokens']}-token question")
        print(f"  cold prefill {r['cold_seconds'] * 1000:.0f} ms, with reuse {r['reuse_seconds'] * 1000:.0f} ms "
              f"({r['reused_positions']} positions reused): {r['saved_seconds'] * 1000:.0f} ms saved, "
              f"{r['speedup']:.1f}x")
    if "batch" in parts:
        r = out["batch"] = batch(model, args.repeat, new_tokens=args.new_tokens)
        print(f"\nbatched decode: {r['requests']} requests, prompts {r['prompt_lengths'][0]}..{r['prompt_lengths'][-1]} "
              f"tokens, {r['new_tokens']} new tokens each (greedy)")
        for name in ("batched_8", "scheduler_1", "generate_sequential", "decode_batched_8", "decode_one_by_one"):
            print(f"  {name:<20} {r[name]['seconds']:7.2f} s  {r[name]['tokens_per_second']:7.1f} tok/s")
        print(f"  requests whose batched tokens equal their tokens alone: {r['same_tokens_as_alone']}/{r['requests']}")
    if "long" in parts:
        r = out["long"] = long_context(model, args.repeat)
        print(f"\ndecode at {r['rows'][0]['context']:,} cached positions (cache filled in {r['fill_seconds']:.1f} s)")
        for row in r["rows"]:
            print(f"  {row['layout']:<10} {row['kv_dtype']:<8} {row['ms_per_token']:7.1f} ms/token  {row['tokens_per_second']:6.1f} tok/s  "
                  f"K/V {row['kv_bytes_read'] / 2**20:6.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
