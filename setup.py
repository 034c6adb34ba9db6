"""setuptools entry point.

Metadata lives in pyproject.toml. This file exists for the native module: the cffi builder in
kvref/native/ is wired in here through `cffi_modules` when the C kernels land.
"""

from setuptools import setup

setup()
