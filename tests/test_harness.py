"""The C kernel harness (tests/harness/kernels.c): every kernel table against the scalar table and the
pool through kvref.h, built and run on this machine, for aarch64 under qemu-aarch64 once per dispatch path
(QEMU_CPU=max has dotprod and i8mm, neoverse-n1 dotprod only, cortex-a53 neither), and for Windows
(mingw-w64) under wine, which runs it on this CPU: every x86 table this CPU has. A target whose compiler
or emulator is missing is skipped with the command that installs it (tests.conftest.require_tools)."""

import sys
from pathlib import Path

import pytest

from tests.conftest import require_tools

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
import build as harness  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """target -> the harness built for it: every target whose tools are here, built together on first use
    (the compilers of different targets overlap)"""
    available = [t for t in harness.TARGETS if not harness.missing_tools(t)]
    exes = {}

    def get(target):
        t = harness.TARGETS[target]
        require_tools(t.compiler, *t.runner, install=t.install)
        if not exes:
            exes.update(harness.build(available, tmp_path_factory.mktemp("harness")))
        return exes[target]

    return get


def assert_all_ok(result, tables):
    report = result.stdout
    assert result.returncode == 0, report + result.stderr
    assert "FAIL" not in report and report.rstrip().endswith("all ok"), report
    # each table this CPU (or emulated CPU) has was checked kernel by kernel (the scalar table is the
    # reference), and the best one's pool
    for isa in tables:
        assert f"ok    {isa} vec_dot q4_0 " in report and f"ok    {isa} attn.score f16/f16 " in report, report
    best = report.splitlines()[0].removeprefix("best instruction set: ")
    assert best == (tables[-1] if tables else "scalar"), report
    assert f"ok    {best} pool threads 1/2/4 matmul " in report, report
    assert "ok    api wrong arguments status " in report, report
    assert "ok    pack round trip q4_k " in report, report


def x86_tables():
    from kvref.native import ops

    return [isa for isa in ops.supported_isas() if isa != "scalar"]


def test_every_kernel_table_of_this_machine_equals_the_scalar_table_within_its_bounds(built):
    assert_all_ok(harness.run("native", built("native")), x86_tables())


@pytest.mark.parametrize("cpu, tables", [("max", ["neon", "neon_dotprod", "neon_i8mm"]),
                                         ("neoverse-n1", ["neon", "neon_dotprod"]), ("cortex-a53", ["neon"])])
def test_every_aarch64_kernel_table_equals_the_scalar_table_under_qemu(built, cpu, tables):
    assert_all_ok(harness.run("aarch64", built("aarch64"), {"QEMU_CPU": cpu}), tables)


def test_every_kernel_table_of_the_windows_build_equals_the_scalar_table_under_wine(built):
    # the Win32 thread pool (csrc/platform.h), _aligned_malloc, and the CPU detection of a Windows process
    assert_all_ok(harness.run("windows", built("windows")), x86_tables())
