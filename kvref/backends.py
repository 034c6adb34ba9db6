"""Which kernel set runs the decoder: the NumPy spec, or the native C module.

Both provide the same names (embed, matmul, matmul_experts, rms_norm, rope, attention, swiglu, geglu) with
the same meaning; the decoder is shared. "auto" takes the native kernels when they are built and the model
is float32 (they compute in float32), and says once when it has to fall back to the spec.

`fused_forward` gives a Model on the native backend its fused C forward (kvref.native.fused: a whole
prefill or decode step in one C call, checked against the shared decoder), or the reason there is none
(the spec backend, weights C cannot read); the model then chooses, per cache, which executor runs
(kvref.executor).
"""

from __future__ import annotations

import os
import warnings

from . import native
from .config import MOE_FIELDS
from .errors import BackendError, DTypeError, KVRefError
from .spec import ops as spec_ops

BACKENDS = ("auto", "numpy", "c")
# how the fused C forward feeds its projections: exact float32, or rounded to 8-bit blocks (kvref.native.fused);
# "auto": int8 where the C forward runs, and the spec's own (unrounded) elsewhere
ACTIVATION_MODES = ("auto", "float32", "int8")
DEFAULT_ACTIVATIONS = "float32"  # the API's, unless KVREF_ACTIVATIONS or the caller says otherwise: the reference
# the programs' (kvref run, chat, serve, bench, perplexity): the fastest mode at least as accurate as
# llama.cpp's own 8-bit path on the same file (docs/benchmarks.md, "What 8-bit activations cost")
PROGRAM_ACTIVATIONS = "auto"
# the ModelConfig family fields the native kernels compute, named one by one: a field added for a new family
# stays on the spec until its native side exists and it is listed here. The fused C forward computes them
# all but latent attention, which the native kernels run
NATIVE_FAMILY_FIELDS = ("qkv_bias", "qk_norm", "sandwich_norms", "embedding_scale", "activation", "attention_scale",
                        "layer_windows", "rope_local_theta", "rope_scaling", "attn_softcap", "final_softcap",
                        "nope_layers", "attention_sinks", "attention_out_bias", *MOE_FIELDS, "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                        "mla_form")
NATIVE_DTYPES = ("float32",)
# K/V storage types each backend runs: the spec's attention reads float64/32/16 and the cache decodes
# bfloat16, int8 and kivi4 to float32 for it; the C forward reads its types in place (any layout or
# type it does not take in place, such as the window or kivi4, is decoded for the native attention
# kernel the same way)
KV_DTYPES = {"numpy": ("float64", "float32", "float16", "bfloat16", "int8", "kivi4"),
             "c": ("float32", "float16", "bfloat16", "int8", "kivi4")}
_fallback_reported = []  # which of the reasons to run the spec were said already


def native_problem(config) -> str | None:
    """Why the native kernels cannot run `config` (None when they can): it sets a family field
    (ModelConfig.family_fields) they do not compute."""
    fields = [] if config is None else [f for f in config.family_fields() if f not in NATIVE_FAMILY_FIELDS]
    if not fields:
        return None
    return f"the native kernels do not compute {', '.join(fields)}, which this model sets"


def resolve(backend: str, dtype: str = "float32", config=None) -> str:
    """The concrete backend ("numpy" or "c") for a requested one; KVREF_BACKEND overrides "auto"."""
    if backend not in BACKENDS:
        raise BackendError(f"backend {backend!r} is unknown; expected one of {BACKENDS}")
    if backend == "auto":
        backend = os.environ.get("KVREF_BACKEND", "auto")
        if backend not in BACKENDS:
            raise BackendError(f"KVREF_BACKEND={backend!r} is unknown; expected one of {BACKENDS}")
        if backend == "numpy" and "KVREF_BACKEND" not in _fallback_reported:
            _fallback_reported.append("KVREF_BACKEND")  # the spec is far slower: say once why it runs
            warnings.warn("KVREF_BACKEND=numpy: kvref runs on the NumPy spec path", RuntimeWarning, stacklevel=3)
    if backend == "auto":
        if dtype not in NATIVE_DTYPES:
            return "numpy"  # the exactness path: float64 runs only in the spec
        if native_problem(config) is not None:
            return "numpy"  # a family whose fields only the spec computes so far (Model.backend says which)
        if native.available():
            return "c"
        if "unavailable" not in _fallback_reported:
            _fallback_reported.append("unavailable")
            warnings.warn(f"kvref runs on the NumPy spec path: {native.unavailable_reason()}", RuntimeWarning,
                          stacklevel=3)
        return "numpy"
    if backend == "c":
        if not native.available():
            raise BackendError(native.unavailable_reason())
        if dtype not in NATIVE_DTYPES:
            raise DTypeError(f"the native backend computes in {NATIVE_DTYPES}; model dtype {dtype!r} needs "
                             "backend='numpy'")
        problem = native_problem(config)
        if problem is not None:
            raise BackendError(f"{problem}; use backend='numpy'")
    return backend


def kernels(backend: str, threads: int | None = None):
    """The kernel set of a resolved backend; `threads` sizes the native thread pool."""
    if backend == "numpy":
        return spec_ops
    from .native import ops as native_ops

    return native_ops.kernels(threads=threads)


def default_activations(default: str = DEFAULT_ACTIVATIONS) -> str:
    """KVREF_ACTIVATIONS (auto | float32 | int8), else `default`."""
    name = os.environ.get("KVREF_ACTIVATIONS", "").strip().lower() or default
    if name not in ACTIVATION_MODES:
        raise BackendError(f"KVREF_ACTIVATIONS={name!r} is unknown; expected one of {ACTIVATION_MODES}")
    return name


def fused_forward(backend: str, config, weights, activations: str | None = None):
    """(FusedForward, None) for a Model of the native backend, or (None, why not): the spec backend, or
    weights the C forward cannot take (a type the native kernels do not read, a non-contiguous matrix),
    which then run the shared decoder over the native kernels.

    activations: "float32" (exact), "int8" (projections round their inputs to 8-bit blocks; see
    kvref.native.fused) or "auto" (int8 here); None: KVREF_ACTIVATIONS, else DEFAULT_ACTIVATIONS. The
    spec computes in the model dtype only, so "int8" asked of it is an error.
    """
    if activations is not None and activations not in ACTIVATION_MODES:
        raise BackendError(f"activations={activations!r} is unknown; expected one of {ACTIVATION_MODES}")
    if backend != "c":
        if activations == "int8":
            raise BackendError("activations='int8' is the fused C forward's mode; the NumPy spec computes every "
                               "projection on unrounded activations (backend='c', or 'auto')")
        return None, "this model runs the NumPy spec"
    from .native import fused

    mode = activations or default_activations()
    try:
        return fused.FusedForward(config, weights, "int8" if mode == "auto" else mode), None
    except KVRefError as exc:
        if activations is not None or isinstance(exc, BackendError):
            raise  # a mode was asked for explicitly, or KVREF_ACTIVATIONS is wrong: say so
        return None, f"the fused C forward cannot take this model's weights ({exc})"
