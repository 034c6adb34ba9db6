"""Multi-head latent attention: one decode step's attention, absorbed against naive, on the native kernels;
and with --decode, a whole decode step, the fused C forward against the shared decoder over the same kernels.

    python benchmarks/mla_attention.py [--positions 1024 4096] [--threads 1] [--repeat 20] [--json out.json]
    python benchmarks/mla_attention.py --decode [--layers 4] [--positions 512 2048] [--threads 2] [--repeat 10]

One layer of DeepSeek-V2-Lite's shape (H 16, kv_lora_rank R 512, qk_rope_head_dim Dr 64, qk_nope_head_dim
Dn 128, v_head_dim Dv 128), S cached positions in a float32 latent cache, one new query:

  absorbed   kvref.spec.decoder's absorbed form (absorbed_queries, attention, absorbed_values, as
             latent_attention_block runs them): W_UK folded into the query, the native attention
             kernel over the S cached latent keys (R + Dr = 576 values each, one kv head), W_UV after;
  naive      kvref.spec.decoder.naive_latent_attention: every cached latent expanded to 16 heads' K
             (Dn + Dr = 192) and V (128) (S x 16 x 320 values), then the native attention over those.

Both read the same cache and give the same output (tests/test_latent_attention.py). Reported: the median
milliseconds per step, and the K/V bytes each form's attention reads (kvref.trace.latent_read_bytes).

--decode: a random float32 model of DeepSeek-V2-Lite's attention (above, no query bottleneck, as V2-Lite)
and a dense MLP of its experts' width (1408) in each of --layers layers, vocabulary 4096; after a prefill
of S positions, greedy decode steps alternate between the fused C forward (one C call, kvref.native.fused)
and the shared decoder (kvref.spec.decoder.forward over the same native kernels), each on its own copy of
the cache; both compute the same logits bit for bit (tests/test_native_fused.py). Reported: the median
milliseconds per step of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import kvref
from kvref import trace
from kvref.native import ops as native_ops
from kvref.spec import decoder

SHAPE = dict(n_layers=1, d_model=2048, n_heads=16, n_kv_heads=16, d_ff=64, vocab_size=64, max_seq_len=8192,
             head_dim=192, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128)  # DeepSeek-V2-Lite's attention


def absorbed(kernels, config, lw, q_nope, q_rope, latent, c, q_positions, k_positions):
    # [T, H, Dn], [T, H, Dr], [S, 1, R + Dr], [S, 1, R], [T], [S] -> [T, H, Dv]: one sequence's absorbed form
    q = decoder.absorbed_queries(kernels, config, lw, q_nope, q_rope)  # [T, H, R + Dr]
    out = kernels.attention(q, latent, c, q_positions, k_positions, scale=decoder.latent_scale(config))  # [T, H, R]
    return decoder.absorbed_values(kernels, config, lw, out)


def time_step(form, kernels, config, lw, q_nope, q_rope, latent, positions, repeat):
    # median seconds of one decode step's attention over the cached latent keys
    q_pos = positions[-1:]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        form(kernels, config, lw, q_nope, q_rope, latent, latent[..., :config.kv_lora_rank], q_pos, positions)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


DECODE_SHAPE = dict(SHAPE, d_ff=1408, vocab_size=4096)  # V2-Lite's expert width as a dense MLP


def time_decode(layers, positions, threads, repeat):
    # {"fused_ms", "decoder_ms"}: median ms of a decode step after a prefill of `positions`, the two
    # computations taking turns so that load from other processes falls on both alike
    config = kvref.ModelConfig(**{**DECODE_SHAPE, "n_layers": layers, "max_seq_len": positions + repeat + 1})
    model = kvref.Model(config, kvref.weights.random_weights(config, seed=0), backend="c", threads=threads)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, positions)
    caches = {"fused": model.new_cache(), "decoder": model.new_cache()}
    for cache in caches.values():
        model.forward(prompt, cache)
    steps = {"fused": lambda ids, cache: model.forward(ids, cache),
             "decoder": lambda ids, cache: decoder.forward(model.ops, config, model.weights, ids, cache)}
    times, token = {name: [] for name in steps}, [int(prompt[-1])]
    for _ in range(repeat):
        for name, step in steps.items():
            start = time.perf_counter()
            logits = step(np.array(token), caches[name])
            times[name].append(time.perf_counter() - start)
        token = [int(np.argmax(logits[-1]))]
    return {f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()}


def decode_main(args):
    rows = []
    for S in args.positions:
        row = {"positions": S, "layers": args.layers, "threads": args.threads,
               **time_decode(args.layers, S, args.threads, args.repeat)}
        rows.append(row)
        print(f"S={S:>6}  fused {row['fused_ms']:8.2f} ms   shared decoder {row['decoder_ms']:8.2f} ms   "
              f"{row['decoder_ms'] / row['fused_ms']:.2f}x")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--decode", action="store_true", help="a whole decode step: fused C against the decoder")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if args.decode:
        rows = decode_main(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    config = kvref.ModelConfig(**SHAPE)
    lw = kvref.weights.random_weights(config, seed=0).layers[0]
    kernels = native_ops.kernels(args.threads)
    rng = np.random.default_rng(0)
    H, R, Dr, Dn = config.n_heads, config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim
    q_nope = rng.standard_normal((1, H, Dn)).astype(np.float32)
    q_rope = rng.standard_normal((1, H, Dr)).astype(np.float32)
    rows = []
    for S in args.positions:
        latent = rng.standard_normal((S, 1, R + Dr)).astype(np.float32)  # [S, 1, R + Dr]
        positions = np.arange(S)
        read = trace.latent_read_bytes(config, S, 4)
        row = {"positions": S, "threads": args.threads, "isa": kernels.isa}
        for name, form in (("absorbed", absorbed), ("naive", decoder.naive_latent_attention)):
            seconds = time_step(form, kernels, config, lw, q_nope, q_rope, latent, positions, args.repeat)
            row[f"{name}_ms"] = 1e3 * seconds
            row[f"{name}_kv_bytes"] = read[name]
        rows.append(row)
        print(f"S={S:>6}  absorbed {row['absorbed_ms']:8.2f} ms (reads {read['absorbed']:>12,} B)   "
              f"naive {row['naive_ms']:8.2f} ms (reads {read['naive']:>12,} B)   "
              f"{row['naive_ms'] / row['absorbed_ms']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
