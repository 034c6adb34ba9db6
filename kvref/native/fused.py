"""The fused native forward: a whole execution (a prefill or a decode step) in one C call.

    fused = FusedForward(config, weights, activations="float32")   # once, at load
    logits = fused.run(kernels, executions, all_logits=False)   # open executions -> [T_b, V] or [1, V] each

`run` is kvref.spec.decoder.forward_batch's meaning computed in C (csrc/forward.c), on the thread pool
of `kernels` (a kvref.native.ops.Kernels): it runs each execution's new tokens at its positions,
writes their K/V into its cache and sets its last logits; the caller's transaction commits them. A
model runs it through kvref.executor.NativeExecutor, chosen for a cache only when
`cache_problem(cache)` is None and the model's weights are the ones this object was built from
(`serves`):

  - the cache describes its storage (`cache.storage()`: contiguous and paged layouts, and per-layer
    rings: `Storage.layer_rings`) with K and V stored as float32, float16, bfloat16, int8 or kivi4 (K
    and V may differ): C writes the new positions' K/V into their slots in the stored form
    (kvref/cache/quant.py's encoding, byte for byte; kivi4 K through the residual rows of
    `Storage.k_residual`, each group quantized as it completes) and attention reads the stored form in place,
    through the block table of a paged cache (kvref.native.descriptors.cache_descriptor). A ring layer of R
    slots needs a layer window W <= R; C runs its new positions in sub-chunks of R - W + 1 (write,
    then attend), so no query reads a slot a later position overwrote.

Every family field of the config is computed in C, as the decoder reads it: Q/K/V biases, the attention
output bias (gpt-oss), QK-norm,
sandwich norms, the embedding scale, SwiGLU, GeGLU or gpt-oss's clamped SwiGLU, the score scale (YaRN's attention factor
included), sink logits, the score and final-logit soft
caps, per-layer windows, and each layer's RoPE frequency table (kvref.spec.ops.rope_frequencies for
the base and scaling of ModelConfig.layer_rope, computed once here, the same table kvref.native.ops.rope
passes), or none on a NoPE layer. Multi-head latent attention (config.kv_lora_rank: DeepSeek-V2/V3) runs
the decoder's absorbed form (kvref.spec.decoder.latent_attention_block): the latent key [c_kv ; k_rope] is
written to the cache as its one stored vector per layer and position, and attention of the queries with
W_UK folded in reads it in place (V: its first kv_lora_rank values), W_UV after; W_UK transposed and W_UV
are float32 copies made here, multiplied head by head as the decoder's ops.matmul calls do.

A mixture of experts (config.n_experts) runs in C too (csrc/moe.c), as kvref.spec.decoder.moe computes
it: the router's projection and bias, kvref_route (the `route` kernel, the C function the decoder calls
on the native backend: softmax or sigmoid scores, the selection bias, grouped top-k, renormalised and
scaled weights), the experts' projections as kvref_matmul_experts computes them (a pass's rows grouped
by expert, so each routed expert's weights stream once per pass, and an expert no row chose is never
read), gpt-oss's expert biases, the gate, the weighted sum in routing order, the shared expert, and
dense first layers. In the int8 mode each expert of a stack is packed like a dense projection, at a
64-byte aligned offset (`packed_stride`: within 1.05x of the stack's bytes), and the router and shared
expert like any projection; MXFP4 experts (gpt-oss GGUFs) have no packed form, so that mode multiplies
them with exact float32 activations.

A cache this forward cannot use in place runs the shared decoder over the native kernels
(kvref.executor.SpecExecutor), which
computes the same thing kernel by kernel on the K/V the cache decodes; `cache_problem` says why (a
window cache stages its writes, float64 K/V, ...).

Numerics. With activations="float32" (exact) the C forward calls the kernels of kvref.native.ops in
the decoder's order, so its logits and cache rows are bit-identical to the decoder's on the same
kernel set (any layout and K/V type: a bfloat16 element, or an int8 V element, is decoded in registers
to the float32 the cache's own decode gives); the bounds of tests/test_native.py carry over unchanged.
An int8 K is the exception, on every instruction set and in either mode: C scores it with each query
head rounded to 8 bits per K scale group and exact integer dot products, the group scales applied once
per group (kvref.spec.ops.int8_key_scores), where the decoder scores the decoded float K. A score moves
by at most scale sum_b d_b (1/2 + 2**-16) ks_b sum_j |k8_j| (d_b = max|q| / 127 of the query's group)
beyond float32 rounding (kvref.tolerance.INT8_KEY_QUERY_ROUNDING); the logits equal, bit for bit,
the decoder's on a kernel set whose attention reads the cache in place as C does, and stay within
kvref.tolerance.INT8_KEY_LOGIT_BOUND of the float-query decoder's on models with d_model >= 16. A
ring layer's keys are in slot order rather than position order, so there the logits are the
decoder's over a contiguous cache to float32 rounding (the online softmax sums in another order).
With activations="int8",
every projection, prefill and decode alike, is Kernels.matmul_int8, bit for bit: each input row is
rounded to blocks of 32 int8 values with scale d = max|x| / 127 before Q4_0, Q4_1, Q5_0, Q8_0, Q4_K
and Q6_K weights, and multiplied with integer dot products (llama.cpp does the same). Those weights
are packed once, here (kvref_pack_int8: 16 rows interleaved, so each 4-byte dot product instruction
serves 16 rows and a block's values are decoded once for every row of x), and C reads only the packed
copy; the file's pages of them are dropped from the resident set (kvref.weights.release_pages), so
the copy costs no memory beside them (it keeps the file's bit width and, but for Q6_K's 0.95% of
header padding, the file's bytes). An embedding table that is the LM head gives its rows from the
packed copy too, and the norm vectors are copied: reading the file maps page-cache folios back in. Each such output moves by at most sum_b d_b (1/2 + 2**-16) sum_{j in b} |w_j| beyond the
float32 rounding of the exact mode; other weight types stay exact. Exact is this class's default and
so kvref.load's (the programs, `kvref run`, `chat`, `serve` and `bench`, ask for int8 unless given
--exact or KVREF_ACTIVATIONS): on SmolLM2 the int8 greedy continuation leaves the float32 reference after 5 and 24 tokens on the two reference
prompts, llama.cpp's after 5 and 25 (tests/test_native_fused.py has the bounds and the measurements).

The descriptor's pointers stay valid for the object's life: C reads only memory that nothing
public can resize, free or write. A Model's weights are frozen (kvref.weights.freeze), so C points
into them and this object holds their pins (a read-only mapped file stays open); any other array
is copied here, once, into one only this object holds, so C computes with the values the weights
had when it was built even if the caller's arrays change later. Norm gains and biases must be
aligned to their dtype, as every array the kernels take (ShapeError otherwise).

Argument checks happen before C runs: token ids by the model (Model.check_tokens, TokenError; C checks
them again), room in the cache (CacheFullError, from cache.begin, which also reserves a paged cache's
blocks), here the cache arrays' dtype, shape and contiguity. C writes only the slots of positions
[length, length + T) inside the execution's transaction, which commits them with the ids and last logits
after C returns; a failed call (or an interrupt) aborts it and leaves the cache as it was. No cffi object
leaves this module.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from ..config import LATENT_NORM_EPS
from ..errors import BackendError, DTypeError, ShapeError
from ..spec import decoder
from ..weights import last_rebind, pin, release_pages
from . import ops as native_ops
from .descriptors import cache_descriptor, in_place_problem
from ..spec import decoder
from .ops import check_expert_stack, check_status, check_weight, ffi, lib, router_descriptor

ACTIVATIONS = {"float32": lib.KVREF_ACT_F32, "int8": lib.KVREF_ACT_INT8}


PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
DENSE_MLP = ("w_gate", "w_up", "w_down")  # absent on a mixture layer (config.moe_layer)
LATENT_PROJECTIONS = ("wq", "wo", "w_gate", "w_up", "w_down")  # MLA's others: FusedForward._latent_layer
MOE_TENSORS = ("router", "router_bias", "expert_selection_bias", "experts_gate", "experts_up", "experts_down",
               "experts_gate_bias", "experts_up_bias", "experts_down_bias", "shared_gate", "shared_up", "shared_down")
PACK_CHUNK_ROWS = 4096  # rows packed per call: a multiple of 256, so each chunk's copy starts 64-byte aligned
LAYER_TENSORS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down", "bq", "bk", "bv",
                 "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm", "sinks", "bo", "wq_a", "q_a_norm", "wkv_a",
                 "kv_a_norm", "wkv_b", *MOE_TENSORS)
GATES = {"silu": lib.KVREF_GATE_SILU, "gelu_tanh": lib.KVREF_GATE_GELU_TANH, "swiglu_oai": lib.KVREF_GATE_SWIGLU_OAI}


def packed_stride(gtype, N, K, X=1) -> int:
    """Bytes from one packed matrix [N, K] of a stack of X to the next (kvref_moe_layer): its packed bytes,
    rounded up to a multiple of 64 so each expert's copy is 64-byte aligned; 0 for a type never packed."""
    matrix = lib.kvref_packed_nbytes(gtype, N, K)
    return -(-matrix // 64) * 64 if X > 1 else matrix


def _tensors(weights):
    """Every tensor object of `weights` (None for an absent optional one), in a fixed order (the
    identity check of `serves`)."""
    out = [weights.tok_embeddings, weights.output_norm, weights.output]
    for lw in weights.layers:
        out += [getattr(lw, name) for name in LAYER_TENSORS]
    return out


class FusedForward:
    """The C model descriptor and run state for one (config, weights), built once.

    Raises DTypeError/ShapeError when the weights cannot run in C (a type the native kernels do not
    read, a non-contiguous matrix); the model then runs the shared decoder (Model.executor says why).
    """

    def __init__(self, config, weights, activations="float32"):
        self.config = config
        self.weights = weights
        self.activations = activations
        if self.activations not in ACTIVATIONS:
            raise BackendError(f"activations={self.activations!r} is unknown; expected one of {tuple(ACTIVATIONS)}")
        self._fingerprint = [id(t) for t in _tensors(weights)]
        # (last_rebind(), ids of weights.layers) when `weights` last matched the fingerprint: while both
        # hold, no tensor was rebound and the ~500 getattr calls of a full check are skipped
        self._checked = None
        self._keep = []  # the pin of every array a descriptor pointer points into (no dangling pointers)
        # each cache's K/V descriptor by its slot store, reused from step to step while its arrays stand
        # (cache_descriptor)
        self._descriptors = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # one state, one call at a time
        c = config
        if len(weights.layers) != c.n_layers:
            raise ShapeError(f"weights have {len(weights.layers)} layers, config says {c.n_layers}")
        E, D = c.d_model, c.head_dim
        desc = ffi.new("kvref_model_desc *")
        # the LM head first: packing it while nothing else is packed keeps the peak of the int8 mode's
        # packed copy and its file's pages low (one tensor's file pages resident beside the copy)
        self._tensor(desc.output, weights.output, "output", projection=True)
        layers = ffi.new("kvref_layer_desc[]", c.n_layers)
        for i, lw in enumerate(weights.layers):
            d = layers[i]
            d.attn_norm = self._vector(lw.attn_norm, E, f"layers[{i}].attn_norm")
            d.ffn_norm = self._vector(lw.ffn_norm, E, f"layers[{i}].ffn_norm")
            for name in LATENT_PROJECTIONS if c.latent else PROJECTIONS:
                if not (c.moe_layer(i) and name in DENSE_MLP):
                    self._tensor(getattr(d, name), getattr(lw, name), f"layers[{i}].{name}", projection=True)
            if c.latent:
                self._latent_layer(d, lw, i)
            if c.moe_layer(i):
                d.moe = self._moe_layer(lw, f"layers[{i}]")
            # the optional fields where the decoder reads them: biases whenever present, the norms by config
            optional = [("bq", c.q_dim, lw.bq is not None), ("bk", c.kv_dim, lw.bq is not None),
                        ("bv", c.kv_dim, lw.bq is not None), ("q_norm", D, c.qk_norm), ("k_norm", D, c.qk_norm),
                        ("post_attn_norm", E, c.sandwich_norms), ("post_ffn_norm", E, c.sandwich_norms),
                        ("sinks", c.n_heads, c.attention_sinks), ("bo", E, c.attention_out_bias)]
            for name, n, present in optional:
                if present:
                    setattr(d, name, self._vector(getattr(lw, name), n, f"layers[{i}].{name}"))
            rope = c.layer_rope(i)  # None: a NoPE layer, no table (C leaves its q and k as projected)
            if rope is not None:  # MLA rotates the last qk_rope_head_dim values of each head
                width = c.qk_rope_head_dim if c.latent else D
                d.rope_freqs = self._keep_buffer(native_ops.rope_table(width, *rope), "double *")
            d.window = native_ops.attention_window(c.window(i))
        desc.n_layers, desc.d_model, desc.n_heads = c.n_layers, c.d_model, c.n_heads
        desc.n_kv_heads, desc.head_dim, desc.d_ff, desc.vocab_size = c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size
        desc.norm_eps = float(c.norm_eps)
        desc.embedding_scale = float(np.float32(c.embedding_scale))  # rounded as the decoder rounds it
        desc.attention_scale = native_ops.attention_scale(c.score_scale, D)
        if c.latent:
            self._latent_model(desc)
        desc.attn_softcap = native_ops.attention_softcap(c.attn_softcap)
        desc.final_softcap = native_ops.attention_softcap(c.final_softcap)
        desc.gate = GATES[c.activation]
        if c.n_experts:
            desc.router = router_descriptor(decoder.router(c), c.n_experts)[0]
            desc.expert_d_ff, desc.shared_d_ff = c.experts_d_ff, c.shared_expert_d_ff
        if weights.tok_embeddings is weights.output:  # tied: one table, which C knows by its address
            for field in ("data", "nbytes", "type", "rows", "cols"):  # not `packed`: the head's, read by C for rows
                setattr(desc.tok_embeddings, field, getattr(desc.output, field))
        else:
            self._tensor(desc.tok_embeddings, weights.tok_embeddings, "tok_embeddings")
        desc.output_norm = self._vector(weights.output_norm, E, "output_norm")
        desc.layers = layers
        out = ffi.new("kvref_model **")
        check_status(lib.kvref_model_create(desc, out), "model descriptor")
        self._model = ffi.gc(out[0], lib.kvref_model_destroy)
        state = ffi.new("kvref_state **")
        check_status(lib.kvref_state_create(self._model, state), "run state")
        self._state = ffi.gc(state[0], lib.kvref_state_destroy)

    def _latent_model(self, desc):
        # MLA's fields of the model descriptor (csrc/kvref.h, kvref_model_desc)
        c = self.config
        desc.kv_lora_rank, desc.q_lora_rank = c.kv_lora_rank, c.q_lora_rank or 0
        desc.qk_rope_head_dim, desc.v_head_dim = c.qk_rope_head_dim, c.v_head_dim
        desc.latent_norm_eps = LATENT_NORM_EPS
        desc.q_rope_scale = float(np.float32(decoder.latent_rope_scale(c)))  # as the decoder multiplies by it
        desc.attention_scale = native_ops.attention_scale(decoder.latent_scale(c), c.kv_lora_rank + c.qk_rope_head_dim)

    def _latent_layer(self, d, lw, i):
        """Layer i's MLA fields of its descriptor: the query's low-rank path, the latent's down-projection
        and norm, and float32 copies of W_UK transposed and W_UV, which C multiplies head by head as the
        decoder does (decoder.latent_up_projections, per_head_matmul)."""
        c = self.config
        if c.q_lora_rank:
            self._tensor(d.wq_a, lw.wq_a, f"layers[{i}].wq_a", projection=True)
            d.q_a_norm = self._vector(lw.q_a_norm, c.q_lora_rank, f"layers[{i}].q_a_norm")
        self._tensor(d.wkv_a, lw.wkv_a, f"layers[{i}].wkv_a", projection=True)
        d.kv_a_norm = self._vector(lw.kv_a_norm, c.kv_lora_rank, f"layers[{i}].kv_a_norm")
        if not isinstance(lw.wkv_b, np.ndarray) or lw.wkv_b.dtype.kind != "f":
            raise DTypeError(f"layers[{i}].wkv_b must be a float array (the decoder reads its heads as one)")
        w_uk, w_uv = decoder.latent_up_projections(c, lw, np.float32)  # [H, Dn, R], [H, Dv, R]
        w_uk_t = np.ascontiguousarray(w_uk.transpose(0, 2, 1))  # [H, R, Dn], as decoder.absorbed_queries makes it
        self._tensor(d.w_uk, w_uk_t.reshape(-1, c.qk_nope_head_dim), f"layers[{i}].wkv_b (W_UK)")
        self._tensor(d.w_uv, np.ascontiguousarray(w_uv).reshape(-1, c.kv_lora_rank), f"layers[{i}].wkv_b (W_UV)")

    def _keep_buffer(self, a, ctype):
        self._keep.append(a)
        return ffi.cast(ctype, ffi.from_buffer(a))

    def _pinned(self, a, copy=False):
        """a when nothing public can free, resize or write its memory (kvref.weights.pin), its pin
        kept; otherwise, or with `copy`, a read-only copy only this object holds."""
        owner = None if copy else pin(a)
        if owner is None:
            a = owner = np.array(a, order="C")  # a copy, aligned
            a.flags.writeable = False
        self._keep.append(owner)
        return a

    def _vector(self, g, n, name):
        # [n] float32 (a norm gain or a bias); float16/float64 ones are converted once, here
        if not isinstance(g, np.ndarray) or g.ndim != 1 or g.shape[0] != n:
            raise ShapeError(f"{name} must be a 1-D array of {n} values")
        if g.dtype.kind != "f":
            raise DTypeError(f"{name} has dtype {g.dtype}; expected a float array")
        if g.dtype == np.float32 and not g.flags.aligned:  # C reads it as float *
            raise ShapeError(f"{name} is not aligned to its dtype (address {g.ctypes.data:#x}); pass a copy")
        # copied in the int8 mode: read in the file, a vector maps the page-cache folio around it back in,
        # pages of the packed projections beside it that were released once packed
        g = self._pinned(np.ascontiguousarray(g, dtype=np.float32), copy=self.activations == "int8")
        return ffi.cast("const float *", ffi.from_buffer(g))

    def _tensor(self, dst, w, name, projection=False):
        gtype, data, N, K = check_weight(w, name)  # validates type, shape, byte count, contiguity, alignment
        data = self._pinned(data)
        dst.data = ffi.from_buffer(data)
        dst.nbytes = data.nbytes
        dst.type = gtype
        dst.rows, dst.cols = N, K
        if projection and self.activations == "int8" and lib.kvref_packed_nbytes(gtype, N, K) > 0:
            dst.packed = ffi.from_buffer(self._packed(gtype, data, N, K, name))

    def _moe_layer(self, lw, name):
        """A mixture layer's kvref_moe_layer (kept alive here): its router (a projection), expert stacks
        and biases where the decoder adds them, and the shared expert when the config has one."""
        c = self.config
        X, E, Fx = c.n_experts, c.d_model, c.experts_d_ff
        m = ffi.new("kvref_moe_layer *")
        self._keep.append(m)
        self._tensor(m.router, lw.router, f"{name}.router", projection=True)
        for field in ("gate", "up", "down"):
            self._expert_stack(getattr(m, field), getattr(lw, f"experts_{field}"), f"{name}.experts_{field}")
        vectors = [("router_bias", "router_bias", X), ("selection_bias", "expert_selection_bias", X),
                   ("gate_bias", "experts_gate_bias", X * Fx), ("up_bias", "experts_up_bias", X * Fx),
                   ("down_bias", "experts_down_bias", X * E)]
        for field, attr, n in vectors:
            if getattr(lw, attr) is not None:
                setattr(m, field, self._vector(np.asarray(getattr(lw, attr)).reshape(-1), n, f"{name}.{attr}"))
        if c.shared_expert_d_ff:
            for field in ("shared_gate", "shared_up", "shared_down"):
                self._tensor(getattr(m, field), getattr(lw, field), f"{name}.{field}", projection=True)
        return m

    def _expert_stack(self, dst, w, name):
        # [X, N, K] -> a kvref_tensor of X * N rows; in the int8 mode each expert packed on its own
        gtype, data, X, N, K = check_expert_stack(w, name)
        data = self._pinned(data)
        dst.data = ffi.from_buffer(data)
        dst.nbytes = data.nbytes
        dst.type = gtype
        dst.rows, dst.cols = X * N, K
        if self.activations == "int8" and lib.kvref_packed_nbytes(gtype, N, K) > 0:
            dst.packed = ffi.from_buffer(self._packed(gtype, data, N, K, name, X))

    def _packed(self, gtype, data, N, K, name, X=1):
        """data [X * N, row bytes] (X matrices [N, K] one after the other: a projection, or an expert stack)
        packed for the int8 mode's kernels (csrc/kvref.h, kvref_pack_int8), which read the copy instead:
        each matrix at a 64-byte aligned offset (kvref_moe_layer), PACK_CHUNK_ROWS rows at a time, each
        chunk's file pages released as soon as it is packed (kvref.weights.release_pages), so they and the
        copy are not resident together."""
        stride = packed_stride(gtype, N, K, X)
        buf = np.empty(X * stride + 64, np.uint8)
        packed = buf[-buf.ctypes.data % 64:][:X * stride]  # 64-byte aligned, as is every chunk's start below
        rows_of = data.reshape(X * N, -1)  # [X * N, row bytes]
        for e in range(X):
            for n in range(0, N, PACK_CHUNK_ROWS):
                rows = rows_of[e * N + n:e * N + min(n + PACK_CHUNK_ROWS, N)]
                out = packed[e * stride + lib.kvref_packed_nbytes(gtype, n, K):][:lib.kvref_packed_nbytes(gtype, len(rows), K)]
                check_status(lib.kvref_pack_int8(ffi.from_buffer(rows), gtype, rows.nbytes, len(rows), K,
                                                 ffi.from_buffer(out), out.nbytes), name)
                release_pages(rows)
        self._keep.append(packed)
        return packed

    # ---- running ------------------------------------------------------------------------------

    def cache_problem(self, cache) -> str | None:
        """Why this C forward cannot run executions on `cache` (None when it can): a layout or K/V type
        the native kernels cannot use in place. Fixed for the cache's life, so a model asks once."""
        problem = in_place_problem(cache)
        return None if problem is None else f"the C forward cannot use this {cache.layout} cache in place: {problem}"

    def serves(self, weights) -> bool:
        """Whether `weights` is the object this forward was built from, still holding the same tensor
        objects (a field rebound since, in it or a layer, would leave C reading the old tensor)."""
        if weights is not self.weights:
            return False
        seen = (last_rebind(), list(map(id, weights.layers)))  # list items are rebound without a setattr
        if seen == self._checked:
            return True
        if [id(t) for t in _tensors(weights)] != self._fingerprint:
            return False
        self._checked = seen
        return True

    def run(self, kernels, executions, all_logits=False, checked=False):
        # B open executions (one per sequence, T_b new ids each, ragged; ids checked by the caller)
        # -> B logits arrays [T_b, V] or [1, V]; the caller commits them all or none (kvref.executor).
        # `kernels` (kvref.native.ops.Kernels): whose thread pool runs it. `checked`: every cache is one
        # this forward takes (cache_problem None, as the native executor knows); else CacheError if not.
        if not isinstance(all_logits, (bool, np.bool_)):
            raise ShapeError(f"all_logits={all_logits!r} must be True or False")
        V, B = self.config.vocab_size, len(executions)
        all_logits = int(bool(all_logits))
        if B == 1:  # a single sequence: no batch arrays to build
            e = executions[0]
            ids = np.array(e.token_ids, dtype=np.int64)  # [T], C-contiguous
            logits = np.empty((ids.shape[0] if all_logits else 1, V), dtype=np.float32)
            kv = cache_descriptor(e.cache, e.write_in_place(), checked, self._descriptors)  # reserved blocks included
            with self._lock:
                status = lib.kvref_forward(kernels.c_pool, self._model, self._state, ffi.from_buffer("int64_t[]", ids),
                                           ids.shape[0], kv.ptr, int(e.positions[0]), ACTIVATIONS[self.activations],
                                           all_logits, ffi.from_buffer("float[]", logits))
            check_status(status, "forward")
            e.last_logits = logits[-1]  # committed with the new positions as the block ends
            return [logits]
        ids = np.concatenate([e.token_ids for e in executions]).astype(np.int64)  # [N], C-contiguous
        logits = np.empty((ids.shape[0] if all_logits else B, V), dtype=np.float32)
        kvs = [cache_descriptor(e.cache, e.write_in_place(), checked, self._descriptors) for e in executions]
        bounds = np.cumsum([0, *(len(e.token_ids) for e in executions)]).astype(np.int64)  # [B + 1]
        lengths = np.array([e.positions[0] for e in executions], dtype=np.int64)  # [B] first new positions
        descriptors = ffi.new("kvref_kv[]", B)
        for b, kv in enumerate(kvs):
            descriptors[b] = kv.ptr[0]
        with self._lock:
            status = lib.kvref_forward_batch(kernels.c_pool, self._model, self._state,
                                             ffi.from_buffer("int64_t[]", ids), ffi.from_buffer("int64_t[]", bounds),
                                             B, descriptors, ffi.from_buffer("int64_t[]", lengths),
                                             ACTIVATIONS[self.activations], all_logits,
                                             ffi.from_buffer("float[]", logits))
        check_status(status, "forward_batch")
        rows = bounds if all_logits else np.arange(B + 1)
        out = [logits[rows[b]:rows[b + 1]] for b in range(B)]  # [T_b or 1, V] each
        for execution, sequence_logits in zip(executions, out):
            execution.last_logits = sequence_logits[-1]  # committed with the sequence's new positions
        return out

    def fail_at_layer(self, layer: int) -> None:
        """Test hook: the next C forward fails (BackendError) on reaching `layer`, after writing the K/V
        of the layers before it; -1 disarms. Lets tests interrupt an execution mid-way in C."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not -1 <= layer < self.config.n_layers:
            raise ShapeError(f"layer={layer!r} must be -1 or in [0, {self.config.n_layers})")
        with self._lock:
            check_status(lib.kvref_state_fail_at_layer(self._state, int(layer)), "fail_at_layer")

    def read_nbytes(self, tensor) -> int:
        """Bytes of `tensor` (a projection, an expert stack or the LM head of these weights) an execution
        reads, every expert of a stack counted: its packed copy's in the int8 mode (csrc/kvref.h,
        kvref_packed_nbytes), else the file's."""
        if len(tensor.shape) == 3:
            gtype, data, X, N, K = check_expert_stack(tensor, "tensor")
        else:
            (gtype, data, N, K), X = check_weight(tensor, "tensor"), 1
        packed = X * packed_stride(gtype, N, K, X) if self.activations == "int8" else 0
        return packed or data.nbytes

    # ---- timing -------------------------------------------------------------------------------

    def timings(self) -> dict:
        """Seconds spent in C forwards since creation or reset_timings(), by kernel family:
        projections (matmuls and their fused SwiGLU/residual adds, a mixture's MLP), attention, other
        (embedding, norms, RoPE, cache writes); `calls` counts the C forwards, `expert_bytes` the routed
        experts' bytes they read. Wall time of the calling thread."""
        out = ffi.new("int64_t[5]")
        with self._lock:
            lib.kvref_state_timings(self._state, out)
        return {"projections": out[0] * 1e-9, "attention": out[1] * 1e-9, "other": out[2] * 1e-9,
                "calls": int(out[3]), "expert_bytes": int(out[4])}

    def reset_timings(self) -> None:
        with self._lock:
            lib.kvref_state_reset_timings(self._state)


__all__ = ["ACTIVATIONS", "FusedForward"]
