"""Decode speed of kvref's NumPy spec path vs transformers (torch CPU) on the same GGUF file.

Each (engine, threads) pair runs in its own subprocess (thread counts of BLAS and torch are fixed at
start-up), interleaved over several rounds so both see the same machine load; medians are reported.
Greedy, a 32-token prompt, 128 new tokens, end token ignored.

    pip install torch==2.13.0 && pip install torch==2.13.0 transformers gguf accelerate
    python benchmarks/spec_vs_transformers.py [--rounds 3] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = ("The KV cache stores the keys and values of every position already processed, so that each "
          "new token only needs its own query, key and value. Explain why this")


def worker(engine: str, n_new: int) -> dict:
    import kvref
    from kvref.formats.gguf import GGUFFile
    from kvref.loader import model_path
    from kvref.text import Tokenizer

    path = model_path()
    with GGUFFile(path) as f:
        prompt = Tokenizer.from_gguf_metadata(f.metadata).encode(PROMPT)[:32]
    assert len(prompt) == 32
    if engine == "kvref-numpy":
        model = kvref.load(path, backend="numpy")
        start = time.perf_counter()
        stamps = []
        for _ in kvref.generate(model, prompt, n_new):
            stamps.append(time.perf_counter())
    else:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        ids = torch.tensor([prompt])
        stamps = []

        class Clock:  # a streamer: called with the prompt first, then once per new token
            def put(self, value):
                stamps.append(time.perf_counter())

            def end(self):
                pass

        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, streamer=Clock())
        stamps = stamps[1:]  # drop the prompt's put
    prefill = stamps[0] - start
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return {"engine": engine, "prefill_s": prefill, "decode_tok_s": decode}


def run(engine, threads, n_new) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), KVREF_THREADS=str(threads))
    out = subprocess.run([sys.executable, __file__, "--worker", engine, "--new-tokens", str(n_new)],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:  # reported and left out of the medians, not hidden
        tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"  {engine} at {threads} thread(s) failed with exit code {out.returncode}: {tail}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--engines", nargs="+", default=["kvref-numpy", "transformers"])
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    if args.worker:
        if args.worker == "transformers":
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        print(json.dumps(worker(args.worker, args.new_tokens)))
        return
    results = {}
    for r in range(args.rounds):
        for threads in args.threads:
            for engine in args.engines:
                res = run(engine, threads, args.new_tokens)
                if res is None:
                    continue
                results.setdefault((engine, threads), []).append(res["decode_tok_s"])
                print(f"round {r + 1}: {engine:<13} {threads} thread(s): {res['decode_tok_s']:7.1f} tok/s decode",
                      file=sys.stderr)
    print(f"\n{'engine':<14} {'threads':>7} {'decode tok/s (median)':>22}")
    for (engine, threads), rates in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{engine:<14} {threads:>7} {statistics.median(rates):>22.1f}")
    for threads in args.threads:
        if all((e, threads) in results for e in ("kvref-numpy", "transformers")):
            ratio = statistics.median(results[("kvref-numpy", threads)]) / statistics.median(results[("transformers", threads)])
            print(f"kvref-numpy / transformers at {threads} thread(s): {ratio:.2f}x")


if __name__ == "__main__":
    main()
