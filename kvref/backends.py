"""Which kernel set runs the decoder: the NumPy spec, or the native C module when it is built."""

from __future__ import annotations

from .errors import BackendError
from .spec import ops as spec_ops

BACKENDS = ("auto", "numpy", "c")


def resolve(backend: str) -> str:
    """The concrete backend for a requested one ("auto" picks the fastest available)."""
    if backend not in BACKENDS:
        raise BackendError(f"backend {backend!r} is unknown; expected one of {BACKENDS}")
    if backend == "c":
        raise BackendError("the native backend is not part of this build yet; use backend='numpy'")
    return "numpy"


def kernels(backend: str):
    """The module whose functions (embed, matmul, rms_norm, rope, attention, swiglu) the decoder calls."""
    return spec_ops
