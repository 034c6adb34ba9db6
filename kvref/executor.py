"""The executor: what runs an execution for a (model, cache) pair.

    executor.run(executions, all_logits)  ->  one logits array per execution: [T_b, V], or [1, V]

There are two. The spec executor runs the shared decoder (kvref.spec.decoder.forward_batch) over a
kernel set: kvref.spec.ops, the native kernels of kvref.native.ops, or any object with the names of
KernelSet. The native executor runs a whole execution in one C call (kvref.native.fused).

A model chooses one for each cache once, when the cache is first given to it (Model.executor): what
decides is fixed for the cache's life (its layout and K/V types, and the model's backend and weights),
so nothing is chosen again per call. The cache keeps it (`cache.executor`); the spec executor says why
the fused C forward does not run (`executor.fallback`: the spec backend, a layout C cannot use in place).

Both run executions that the caller has opened (cache.begin, or kvref.cache.begin_all for several):
they fill each execution's K/V and last logits, and the caller's `with` block commits them, or leaves
every cache as it was if anything fails. Token ids were checked by the caller (Model.check_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Protocol

from .spec import decoder


class KernelSet(Protocol):
    """The kernels the shared decoder calls by name, with the meaning of kvref.spec.ops (its NumPy
    definitions) and the same names in kvref.native.ops.Kernels. Shapes: T new positions, S cached +
    new, H heads, Hkv kv heads, D head_dim, E d_model, V vocab, F d_ff."""

    def embed(self, table, token_ids): ...  # [V, E], [T] -> [T, E]

    def matmul(self, x, w): ...  # [T, K], w [N, K] (any stored type) -> [T, N]

    def matmul_experts(self, x, w, experts): ...  # [R, K], w [X, N, K], [R] expert ids -> [R, N]

    def rms_norm(self, x, weight, eps): ...  # [T, E], [E] -> [T, E]

    def rope(self, x, positions, theta, scaling=None): ...  # [T, H, D], [T] -> [T, H, D]

    def attention(self, q, k, v, q_positions, k_positions, scale=None, window=None, softcap=None, sinks=None): ...
    # [T, H, D], [S, Hkv, D] x2, [T], [S], [H] or None -> [T, H, D]

    def swiglu(self, gate, up): ...  # [T, F] x2 -> [T, F]

    def geglu(self, gate, up): ...  # [T, F] x2 -> [T, F]

    def swiglu_oai(self, gate, up): ...  # [T, F] x2 -> [T, F]

    def soft_cap(self, x, cap): ...  # [...] -> [...]


class Executor(Protocol):
    name: str  # "spec" or "native"
    owner: object  # the Model whose executions it runs (its config and weights)
    fallback: str | None  # why the fused C forward does not run (the spec executor's); None for the native one

    def run(self, executions, all_logits: bool) -> list: ...


@dataclass(frozen=True, eq=False)
class SpecExecutor:
    """The shared decoder over a kernel set, one execution or a batch of them alike."""

    kernels: KernelSet
    owner: object  # the Model: its config and weights, read at each run
    fallback: str  # why not the fused C forward: the spec backend, weights C cannot read, this cache
    name = "spec"

    def run(self, executions, all_logits: bool) -> list:
        # B open executions -> B logits arrays [T_b, V] or [1, V]
        model = self.owner
        return decoder.forward_batch(self.kernels, model.config, model.weights, executions, all_logits)


class NativeExecutor:
    """A whole execution (or a batch of them) in one C call: kvref.native.fused.FusedForward."""

    name = "native"
    fallback = None

    def __init__(self, fused, kernels: KernelSet, owner):
        self.fused = fused  # kvref.native.fused.FusedForward, built once from the owner's config and weights
        self.kernels = kernels  # a kvref.native.ops.Kernels: its thread pool runs the C forward
        self.owner = owner  # the Model
        # run(executions, all_logits): B open executions -> B logits arrays [T_b, V] or [1, V]. The fused
        # forward itself, on these kernels, for caches it was chosen for: no frame of its own per step
        self.run = partial(fused.run, kernels, checked=True)


def describe(executor) -> str:
    """One line for `kvref run --verbose` and bench's header: which executor runs, and why not C."""
    if executor.name == "native":
        return f"native (the fused C forward, {executor.fused.activations} activations)"
    isa = getattr(executor.kernels, "isa", None)
    return f"spec (the shared decoder over the {'native ' + isa if isa else 'NumPy'} kernels: {executor.fallback})"


__all__ = ["Executor", "KernelSet", "NativeExecutor", "SpecExecutor", "describe"]
