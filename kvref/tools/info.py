"""`kvref inspect`, `kvref trace` and `kvref memory`: what a model file holds, what the cache saves an
execution, and what a cache costs, each without generating text (the `kvref` command: kvref/tools/cli.py)."""

from __future__ import annotations

from .. import trace
from ..cache import ELEMENT_BYTES, bytes_per_position, cache_bytes
from ..cache.report import window_summary
from ..config import ModelConfig
from ..errors import ConfigError
from ..generation.generate import generate
from ..model import Model
from .common import count, human_bytes


def add_inspect(commands):
    p = commands.add_parser("inspect", help="architecture, KV cache size, metadata (and with --tensors every "
                                            "tensor) of a GGUF file or a Hugging Face checkpoint directory",
                            description="A summary of a model file: its architecture as the decoder reads it, "
                                        "which layers attend over a window, the KV cache's bytes per token, "
                                        "then the file's metadata; --tensors adds the table of tensors.")
    p.add_argument("path", nargs="?", default=None,
                   help="GGUF file, checkpoint directory or short name (default: the default model)")
    p.add_argument("--tensors", action="store_true", help="also list every tensor: name, type, shape and bytes")
    p.set_defaults(run=run_inspect)


def run_inspect(args) -> int:
    from ..loader import load_config, resolve

    source = resolve(args.path)  # org/name of the HF cache included
    title, architecture, metadata, tensors = read_checkpoint(source) if source.is_dir() else read_gguf(source)
    config = load_config(source)
    print(title)
    print(f"architecture: {architecture}")
    for name, value in config_lines(config):
        print(f"  {name:<16} {value}")
    print(f"attention: {window_summary(config)}")
    for dtype in ("float32", "float16"):
        latent = dict(kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim)
        per_token = cache_bytes(config.n_layers, 1, config.n_kv_heads, config.head_dim, dtype,
                                layer_windows=config.layer_windows, **(latent if config.latent else {}))
        full = per_token * config.max_seq_len
        print(f"KV cache ({dtype}): {per_token:,} bytes per token, {human_bytes(full)} at the max context "
              f"of {config.max_seq_len:,} positions")
    if config.layer_windows is not None:
        from ..cache.report import hybrid_report

        print(hybrid_report(config, config.max_seq_len, "float16"))
    if metadata:
        print(f"\nmetadata ({len(metadata)} keys):")
        for key, value in metadata:
            print(f"  {key:<45} {value}")
    if args.tensors:
        print_tensors(tensors)
    else:
        print(f"\n{len(tensors)} tensors, {sum(r[3] for r in tensors):,} bytes (--tensors lists them)")
    return 0


def config_lines(config) -> list[tuple[str, str]]:
    """The config as (label, value) lines for people: sizes, heads, RoPE, and what makes its family."""
    heads = f"{config.n_heads} query, {config.n_kv_heads} kv"
    if config.n_heads != config.n_kv_heads:
        heads += f" ({config.group_size} query heads share each kv head)"
    lines = [("layers", f"{config.n_layers}"), ("d_model", f"{config.d_model:,}"),
             ("heads", f"{heads}, head_dim {config.head_dim}"), ("d_ff", f"{config.d_ff:,}"),
             ("vocabulary", f"{config.vocab_size:,} tokens"), ("context", f"{config.max_seq_len:,} positions"),
             ("RoPE base", _number(config.rope_theta) + ("" if config.rope_local_theta is None else
                                                         f" ({_number(config.rope_local_theta)} on window layers)")),
             ("norm epsilon", f"{config.norm_eps:g}"),
             ("embeddings", "tied (the LM head reuses them)" if config.tie_embeddings else "separate LM head")]
    if config.n_experts:
        dense = f"; layers 0-{config.first_dense_layers - 1} dense" if config.first_dense_layers else ""
        shared = f"; a shared expert {config.shared_expert_d_ff:,} wide" if config.shared_expert_d_ff else ""
        lines.append(("experts", f"{config.n_experts_used} of {config.n_experts} per position, each "
                                 f"{config.experts_d_ff:,} wide{dense}{shared}"))
    family = {name: value for name, value in config.family_fields().items()
              if name not in ("layer_windows", "rope_local_theta")}  # on their own lines
    if "rope_scaling" in family:
        scaling = family["rope_scaling"]
        if scaling[0] == "factors":
            family["rope_scaling"] = f"factors ({len(scaling[1])} divisors)"
        elif scaling[0] == "longrope":  # the set in use: ModelConfig.layer_rope
            chosen = "long" if config.max_seq_len > scaling[3] else "short"
            family["rope_scaling"] = f"longrope (original {scaling[3]:,} positions; the {chosen} factors)"
        else:
            family["rope_scaling"] = ", ".join(map(str, scaling))
    lines.append(("family fields", ", ".join(f"{k}={_number(v) if isinstance(v, float) else v}"
                                             for k, v in family.items()) or "none (Llama's)"))
    return lines


def _number(x: float) -> str:
    """1000000.0 -> '1,000,000'; 25.298221588134766 -> '25.2982'."""
    return f"{int(x):,}" if float(x).is_integer() else f"{x:.6g}"


def read_gguf(path):
    """(title, architecture, metadata lines, tensor rows) of a GGUF file."""
    from ..formats.gguf import GGUFFile
    from ..loader import model_path

    with GGUFFile(model_path(path)) as gguf:
        meta = gguf.metadata
        title = f"{gguf.path}: GGUF v{gguf.version}, {len(meta)} metadata keys, {len(gguf.tensors)} tensors"
        rows = [(name, info.ggml_type.name, info.shape, info.nbytes) for name, info in gguf.tensors.items()]
    architecture = str(meta.get("general.architecture", "unknown"))
    if "general.name" in meta:
        architecture += f" ({meta['general.name']})"
    return title, architecture, [(key, metadata_value(meta[key])) for key in sorted(meta)], rows


def metadata_value(value) -> str:
    """A metadata value on one line: long text cut, arrays counted."""
    if isinstance(value, str) and len(value) > 60:
        return value[:57].replace("\n", " ") + "..."
    if not isinstance(value, (str, int, float, bool)):
        return f"[{len(value)} items]"
    return str(value)


def read_checkpoint(directory):
    """(title, architecture, metadata lines (none), tensor rows) of a Hugging Face checkpoint directory."""
    from ..formats.safetensors import Checkpoint
    from ..loader import read_config_json

    config_json = read_config_json(directory)
    checkpoint = Checkpoint(directory)
    title = (f"{directory}: Hugging Face checkpoint, model_type {config_json.get('model_type')!r}, "
             f"{len(checkpoint.files)} safetensors file(s), {len(checkpoint.keys())} tensors")
    rows = [(name, dtype, shape, end - begin) for file in checkpoint.files
            for name, (dtype, shape, begin, end) in file.tensors.items()]
    return title, str(config_json.get("model_type", "unknown")), [], rows


def print_tensors(rows):
    # rows of (name, type, shape, bytes)
    print(f"\n  {'tensor':<44} {'type':<6} {'shape':<16} {'bytes':>12}")
    for name, kind, shape, nbytes in rows:
        print(f"  {name:<44} {kind:<6} {'x'.join(map(str, shape)):<16} {nbytes:>12,}")
    print(f"  {'total':<68} {sum(r[3] for r in rows):>12,}")


def add_trace(commands):
    p = commands.add_parser("trace", help="executions x positions with and without the KV cache",
                            description="Generate a few tokens greedily with a small random model, once without "
                                        "a cache and once with it, and draw which positions each execution "
                                        "computes, recomputes or reads from the cache, with FLOP totals.")
    p.add_argument("--prompt-tokens", type=count, default=3, help="prompt length (default 3: p0 p1 p2)")
    p.add_argument("--new-tokens", type=count, default=4, help="tokens to generate (default 4)")
    p.add_argument("--layers", type=count, default=2, help="the random model's layers (default 2)")
    p.add_argument("--d-model", type=count, default=64, help="its residual width; d_ff is 4x this (default 64)")
    p.add_argument("--heads", type=count, default=4, help="its query heads (default 4)")
    p.add_argument("--kv-heads", type=count, default=2, help="its kv heads, a divisor of --heads (default 2)")
    p.add_argument("--seed", type=int, default=0, help="the seed of its random weights (default 0)")
    p.add_argument("--latent", type=count, metavar="R",
                   help="make it a multi-head latent attention model (DeepSeek's MLA) caching a latent of R values "
                        "and a RoPE key of half a head per position, and compare the bytes a decode step reads "
                        "over the latent (absorbed) and over the per-head K/V expanded from it (naive)")
    p.set_defaults(run=run_trace)


def run_trace(args) -> int:
    latent = {}
    if args.latent:  # every head expands the latent: n_kv_heads = n_heads; RoPE on half of each head
        head_dim = args.d_model // args.heads
        latent = dict(n_kv_heads=args.heads, head_dim=head_dim, kv_lora_rank=args.latent,
                      qk_rope_head_dim=2 * max(1, head_dim // 4), v_head_dim=head_dim)
    config = ModelConfig(**{**dict(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                                   n_kv_heads=args.kv_heads, d_ff=4 * args.d_model, vocab_size=256,
                                   max_seq_len=max(args.prompt_tokens + args.new_tokens, 1)), **latent})
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
    if config.latent:
        print_latent_reads(config, len(prompt) + len(tokens) - 1)
    return 0


def print_latent_reads(config, n_keys) -> None:
    """What the last decode step read from a latent cache, absorbed and naive (kvref.trace.latent_read_bytes)."""
    read = trace.latent_read_bytes(config, n_keys, 4)
    print("\n" f"multi-head latent attention: the cache holds {config.kv_lora_rank} + {config.qk_rope_head_dim} "
          f"values per layer and position (c_kv and the shared RoPE key), no per-head K/V.\nThe last decode "
          f"step, over {n_keys} positions in float32, reads {read['absorbed']:,} bytes of latent keys in the "
          f"absorbed form (W_UK folded into the query, one latent read by all {config.n_heads} heads), against "
          f"{read['naive']:,} bytes of per-head K/V in the naive form ({config.n_heads} heads x "
          f"({config.head_dim} + {config.v_head_dim}) per position, expanded from the latent first): "
          f"{read['naive'] / read['absorbed']:.1f}x.")


def add_memory(commands):
    p = commands.add_parser("memory", help="KV cache size: 2 x layers x tokens x kv heads x head_dim x bytes")
    p.add_argument("-m", "--model", help="take layers, kv heads, head_dim, windows (and tokens) from a GGUF "
                                         "file, a Hugging Face checkpoint directory or a short name")
    p.add_argument("--layers", type=count, help="layers (default with -m: the model's)")
    p.add_argument("--kv-heads", type=count, help="kv heads per layer (default with -m: the model's)")
    p.add_argument("--head-dim", type=count, help="elements per head vector (default with -m: the model's)")
    p.add_argument("--tokens", type=count, help="positions held (default with -m: the model's max context)")
    p.add_argument("--batch", type=count, default=1, help="sequences held at once (default 1)")
    p.add_argument("--dtype", default="float16", choices=sorted(ELEMENT_BYTES),
                   help="element type of the cached K and V (default float16)")
    p.add_argument("--layouts", action="store_true",
                   help="also compare every cache layout (contiguous, paged, window, and hybrid for a model "
                        "with window layers) in every K/V type")
    p.set_defaults(run=run_memory)


def run_memory(args) -> int:
    config = None
    if args.model:
        from ..loader import load_config

        config = load_config(args.model)
        args.layers = config.n_layers if args.layers is None else args.layers
        args.kv_heads = config.n_kv_heads if args.kv_heads is None else args.kv_heads
        args.head_dim = config.head_dim if args.head_dim is None else args.head_dim
        args.tokens = config.max_seq_len if args.tokens is None else args.tokens
    missing = [name for name in ("layers", "kv_heads", "head_dim", "tokens") if getattr(args, name) is None]
    if missing:
        raise ConfigError("kvref memory needs -m MODEL or " + ", ".join(f"--{m.replace('_', '-')}" for m in missing))
    # the formula's bytes, plus int8's float32 scales (what cache.nbytes and --layouts count)
    latent = config is not None and config.latent  # MLA: one latent key per layer and position, no V
    if latent:
        width = config.kv_lora_rank + config.qk_rope_head_dim
        per_position = bytes_per_position(args.layers, 1, width, args.dtype, latent_dim=config.kv_lora_rank)
        per_sequence = per_position * args.tokens
        formula = (f"{args.layers} layers x {args.tokens:,} tokens x (kv_lora_rank {config.kv_lora_rank} + "
                   f"qk_rope_head_dim {config.qk_rope_head_dim}) x {ELEMENT_BYTES[args.dtype]} bytes ({args.dtype}), "
                   "the latent key of multi-head latent attention")
        plain = args.layers * args.tokens * width * ELEMENT_BYTES[args.dtype]
    else:
        per_sequence = bytes_per_position(args.layers, args.kv_heads, args.head_dim, args.dtype) * args.tokens
        formula = (f"2 (K and V) x {args.layers} layers x {args.tokens:,} tokens x {args.kv_heads} kv heads "
                   f"x {args.head_dim} head_dim x {ELEMENT_BYTES[args.dtype]} bytes ({args.dtype})")
        plain = cache_bytes(args.layers, args.tokens, args.kv_heads, args.head_dim, args.dtype)
    total = per_sequence * args.batch
    scales = per_sequence - plain
    print(formula + (f" + {scales:,} bytes of float32 scales" if scales else "")
          + f" x {args.batch} sequence{'s' if args.batch != 1 else ''}")
    print(f"= {total:,} bytes ({human_bytes(total)})")
    if args.tokens:
        print(f"  {per_sequence // args.tokens:,} bytes per token per sequence")
    if config is not None and config.layer_windows is not None and args.tokens:
        from ..cache.report import hybrid_report

        print()
        print(hybrid_report(config, args.tokens, args.dtype, args.batch))
    if args.layouts:
        from ..cache.report import layout_report

        # only the cache's own sizes (and the model's layer windows: the hybrid rows) matter to the
        # layouts; the other numbers are placeholders
        windows = config.layer_windows if config is not None and args.layers == config.n_layers else None
        sizes = ModelConfig(n_layers=args.layers, d_model=args.kv_heads * args.head_dim, n_heads=args.kv_heads,
                            n_kv_heads=args.kv_heads, head_dim=args.head_dim, d_ff=1, vocab_size=1,
                            max_seq_len=max(args.tokens, 1), layer_windows=windows)
        print()
        print(layout_report(sizes, args.tokens, args.batch))
    return 0
