"""The native module's build (kvref/native/build.py) beyond this machine's x86-64: the same C sources
and flags build for aarch64, where the x86 kernel files compile to nothing and the scalar kernels
are the kernel set (issue 4: one source tree that still builds on aarch64)."""

import shutil
import subprocess

import pytest

from kvref.native import build

CROSS = shutil.which("aarch64-linux-gnu-gcc")
NM = shutil.which("aarch64-linux-gnu-nm")


def defined_symbols(obj) -> set[str]:
    out = subprocess.run([NM, "--defined-only", "-g", str(obj)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@pytest.mark.skipif(CROSS is None or NM is None, reason="needs the aarch64-linux-gnu cross toolchain")
def test_the_c_sources_build_for_aarch64_with_only_the_portable_kernels(tmp_path, monkeypatch):
    for name in ("KVREF_CFLAGS", "KVREF_SANITIZE"):  # host-specific flags (-march=native, ASan) stay out
        monkeypatch.delenv(name, raising=False)
    cflags, ldflags = build.compiler_flags(msvc=False)
    objects = {}
    for name in build.SOURCES:
        objects[name] = tmp_path / f"{name}.o"
        subprocess.run([CROSS, *cflags, "-Werror", "-fPIC", "-I", str(build.CSRC), "-c", str(build.CSRC / name),
                        "-o", str(objects[name])], check=True)
    library = tmp_path / "libkvref.so"
    # --no-undefined: every symbol the sources use is defined by them, libc, libm or pthreads
    subprocess.run([CROSS, "-shared", "-Wl,--no-undefined", *map(str, objects.values()), *ldflags, "-lm", "-lpthread",
                    "-o", str(library)], check=True)
    assert "kvref_kernels_scalar" in defined_symbols(objects["scalar.c"])
    assert defined_symbols(objects["kernels_avx2.c"]) == defined_symbols(objects["kernels_avx512.c"]) == set()
    api = set().union(*(defined_symbols(obj) for obj in objects.values()))
    assert {"kvref_pool_create", "kvref_forward", "kvref_attention", "kvref_matmul"} <= api
    assert library.stat().st_size > 0


def test_msvc_gets_msvc_flags_and_no_gnu_ones(monkeypatch):
    # setuptools compiles with MSVC on Windows: a GNU flag there (-O3, -Wall, -fvisibility) is an error or
    # silently means something else
    monkeypatch.delenv("KVREF_CFLAGS", raising=False)
    monkeypatch.delenv("KVREF_SANITIZE", raising=False)
    cflags, ldflags = build.compiler_flags(msvc=True)
    assert {"/std:c11", "/experimental:c11atomics", "/O2"} <= set(cflags)
    assert not [flag for flag in cflags + ldflags if flag.startswith("-")]
    monkeypatch.setenv("KVREF_SANITIZE", "1")
    with pytest.raises(RuntimeError, match="GCC or Clang"):
        build.compiler_flags(msvc=True)
