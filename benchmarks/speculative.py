"""Speculative decoding by prompt lookup: decode tokens/s with and without it, kvref beside llama.cpp.

    python benchmarks/speculative.py [--rounds 3] [--speculate 16] [--llama-speculate N] [--new-tokens 160]
                                     [--ignore-eos] [--threads 2]
                                     [--llama-python /work/llama-venv/bin/python] [--json out.json]

The prompt is copy-heavy: SmolLM2-135M-Instruct (the default model) is asked, through its chat
template, to rewrite a Python code block with type hints, so most of the answer repeats the prompt.
Every engine gets the same prompt ids (kvref's tokenizer) and decodes greedily until the end of the
answer (the model's end ids: <|im_end|>) or --new-tokens; the report gives each engine's token count.

Engines, each in its own subprocess per round (rounds interleave them, their order rotating, so that all
see the same machine load; the report gives medians over rounds):
  kvref            kvref.load(backend="c", threads=T), float16 K/V, generate(..., speculate=0)
  kvref-lookup     the same with speculate=N (kvref.generation.speculative: prompt lookup, n-grams 3..2, adaptive
                   draft length up to N)
  llama.cpp        llama_cpp.Llama(n_threads=T, n_threads_batch=T), Llama.generate(temp=0)
  llama.cpp-lookup the same with draft_model=LlamaPromptLookupDecoding(num_pred_tokens=N) (its n-grams
                   2..1, first match, N drafted tokens whenever one matches); llama-cpp-python evaluates
                   the token and the draft in one batch and removes rejected positions with kv_cache_seq_rm
llama.cpp runs under --llama-python (a venv with llama-cpp-python); it is left out if that fails.

Decode tokens/s = (tokens - 1) / (time of the last token - time of the first token), measured in Python
around each engine's token generator the same way for all engines: the prefill is not counted. The
speedup is given as the ratio of the medians and as the median of the ratios within each round (the
two runs of one round are minutes apart at most, so that ratio follows the machine's load better). The
acceptance rate is accepted / drafted (kvref's SpeculationStats; llama.cpp's from its yielded tokens
and the drafts it asked for, counted by a wrapper around the draft model).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINES = ("kvref", "kvref-lookup", "llama.cpp", "llama.cpp-lookup")

CODE = '''```python
def merge_intervals(intervals):
    """Merge overlapping intervals and return them sorted by start."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def total_covered(intervals):
    """Total length covered by the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))
```'''
REQUEST = "Rewrite this Python code with type hints added. Keep everything else exactly the same.\n\n" + CODE


def prompt_ids(model) -> list:
    return model.text.chat_ids([{"role": "user", "content": REQUEST}])


# ---- workers: one engine, one run, a JSON line on stdout ------------------------------------------------

def run_kvref(ids, new_tokens, speculate, threads, ignore_eos) -> dict:
    import kvref

    model = kvref.load(backend="c", threads=threads)
    warm = model.new_cache(kv_dtype="float16", capacity=64)
    list(kvref.generate(model, ids[:8], 4, cache=warm, ignore_eos=True))
    cache = model.new_cache(kv_dtype="float16", capacity=len(ids) + new_tokens)
    stats = kvref.SpeculationStats() if speculate else None
    extra = {"speculate": speculate, "stats": stats} if speculate else {}
    times, tokens = [], []
    for token in kvref.generate(model, ids, new_tokens, cache=cache, ignore_eos=ignore_eos, **extra):
        times.append(time.perf_counter())
        tokens.append(token)
    result = {"decode_tok_s": (len(tokens) - 1) / (times[-1] - times[0]), "tokens": tokens}
    if stats is not None:
        result.update(drafted=stats.drafted, accepted=stats.accepted, steps=stats.steps,
                      plain_steps=stats.plain_steps, near_ties=len(stats.near_ties))
    return result


def run_llama(ids, new_tokens, speculate, threads, path, end_ids) -> dict:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    counts = {"drafted": 0, "calls": 0}

    class CountingLookup(LlamaPromptLookupDecoding):
        def __call__(self, input_ids, *args, **kwargs):
            draft = super().__call__(input_ids, *args, **kwargs)
            counts["drafted"] += len(draft)
            counts["calls"] += 1
            return draft

    draft = CountingLookup(num_pred_tokens=speculate) if speculate else None
    llm = llama_cpp.Llama(path, n_ctx=len(ids) + new_tokens + 64, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False, draft_model=draft)
    for _ in zip(range(4), llm.generate(ids[:8], temp=0.0, top_k=1)):  # warm-up
        pass
    times, tokens = [], []
    for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
        times.append(time.perf_counter())
        tokens.append(token)
        if len(tokens) == new_tokens or token in end_ids:  # kvref.generate yields the end id and stops
            break
    result = {"decode_tok_s": (len(tokens) - 1) / (times[-1] - times[0]), "tokens": tokens}
    if speculate:
        # the prompt's batch yields the first token; each later batch (one draft call before it) yields
        # its accepted drafts + 1, so accepted = tokens - 1 - calls (the last batch may be cut short by
        # --new-tokens, so this can miss a few)
        result.update(drafted=counts["drafted"], accepted=len(tokens) - 1 - counts["calls"], steps=counts["calls"])
    return result


def worker(args) -> None:
    job = json.loads(Path(args.worker).read_text())
    if job["engine"].startswith("kvref"):
        result = run_kvref(job["ids"], job["new_tokens"], job["speculate"], job["threads"], job["ignore_eos"])
    else:
        result = run_llama(job["ids"], job["new_tokens"], job["speculate"], job["threads"], job["path"],
                           set(job["end_ids"]))
    print(json.dumps(result))


# ---- the driver ----------------------------------------------------------------------------------------

def launch(engine, job_file, args) -> dict | None:
    python = sys.executable if engine.startswith("kvref") else args.llama_python
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVREF_THREADS": str(args.threads),
           "OMP_NUM_THREADS": str(args.threads), "OPENBLAS_NUM_THREADS": str(args.threads)}
    done = subprocess.run([python, __file__, "--worker", str(job_file)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(f"{engine}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--speculate", type=int, default=16, help="drafted tokens per step at most (kvref; llama.cpp "
                   "too unless --llama-speculate)")
    p.add_argument("--llama-speculate", type=int, default=None,
                   help="llama.cpp's num_pred_tokens, if not --speculate (llama-cpp-python's default: 10)")
    p.add_argument("--new-tokens", type=int, default=160, help="tokens at most (the answer ends earlier)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end of the answer (the model's "
                   "end ids) to --new-tokens: text that no longer copies the prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--llama-python", default="/work/llama-venv/bin/python")
    p.add_argument("--json", default=None, help="write every round's figures here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    import kvref

    model = kvref.load()
    ids = prompt_ids(model)
    path = str(kvref.loader.default_model_path())
    end_ids = [] if args.ignore_eos else sorted(model.generation_config.end_ids(model.tokenizer))
    runs = {engine: [] for engine in args.engines}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            order = args.engines[r % len(args.engines):] + args.engines[:r % len(args.engines)]
            for engine in order:
                job = {"engine": engine, "ids": ids, "new_tokens": args.new_tokens, "threads": args.threads,
                       "speculate": (args.speculate if engine.startswith("kvref") or args.llama_speculate is None
                                     else args.llama_speculate) if engine.endswith("lookup") else 0, "path": path,
                       "ignore_eos": args.ignore_eos, "end_ids": end_ids}
                job_file = Path(scratch) / "job.json"
                job_file.write_text(json.dumps(job))
                result = launch(engine, job_file, args)
                if result is not None:
                    runs[engine].append(result)
                    print(f"round {r + 1} {engine:17s} {result['decode_tok_s']:6.1f} tok/s", file=sys.stderr)
    report(runs, model, ids, args)
    return 0


def report(runs, model, ids, args) -> None:
    median = {e: statistics.median(r["decode_tok_s"] for r in rs) for e, rs in runs.items() if rs}
    print(f"prompt {len(ids)} tokens, {args.new_tokens} new tokens, greedy, {args.threads} threads, "
          f"--speculate {args.speculate} (llama.cpp {args.llama_speculate or args.speculate}), "
          f"medians of {args.rounds} interleaved rounds")
    print("| engine | decode tok/s | speedup: ratio of medians | speedup: median of per-round ratios | tokens | "
          "drafted | accepted | acceptance |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for engine, rate in median.items():
        plain = engine.replace("-lookup", "")
        last = runs[engine][-1]  # the counts are the same every round (greedy, deterministic drafts)
        cells = ["", "", "", "", ""]
        if engine != plain and plain in median:
            per_round = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(runs[engine], runs[plain])]
            cells[:2] = [f"{rate / median[plain]:.2f}x", f"{statistics.median(per_round):.2f}x"]
        if "drafted" in last:
            cells[2:] = [str(last["drafted"]), str(last["accepted"]),
                         f"{last['accepted'] / last['drafted']:.1%}" if last["drafted"] else ""]
        print(f"| {engine} | {rate:.1f} | {cells[0]} | {cells[1]} | {len(last['tokens'])} | "
              + " | ".join(cells[2:]) + " |")
    same = {e: runs[e][-1]["tokens"] == runs[e.replace('-lookup', '')][-1]["tokens"]
            for e in median if e.endswith("lookup") and e.replace("-lookup", "") in median}
    for engine, equal in same.items():
        print(f"{engine}: greedy tokens {'identical to' if equal else 'DIFFER from'} its plain decoding")
    if "kvref-lookup" in median:
        print(f"kvref-lookup: {runs['kvref-lookup'][-1]['near_ties']} steps with a top-2 margin below the "
              "verification's rounding bound (where its greedy token could differ from plain decoding's)")
    text = model.tokenizer.decode(runs[next(iter(median))][-1]["tokens"]) if median else ""
    print("answer (first engine, last round):\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(), "args": vars(args), "prompt_tokens": len(ids),
            "load_average": os.getloadavg(), "runs": runs, "medians": median}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
