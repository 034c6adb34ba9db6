"""The native module's build (kvref/native/build.py) beyond this machine's x86-64: the same C sources
and flags build for aarch64, where the x86 kernel files compile to nothing and the NEON kernel
tables join the scalar one (issue 4: one source tree that still builds on aarch64; issue 25: NEON).
Whether those kernels compute the right values is tests/harness's, under qemu-aarch64."""

import shutil
import subprocess

import pytest

from kvref.native import build

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


@pytest.mark.skipif(CROSS is None or NM is None or OBJDUMP is None, reason="needs the aarch64-linux-gnu cross toolchain")
def test_the_c_sources_build_for_aarch64_with_the_neon_tables_and_no_x86_kernels(tmp_path, monkeypatch):
    for name in ("KVREF_CFLAGS", "KVREF_SANITIZE"):  # host-specific flags (-march=native, ASan) stay out
        monkeypatch.delenv(name, raising=False)
    cflags, ldflags = build.compiler_flags()
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
        "sdot": {"attn_score_dotprod", "packed_dot_dotprod", "gemm_q8_dotprod"}, "smmla": {"packed_dot_i8mm", "gemm_q8_i8mm"}}
    api = set().union(*(defined_symbols(obj) for obj in objects.values()))
    assert {"kvref_pool_create", "kvref_forward", "kvref_attention", "kvref_matmul"} <= api
    assert library.stat().st_size > 0
