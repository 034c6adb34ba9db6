"""Weights: every tensor of a decoder, in file layout, one plain type per level.

Projection matrices are [out, in] as GGUF and PyTorch store them; nothing is transposed at load.
A backend may hold a tensor in its own form (the native path keeps quantized blocks); the decoder
never looks inside, it only passes tensors to kernels.

A Model on the native backend freezes the weights it is built with (`freeze`): every array becomes
read-only memory that no public handle can resize, free or write — a view of an immutable bytes
object, or of a read-only memory-mapped file that the native path pins (`pin`) — because C keeps
raw pointers into them between calls. Rebinding a field of Weights stays possible; the fused C
forward notices (it checks every tensor's identity again once any field was assigned: last_rebind)
and runs the shared decoder on the new tensor.
"""

from __future__ import annotations

import itertools
import mmap
from dataclasses import dataclass, fields, is_dataclass, replace

import numpy as np

from .config import ModelConfig


_rebinds = itertools.count(1)
_last_rebind = 0


def last_rebind() -> int:
    """A number that changes whenever a field of any Weights or LayerWeights is assigned (construction
    included): code that trusts the tensors it saw last can skip looking at each one while it holds."""
    return _last_rebind


class _CountsRebinds:
    def __setattr__(self, name, value):
        global _last_rebind
        super().__setattr__(name, value)
        # after the assignment, so a reader that saw the old number looks again; next() is atomic,
        # so two racing rebinds still leave a number nobody saw before
        _last_rebind = next(_rebinds)


@dataclass
class LayerWeights(_CountsRebinds):
    attn_norm: object  # [E]        RMSNorm gain before attention
    wq: object  # [H*D, E]          query projection (MLA with q_lora_rank: q_b, [H*D, q_lora_rank])
    wk: object  # [Hkv*D, E]        key projection (None with MLA)
    wv: object  # [Hkv*D, E]        value projection (None with MLA)
    wo: object  # [E, H*D]          attention output projection (MLA: [E, H*Dv])
    ffn_norm: object  # [E]         RMSNorm gain before the MLP
    w_gate: object  # [F, E]        SwiGLU gate projection (None on a MoE layer: config.moe_layer)
    w_up: object  # [F, E]          SwiGLU up projection
    w_down: object  # [E, F]        SwiGLU down projection
    bq: object = None  # [H*D]      query bias (config.qkv_bias)
    bk: object = None  # [Hkv*D]    key bias
    bv: object = None  # [Hkv*D]    value bias
    q_norm: object = None  # [D]    RMSNorm gain of each query head (config.qk_norm)
    k_norm: object = None  # [D]    RMSNorm gain of each key head
    post_attn_norm: object = None  # [E]  RMSNorm gain on the attention output (config.sandwich_norms)
    post_ffn_norm: object = None  # [E]   RMSNorm gain on the MLP output
    sinks: object = None  # [H]     each query head's sink logit (config.attention_sinks)
    bo: object = None  # [E]        attention output bias (config.attention_out_bias)
    # a MoE layer (config.moe_layer): X experts of width Fx, each a gated MLP, stacked on a leading expert
    # axis as GGUF stores them (one 3-D tensor per projection); the decoder reads the routed experts' only
    router: object = None  # [X, E]             expert logits per position
    router_bias: object = None  # [X]           (config.router_bias)
    expert_selection_bias: object = None  # [X] added to the scores to choose experts (config.expert_selection_bias)
    experts_gate: object = None  # [X, Fx, E]   each expert's gate projection
    experts_up: object = None  # [X, Fx, E]     each expert's up projection
    experts_down: object = None  # [X, E, Fx]   each expert's down projection
    experts_gate_bias: object = None  # [X, Fx] (config.expert_bias)
    experts_up_bias: object = None  # [X, Fx]
    experts_down_bias: object = None  # [X, E]
    shared_gate: object = None  # [Fs, E]       the shared expert every position runs (config.shared_expert_d_ff)
    shared_up: object = None  # [Fs, E]
    shared_down: object = None  # [E, Fs]
    # multi-head latent attention (config.kv_lora_rank = R; Dr = qk_rope_head_dim, Dn = D - Dr, Dv = v_head_dim)
    wq_a: object = None  # [q_lora_rank, E]   the query's down-projection (config.q_lora_rank), then q_a_norm, wq
    q_a_norm: object = None  # [q_lora_rank]  its RMSNorm gain
    wkv_a: object = None  # [R + Dr, E]       down-projection to the latent c_kv and the shared RoPE key
    kv_a_norm: object = None  # [R]           RMSNorm gain of c_kv
    wkv_b: object = None  # [H*(Dn + Dv), R]  up-projection: per head W_UK [Dn, R] rows then W_UV [Dv, R] rows


@dataclass
class Weights(_CountsRebinds):
    tok_embeddings: object  # [V, E]
    layers: list  # n_layers x LayerWeights
    output_norm: object  # [E]
    output: object  # [V, E]: the LM head; the same object as tok_embeddings when tied


def random_weights(config: ModelConfig, seed: int, dtype="float32") -> Weights:
    """Deterministic random weights: the same seed gives the same numbers in every dtype.

    Drawn in float64 and rounded once, so a float32 model is the float64 model rounded: the
    float64 run is an exact oracle for it. Scales keep activations O(1) through the layers
    (matrices ~ N(0, 1/fan_in), norm gains near 1), so logits are neither flat nor saturated.
    """
    rng = np.random.default_rng(seed)
    E, F, V = config.d_model, config.d_ff, config.vocab_size

    def matrix(n_out, n_in):
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(dtype)

    def gain(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(dtype)

    tok_embeddings = rng.standard_normal((V, E)).astype(dtype)
    def bias(n):
        return (0.1 * rng.standard_normal(n)).astype(dtype) if config.qkv_bias else None

    def optional_gain(n, present):
        return gain(n) if present else None

    def stack(n_out, n_in):  # [X, n_out, n_in]: one matrix per expert
        return np.stack([matrix(n_out, n_in) for _ in range(config.n_experts)])

    def small(*shape, present=True):  # router and expert biases
        return (0.1 * rng.standard_normal(shape)).astype(dtype) if present else None

    def attention():
        # one layer's attention projections, drawn in field order: K/V heads, or MLA's latent projections
        if not config.latent:
            return dict(wq=matrix(config.q_dim, E), wk=matrix(config.kv_dim, E), wv=matrix(config.kv_dim, E),
                        wo=matrix(E, config.q_dim))
        H, R, Dr, Dv, Q = (config.n_heads, config.kv_lora_rank, config.qk_rope_head_dim, config.v_head_dim,
                           config.q_lora_rank)
        low_rank_q = {} if Q is None else dict(wq_a=matrix(Q, E), q_a_norm=gain(Q))
        return dict(**low_rank_q, wq=matrix(config.q_dim, E if Q is None else Q), wk=None, wv=None,
                    wkv_a=matrix(R + Dr, E), kv_a_norm=gain(R),
                    wkv_b=matrix(H * (config.qk_nope_head_dim + Dv), R), wo=matrix(E, H * Dv))

    def layer(i):
        dense = not config.moe_layer(i)
        lw = LayerWeights(
            attn_norm=gain(E),
            **attention(),
            ffn_norm=gain(E),
            w_gate=matrix(F, E) if dense else None,  # drawn in this order: the dense models' numbers never change
            w_up=matrix(F, E) if dense else None,
            w_down=matrix(E, F) if dense else None,
            bq=bias(config.q_dim), bk=bias(config.kv_dim), bv=bias(config.kv_dim),
            q_norm=optional_gain(config.head_dim, config.qk_norm),
            k_norm=optional_gain(config.head_dim, config.qk_norm),
            post_attn_norm=optional_gain(E, config.sandwich_norms),
            post_ffn_norm=optional_gain(E, config.sandwich_norms),
            sinks=rng.standard_normal(config.n_heads).astype(dtype) if config.attention_sinks else None,
            bo=(0.1 * rng.standard_normal(E)).astype(dtype) if config.attention_out_bias else None,
        )
        if dense:
            return lw
        X, Fx, Fs = config.n_experts, config.experts_d_ff, config.shared_expert_d_ff
        lw.router = matrix(X, E)
        lw.router_bias = small(X, present=config.router_bias)
        lw.expert_selection_bias = small(X, present=config.expert_selection_bias)
        lw.experts_gate, lw.experts_up, lw.experts_down = stack(Fx, E), stack(Fx, E), stack(E, Fx)
        if config.expert_bias:
            lw.experts_gate_bias, lw.experts_up_bias, lw.experts_down_bias = small(X, Fx), small(X, Fx), small(X, E)
        if Fs:
            lw.shared_gate, lw.shared_up, lw.shared_down = matrix(Fs, E), matrix(Fs, E), matrix(E, Fs)
        return lw

    layers = [layer(i) for i in range(config.n_layers)]
    output_norm = gain(E)
    output = tok_embeddings if config.tie_embeddings else matrix(V, E)
    return Weights(tok_embeddings, layers, output_norm, output)


def release_pages(a) -> None:
    """Drop the pages of an array of a read-only mapped file from this process's resident set: the OS
    keeps them cached, and a later read faults them back in unchanged. For weights C has copied (the
    int8 mode's packed projections), so their file pages are not counted twice. Other arrays: nothing."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    if not isinstance(base, mmap.mmap) or base.closed or a.nbytes == 0:
        return
    offset = a.ctypes.data - np.frombuffer(base, dtype=np.uint8).ctypes.data
    start = offset - offset % mmap.PAGESIZE
    base.madvise(mmap.MADV_DONTNEED, start, offset + a.nbytes - start)


def pin(a):
    """What keeps a's memory alive and unchanged while held, when nothing public can free, resize or
    write it; None otherwise. That memory is a read-only, aligned array whose chain of bases (views
    owning nothing) ends at a bytes object (the pin is the bytes), or at a read-only mmap (the pin is
    a memoryview of it: an open export makes mmap.close() and resize() raise BufferError). An array
    owning its data is never pinned: ndarray.resize(refcheck=False) and __setstate__ free it."""
    if not isinstance(a, np.ndarray) or a.flags.writeable or not a.flags.aligned:
        return None
    base = a
    while isinstance(base, np.ndarray):
        if base.flags.owndata:
            return None
        base = base.base
    if isinstance(base, bytes):
        return base
    if isinstance(base, mmap.mmap) and not base.closed:
        view = memoryview(base)
        return view if view.readonly else None
    return None


def frozen_tensor(t):
    """t as frozen memory (see pin): itself when it already is, else a read-only copy viewing a new
    bytes object (aligned, as CPython's allocator aligns it to 16 bytes). A tensor held as blocks
    (kvref.spec.ggml.QuantizedTensor, a dataclass with a `data` array: not imported, since the spec
    imports this module) freezes its blocks; None and other objects are returned as they are."""
    if is_dataclass(t) and isinstance(getattr(t, "data", None), np.ndarray):
        data = frozen_tensor(t.data)
        return t if data is t.data else replace(t, data=data)
    if not isinstance(t, np.ndarray) or pin(t) is not None:
        return t
    a = np.ascontiguousarray(t)
    return np.frombuffer(a.tobytes(), dtype=a.dtype).reshape(a.shape)


def freeze(weights: Weights) -> Weights:
    """New Weights holding every tensor of `weights` frozen (frozen_tensor); a tensor shared by two
    fields (tied embeddings) stays one object. The arrays of `weights` itself are left as they were."""
    done = {}  # id of a tensor -> its frozen form

    def f(t):
        if id(t) not in done:
            done[id(t)] = frozen_tensor(t)
        return done[id(t)]

    layers = [replace(lw, **{field.name: f(getattr(lw, field.name)) for field in fields(lw)})
              for lw in weights.layers]
    return Weights(f(weights.tok_embeddings), layers, f(weights.output_norm), f(weights.output))
