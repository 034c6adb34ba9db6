"""setuptools entry point.

Metadata lives in pyproject.toml. This file exists for the native module: the cffi builder in
kvref/native/build.py (out-of-line API mode) compiles csrc/ into kvref.native._kvref.
"""

from setuptools import setup

setup(
    cffi_modules=["kvref/native/build.py:ffibuilder"],
    # cffi compiles against the stable ABI (the module never includes NumPy or version-specific
    # headers), so one wheel per platform serves every CPython >= 3.10
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
