"""Bench models of real shapes: random-weight GGUF files with the exact tensor shapes of released models.

    PYTHONPATH=. /work/llama-venv/bin/python benchmarks/synthetic.py [--shapes llama3.2-1b llama3.2-3b qwen2.5-1.5b
        llama3.1-8b qwen3-30b-a3b-4l] [--types Q4_K_M Q4_0 Q8_0 Q6_K] [--out /work/bench-models] [--tokenizer GGUF]
        [--keep-f16]
    PYTHONPATH=. /work/llama-venv/bin/python benchmarks/synthetic.py --check FILE...

writes OUT/<shape>-<type>.gguf for each shape and type (issue 24), then checks each: kvref (native
backend) and llama.cpp both load it and give finite logits for the same prompt (--check does only
that, on the files given). Each shape is written once in f16
(norm gains, biases and rope_freqs in f32, as llama.cpp's converter writes them), then quantized by
llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize), which picks per-tensor types as it
does for a real model (Q4_K_M: Q6_K for the LM head or the tied embedding and for some V/down
projections). The f16 file is deleted afterwards unless --keep-f16.

What is real: every tensor name and shape, the vocabulary size (the embedding and LM head are a fifth
of a 1B model's bytes), tied or untied embeddings, Q/K/V biases (Qwen 2.5), QK-norm (Qwen 3), the RoPE
base and Llama 3's RoPE scaling (a rope_freqs.weight tensor of divisors, computed as llama.cpp's
converter does), and for a mixture of experts (issue 27) the expert count, the experts used per token,
the expert width and the router (ffn_gate_inp, f32). qwen3-30b-a3b-4l is Qwen3-30B-A3B with 4 of its 48
layers, so that the f16 file (5.8 GiB) and the quantized ones fit this machine. What is not: the
weights, drawn from a normal distribution (std 0.02 for matrices, routers and embeddings, norm gains 1,
biases std 0.02) so that activations stay finite in every engine, and the tokenizer, which is the
tokenizer GGUF's (default: kvref's default model, SmolLM2) padded with unused filler tokens up to the
real vocabulary size. These files measure speed and memory only; the text they generate means
nothing, and accuracy is measured on the real models.

Random weights route alike: with embeddings of std 0.02 the attention outputs dominate every position's
residual stream, so a 64-token prompt of qwen3-30b-a3b-4l reached only 37-90 of the 128 experts per layer
and greedy decoding repeated one token whose steps shared 7.1-7.5 of their 8 experts. Scaling the router
cannot help (top-k is unchanged by a common scale), so the MoE shape, whose LM head is its own matrix, has
embeddings of std 1 (Shape.embedding_std): each position's own token then dominates, the same prompt
reaches 90-120 experts per layer, and decoding walks through distinct tokens whose consecutive steps
share 0.6-1.5 of 8 experts (uniform choice: 0.5).

Needs the gguf and llama-cpp-python packages (the benchmark venv's, never kvref's runtime dependencies)
and kvref importable there (PYTHONPATH=. with its native module built, its dependencies installed).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvref.loader import model_path

WEIGHT_STD = 0.02  # the initializer range of Llama / Qwen configs: q.k and the logits stay O(1)
FILLER_TYPE = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED (kvref.text.UNUSED): never produced by encoding
QUANT_TYPES = ("Q4_K_M", "Q4_0", "Q8_0", "Q6_K")
CHECK_PROMPT = "The quick brown fox jumps over the lazy dog."


@dataclass(frozen=True)
class Shape:
    """The architecture numbers of a released model (its config.json), as llama.cpp's converter writes them."""
    architecture: str  # general.architecture
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    qkv_bias: bool = False
    llama3_rope_factor: float | None = None  # rope_scaling {"rope_type": "llama3", "factor": ...}
    qk_norm: bool = False  # attn_q_norm / attn_k_norm gains over each head (Qwen 3)
    n_experts: int = 0  # a mixture of experts when > 0: every layer's FFN is n_experts experts and a router
    n_experts_used: int = 0
    expert_d_ff: int = 0
    embedding_std: float = WEIGHT_STD  # of token_embd.weight when the LM head is its own matrix


LLAMA3_VOCAB, QWEN25_VOCAB = 128256, 151936
SHAPES = {
    "llama3.2-1b": Shape("llama", 16, 2048, 32, 8, 64, 8192, LLAMA3_VOCAB, 131072, 500000.0, 1e-5, True,
                         llama3_rope_factor=32.0),
    "llama3.2-3b": Shape("llama", 28, 3072, 24, 8, 128, 8192, LLAMA3_VOCAB, 131072, 500000.0, 1e-5, True,
                         llama3_rope_factor=32.0),
    "qwen2.5-1.5b": Shape("qwen2", 28, 1536, 12, 2, 128, 8960, QWEN25_VOCAB, 32768, 1000000.0, 1e-6, True,
                          qkv_bias=True),
    "llama3.1-8b": Shape("llama", 32, 4096, 32, 8, 128, 14336, LLAMA3_VOCAB, 131072, 500000.0, 1e-5, False,
                         llama3_rope_factor=8.0),
    # Qwen3-30B-A3B's layers (issue 27 item 5), 4 of its 48 so that the f16 file (5.8 GiB) fits this machine
    "qwen3-30b-a3b-4l": Shape("qwen3moe", 4, 2048, 32, 4, 128, 6144, QWEN25_VOCAB, 40960, 1000000.0, 1e-6, False,
                              qk_norm=True, n_experts=128, n_experts_used=8, expert_d_ff=768, embedding_std=1.0),
}
ROUTER = "ffn_gate_inp.weight"  # kept in f32 as llama.cpp's converter writes it, and its quantizer leaves it


def llama3_rope_divisors(shape: Shape) -> np.ndarray:
    """rope_freqs.weight: one divisor per RoPE frequency, Llama 3's scaling as llama.cpp's converter
    computes it (low_freq_factor 1, high_freq_factor 4, original context 8,192)."""
    low_factor, high_factor, old_context = 1.0, 4.0, 8192
    freqs = 1.0 / shape.rope_theta ** (np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim)
    divisors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < old_context / high_factor:
            divisors.append(1.0)
        elif wavelength > old_context / low_factor:
            divisors.append(shape.llama3_rope_factor)
        else:
            smooth = (old_context / wavelength - low_factor) / (high_factor - low_factor)
            divisors.append(1.0 / ((1 - smooth) / shape.llama3_rope_factor + smooth))
    return np.asarray(divisors, dtype=np.float32)  # [head_dim / 2]


def tensor_shapes(shape: Shape) -> dict:
    """Every tensor of the file with its NumPy shape ([out, in] for matrices), in llama.cpp's order."""
    E, F, V = shape.d_model, shape.d_ff, shape.vocab_size
    q_dim, kv_dim = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    out = {"token_embd.weight": (V, E)}
    if shape.llama3_rope_factor is not None:
        out["rope_freqs.weight"] = (shape.head_dim // 2,)
    for i in range(shape.n_layers):
        block = {"attn_norm.weight": (E,), "attn_q.weight": (q_dim, E), "attn_k.weight": (kv_dim, E),
                 "attn_v.weight": (kv_dim, E), "attn_output.weight": (E, q_dim), "ffn_norm.weight": (E,)}
        if shape.n_experts:
            X, Fx = shape.n_experts, shape.expert_d_ff
            block.update({"ffn_gate_inp.weight": (X, E), "ffn_gate_exps.weight": (X, Fx, E),
                          "ffn_up_exps.weight": (X, Fx, E), "ffn_down_exps.weight": (X, E, Fx)})
        else:
            block.update({"ffn_gate.weight": (F, E), "ffn_up.weight": (F, E), "ffn_down.weight": (E, F)})
        if shape.qkv_bias:
            block.update({"attn_q.bias": (q_dim,), "attn_k.bias": (kv_dim,), "attn_v.bias": (kv_dim,)})
        if shape.qk_norm:
            block.update({"attn_q_norm.weight": (shape.head_dim,), "attn_k_norm.weight": (shape.head_dim,)})
        out.update({f"blk.{i}.{name}": dims for name, dims in block.items()})
    out["output_norm.weight"] = (E,)
    if not shape.tie_embeddings:
        out["output.weight"] = (V, E)
    return out


def random_tensor(name: str, dims: tuple, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    """Matrices in f16, std WEIGHT_STD; norm gains 1 and biases (std WEIGHT_STD) in f32, as converted files hold them."""
    if name == "rope_freqs.weight":
        return llama3_rope_divisors(shape)
    if name.endswith("norm.weight"):
        return np.ones(dims, dtype=np.float32)
    std = shape.embedding_std if name == "token_embd.weight" else WEIGHT_STD
    values = rng.standard_normal(dims, dtype=np.float32) * np.float32(std)
    return values if name.endswith(".bias") or name.endswith(ROUTER) else values.astype(np.float16)


def tokenizer_fields(path: Path, vocab_size: int) -> list:
    """(key, value, type, array item type) of every tokenizer.* key of the GGUF at `path`, its token
    list padded with unused filler tokens to `vocab_size` (their merges never produce them)."""
    import gguf

    reader = gguf.GGUFReader(path)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value, types = field.contents(), field.types
        n = len(value) if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type") else None
        if n is not None and n > vocab_size:
            raise SystemExit(f"{path} has {n} tokens, more than the vocabulary of {vocab_size} to write")
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<|filler_{i}|>" for i in range(n, vocab_size)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [FILLER_TYPE] * (vocab_size - n)
        out.append((key, value, types[0], types[1] if len(types) > 1 else None))
    return out


def write_f16(shape_name: str, shape: Shape, tokenizer: Path, path: Path, seed: int) -> None:
    """The f16 GGUF of `shape`, one tensor generated and written at a time (an 8B model is 16 GB in f16)."""
    import gguf

    arch = shape.architecture
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"random-weight {shape_name} (kvref benchmarks/synthetic.py: speed only)")
    numbers = {"file_type": gguf.LlamaFileType.MOSTLY_F16, "block_count": shape.n_layers,
               "context_length": shape.context_length, "embedding_length": shape.d_model,
               "feed_forward_length": shape.d_ff, "head_count": shape.n_heads, "head_count_kv": shape.n_kv_heads,
               "key_length": shape.head_dim, "value_length": shape.head_dim,
               "rope_dimension_count": shape.head_dim, "rope_freq_base": shape.rope_theta,
               "layer_norm_rms_eps": shape.norm_eps, "vocab_size": shape.vocab_size}
    if shape.n_experts:
        numbers.update({"expert_count": shape.n_experts, "expert_used_count": shape.n_experts_used,
                        "expert_feed_forward_length": shape.expert_d_ff})
    for name, value in numbers.items():  # GGUFWriter.add_<name> writes <architecture>.<its key>
        getattr(writer, f"add_{name}")(value)
    for key, value, vtype, item_type in tokenizer_fields(tokenizer, shape.vocab_size):
        writer.add_key_value(key, value, vtype, sub_type=item_type)
    shapes = tensor_shapes(shape)
    dtypes = {name: np.float32 if len(dims) == 1 or name.endswith(ROUTER) else np.float16
              for name, dims in shapes.items()}
    for name, dims in shapes.items():
        writer.add_tensor_info(name, dims, np.dtype(dtypes[name]), int(np.prod(dims)) * np.dtype(dtypes[name]).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in shapes.items():
        writer.write_tensor_data(random_tensor(name, dims, shape, rng))
    writer.close()


def quantize(source: Path, target: Path, quant_type: str, threads: int) -> None:
    """llama.cpp's quantizer, with the per-tensor choices it makes for a real model of that type."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant_type}")
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if status != 0:
        raise SystemExit(f"llama_model_quantize({source} -> {quant_type}) failed with status {status}")


def check(path: Path, threads: int) -> str:
    """kvref's native backend and llama.cpp both load `path` and give finite last-position logits for
    CHECK_PROMPT; -> a line with their argmax and correlation (random weights: close, not equal)."""
    import llama_cpp

    import kvref

    model = kvref.load(path, backend="c", threads=threads)
    ids = model.tokenizer.encode(CHECK_PROMPT)
    ours = model.forward(ids, model.new_cache(capacity=len(ids)))  # [vocab]
    llm = llama_cpp.Llama(str(path), n_ctx=len(ids), n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.eval(ids)
    theirs = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))  # [vocab]
    for engine, logits in (("kvref", ours), ("llama.cpp", theirs)):
        if logits.shape != (model.config.vocab_size,) or not np.isfinite(logits).all():
            raise SystemExit(f"{path}: {engine} gave logits of shape {logits.shape}, finite: "
                             f"{bool(np.isfinite(logits).all())}; expected {model.config.vocab_size} finite values")
    return (f"{path.name}: finite logits in kvref and llama.cpp; argmax {int(np.argmax(ours))} / "
            f"{int(np.argmax(theirs))}, correlation {np.corrcoef(ours, theirs)[0, 1]:.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--types", nargs="+", default=list(QUANT_TYPES), choices=QUANT_TYPES)
    parser.add_argument("--out", type=Path, default=Path("/work/bench-models"))
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="GGUF whose tokenizer is padded (default: kvref's default model, or $KVREF_MODEL)")
    parser.add_argument("--threads", type=int, default=2, help="threads of the quantizer and the check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-f16", action="store_true", help="keep OUT/<shape>-F16.gguf")
    parser.add_argument("--check", nargs="+", type=Path, default=None, metavar="FILE",
                        help="only check these files (kvref and llama.cpp load them, finite logits)")
    args = parser.parse_args()
    if args.check:
        for path in args.check:
            print(check(path, args.threads), flush=True)
        return
    tokenizer = args.tokenizer or model_path()
    args.out.mkdir(parents=True, exist_ok=True)
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        f16 = args.out / f"{shape_name}-F16.gguf"
        start = time.perf_counter()
        write_f16(shape_name, shape, tokenizer, f16, args.seed)
        print(f"{f16}: {f16.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - start:.0f} s", flush=True)
        for quant_type in args.types:
            target = args.out / f"{shape_name}-{quant_type}.gguf"
            start = time.perf_counter()
            quantize(f16, target, quant_type, args.threads)
            print(f"{target}: {target.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - start:.0f} s",
                  flush=True)
            print(check(target, args.threads), flush=True)
        if not args.keep_f16:
            f16.unlink()


if __name__ == "__main__":
    main()
