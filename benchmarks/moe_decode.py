"""Decode speed of a mixture of experts with Qwen3-30B-A3B's layer shapes, and the bytes its experts read.

    PYTHONPATH=. python benchmarks/moe_decode.py [--layers 4] [--threads 2] [--type Q4_0|Q8_0]
        [--activations float32|int8] [--json FILE]

builds, in memory, a random-weight model with the layer shapes of Qwen3-30B-A3B (d_model 2048, 32 query
heads and 4 kv heads of 128 with QK-norm, 128 experts of width 768 of which 8 run per position, a
151,936-token vocabulary with its own LM head) but --layers layers instead of 48, every matrix and expert
stack in --type blocks (random quants, scales chosen so values have a std of ~0.02), and runs `kvref bench`
on it (bench.run: prefill, decode, the split by kernel family, the experts' bytes read per token beside the
active experts' bytes, the roofline). No file is written and no other engine runs: this measures how
close the native kernels' expert projections come to the read bandwidth, not llama.cpp's speed (for a
GGUF of these shapes that llama.cpp also runs: synthetic.py --shapes qwen3-30b-a3b-4l, then compare.py).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import kvref
from kvref.spec.ggml import BLOCK_LAYOUT, GGMLType, QuantizedTensor, row_nbytes
from kvref.tools import bench
from kvref.weights import LayerWeights, Weights

E, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 32, 4, 128, 151936  # Qwen3-30B-A3B's config.json
EXPERTS, USED, EXPERT_FF = 128, 8, 768
SCALE_OFFSET = 0  # Q4_0 and Q8_0 blocks start with their float16 scale d
VALUE_STD = {GGMLType.Q4_0: 4.6, GGMLType.Q8_0: 73.0}  # std of a uniform random quant (minus Q4_0's 8)


def random_blocks(rng, gtype, *shape):
    """A QuantizedTensor of `shape` ([..., K], K a whole number of blocks): random quants, one scale for all
    blocks so that values have a std of ~0.02 (the initializer range of Qwen configs)."""
    *rows, K = shape
    block_values, block_bytes = BLOCK_LAYOUT[gtype]
    n = int(np.prod(rows)) * (K // block_values)
    blocks = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    blocks[:, SCALE_OFFSET:SCALE_OFFSET + 2] = np.array([0.02 / VALUE_STD[gtype]], np.float16).view(np.uint8)
    return QuantizedTensor(gtype, tuple(shape), blocks.reshape(*rows, row_nbytes(gtype, K)))


def model(layers, gtype, threads, activations="float32", seed=0):
    rng = np.random.default_rng(seed)
    config = kvref.ModelConfig(n_layers=layers, d_model=E, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               d_ff=6144, vocab_size=VOCAB, max_seq_len=4096, rope_theta=1e6, norm_eps=1e-6,
                               qk_norm=True, n_experts=EXPERTS, n_experts_used=USED, expert_d_ff=EXPERT_FF,
                               norm_topk_prob=True)
    gain = np.ones(E, np.float32)
    head_gain = np.ones(HEAD_DIM, np.float32)

    def matrix(*shape):
        return random_blocks(rng, gtype, *shape)

    blocks = []
    for _ in range(layers):
        lw = LayerWeights(attn_norm=gain, wq=matrix(HEADS * HEAD_DIM, E), wk=matrix(KV_HEADS * HEAD_DIM, E),
                          wv=matrix(KV_HEADS * HEAD_DIM, E), wo=matrix(E, HEADS * HEAD_DIM), ffn_norm=gain,
                          w_gate=None, w_up=None, w_down=None, q_norm=head_gain, k_norm=head_gain)
        lw.router = (0.02 * rng.standard_normal((EXPERTS, E))).astype(np.float32)  # float32, as GGUF files keep it
        lw.experts_gate, lw.experts_up = matrix(EXPERTS, EXPERT_FF, E), matrix(EXPERTS, EXPERT_FF, E)
        lw.experts_down = matrix(EXPERTS, E, EXPERT_FF)
        blocks.append(lw)
    weights = Weights(matrix(VOCAB, E), blocks, gain, matrix(VOCAB, E))
    return kvref.Model(config, weights, backend="c", threads=threads, activations=activations)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--type", choices=("Q4_0", "Q8_0"), default="Q4_0")
    parser.add_argument("--activations", choices=("float32", "int8"), default="float32",
                        help="the fused C forward's activation mode (kvref.native.fused)")
    parser.add_argument("--json", help="also write bench.run's result here")
    args = parser.parse_args(argv)
    m = model(args.layers, GGMLType[args.type], args.threads, args.activations)
    result = bench.run(m, prompt_tokens=16, new_tokens=32, context=0, prefill_tokens=64, repeat=3)
    print(bench.report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
