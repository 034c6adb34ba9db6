"""The native kernel set: the names and meanings of kvref.spec.ops, computed by the C module.

    embed(table, token_ids)                          [V, E], [T] -> [T, E]
    matmul(x, w)                                     [T, K], [N, K] -> [T, N]      (y = x @ W.T)
    rms_norm(x, weight, eps)                         [T, E], [E] -> [T, E]
    rope(x, positions, theta, scaling=None)          [T, nh, D], [T] -> [T, nh, D]
    attention(q, k, v, q_positions, k_positions,     [T, H, D], [S, Hkv, D] x2, [T], [S] -> [T, H, D]
              scale=None, window=None, softcap=None, sinks=None)  (sinks: [H] sink logits, gpt-oss)
    swiglu(gate, up)                                 [T, F], [T, F] -> [T, F]
    geglu(gate, up)                                  [T, F], [T, F] -> [T, F]
    swiglu_oai(gate, up)                             [T, F], [T, F] -> [T, F]  (gpt-oss's clamped SwiGLU)
    soft_cap(x, cap)                                 [...] -> [...]   (Gemma 2's final logits)
    matmul_experts(x, w, experts)                    [R, K], [X, N, K], [R] -> [R, N]  (row r through
        expert experts[r]'s matrix; each expert named read once, the others never)
    matmul_int8(x, w)                                [T, K], [N, K] -> [T, N]  (Kernels only: the
        int8 activation mode's projection, x rounded to 8-bit blocks of 32; see kvref.native.fused)

Activations are float32 (the kernels take and return float32 only). A weight is a float32 (or
float16) ndarray in file layout, or a kvref.spec.ggml.QuantizedTensor of type F32, F16, BF16,
Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K or MXFP4, multiplied straight from its blocks; an embedding table may be
quantized too (only the rows asked for are decoded). K/V for attention are float32 or float16
arrays; `Kernels.cache_attention` reads a cache's K/V in place instead (any layout whose
`cache.storage()` describes them: contiguous, paged, and per-layer rings), stored as float32,
float16, bfloat16 or int8 (decoded in registers: the same float32 values NumPy decodes), except that
an int8 K is scored with integers against the query rounded to 8 bits per scale group: the
attention of kvref.spec.ops.attention_int8_keys (bound in kvref.tolerance, INT8_KEY_QUERY_ROUNDING).

RoPE takes the spec's frequency table (kvref.spec.ops.rope_frequencies, computed here and passed
to C), so every base and scaling the spec knows runs natively, bit for bit the same table.

Numerics: every weight value is decoded to exactly the float32 the spec dequantizer
(kvref.spec.quants) produces, and dot products accumulate in float32, so matmul differs from the
spec only by summation order: |native - spec| <= 2 gamma(K) (|x| @ |W|.T), gamma(K) = K u / (1 - K u),
u = 2**-24. Attention, RMSNorm, RoPE, SwiGLU and GeGLU have similar derived bounds; tests/test_native.py
states and checks each one. Activations are rounded to 8 bits only by matmul_int8, which the fused
forward uses in its opt-in int8 mode (bound in tests/test_native_fused.py).

Every argument is checked here, before C runs: types, dtypes, C-contiguity, alignment, shapes,
lengths, token ids, quantized byte counts and thread counts. A wrong call raises a KVRefError
subclass naming the argument; it never reaches C. The C side checks its scalar arguments again
and returns a status, which is mapped to the same exceptions (check_status). No cffi object leaves
kvref.native: Kernels.c_pool, check_status and check_weight exist for the fused forward's C calls
(kvref.native.fused) and are not in __all__.

Threads: the module functions run on a shared pool per (threads, isa), created on first use with
`threads` from the argument, else KVREF_THREADS (read once, at the first call; reset_default()
re-reads it), else the CPUs this process may run on. KVREF_ISA (auto|scalar|avx2|avx512 on
x86-64, auto|scalar|neon|neon_dotprod|neon_i8mm on aarch64) forces an instruction set the same way. Results
do not depend on the thread count (see csrc/kvref.h). `Kernels(threads=..., isa=...)` binds the
same functions to one pool, for a backend that wants its own.
"""

from __future__ import annotations

import os
import threading
import warnings

import numpy as np

from ..errors import BackendError, ConfigError, DTypeError, KVRefError, ShapeError, TokenError
from ..spec import ops as spec_ops
from ..spec.ggml import BLOCK_LAYOUT, GGMLType, QuantizedTensor
from . import MAX_THREADS, available, unavailable_reason  # noqa: F401  (MAX_THREADS re-exported)

if not available():
    raise BackendError(unavailable_reason())

from ._kvref import ffi, lib  # noqa: E402
from .descriptors import (KV_TYPES, KVDescriptor, cache_descriptor, in_place_problem,  # noqa: E402, F401
                          ring_positions)  # (KV_TYPES, in_place_problem: re-exported)


#: GGML types the native matmul/embed read directly
WEIGHT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
                GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.MXFP4)

# narrowest first within each architecture (supported_isas keeps this order: the best is last)
ISAS = {"auto": lib.KVREF_ISA_AUTO, "scalar": lib.KVREF_ISA_SCALAR, "avx2": lib.KVREF_ISA_AVX2,
        "avx512": lib.KVREF_ISA_AVX512, "neon": lib.KVREF_ISA_NEON, "neon_dotprod": lib.KVREF_ISA_NEON_DOTPROD,
        "neon_i8mm": lib.KVREF_ISA_NEON_I8MM}
_ISA_NAMES = {v: k for k, v in ISAS.items()}

_F32 = np.dtype(np.float32)
PROBE_UNIT = lib.KVREF_PROBE_UNIT  # bytes the read-bandwidth probe reads per unit of work
GEMM_MIN_T = lib.KVREF_GEMM_MIN_T  # rows of x from which matmul takes the tiled GEMM path
GEMM_Q8_MIN_T = lib.KVREF_GEMM_Q8_MIN_T  # ... and matmul_int8 its 8-bit GEMM
_F16 = np.dtype(np.float16)
_U8 = np.dtype(np.uint8)
_I64 = np.dtype(np.int64)

_STATUS_ERRORS = {
    lib.KVREF_ERR_NULL: ShapeError, lib.KVREF_ERR_DIM: ShapeError, lib.KVREF_ERR_SHAPE: ShapeError,
    lib.KVREF_ERR_SIZE: ShapeError, lib.KVREF_ERR_VALUE: ShapeError, lib.KVREF_ERR_TYPE: DTypeError,
    lib.KVREF_ERR_NOMEM: BackendError, lib.KVREF_ERR_THREAD: BackendError,
    lib.KVREF_ERR_ISA: BackendError, lib.KVREF_ERR_INJECTED: BackendError,
}


def check_status(status, what):
    """Raise the KVRefError subclass of a C status (nothing for KVREF_OK); `what` names the call."""
    if status != lib.KVREF_OK:
        message = ffi.string(lib.kvref_status_string(status)).decode()
        raise _STATUS_ERRORS.get(status, BackendError)(f"native {what} failed: {message} (status {status})")


# ---- argument checks (all raise before any C call) ------------------------------------------

def _array(a, name, dtypes, ndim):
    """a as-is if it is a C-contiguous, aligned ndarray of one of `dtypes` with `ndim` axes."""
    if not isinstance(a, np.ndarray):
        raise ShapeError(f"{name} must be a NumPy array, not {type(a).__name__}")
    if a.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise DTypeError(f"{name} has dtype {a.dtype}; the native kernels take {expected}")
    if ndim is not None and a.ndim not in ((ndim,) if isinstance(ndim, int) else ndim):
        raise ShapeError(f"{name} must have {ndim} axes, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ShapeError(f"{name} is not C-contiguous (shape {a.shape}, strides {a.strides}); "
                         f"pass np.ascontiguousarray({name})")
    if not a.flags.aligned:
        raise ShapeError(f"{name} is not aligned to its dtype; pass a copy")
    return a


def _positions(p, name, length):
    """Integer positions/ids as a C-contiguous int64 [length] array (a copy if needed)."""
    if isinstance(p, np.ndarray):
        arr = p
    else:
        try:
            arr = np.asarray(p)
        except (TypeError, ValueError) as exc:
            raise ShapeError(f"{name} must be a 1-D sequence of integers: {exc}") from None
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":  # np.asarray([]) is float64
            arr = arr.astype(_I64)
        else:
            raise DTypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ShapeError(f"{name} must be 1-D, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise ShapeError(f"{name} has {arr.shape[0]} entries, expected {length}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ShapeError(f"{name} holds values beyond int64")
    if arr.dtype != _I64 or not arr.flags.c_contiguous or not arr.flags.aligned:
        arr = np.ascontiguousarray(arr, dtype=_I64)
    return arr


def _real(value, name, minimum_exclusive=None, minimum=None):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{name}={value!r} must be a real number")
    v = float(value)
    if not np.isfinite(v) or (minimum is not None and v < minimum) or (
            minimum_exclusive is not None and v <= minimum_exclusive):
        bound = f">= {minimum}" if minimum is not None else f"> {minimum_exclusive}"
        raise ConfigError(f"{name}={value!r} must be finite and {bound}")
    return v


def rope_table(head_dim, theta, scaling=None) -> np.ndarray:
    """The RoPE frequencies C rotates with: kvref.spec.ops.rope_frequencies(head_dim, theta, scaling),
    float64 [head_dim / 2], checked (ConfigError for a base or scaling it cannot compute)."""
    theta = _real(theta, "theta", minimum_exclusive=0.0)
    try:
        table = spec_ops.rope_frequencies(head_dim, theta, scaling)
    except (TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
        raise ConfigError(f"RoPE scaling {scaling!r} cannot be computed: {exc}") from None
    table = np.ascontiguousarray(table, dtype=np.float64)
    if table.shape != (head_dim // 2,) or not np.all(np.isfinite(table)):
        raise ConfigError(f"RoPE scaling {scaling!r} with base {theta} gives no finite frequency table of "
                          f"{head_dim // 2} entries")
    return table


def attention_scale(scale, head_dim) -> float:
    """The float32 score scale C multiplies by: `scale`, or 1/sqrt(head_dim) for None (the spec's
    default); ConfigError unless positive and finite."""
    if scale is None:
        return float(np.float32(1.0 / np.sqrt(head_dim)))
    return float(np.float32(_real(scale, "scale", minimum_exclusive=0.0)))


def attention_softcap(softcap) -> float:
    """A score soft cap as C takes it: the float32 cap, or 0 for None (no cap); ConfigError unless
    positive and finite."""
    return 0.0 if softcap is None else float(np.float32(_real(softcap, "softcap", minimum_exclusive=0.0)))


def attention_window(window) -> int:
    """A layer window as C takes it: a positive int, or 0 for None (no window)."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window <= 0:
        raise ConfigError(f"window={window!r} must be None or a positive integer")
    return int(window)


def attention_sinks(sinks, n_heads):
    """Sink logits as C takes them: a C-contiguous float32 [n_heads] array (a copy if needed; float16/64
    values are rounded to float32 as the spec's float32 softmax rounds them). ShapeError otherwise."""
    if not isinstance(sinks, np.ndarray) or sinks.dtype.kind != "f" or sinks.shape != (n_heads,):
        shape = getattr(sinks, "shape", type(sinks).__name__)
        raise ShapeError(f"sinks must be a float array of one logit per query head, shape ({n_heads},); got {shape}")
    return np.ascontiguousarray(sinks, dtype=_F32)


def _prefix_of(v, k) -> bool:
    """Whether v is k[..., :Dv] of a C-contiguous k, Dv < D: the same memory, read in place."""
    return (isinstance(v, np.ndarray) and isinstance(k, np.ndarray) and v.ndim == 3 and v.shape[:2] == k.shape[:2]
            and 0 < v.shape[-1] < k.shape[-1] and v.dtype == k.dtype and k.flags.c_contiguous
            and v.strides == k.strides and (v.size == 0 or v.ctypes.data == k.ctypes.data))


def _common_width(q, k, v, scale):
    # q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv] -> the same padded with zeros to one width W = max(D, Dv), the
    # values' width Dv (None when Dv == D) and the scale of the unpadded D: C reads K and V vectors of one
    # width, and zeros add nothing to a score (MLA's naive form has Dv != D: a copy, off the absorbed path)
    D, Dv = k.shape[-1], v.shape[-1]
    if D == Dv:
        return q, k, v, None, scale
    W = max(D, Dv)
    scale = attention_scale(scale, q.shape[-1])

    def widened(a):
        out = np.zeros((*a.shape[:-1], W), dtype=a.dtype)
        out[..., :a.shape[-1]] = a
        return out

    if D < W:
        return widened(q), widened(k), v, None, scale
    return q, k, widened(v), Dv, scale


def check_weight(w, name):
    """(type id, uint8/float buffer, N, K) for a float ndarray or a QuantizedTensor [N, K], checked
    (type, shape, byte count, contiguity); DTypeError/ShapeError naming `name` otherwise."""
    gtype, data, (N, K) = _checked_weight(w, name, 2)
    return gtype, data, N, K


ROUTER_SCORES = {"softmax": lib.KVREF_ROUTER_SOFTMAX, "sigmoid": lib.KVREF_ROUTER_SIGMOID}
GROUP_SCORES = {"top2_sum": lib.KVREF_GROUP_TOP2_SUM, "max": lib.KVREF_GROUP_MAX}


def router_descriptor(router, X):
    """A kvref.spec.ops.Router over X experts as C's kvref_router (cffi, owned by the caller);
    ShapeError naming the field when C would refuse it."""
    k, G, G_used = router.n_used, router.n_groups, router.n_groups_used
    if router.score not in ROUTER_SCORES or router.group_score not in GROUP_SCORES:
        raise ShapeError(f"router score {router.score!r} / group score {router.group_score!r}: expected one of "
                         f"{tuple(ROUTER_SCORES)} / {tuple(GROUP_SCORES)}")
    if not (1 <= k <= X and 1 <= G_used <= G and X % G == 0 and G_used * (X // G) >= k):
        raise ShapeError(f"a router of {k} experts from the best {G_used} of {G} groups cannot choose among {X} "
                         f"experts (1 <= k <= X, G divides X, G_used groups hold >= k experts)")
    if not np.isfinite(np.float32(router.scaling)):
        raise ShapeError(f"router scaling {router.scaling!r} must be finite in float32")
    r = ffi.new("kvref_router *")
    r.n_experts, r.n_used, r.score = X, k, ROUTER_SCORES[router.score]
    r.n_groups, r.n_groups_used, r.group_score = G, G_used, GROUP_SCORES[router.group_score]
    r.normalize, r.scaling = int(bool(router.normalize)), float(np.float32(router.scaling))
    return r


def selection_vector(bias, X):
    """A router's selection bias as the float32 [X] C adds (a float16 or float64 one converted)."""
    if not isinstance(bias, np.ndarray) or bias.shape != (X,) or bias.dtype.kind != "f":
        raise ShapeError(f"selection_bias must be a float array of {X} values (one per expert)")
    return np.ascontiguousarray(bias, dtype=_F32)


def check_expert_stack(w, name):
    """(type id, uint8/float buffer, X, N, K) for a mixture's stack of X matrices [N, K] (LayerWeights.experts_*):
    a float ndarray or a QuantizedTensor [X, N, K], checked like check_weight."""
    gtype, data, (X, N, K) = _checked_weight(w, name, 3)
    return gtype, data, X, N, K


def _checked_weight(w, name, ndim):
    # (type id, buffer, shape) of a weight of `ndim` axes, the last its K values (whole blocks) per row
    axes = ("X", "N", "K")[-ndim:]
    if isinstance(w, QuantizedTensor):
        try:
            gtype = GGMLType(w.ggml_type)
        except ValueError:
            raise DTypeError(f"{name} has unknown GGML type {w.ggml_type!r}") from None
        if gtype not in WEIGHT_TYPES:
            raise DTypeError(f"{name} is {gtype.name}; the native kernels read "
                             f"{', '.join(t.name for t in WEIGHT_TYPES)}")
        shape = w.shape
        if (not isinstance(shape, tuple) or len(shape) != ndim
                or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise ShapeError(f"{name}.shape must be ({', '.join(axes)}) with non-negative ints, got {shape!r}")
        shape = tuple(int(s) for s in shape)
        K = shape[-1]
        block_values, block_bytes = BLOCK_LAYOUT[gtype]
        if K % block_values:
            raise ShapeError(f"{name}: K={K} is not a whole number of {gtype.name} blocks of {block_values}")
        row_bytes = K // block_values * block_bytes
        data = w.data
        if not isinstance(data, np.ndarray) or data.dtype != _U8:
            raise DTypeError(f"{name}.data must be a uint8 ndarray, got "
                             f"{type(data).__name__} {getattr(data, 'dtype', '')}")
        if data.shape != (*shape[:-1], row_bytes):
            rows = int(np.prod(shape[:-1]))
            raise ShapeError(f"{name}.data has shape {data.shape}; a {gtype.name} {list(shape)} tensor is "
                             f"uint8 {[*shape[:-1], row_bytes]} ({rows * row_bytes} bytes, got {data.nbytes})")
        if not data.flags.c_contiguous:
            raise ShapeError(f"{name}.data is not C-contiguous")
        return int(gtype), data, shape
    if isinstance(w, np.ndarray):
        _array(w, name, (_F32, _F16), ndim)
        return (lib.KVREF_TYPE_F32 if w.dtype == _F32 else lib.KVREF_TYPE_F16), w, w.shape
    raise DTypeError(f"{name} must be a float32/float16 ndarray or a QuantizedTensor, not {type(w).__name__}")


def _threads(threads):
    source = "threads"
    if threads is None:
        env = os.environ.get("KVREF_THREADS", "").strip()
        if not env:
            return min(_usable_cores(), MAX_THREADS)
        source = "KVREF_THREADS"
        try:
            threads = int(env)
        except ValueError:
            raise BackendError(f"KVREF_THREADS={env!r} is not an integer") from None
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)):
        raise BackendError(f"threads={threads!r} must be an integer")
    if not 1 <= threads <= MAX_THREADS:
        raise BackendError(f"{source}={threads} must be in [1, {MAX_THREADS}]")
    usable = _usable_cores()
    if threads > usable and (source, threads) not in _oversubscribed:
        # allowed (a test of the pool's scheduling may want it), but never faster: said once
        _oversubscribed.add((source, threads))
        warnings.warn(f"{source}={threads} is more than the {usable} cores this process may use; the pool's "
                      "threads take turns on them, which is slower than one thread per core", RuntimeWarning,
                      stacklevel=4)
    return int(threads)


_oversubscribed = set()  # (source, threads) already warned about


def _usable_cores() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _isa(isa):
    if isa is None:
        isa = os.environ.get("KVREF_ISA", "auto").strip().lower() or "auto"
    if isa not in ISAS:
        raise BackendError(f"isa={isa!r} is unknown; expected one of {tuple(ISAS)}")
    if not lib.kvref_isa_supported(ISAS[isa]):
        raise BackendError(f"isa={isa!r} is not supported by this CPU (best: {best_isa()})")
    return isa


def best_isa() -> str:
    """The instruction set 'auto' selects on this CPU."""
    return _ISA_NAMES[lib.kvref_isa_best()]


def supported_isas() -> tuple:
    return tuple(name for name, v in ISAS.items() if name != "auto" and lib.kvref_isa_supported(v))


# ---- pools --------------------------------------------------------------------------------

class _Pool:
    """Owns one C pool. Destroyed by the process that created it (a forked child never joins
    threads it does not have)."""

    def __init__(self, threads, isa):
        out = ffi.new("kvref_pool **")
        check_status(lib.kvref_pool_create(threads, ISAS[isa], out), "pool creation")
        self.ptr = out[0]
        self.pid = os.getpid()

    def close(self):
        if self.ptr is not None and self.pid == os.getpid():
            lib.kvref_pool_destroy(self.ptr)
        self.ptr = None

    def __del__(self):
        self.close()


_pools_lock = threading.Lock()
_kernel_sets = {}  # (threads, isa) -> Kernels, for the module-level functions


def _forget_pools_after_fork():
    # the child has only the forking thread: its pools' workers are gone; drop them unclosed
    for ks in _kernel_sets.values():
        ks._pool.pid = -1
    _kernel_sets.clear()
    _default.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)


_default = []  # [Kernels] for calls without threads/isa: KVREF_THREADS/KVREF_ISA read once


def kernels(threads=None, isa=None) -> "Kernels":
    """The shared kernel set for a thread count and instruction set (created on first use).

    Without arguments: the default set, from KVREF_THREADS and KVREF_ISA as they were at the
    first such call (like OMP_NUM_THREADS); reset_default() re-reads them.
    """
    if threads is None and isa is None:
        if _default:
            return _default[0]
        ks = kernels(_threads(None), _isa(None))
        _default[:] = [ks]
        return ks
    key = (_threads(threads), _isa(isa))
    ks = _kernel_sets.get(key)
    if ks is None:
        with _pools_lock:
            ks = _kernel_sets.get(key)
            if ks is None:
                ks = _kernel_sets[key] = Kernels(*key)
    return ks


def reset_default():
    """Forget the default kernel set, so the next call re-reads KVREF_THREADS and KVREF_ISA."""
    _default.clear()


# ---- the kernel set -----------------------------------------------------------------------

class Kernels:
    """embed, matmul, rms_norm, rope, attention, swiglu, geglu, swiglu_oai on one pool of `threads` threads."""

    def __init__(self, threads=None, isa=None):
        self.threads = _threads(threads)
        self.isa = _isa(isa)
        self._pool = _Pool(self.threads, self.isa)
        # the C pool (a cffi pointer), for the C calls of kvref.native's own modules (the fused forward);
        # no cffi object leaves kvref.native. Valid while these kernels live (_Pool closes it when collected)
        self.c_pool = self._pool.ptr
        if self.isa == "auto":
            self.isa = _ISA_NAMES[lib.kvref_pool_isa(self._pool.ptr)]

    def __repr__(self):
        return f"Kernels(threads={self.threads}, isa={self.isa!r})"

    def embed(self, table, token_ids):
        # [V, E], [T] -> [T, E] float32
        gtype, data, V, E = check_weight(table, "table")
        ids = _positions(token_ids, "token_ids", None)
        if ids.size and (ids.min() < 0 or ids.max() >= V):
            bad = ids[(ids < 0) | (ids >= V)][0]
            raise TokenError(f"token id {int(bad)} is outside the vocabulary [0, {V})")
        out = np.empty((ids.shape[0], E), dtype=_F32)
        status = lib.kvref_embed(self._pool.ptr, ffi.from_buffer(data), gtype, data.nbytes, V, E,
                                 ffi.from_buffer("int64_t[]", ids), ids.shape[0],
                                 ffi.from_buffer("float[]", out))
        check_status(status, "embed")
        return out

    def matmul(self, x, w):
        # [T, K], [N, K] -> [T, N]
        return self._projection(lib.kvref_matmul, "matmul", x, w)

    def matmul_experts(self, x, w, experts):
        # [R, K], [X, N, K], [R] expert ids -> [R, N]: row r through expert experts[r]'s matrix, the rows of
        # each expert taken together (each expert named is read once, the others never)
        _array(x, "x", (_F32,), 2)
        gtype, data, X, N, K = check_expert_stack(w, "w")
        R = x.shape[0]
        if x.shape[1] != K:
            raise ShapeError(f"x has {x.shape[1]} columns but w is [{X}, {N}, {K}] (each expert needs {K})")
        ids = _positions(experts, "experts", R)
        if ids.size and (ids.min() < 0 or ids.max() >= X):
            bad = ids[(ids < 0) | (ids >= X)][0]
            raise ShapeError(f"experts holds {int(bad)}, outside the {X} experts [0, {X}) of w")
        y = np.empty((R, N), dtype=_F32)
        status = lib.kvref_matmul_experts(self._pool.ptr, ffi.from_buffer("float[]", x), R, K,
                                          ffi.from_buffer("int64_t[]", ids), ffi.from_buffer(data), gtype,
                                          data.nbytes, X, N, ffi.from_buffer("float[]", y))
        check_status(status, "matmul_experts")
        return y

    def matmul_int8(self, x, w):
        # [T, K], [N, K] -> [T, N]: the int8 activation mode's projection (see csrc/kvref.h):
        # rows of x rounded to 8-bit blocks of 32 for Q4_0/Q4_1/Q5_0/Q8_0 weights (and Q4_K/Q6_K from 4
        # rows on where the 8-bit GEMM runs), exact otherwise
        return self._projection(lib.kvref_matmul_int8, "matmul_int8", x, w)

    def _projection(self, c_function, name, x, w):
        # the checks and call shared by both projections; c_function has kvref_matmul's signature
        _array(x, "x", (_F32,), 2)
        gtype, data, N, K = check_weight(w, "w")
        T = x.shape[0]
        if x.shape[1] != K:
            raise ShapeError(f"x has {x.shape[1]} columns but w is [{N}, {K}] (y = x @ W.T needs {K})")
        y = np.empty((T, N), dtype=_F32)
        status = c_function(self._pool.ptr, ffi.from_buffer("float[]", x), T, K,
                            ffi.from_buffer(data), gtype, data.nbytes, N, ffi.from_buffer("float[]", y))
        check_status(status, name)
        return y

    def read_probe(self, buf) -> int:
        # uint8 [n], n a multiple of PROBE_UNIT, 64-byte aligned -> the wrapping sum of its 64-bit words,
        # every byte read once by the pool's threads with this instruction set's vector loads
        _array(buf, "buf", (np.dtype(np.uint8),), 1)
        if buf.size == 0 or buf.size % PROBE_UNIT:
            raise ShapeError(f"buf has {buf.size} bytes; the probe reads whole units of {PROBE_UNIT}")
        if buf.ctypes.data % 64:
            raise ShapeError("buf must start at a 64-byte boundary")
        out = ffi.new("uint64_t *")
        check_status(lib.kvref_read_probe(self._pool.ptr, ffi.from_buffer(buf), buf.size, out), "read_probe")
        return int(out[0])

    def rms_norm(self, x, weight, eps):
        # [T, E] (or [E]), [E] -> same shape as x
        _array(x, "x", (_F32,), (1, 2))
        _array(weight, "weight", (_F32, _F16), 1)
        E = x.shape[-1]
        if weight.shape[0] != E:
            raise ShapeError(f"weight has {weight.shape[0]} entries, x rows have {E}")
        if weight.dtype != _F32:
            weight = weight.astype(_F32)  # float16 gains widen exactly
        eps = _real(eps, "eps", minimum=0.0)
        out = np.empty_like(x)
        T = x.shape[0] if x.ndim == 2 else 1
        status = lib.kvref_rms_norm(self._pool.ptr, ffi.from_buffer("float[]", x), T, E,
                                    ffi.from_buffer("float[]", weight), eps,
                                    ffi.from_buffer("float[]", out))
        check_status(status, "rms_norm")
        return out

    def rope(self, x, positions, theta, scaling=None):
        # [T, nh, D], [T] -> [T, nh, D]; the spec's frequency table for (theta, scaling)
        _array(x, "x", (_F32,), 3)
        T, nh, D = x.shape
        if D % 2:
            raise ShapeError(f"x has head_dim {D}; RoPE rotates pairs, so it must be even")
        pos = _positions(positions, "positions", T)
        table = rope_table(D, theta, scaling)
        out = np.empty_like(x)
        status = lib.kvref_rope(self._pool.ptr, ffi.from_buffer("float[]", x), T, nh, D,
                                ffi.from_buffer("int64_t[]", pos), ffi.from_buffer("double[]", table),
                                ffi.from_buffer("float[]", out))
        check_status(status, "rope")
        return out

    def attention(self, q, k, v, q_positions, k_positions, scale=None, window=None, softcap=None, sinks=None):
        # [T, H, D], [S, Hkv, D], [S, Hkv, Dv], [T], [S], [H] or None -> [T, H, Dv]
        _array(k, "k", (_F32, _F16), 3)
        if _prefix_of(v, k):  # MLA's latent values: the first Dv elements of each key, read in place
            v, v_dim = k, v.shape[-1]
        else:
            _array(v, "v", (_F32, _F16), 3)
            if v.shape[:2] != k.shape[:2] or v.dtype != k.dtype:
                raise ShapeError(f"k and v must match: k {k.dtype} {k.shape}, v {v.dtype} {v.shape}")
            q, k, v, v_dim, scale = _common_width(q, k, v, scale)
        if k.shape[1] == 0:
            raise ShapeError(f"{q.shape[1]} query heads cannot be grouped over 0 kv heads")
        kv_type = lib.KVREF_TYPE_F32 if k.dtype == _F32 else lib.KVREF_TYPE_F16
        kv = KVDescriptor(k[None], v[None], None, None, kv_type, kv_type, None,  # one layer, key s in slot s
                          v_dim=v_dim)
        return self._attention(q, kv, k.shape[0], k.shape[1], q_positions, k_positions, scale=scale, window=window,
                               softcap=softcap, sinks=sinks)

    def cache_attention(self, q, q_positions, cache, layer, scale=None, window=None, softcap=None, sinks=None):
        # [T, H, D], [T], a cache of `length` positions [H] or None -> [T, H, D]
        """Attention of q over every stored position of `layer`, reading the cache in place (its
        cache.storage(): a slot store, with a block table for a paged cache, or per-layer rings),
        K/V in float32, float16, bfloat16 or int8. A ring layer's keys are its slots, holding the
        last of the cache.next_position positions written; a slot whose position the layer no
        longer holds (after a truncate, or a load of fewer rows) is never attended."""
        kv = cache_descriptor(cache)
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < cache.n_layers:
            raise ShapeError(f"layer {layer!r} out of range: the cache has {cache.n_layers} layers")
        ring = int(kv.ptr.layer_ring[layer]) if kv.ptr.layer_ring != ffi.NULL else 0
        k_positions = ring_positions(ring, cache.next_position) if ring else np.arange(cache.length)
        if ring:  # a later position than any query's: masked
            held = cache.layer_positions(layer)
            stale = k_positions < (held[0] if len(held) else cache.next_position)
            k_positions[stale] = np.iinfo(np.int64).max
        return self._attention(q, kv, k_positions.shape[0], cache.n_kv_heads, q_positions, k_positions, layer,
                               scale, window, softcap, sinks)

    def _attention(self, q, kv, S, Hkv, q_positions, k_positions, layer=0, scale=None, window=None, softcap=None, sinks=None):
        _array(q, "q", (_F32,), 3)
        T, H, D = q.shape
        c_scale, c_window, c_softcap = attention_scale(scale, D), attention_window(window), attention_softcap(softcap)
        c_sinks = ffi.NULL if sinks is None else ffi.from_buffer("float[]", attention_sinks(sinks, H))
        if D != kv.ptr.head_dim:
            raise ShapeError(f"q has head_dim {D}, the keys have {kv.ptr.head_dim}")
        if H % Hkv:
            raise ShapeError(f"{H} query heads cannot be grouped over {Hkv} kv heads (H % Hkv must be 0)")
        qp = _positions(q_positions, "q_positions", T)
        kp = _positions(k_positions, "k_positions", S)
        out = np.empty((T, H, kv.ptr.v_dim or D), dtype=_F32)  # [T, H, Dv]
        status = lib.kvref_attention(self._pool.ptr, ffi.from_buffer("float[]", q), T, H, D, kv.ptr, layer, S,
                                     ffi.from_buffer("int64_t[]", qp), ffi.from_buffer("int64_t[]", kp),
                                     c_window, c_softcap, c_scale, c_sinks, ffi.from_buffer("float[]", out))
        check_status(status, "attention")
        return out

    def swiglu(self, gate, up):
        # [T, F], [T, F] -> [T, F]  (any shape, elementwise)
        return self._glu(lib.kvref_swiglu, "swiglu", gate, up)

    def geglu(self, gate, up):
        # [T, F], [T, F] -> [T, F]  (any shape, elementwise)
        return self._glu(lib.kvref_geglu, "geglu", gate, up)

    def swiglu_oai(self, gate, up):
        # [T, F], [T, F] -> [T, F]  (any shape, elementwise)
        return self._glu(lib.kvref_swiglu_oai, "swiglu_oai", gate, up)

    def soft_cap(self, x, cap):
        # [...] -> [...]: cap * tanh(x / cap) elementwise, a non-finite x kept (kvref.spec.ops.soft_cap)
        _array(x, "x", (_F32,), None)
        out = np.empty_like(x)
        status = lib.kvref_soft_cap(self._pool.ptr, ffi.from_buffer("float[]", x), x.size,
                                    float(np.float32(_real(cap, "cap", minimum_exclusive=0.0))),
                                    ffi.from_buffer("float[]", out))
        check_status(status, "soft_cap")
        return out

    def route(self, logits, selection_bias, router):
        # [T, X] router logits, [X] or None, kvref.spec.ops.Router -> experts [T, k] int64 (best first), weights [T, k]
        _array(logits, "logits", (_F32,), 2)
        T, X = logits.shape
        router_desc = router_descriptor(router, X)
        bias = ffi.NULL
        if selection_bias is not None:
            selection_bias = selection_vector(selection_bias, X)
            bias = ffi.from_buffer("float[]", selection_bias)
        experts = np.empty((T, router.n_used), dtype=_I64)
        weights = np.empty((T, router.n_used), dtype=_F32)
        status = lib.kvref_route(ffi.from_buffer("float[]", logits), T, bias, router_desc,
                                 ffi.from_buffer("int64_t[]", experts), ffi.from_buffer("float[]", weights))
        check_status(status, "route")
        return experts, weights

    def _glu(self, c_function, name, gate, up):
        _array(gate, "gate", (_F32,), None)
        _array(up, "up", (_F32,), None)
        if gate.shape != up.shape:
            raise ShapeError(f"gate {gate.shape} and up {up.shape} must have the same shape")
        out = np.empty_like(gate)
        status = c_function(self._pool.ptr, ffi.from_buffer("float[]", gate), ffi.from_buffer("float[]", up),
                            gate.size, ffi.from_buffer("float[]", out))
        check_status(status, name)
        return out


# ---- module-level kernel set (what the decoder calls as `ops.<name>`) --------------------

def embed(table, token_ids, *, threads=None):
    # [V, E], [T] -> [T, E]
    return kernels(threads).embed(table, token_ids)


def matmul(x, w, *, threads=None):
    # [T, K], [N, K] -> [T, N]
    return kernels(threads).matmul(x, w)


def matmul_experts(x, w, experts, *, threads=None):
    # [R, K], [X, N, K], [R] -> [R, N]
    return kernels(threads).matmul_experts(x, w, experts)


def rms_norm(x, weight, eps, *, threads=None):
    # [T, E], [E] -> [T, E]
    return kernels(threads).rms_norm(x, weight, eps)


def rope(x, positions, theta, scaling=None, *, threads=None):
    # [T, nh, D], [T] -> [T, nh, D]
    return kernels(threads).rope(x, positions, theta, scaling)


def attention(q, k, v, q_positions, k_positions, scale=None, window=None, softcap=None, sinks=None, *, threads=None):
    # [T, H, D], [S, Hkv, D], [S, Hkv, D], [T], [S], [H] or None -> [T, H, D]
    return kernels(threads).attention(q, k, v, q_positions, k_positions, scale, window, softcap, sinks)


def swiglu(gate, up, *, threads=None):
    # [T, F], [T, F] -> [T, F]
    return kernels(threads).swiglu(gate, up)


def geglu(gate, up, *, threads=None):
    # [T, F], [T, F] -> [T, F]
    return kernels(threads).geglu(gate, up)


def route(logits, selection_bias, router, *, threads=None):
    # [T, X], [X] or None, Router -> [T, k] int64, [T, k]
    return kernels(threads).route(logits, selection_bias, router)


def swiglu_oai(gate, up, *, threads=None):
    # [T, F], [T, F] -> [T, F]
    return kernels(threads).swiglu_oai(gate, up)


def soft_cap(x, cap, *, threads=None):
    # [...] -> [...]
    return kernels(threads).soft_cap(x, cap)


__all__ = ["Kernels", "KVRefError", "WEIGHT_TYPES", "attention", "best_isa", "embed", "geglu", "kernels",
           "matmul", "matmul_experts", "reset_default", "rms_norm", "rope", "route", "soft_cap", "supported_isas", "swiglu",
           "swiglu_oai"]
