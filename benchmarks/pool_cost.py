"""The thread pool's own cost: what a kernel call pays beyond its work, at 1 and 2 threads.

    python benchmarks/pool_cost.py [--threads 1 2] [--repeat 5] [--rounds 20000] [--json out.json]
    python benchmarks/pool_cost.py --calls FILE.gguf [--activations int8]    # pool calls per decode step (gdb)

Builds benchmarks/pool_cost.c with the C sources (gcc, -O3, the build's warnings) in a temporary
folder and runs it `--repeat` times per thread count, the counts interleaved, so a noisy machine
weighs on each alike. Reported per thread count: the median over repeats of each run's medians
(pool_cost.c says what each figure is), in nanoseconds, and the load average before and after.
docs/benchmarks.md ("The thread pool past two cores") reads them with the number of pool runs a
decode step makes per layer, which `--calls` counts: gdb counts kvref_pool_run's calls in a process that
loads FILE (2 threads), runs a 32-token prompt into a 512-position float16 cache and then 0, or 10,
one-token steps; the difference over 10 is the calls per step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("run_empty", "run_empty_64", "run_work", "handoff_hot", "handoff_cold")


def build(folder: Path) -> Path:
    exe = folder / "pool_cost"
    sources = sorted(str(p) for p in (ROOT / "csrc").glob("*.c"))
    subprocess.run(["gcc", "-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread",
                    "-I", str(ROOT / "csrc"), str(ROOT / "benchmarks" / "pool_cost.c"), *sources, "-lm",
                    "-o", str(exe)], check=True)
    return exe


STEPS = """
import sys, kvref
model = kvref.load(sys.argv[1], threads=2, activations=sys.argv[2])
cache = model.new_cache(capacity=512, kv_dtype="float16")
model.forward(list(range(1, 33)), cache)
for i in range(int(sys.argv[3])):
    model.forward([100 + i], cache)
"""


def pool_calls(model: str, activations: str, steps: int) -> int:
    # kvref_pool_run's calls in a process that loads `model` and runs a prompt and `steps` decode steps
    out = subprocess.run(["gdb", "-q", "-batch", "-ex", "set breakpoint pending on", "-ex", "break kvref_pool_run",
                          "-ex", "ignore 1 1000000000", "-ex", "run", "-ex", "info breakpoints",
                          "--args", sys.executable, "-c", STEPS, model, activations, str(steps)],
                         check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return int(re.search(r"already hit (\d+) time", out).group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20000, help="runs per figure in one process")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--calls", metavar="FILE", help="count the pool calls per decode step on this GGUF instead")
    parser.add_argument("--activations", default="int8", choices=["int8", "float32"])
    args = parser.parse_args()
    if args.calls:
        before, after = pool_calls(args.calls, args.activations, 0), pool_calls(args.calls, args.activations, 10)
        print(f"{args.calls} ({args.activations}): {(after - before) / 10:g} pool calls per decode step "
              f"({after} - {before} over 10 steps)")
        return 0
    load_before = os.getloadavg()[0]
    runs = {n: [] for n in args.threads}
    with tempfile.TemporaryDirectory() as folder:
        exe = build(Path(folder))
        for _ in range(args.repeat):
            for n in args.threads:
                out = subprocess.run([str(exe), str(n), str(args.rounds)], check=True, capture_output=True, text=True)
                runs[n].append(json.loads(out.stdout))
    result = {"load_before": load_before, "load_after": os.getloadavg()[0], "threads": {}}
    for n, rows in runs.items():
        # a negative figure: not measured (no worker at 1 thread, or none took a unit)
        result["threads"][n] = {f: statistics.median(r[f] for r in rows) if min(r[f] for r in rows) >= 0 else None
                                for f in FIGURES}
    print(f"load average {result['load_before']:.2f} -> {result['load_after']:.2f}; medians in ns")
    print(f"{'threads':>7} " + " ".join(f"{f:>13}" for f in FIGURES))
    for n, figures in result["threads"].items():
        print(f"{n:>7} " + " ".join(f"{'-' if figures[f] is None else round(figures[f]):>13}" for f in FIGURES))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
