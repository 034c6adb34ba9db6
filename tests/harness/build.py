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
    return [tool for tool in (t.compiler, *t.runner) if shutil.which(tool) is None]


def cflags() -> list[str]:
    """The extension's release flags (no sanitizer, no KVREF_CFLAGS: those are host-specific), without
    -fvisibility, which means nothing to an executable."""
    env = {name: os.environ.pop(name) for name in ("KVREF_SANITIZE", "KVREF_CFLAGS") if name in os.environ}
    try:
        flags, _ = native_build.compiler_flags(msvc=False)
    finally:
        os.environ.update(env)
    return [f for f in flags if not f.startswith("-fvisibility")]


def build(targets: list[str], out_dir: Path) -> dict[str, Path]:
    """Compile csrc/*.c and the harness for each target into out_dir/<target>, warnings as errors, every
    (target, source) on its own process and the slowest first (the SIMD kernel files; the aarch64 build
    compiles them to nothing), so the targets' builds overlap; link each. Returns target -> executable."""
    sources = [native_build.CSRC / name for name in native_build.SOURCES] + [HERE / "kernels.c"]
    jobs = sorted(((t, src) for t in targets for src in sources),
                  key=lambda job: (job[0] == "aarch64", not job[1].name.startswith("kernels_")))

    def compile_one(job) -> Path:
        target, source = job
        t = TARGETS[target]
        obj = out_dir / target / f"{source.name}.o"
        obj.parent.mkdir(parents=True, exist_ok=True)
        # the harness itself only loops and compares: -O1 compiles it in a quarter of -O3's time
        speed = ["-O1"] if source.parent == HERE else []
        subprocess.run([t.compiler, *cflags(), "-Werror", *t.flags, *speed, "-I", str(native_build.CSRC), "-c",
                        str(source), "-o", str(obj)], check=True)
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = dict(zip(jobs, pool.map(compile_one, jobs)))
    exes = {}
    for target in targets:
        t = TARGETS[target]
        exes[target] = out_dir / target / t.exe
        subprocess.run([t.compiler, *t.flags, *(str(objects[target, src]) for src in sources), *t.libraries, "-o",
                        str(exes[target])], check=True)
    return exes


def run(target: str, exe: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a built harness (under its target's emulator); its report is the stdout."""
    full_env = {**os.environ, "WINEDEBUG": "-all", **(env or {})}
    return subprocess.run([*TARGETS[target].runner, str(exe)], capture_output=True, text=True, env=full_env,
                          timeout=600)


def main(argv: list[str]) -> int:
    targets = argv or ["native"]
    status = 0
    for target in [t for t in targets if missing_tools(t)]:
        print(f"{target}: {', '.join(missing_tools(target))} not found ({TARGETS[target].install})")
        targets.remove(target)
        status = 1
    with tempfile.TemporaryDirectory() as tmp:
        for target, exe in build(targets, Path(tmp)).items():
            result = run(target, exe)
            cpu = f" QEMU_CPU={os.environ['QEMU_CPU']}" if target == "aarch64" and "QEMU_CPU" in os.environ else ""
            print(f"== {target}{cpu}")
            print(result.stdout, end="")
            print(result.stderr, end="", file=sys.stderr)
            status |= result.returncode != 0
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
