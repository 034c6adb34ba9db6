"""The native path: C kernels (csrc/) built with cffi, behind thin validating wrappers (ops.py).

`available()` says whether the compiled module `kvref.native._kvref` imports; when it does not
(no compiler at install time, a sanitizer build without its runtime preloaded, another platform),
`unavailable_reason()` says why, and kvref runs on the NumPy spec path.
"""

from __future__ import annotations

# the most threads a native pool runs (csrc's KVREF_MAX_THREADS); known without the built module
MAX_THREADS = 1024

try:
    from . import _kvref  # noqa: F401  (the compiled extension)
except ImportError as exc:  # not built, or built for another interpreter
    _kvref = None
    _REASON = (f"the native module kvref.native._kvref is not built or cannot be loaded ({exc}); "
               "build it with `pip install .` or `python kvref/native/build.py`")
else:
    _REASON = None


def available() -> bool:
    """True when the compiled kernels can be used."""
    return _kvref is not None


def unavailable_reason() -> str | None:
    """Why the native kernels cannot be used, or None when they can."""
    return _REASON


__all__ = ["MAX_THREADS", "available", "unavailable_reason"]
