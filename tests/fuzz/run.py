"""Run a fuzz target: the corpus, then mutations, each input checked for escapes, hangs and memory.

    python -m tests.fuzz.run TARGET [--seed S] [--mutations N] [--seconds T] [--json]
    python -m tests.fuzz.run TARGET --atheris [-- libFuzzer options]       (coverage-guided; pip install atheris)

TARGET is one of tests/fuzz/targets.py's (gguf, safetensors, cache, tokenizer, chat) or "all". Every
input must finish within HANG_SECONDS of CPU time (and BLOCKED_SECONDS of wall-clock time, for an
input that waits: a busy machine slows the clock, not the CPU time) with the process's peak RSS at
most RSS_LIMIT_BYTES, and raise nothing but a KVRefError. The corpus (tests/fuzz/corpus/TARGET/) is
replayed first, then mutations of it (tests/fuzz/mutate.py) drawn from --seed, as many as --mutations
or for --seconds, whichever ends first.
Findings are written to tests/fuzz/findings/TARGET/ (not checked in; a fixed one joins the corpus)
unless --no-save (CI).
The report: inputs run, KVRefErrors (and which corpus entries were refused), findings, the slowest
input and the peak RSS, as one line of JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

from . import targets
from .mutate import mutate

HANG_SECONDS = 5  # of CPU time: what an input costs, whatever else the machine is running
BLOCKED_SECONDS = 30  # of wall-clock time: an input that waits (a FIFO, a lock) uses no CPU
ATHERIS_HANG_SECONDS = 30
RSS_LIMIT_BYTES = 2**30
ADDRESS_SPACE_BYTES = 16 * 2**30  # an input that really allocates this much fails fast, not the machine
FINDINGS = Path(__file__).parent / "findings"


class Hang(BaseException):
    """Raised into an input that ran past its time (a BaseException: no target catches it)."""


def _cpu_timer(signum, frame):
    raise Hang(f"still running after {HANG_SECONDS} s of CPU time")


def _wall_timer(signum, frame):
    raise Hang(f"blocked for {BLOCKED_SECONDS} s")


def corpus(target: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted((targets.CORPUS / target).iterdir()) if p.is_file()]


def check(target: str, data: bytes) -> tuple[str | None, float, str]:
    """(finding kind, "refused" or None; CPU seconds; detail) for one input."""
    start = time.process_time()
    signal.setitimer(signal.ITIMER_PROF, HANG_SECONDS + 0.5)  # CPU time of the process, every thread
    signal.alarm(BLOCKED_SECONDS)
    kind, detail = None, ""
    try:
        refusal = targets.run_one(target, data)
        if refusal is not None:
            kind, detail = "refused", f"{type(refusal).__name__}: {refusal}"
    except Hang as exc:
        kind, detail = "hang", str(exc)
    except Exception as exc:  # noqa: BLE001 - any non-KVRefError escape is what we look for
        kind, detail = "escape", "".join(traceback.format_exception(exc)[-3:])
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.alarm(0)
    seconds = time.process_time() - start
    if kind in (None, "refused") and seconds > HANG_SECONDS:
        kind, detail = "hang", f"took {seconds:.1f} s of CPU time"
    if kind in (None, "refused") and peak_rss() > RSS_LIMIT_BYTES:
        kind, detail = "rss", f"peak RSS {peak_rss() / 2**20:.0f} MB"
    return kind, seconds, detail


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KB


def fuzz(target: str, seed: int, mutations: int, seconds: float, save: bool) -> dict:
    seeds = corpus(target)
    rng = random.Random(f"{target}-{seed}")
    report = {"target": target, "seed": seed, "inputs": 0, "refused": 0, "findings": [], "slowest_seconds": 0.0,
              "corpus_refused": []}
    deadline = time.monotonic() + seconds
    inputs = iter(seeds)
    while True:
        data = next(inputs, None)
        if data is None:
            if report["inputs"] >= len(seeds) + mutations or time.monotonic() > deadline:
                break
            data = mutate(rng.choice(seeds), rng, seeds, target)
        kind, took, detail = check(target, data)
        report["inputs"] += 1
        report["slowest_seconds"] = max(report["slowest_seconds"], round(took, 3))
        if kind == "refused":
            report["refused"] += 1
            if report["inputs"] <= len(seeds):  # which seeds are refusals (the hostile ones should be)
                report["corpus_refused"].append(detail[:200])
        elif kind is not None:
            name = hashlib.sha256(data).hexdigest()[:16]
            report["findings"].append({"kind": kind, "input": name, "detail": detail[-600:]})
            if save:
                (FINDINGS / target).mkdir(parents=True, exist_ok=True)
                (FINDINGS / target / name).write_bytes(data)
            if kind == "rss":  # the peak only grows: every later input would look the same
                break
    report["peak_rss_mb"] = round(peak_rss() / 2**20)
    return report


def replay(target: str, paths: list[str]) -> int:
    failed = 0
    for path in paths:
        kind, took, detail = check(target, Path(path).read_bytes())
        failed += kind not in (None, "refused")
        print(f"{path}: {kind or 'accepted'} in {took:.2f} s {detail}")
    return 1 if failed else 0


def run_atheris(target: str, argv: list[str]) -> None:
    import atheris  # exploratory only: pip install atheris

    def one(data: bytes):
        targets.run_one(target, data)  # a KVRefError is swallowed there; anything else is a crash

    seeds = FINDINGS / target / "atheris-corpus"  # libFuzzer adds what it finds: a scratch copy of the corpus
    seeds.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(corpus(target)):
        (seeds / f"seed-{i}").write_bytes(data)
    atheris.instrument_all()
    # instrumented Python runs several times slower: libFuzzer's timeout is ATHERIS_HANG_SECONDS, and an
    # input it reports is judged by the plain rule with --replay
    atheris.Setup([sys.argv[0], f"-timeout={ATHERIS_HANG_SECONDS}", f"-rss_limit_mb={RSS_LIMIT_BYTES >> 20}",
                   f"-artifact_prefix={FINDINGS / target}/", *argv, str(seeds)], one)
    atheris.Fuzz()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=[*targets.TARGETS, "all"])
    parser.add_argument("--seed", type=int, default=None, help="mutation seed (default: from the clock)")
    parser.add_argument("--mutations", type=int, default=10**12, help="mutations after the corpus")
    parser.add_argument("--seconds", type=float, default=float("inf"), help="stop mutating after this long")
    parser.add_argument("--json", action="store_true", help="print only the report, as one line of JSON")
    parser.add_argument("--no-save", action="store_true", help="do not write findings to tests/fuzz/findings/")
    parser.add_argument("--atheris", action="store_true", help="coverage-guided fuzzing with atheris instead")
    parser.add_argument("--replay", nargs="+", metavar="FILE", help="check these inputs (e.g. findings) and stop")
    argv = sys.argv[1:] if argv is None else argv
    libfuzzer = argv[argv.index("--") + 1:] if "--" in argv else []  # libFuzzer's options, e.g. -max_total_time=600
    args = parser.parse_args(argv[:len(argv) - len(libfuzzer) - (1 if "--" in argv else 0)])
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    if args.atheris:
        run_atheris(args.target, libfuzzer)  # libFuzzer keeps time and memory itself
        return 0
    signal.signal(signal.SIGPROF, _cpu_timer)
    signal.signal(signal.SIGALRM, _wall_timer)
    try:
        if args.replay:
            return replay(args.target, args.replay)
        seed = args.seed if args.seed is not None else int(time.time())
        names = list(targets.TARGETS) if args.target == "all" else [args.target]
        reports = [fuzz(name, seed, args.mutations, args.seconds, save=not args.no_save) for name in names]
    finally:
        targets.remove_scratch()
    for report in reports:
        if not args.json:
            print(f"{report['target']}: {report['inputs']} inputs (seed {report['seed']}), {report['refused']} "
                  f"KVRefErrors, {len(report['findings'])} findings, slowest {report['slowest_seconds']} s, "
                  f"peak RSS {report['peak_rss_mb']} MB", file=sys.stderr)
            for finding in report["findings"]:
                print(f"  {finding['kind']} {finding['input']}: {finding['detail']}", file=sys.stderr)
        print(json.dumps(report))
    return 1 if any(r["findings"] for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
