"""The int8 mode's packed kernel alone (AVX-512 VNNI, one thread): its rate in cache and streaming from memory.

    python benchmarks/packed_kernel.py [--repeat 5] [--prefetch 4 16] [--json out.json]

Builds benchmarks/packed_kernel.c with the C sources (gcc, -O3) in a temporary folder, once per
software prefetch distance in --prefetch (KVREF_PACK_PREFETCH_RECORDS, records ahead at 4 or more rows
of x), and runs each case `--repeat` times, the builds interleaved so a noisy machine weighs on each
alike. Cases, at Llama 3.2 1B's widths: Q4_K and Q6_K weights of K = 2048 and 8192 against a pass of
128 rows of x (weights and x in cache: the kernel's arithmetic, a prefill), and against 8 rows with
~75 MiB of groups (every record read from memory once: a batched decode step of 8 sequences); Q4_0,
Q8_0, Q4_K and Q6_K against 1 row with ~75 MiB of groups (a single-sequence decode step on one thread).
Reported per case and build: the median over runs of each run's fastest pass, in ns per (row of x,
record of 16 weight rows and 32 values) and, from memory, the weight bytes read per second; and the
load average before and after. docs/benchmarks.md
("The packed kernel with many rows of x") reads them. Needs a CPU with AVX-512 VNNI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
Q4_0, Q8_0, Q4_K, Q6_K = 2, 8, 12, 14  # kvref type numbers (csrc/kvref.h)
CASES = {  # name: (type, K, T, groups)
    "q4_k 2048 x128 (cache)": (Q4_K, 2048, 128, 48),
    "q4_k 8192 x128 (cache)": (Q4_K, 8192, 128, 8),
    "q6_k 8192 x128 (cache)": (Q6_K, 8192, 128, 8),
    "q4_k 2048 x8 (memory)": (Q4_K, 2048, 8, 4000),
    "q6_k 8192 x8 (memory)": (Q6_K, 8192, 8, 700),
    "q4_0 2048 x1 (memory)": (Q4_0, 2048, 1, 4000),
    "q8_0 2048 x1 (memory)": (Q8_0, 2048, 1, 2000),
    "q4_k 2048 x1 (memory)": (Q4_K, 2048, 1, 4000),
    "q6_k 8192 x1 (memory)": (Q6_K, 8192, 1, 700),
}


def build(folder: Path, prefetch: int) -> Path:
    exe = folder / f"packed_kernel_{prefetch}"
    sources = sorted(str(p) for p in (ROOT / "csrc").glob("*.c"))
    subprocess.run(["gcc", "-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread",
                    f"-DKVREF_PACK_PREFETCH_RECORDS={prefetch}", "-I", str(ROOT / "csrc"),
                    str(ROOT / "benchmarks" / "packed_kernel.c"), *sources, "-lm", "-o", str(exe)], check=True)
    return exe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--prefetch", type=int, nargs="+", default=[4], help="records ahead, one build each")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        raise SystemExit("packed_kernel.py: this CPU has no AVX-512 VNNI")
    load_before = os.getloadavg()[0]
    runs = {(case, d): [] for case in CASES for d in args.prefetch}
    with tempfile.TemporaryDirectory() as folder:
        exes = {d: build(Path(folder), d) for d in args.prefetch}
        for _ in range(args.repeat):
            for case, (type_, K, T, groups) in CASES.items():
                passes = 3 if T <= 8 else 10
                for d, exe in exes.items():
                    out = subprocess.run([str(exe), str(type_), str(K), str(T), str(groups), str(passes)],
                                         check=True, capture_output=True, text=True)
                    runs[case, d].append(json.loads(out.stdout))
    result = {"load_before": load_before, "load_after": os.getloadavg()[0],
              "ns_per_row_record": {f"{case}, prefetch {d}": statistics.median(r["ns_fastest"] for r in v)
                                    for (case, d), v in runs.items()},
              "gb_s": {f"{case}, prefetch {d}": statistics.median(r["gb_s"] for r in v)
                       for (case, d), v in runs.items() if case.endswith("(memory)")},
              "runs": {f"{case}, prefetch {d}": [r["ns_fastest"] for r in v] for (case, d), v in runs.items()}}
    print(f"load average {result['load_before']:.2f} -> {result['load_after']:.2f}; "
          f"ns per (row, record), medians of {args.repeat} runs (GMAC/s = 512 / ns); weights read from memory")
    for name, ns in result["ns_per_row_record"].items():
        read = f"  {result['gb_s'][name]:5.1f} GB/s" if name in result["gb_s"] else ""
        print(f"  {name:<42} {ns:7.3f}  {512 / ns:6.1f} GMAC/s{read}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
