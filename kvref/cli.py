"""The `kvref` command: trace (what the cache saves), memory (what it costs)."""

from __future__ import annotations

import argparse
import sys

from . import trace
from .cache import ELEMENT_BYTES, cache_bytes
from .config import ModelConfig
from .errors import KVRefError
from .generate import generate
from .model import Model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvref", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_trace(commands)
    add_memory(commands)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KVRefError as error:
        print(f"kvref {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


def add_trace(commands):
    p = commands.add_parser("trace", help="executions x positions with and without the KV cache")
    p.add_argument("--prompt-tokens", type=count, default=3, help="prompt length (default 3: p0 p1 p2)")
    p.add_argument("--new-tokens", type=count, default=4, help="tokens to generate (default 4)")
    p.add_argument("--layers", type=count, default=2)
    p.add_argument("--d-model", type=count, default=64)
    p.add_argument("--heads", type=count, default=4)
    p.add_argument("--kv-heads", type=count, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run_trace)


def run_trace(args) -> int:
    config = ModelConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                         n_kv_heads=args.kv_heads, d_ff=4 * args.d_model, vocab_size=256,
                         max_seq_len=max(args.prompt_tokens + args.new_tokens, 1))
    model = Model.random(config, seed=args.seed)
    prompt = list(range(1, args.prompt_tokens + 1))
    runs = {}
    for use_cache in (False, True):
        runs[use_cache] = executions = []
        tokens = list(generate(model, prompt, args.new_tokens, use_cache=use_cache, executions=executions))
    labels = [f"p{i}" for i in range(len(prompt))] + [f"x{i}" for i in range(len(tokens) - 1)]
    print(f"random model: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads, "
          f"{config.n_kv_heads} kv heads; prompt {len(prompt)} tokens, {len(tokens)} generated (greedy)")
    print("N = computed for the first time, R = recomputed, c = K/V read from the cache\n")
    for use_cache, title in ((False, "without a cache: every execution recomputes the whole history"),
                             (True, "with the KV cache: each execution computes only its new positions")):
        print(title)
        print(trace.render_grid(runs[use_cache], labels))
        t = trace.totals(runs[use_cache])
        print(f"total: {t['new'] + t['recomputed']} positions computed ({t['recomputed']} recomputed), "
              f"{t['cached']} cached positions read, {t['projection_flops'] + t['attention_flops']:,} FLOPs\n")
    without, with_ = trace.totals(runs[False]), trace.totals(runs[True])
    flops = lambda t: t["projection_flops"] + t["attention_flops"]  # noqa: E731
    print(f"the cache computes {with_['new'] + with_['recomputed']} positions instead of "
          f"{without['new'] + without['recomputed']} and {flops(without) / flops(with_):.2f}x fewer FLOPs; "
          "without it the work grows with the square of the length, with it linearly")
    return 0


def add_memory(commands):
    p = commands.add_parser("memory", help="KV cache size: 2 x layers x tokens x kv heads x head_dim x bytes")
    p.add_argument("--layers", type=count, required=True)
    p.add_argument("--kv-heads", type=count, required=True)
    p.add_argument("--head-dim", type=count, required=True)
    p.add_argument("--tokens", type=count, required=True)
    p.add_argument("--batch", type=count, default=1, help="sequences held at once")
    p.add_argument("--dtype", default="float16", choices=sorted(ELEMENT_BYTES))
    p.set_defaults(run=run_memory)


def run_memory(args) -> int:
    per_sequence = cache_bytes(args.layers, args.tokens, args.kv_heads, args.head_dim, args.dtype)
    total = per_sequence * args.batch
    print(f"2 (K and V) x {args.layers} layers x {args.tokens:,} tokens x {args.kv_heads} kv heads "
          f"x {args.head_dim} head_dim x {ELEMENT_BYTES[args.dtype]} bytes ({args.dtype}) x {args.batch} "
          f"sequence{'s' if args.batch != 1 else ''}")
    print(f"= {total:,} bytes ({human_bytes(total)})")
    if args.tokens:
        print(f"  {per_sequence // args.tokens:,} bytes per token per sequence")
    return 0


def count(text: str) -> int:
    """argparse type: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


if __name__ == "__main__":
    sys.exit(main())
