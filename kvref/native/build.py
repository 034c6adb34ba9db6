"""cffi builder for kvref's native kernels (out-of-line API mode): `kvref.native._kvref`.

The cdef is csrc/kvref.h itself, with its preprocessor lines (and the C++ guard they enclose)
removed, so the header and the binding cannot drift apart.

Build
    pip install .            # or: pip wheel .   (setup.py wires this file through cffi_modules)
    pip install -e .         # editable; the extension is built in place
    python kvref/native/build.py               # in-place development build, no pip involved

The default build is -O3 for baseline x86-64 (no -march=native): the AVX2 and AVX-512 kernels
carry target attributes and the pool picks them at run time from CPUID, so one wheel runs on any
x86-64 CPU. On other architectures the x86 files compile to nothing and the scalar C kernels run.

Sanitizer build (AddressSanitizer + UndefinedBehaviorSanitizer)
    KVREF_SANITIZE=1 python kvref/native/build.py
    LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
        UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 python -m pytest tests/test_native.py
  Python itself is not built with ASan, so the runtime must be preloaded; leak detection is off
  because the interpreter keeps objects alive until exit. UBSan stops at the first error
  (-fno-sanitize-recover), so a clean run is a passing run. Rebuild without KVREF_SANITIZE
  afterwards (the sanitized .so cannot be imported without the preload).

Environment
    KVREF_SANITIZE=1     build with -fsanitize=address,undefined -O1 -g
    KVREF_CFLAGS="..."   extra compiler flags appended to the default set
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CSRC = ROOT / "csrc"
SOURCES = ["pool.c", "scalar.c", "kernels_avx2.c", "kernels_avx512.c", "kernels_neon.c", "matmul.c", "attention.c",
           "elementwise.c", "kvcache.c", "forward.c", "moe.c"]
MODULE = "kvref.native._kvref"


def cdef_from_header(text: str) -> str:
    """The declarations of kvref.h as cffi's cdef wants them: no preprocessor lines, no C++ guard."""
    out, skipping = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#ifdef __cplusplus"):
            skipping = True
            continue
        if skipping:
            if stripped.startswith("#endif"):
                skipping = False
            continue
        if stripped.startswith("#"):
            continue
        out.append(line)
    return "\n".join(out)


def _rel(path: Path) -> str:
    # setuptools wants source paths relative to the project root (it mirrors them under build/)
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)


def compiler_flags(msvc: bool = sys.platform == "win32"):
    """(cflags, ldflags) for the C sources: KVREF_SANITIZE=1 builds with ASan/UBSan; KVREF_CFLAGS adds flags.

    On Windows setuptools compiles with MSVC, which takes none of the GNU flags: it gets C11 with MSVC's
    C11 atomics (Visual Studio 2022 17.5 or later) and /O2. MSVC defines neither __GNUC__ nor __clang__,
    so the AVX2 and AVX-512 files compile to nothing there (internal.h, KVREF_X86) and such a module runs
    the scalar kernels; GCC and Clang builds for Windows (mingw-w64, as tests/harness builds the core and
    runs it under wine) compile every kernel table. The sanitizer build needs GCC or Clang."""
    if msvc:
        if os.environ.get("KVREF_SANITIZE", "") not in ("", "0"):
            raise RuntimeError("KVREF_SANITIZE=1 needs GCC or Clang (-fsanitize), not MSVC")
        return ["/std:c11", "/experimental:c11atomics", "/O2", "/W3", *os.environ.get("KVREF_CFLAGS", "").split()], []
    if os.environ.get("KVREF_SANITIZE", "") not in ("", "0"):
        cflags = ["-std=c11", "-O1", "-g", "-fno-omit-frame-pointer",
                  "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
        ldflags = ["-fsanitize=address,undefined"]
    else:
        cflags = ["-std=c11", "-O3", "-fvisibility=hidden"]
        ldflags = []
    cflags += ["-Wall", "-Wextra", "-Wno-unused-parameter"]
    cflags += os.environ.get("KVREF_CFLAGS", "").split()
    return cflags, ldflags


def make_builder(absolute_paths: bool = False) -> FFI:
    """The FFI builder. setuptools runs it from the project root and wants relative source paths;
    FFI.compile() changes into its tmpdir first, so in-place builds need absolute ones."""
    path = str if absolute_paths else _rel
    builder = FFI()
    builder.cdef(cdef_from_header((CSRC / "kvref.h").read_text()))
    cflags, ldflags = compiler_flags()
    builder.set_source(
        MODULE,
        '#include "kvref.h"',
        sources=[path(CSRC / name) for name in SOURCES],
        include_dirs=[path(CSRC)],
        depends=[path(CSRC / name) for name in ("kvref.h", "internal.h", "platform.h")],
        extra_compile_args=cflags,
        extra_link_args=ldflags,
        libraries=["m", "pthread"] if sys.platform != "win32" else [],
    )
    return builder


ffibuilder = make_builder()


def build_in_place() -> Path:
    """Compile into build/cffi and copy the extension next to this file (development builds)."""
    tmp = ROOT / "build" / "cffi"
    tmp.mkdir(parents=True, exist_ok=True)
    built = Path(make_builder(absolute_paths=True).compile(tmpdir=str(tmp), verbose=True))
    for stale in HERE.glob("_kvref*.so"):  # e.g. an abi3 build from `pip install -e .` would shadow it
        stale.unlink()
    target = HERE / built.name
    shutil.copy2(built, target)
    return target


if __name__ == "__main__":
    print(build_in_place())
