"""Build and run the C kernel harness (tests/harness/kernels.c) for a target: this machine, aarch64 Linux
(a static binary, run under qemu-aarch64) or Windows x86-64 (mingw-w64, run under wine). The sources and
flags are kvref/native/build.py's, so the harness checks the kernels as the extension compiles them.

    python tests/harness/build.py                          # native
    python tests/harness/build.py aarch64 windows          # cross builds, run under emulation
    QEMU_CPU=cortex-a53 python tests/harness/build.py aarch64

Each run prints one line per (kernel table, kernel, type) and exits non-zero on any mismatch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from kvref.native import build as native_build  # noqa: E402


@dataclass(frozen=True)
class Target:
    compiler: str
    flags: tuple[str, ...]     # compile and link flags beyond the extension's
    libraries: tuple[str, ...]
    runner: tuple[str, ...]    # the emulator the binary runs under (nothing: natively)
    install: str               # how to get the compiler and the runner on Debian/Ubuntu
    exe: str = "kernels"


TARGETS = {
    "native": Target(os.environ.get("CC", "gcc"), (), ("-lm", "-lpthread"), (), "apt-get install gcc"),
    # static: no aarch64 loader or libc on this machine, and no binfmt to find one
    "aarch64": Target("aarch64-linux-gnu-gcc", ("-static",), ("-lm", "-lpthread"), ("qemu-aarch64",),
                      "apt-get install gcc-aarch64-linux-gnu qemu-user"),
    # static: the binary needs no mingw DLL under wine
    "windows": Target("x86_64-w64-mingw32-gcc", ("-static",), (), ("wine",),
                      "apt-get install mingw-w64 wine64", "kernels.exe"),
}


def missing_tools(target: str) -> list[str]:
    t = TARGETS[target]
    return [tool for tool in (t.compiler, *t.runner[:1]) if shutil.which(tool) is None]


def cflags() -> list[str]:
    """The extension's release flags (no sanitizer, no KVREF_CFLAGS: those are host-specific), without
    -fvisibility, which means nothing to an executable."""
    env = {name: os.environ.pop(name) for name in ("KVREF_SANITIZE", "KVREF_CFLAGS") if name in os.environ}
    try:
        flags, _ = native_build.compiler_flags()
    finally:
        os.environ.update(env)
    return [f for f in flags if not f.startswith("-fvisibility")]


def build(target: str, out_dir: Path) -> Path:
    """Compile csrc/*.c and the harness for `target` into out_dir, one object per source (in parallel),
    warnings as errors; returns the executable."""
    t = TARGETS[target]
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = [native_build.CSRC / name for name in native_build.SOURCES] + [HERE / "kernels.c"]
    common = [t.compiler, *cflags(), "-Werror", *t.flags, "-I", str(native_build.CSRC)]

    def compile_one(source: Path) -> Path:
        obj = out_dir / f"{source.name}.o"
        # the harness itself only loops and compares: -O1 compiles it in a quarter of -O3's time
        speed = ["-O1"] if source.parent == HERE else []
        subprocess.run([*common, *speed, "-c", str(source), "-o", str(obj)], check=True)
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, sources))
    exe = out_dir / t.exe
    subprocess.run([t.compiler, *t.flags, *map(str, objects), *t.libraries, "-o", str(exe)], check=True)
    return exe


def run(target: str, exe: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a built harness (under its target's emulator); its report is the stdout."""
    full_env = {**os.environ, "WINEDEBUG": "-all", **(env or {})}
    return subprocess.run([*TARGETS[target].runner, str(exe)], capture_output=True, text=True, env=full_env,
                          timeout=600)


def main(argv: list[str]) -> int:
    targets = argv or ["native"]
    status = 0
    for target in targets:
        if missing := missing_tools(target):
            print(f"{target}: {', '.join(missing)} not found ({TARGETS[target].install})")
            status = 1
            continue
        with tempfile.TemporaryDirectory() as tmp:
            exe = build(target, Path(tmp))
            result = run(target, exe)
        print(f"== {target}{' QEMU_CPU=' + os.environ['QEMU_CPU'] if target == 'aarch64' and 'QEMU_CPU' in os.environ else ''}")
        print(result.stdout, end="")
        print(result.stderr, end="", file=sys.stderr)
        status |= result.returncode != 0
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
