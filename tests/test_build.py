"""The native module's build (kvref/native/build.py) beyond this machine's x86-64: the same C sources
and flags build for aarch64, where the x86 kernel files compile to nothing and the NEON kernel
tables join the scalar one (issue 4: one source tree that still builds on aarch64; issue 25: NEON;
whether those kernels compute the right values is tests/harness's, under qemu-aarch64); Clang (macOS's
compiler) compiles them warning-clean for x86-64, aarch64 and Windows, and they call nothing Linux-only
outside a Linux guard; MSVC gets MSVC's flags."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvref.native import build
from tests.conftest import require_tools

CLANG = shutil.which("clang")
CROSS = shutil.which("aarch64-linux-gnu-gcc")
NM = shutil.which("aarch64-linux-gnu-nm")
OBJDUMP = shutil.which("aarch64-linux-gnu-objdump")


def defined_symbols(obj) -> set[str]:
    out = subprocess.run([NM, "--defined-only", "-g", str(obj)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def instructions_by_function(obj, mnemonics) -> dict[str, set[str]]:
    """The functions of obj whose disassembly uses each of `mnemonics`."""
    out = subprocess.run([OBJDUMP, "-d", str(obj)], check=True, capture_output=True, text=True).stdout
    found, function = {m: set() for m in mnemonics}, None
    for line in out.splitlines():
        if line.endswith(">:"):
            function = line.split("<", 1)[1][:-2]
        elif "\t" in line and (fields := line.split("\t")) and len(fields) > 2 and fields[2].split()[0] in found:
            found[fields[2].split()[0]].add(function)
    return found


def test_the_c_sources_build_for_aarch64_with_the_neon_tables_and_no_x86_kernels(tmp_path, monkeypatch):
    require_tools("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-nm", "aarch64-linux-gnu-objdump",
                  install="apt-get install gcc-aarch64-linux-gnu")
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
    assert defined_symbols(objects["kernels_neon.c"]) == {"kvref_kernels_neon", "kvref_kernels_neon_dotprod",
                                                          "kvref_kernels_neon_i8mm"}
    # one build for every ARMv8-A core: sdot and smmla only in the functions the dotprod and i8mm tables hold
    # (their target attributes), never in the plain NEON table's, which a Cortex-A53 runs
    assert instructions_by_function(objects["kernels_neon.c"], ("sdot", "smmla")) == {
        "sdot": {"attn_score_dotprod", "packed_dot_dotprod", "gemm_q8_dotprod"},
        "smmla": {"packed_dot_i8mm", "gemm_q8_i8mm"}}
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


# clang targets: this machine; aarch64, Apple silicon's architecture (with Debian's aarch64 headers: there
# is no macOS SDK here); Windows (mingw-w64's headers), as clang-cl and mingw builds compile it. Each: its
# --target, the cross gcc whose headers it borrows, and that gcc's package.
CLANG_TARGETS = {"host": (None, None, None),
                 "aarch64": ("aarch64-linux-gnu", "aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu"),
                 "windows": ("x86_64-w64-mingw32", "x86_64-w64-mingw32-gcc", "mingw-w64")}


@pytest.mark.parametrize("name", CLANG_TARGETS)
def test_the_c_core_compiles_warning_clean_with_clang(name, monkeypatch):
    target, headers, package = CLANG_TARGETS[name]
    require_tools("clang", *filter(None, [headers]), install=" ".join(filter(None, ["apt-get install clang", package])))
    for variable in ("KVREF_CFLAGS", "KVREF_SANITIZE"):
        monkeypatch.delenv(variable, raising=False)
    cflags, _ = build.compiler_flags(msvc=False)
    for source in build.SOURCES:
        subprocess.run([CLANG, *([f"--target={target}"] if target else []), *cflags, "-Werror", "-fsyntax-only",
                        "-I", str(build.CSRC), str(build.CSRC / source)], check=True)


# calls and names only Linux has (macOS and the BSDs are POSIX without them): CPU affinity and counts,
# auxiliary vector (hardware capabilities), futexes, /proc, Linux mmap and madvise flags
LINUX_ONLY = {"getauxval", "sched_getaffinity", "sched_setaffinity", "pthread_setaffinity_np", "CPU_COUNT", "prctl",
              "syscall", "futex", "get_nprocs", "sysinfo", "memfd_create", "MAP_POPULATE", "MAP_HUGETLB",
              "MADV_HUGEPAGE", "proc"}


def identifiers_from_csrc(preprocessed: str) -> set[str]:
    """The identifiers of the preprocessed lines that come from csrc/ (the linemarkers name each line's
    file), not from the system headers."""
    names, ours = set(), False
    for line in preprocessed.splitlines():
        if marker := re.match(r'# \d+ "([^"]*)"', line):
            ours = Path(marker.group(1)).resolve().parent == build.CSRC.resolve()
        elif ours:
            names |= set(re.findall(r"[A-Za-z_]\w*", line))  # string literals too: "/proc/cpuinfo" names proc
    return names


def test_the_c_core_calls_nothing_linux_only_outside_a_linux_guard():
    require_tools("clang", install="apt-get install clang")
    # preprocessed as a POSIX system that is not Linux sees it (macOS): the Linux macros undefined
    for name in build.SOURCES:
        out = subprocess.run([CLANG, "-std=c11", "-E", "-U__linux__", "-U__linux", "-Ulinux", "-U__gnu_linux__",
                              "-I", str(build.CSRC), str(build.CSRC / name)], check=True, capture_output=True,
                             text=True).stdout
        assert not identifiers_from_csrc(out) & LINUX_ONLY, name
