"""setuptools entry point.

Metadata lives in pyproject.toml. This file exists for the native module: the cffi builder in
kvref/native/build.py (out-of-line API mode) compiles csrc/ into kvref.native._kvref.
"""

from setuptools import setup

setup(cffi_modules=["kvref/native/build.py:ffibuilder"])
