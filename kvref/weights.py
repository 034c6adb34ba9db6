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
    wq: object  # [H*D, E]          query projection
    wk: object  # [Hkv*D, E]        key projection
    wv: object  # [Hkv*D, E]        value projection
    wo: object  # [E, H*D]          attention output projection
    ffn_norm: object  # [E]         RMSNorm gain before the MLP
    w_gate: object  # [F, E]        SwiGLU gate projection
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

    layers = [
        LayerWeights(
            attn_norm=gain(E),
            wq=matrix(config.q_dim, E),
            wk=matrix(config.kv_dim, E),
            wv=matrix(config.kv_dim, E),
            wo=matrix(E, config.q_dim),
            ffn_norm=gain(E),
            w_gate=matrix(F, E),
            w_up=matrix(F, E),
            w_down=matrix(E, F),
            bq=bias(config.q_dim), bk=bias(config.kv_dim), bv=bias(config.kv_dim),
            q_norm=optional_gain(config.head_dim, config.qk_norm),
            k_norm=optional_gain(config.head_dim, config.qk_norm),
            post_attn_norm=optional_gain(E, config.sandwich_norms),
            post_ffn_norm=optional_gain(E, config.sandwich_norms),
            sinks=rng.standard_normal(config.n_heads).astype(dtype) if config.attention_sinks else None,
            bo=(0.1 * rng.standard_normal(E)).astype(dtype) if config.attention_out_bias else None,
        )
        for _ in range(config.n_layers)
    ]
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
