"""kvref side by side with llama.cpp and transformers: same GGUF file, same prompt ids, same thread count.

    python benchmarks/compare.py [--rounds 3] [--threads 1 2] [--engines kvref-c kvref-numpy llama.cpp transformers]
                                 [--cases decode prefill context batch] [--context 4096] [--batch 8]
                                 [--json out.json] [--quick]

Engines (each one that is installed; a missing one is reported and left out):
  kvref-c       kvref.load(path, backend="c", threads=T)       the native path (fused C forward);
                K/V cache float16 like llama.cpp's (--kv-dtype); exact float32 activations;
                kvref-c@int8 (any kvref engine, any K/V type) overrides --kv-dtype for that engine, so
                several K/V types run side by side: --engines kvref-c kvref-c@int8 llama.cpp
  kvref-c-int8  the same with KVREF_ACTIVATIONS=int8: every projection rounds its input to 8-bit blocks
                before the quantized weights, as llama.cpp does (kvref.native.fused)
  kvref-numpy   kvref.load(path, backend="numpy")               the NumPy spec, OpenBLAS with T threads;
                K/V cache float32
  llama.cpp     llama_cpp.Llama(path, n_ctx, n_threads=T, n_threads_batch=T, n_batch=512)
                (pip install llama-cpp-python: builds llama.cpp from source with -march=native);
                K/V cache f16 (its default); flash attention on (--llama-flash-attn), as the llama.cpp
                CLI and llama-bench run by default ("auto" picks it on the CPU)
  transformers  AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32): the weights
                dequantized to float32; torch.set_num_threads(T); DynamicCache; logits of the last position only
                (pip install torch==2.13.0 && pip install torch==2.13.0 transformers gguf accelerate)

Cases (the targets of issue 4; --context, --new-tokens etc. change the sizes):
  decode   a 32-token prompt is prefilled (not timed), then 128 decode steps: steps / seconds
  prefill  one 512-token prompt into an empty cache: tokens / seconds
  batch    --batch sequences (8), each its own --prompt-tokens prompt prefilled in one batched execution
           (not timed), then --new-tokens decode steps of all of them together: sequences x steps /
           seconds (kvref: kvref.generation.batch.forward_batch; llama.cpp: one llama_decode per step over a
           sequence id per row, in a second context with n_seq_max = --batch; others: not run)
  context  the cache is filled with 4096 positions by prefills of 512 (not timed; its rate is reported as
           "fill"), then 64 decode steps are timed (llama-bench's `-d 4096 -n 64`)
Roofline: each round also runs a probe worker per thread count (`kvref bench`'s fixed read probe, the
native kernels' vector loads over a buffer 4x the last-level cache, with T threads) and counts the bytes
a decode step must read: the file's weights (kvref.tools.machine.weight_bytes_per_token on the exact
mode's load: every tensor but the embedding table, one embedding row, the active experts) plus the f16
K/V the step attends to. Each decode and context rate times those bytes, over that round's probe
bandwidth, is the fraction of the roofline the engine reached; the report gives its median over rounds.
The same bytes count for every engine: what the file holds, not what an engine repacks it into.
A decode step is, for every engine: the forward over the token just selected, then the argmax of the
last logits (greedy, the end token ignored). Every engine gets the same token ids (kvref's tokenizer on
PASSAGE of kvref.tools.bench, repeated); each worker warms up (8-token prompt, 4 steps) before timing.

Every (engine, thread count) pair runs in its own subprocess per round (thread pools and BLAS thread
counts are fixed at start-up; no engine shares a process with another), with OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS, MKL_NUM_THREADS and KVREF_THREADS set to T. Rounds interleave the engines
(their order rotates each round) so that all of them see the same machine load; the report gives
medians over rounds and ratios to llama.cpp (> 1: faster than llama.cpp). Rates are wall-clock rates
measured in Python around each engine's own call, the same way for all engines; each engine's own
counters for the timed part of a case are recorded beside them in the JSON ("perf": llama.cpp's
llama_perf_context, kvref's C forward seconds by kernel family).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINES = ("kvref-c", "kvref-c-int8", "kvref-numpy", "llama.cpp", "transformers")
CASES = ("decode", "prefill", "context", "batch")
FILL_CHUNK = 512
WARMUP_PROMPT, WARMUP_STEPS = 8, 4


# ---- engines: reset(capacity), feed(ids) -> greedy next token id -----------------------------------

class KvrefEngine:
    def __init__(self, path, backend, threads, kv_dtype=None, activations=None):
        if activations:
            os.environ["KVREF_ACTIVATIONS"] = activations  # read when the model builds its forward
        import kvref

        self.model = kvref.load(path, backend=backend, threads=threads)
        self.kv_dtype = kv_dtype
        self.cache = None
        self.info = {"backend": self.model.backend, "threads": threads, "kv_dtype": kv_dtype or self.model.dtype,
                     "isa": getattr(self.model.ops, "isa", None), "version": kvref.__version__,
                     "activations": self.model.activations}

    def reset(self, capacity):
        self.cache = self.model.new_cache(capacity=capacity, kv_dtype=self.kv_dtype)

    def feed(self, ids):
        import numpy as np

        return int(np.argmax(self.model.forward(ids, self.cache)))

    def reset_batch(self, n, capacity):
        self.caches = [self.model.new_cache(capacity=capacity, kv_dtype=self.kv_dtype) for _ in range(n)]

    def feed_batch(self, id_lists):
        # one execution over every sequence's new ids (kvref.generation.batch.forward_batch: one C call)
        import numpy as np

        from kvref.generation.batch import forward_batch

        return [int(np.argmax(logits)) for logits in forward_batch(self.model, id_lists, self.caches)]

    def _perf_reset(self):
        self.model.reset_timings()

    def perf(self) -> dict | None:
        """The C forward's own counters since the last reset (Model.timings(): seconds by kernel family,
        forward calls); None for the shared decoder, which keeps none."""
        return self.model.timings()


class LlamaEngine:
    def __init__(self, path, threads, n_ctx, flash_attn=True):
        import llama_cpp

        self.llama_cpp = llama_cpp
        options = dict(n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, n_ubatch=512,
                       verbose=False)
        try:
            self.llm = llama_cpp.Llama(str(path), flash_attn=flash_attn, **options)
        except TypeError:  # a version without the flash_attn argument
            self.llm = llama_cpp.Llama(str(path), **options)
            flash_attn = None
        self.n_vocab = self.llm.n_vocab()
        self.timed_ctx = self.llm.ctx  # the context whose counters perf() reads: the batch case's its own
        self.info = {"version": llama_cpp.__version__, "threads": threads, "n_ctx": n_ctx, "n_batch": 512,
                     "flash_attn": flash_attn, "kv_dtype": "float16 (default type_k/type_v)"}

    def reset(self, capacity):
        self.llm.reset()  # n_tokens = 0; the next eval removes every stored position from the KV cache
        self.timed_ctx = self.llm.ctx
        self._perf_reset()

    def feed(self, ids):
        import numpy as np

        self.llm.eval(list(ids))  # logits of the batch's last position only (logits_all=False)
        logits = np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def reset_batch(self, n, capacity):
        # a second context on the same weights with a sequence per batch row (Llama keeps one sequence),
        # unified K/V of n * capacity cells, and a batch of up to n_batch tokens over n sequences
        from llama_cpp import _internals

        self.batch_ctx = None  # the previous one's K/V go first
        params = self.llm.context_params
        params.n_ctx, params.n_seq_max, params.kv_unified = n * capacity, n, True
        self.batch_ctx = _internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=512, embd=0, n_seq_max=n, verbose=False)
        self.positions = [0] * n
        self.timed_ctx = self.batch_ctx.ctx

    def feed_batch(self, id_lists):
        # one llama_decode per batch of at most 512 tokens, each sequence's last position's logits kept
        import numpy as np

        rows = [(b, t, i == len(ids) - 1) for b, ids in enumerate(id_lists) for i, t in enumerate(ids)]
        selected = {}
        for start in range(0, len(rows), 512):
            chunk, batch, ends = rows[start:start + 512], self.batch.batch, {}
            batch.n_tokens = len(chunk)
            for i, (b, token, last) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, self.positions[b], 1
                batch.seq_id[i][0], batch.logits[i] = b, last
                self.positions[b] += 1
                if last:
                    ends[b] = i
            self.batch_ctx.decode(self.batch)
            for b, i in ends.items():
                logits = np.ctypeslib.as_array(self.batch_ctx.get_logits_ith(i), shape=(self.n_vocab,))
                selected[b] = int(np.argmax(logits))
        return [selected[b] for b in range(len(id_lists))]

    def _perf_reset(self):
        fn = getattr(self.llama_cpp, "llama_perf_context_reset", None)
        if fn is not None:
            fn(self.timed_ctx)

    def perf(self) -> dict | None:
        """llama.cpp's own counters since the last reset: prompt-eval and eval milliseconds and counts."""
        fn = getattr(self.llama_cpp, "llama_perf_context", None)
        if fn is None:
            return None
        p = fn(self.timed_ctx)
        return {"t_p_eval_ms": p.t_p_eval_ms, "n_p_eval": p.n_p_eval, "t_eval_ms": p.t_eval_ms, "n_eval": p.n_eval}


class TransformersEngine:
    def __init__(self, path, threads):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()
        self.past = None
        self.info = {"version": transformers.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
                     "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                     "kv_dtype": "float32"}

    def reset(self, capacity):
        from transformers import DynamicCache

        self.past = DynamicCache()

    def feed(self, ids):
        torch = self.torch
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([list(ids)]), past_key_values=self.past, use_cache=True,
                             logits_to_keep=1)
        self.past = out.past_key_values
        return int(out.logits[0, -1].argmax())


def engine_kind(name: str) -> str:
    """The engine of a name given to --engines: kvref-c@int8 is kvref-c with int8 K/V."""
    return name.partition("@")[0]


def engine_name(name: str) -> str:
    """argparse type of --engines: a known engine, for kvref-c engines optionally @<K/V type>."""
    kind, at, kv = name.partition("@")
    if kind not in ENGINES or (at and (kind not in ("kvref-c", "kvref-c-int8") or not kv)):
        raise argparse.ArgumentTypeError(f"{name!r}: expected one of {ENGINES}, or kvref-c[-int8]@<K/V type>")
    return name


def make_engine(name, path, threads, args):
    kind, _, kv_dtype = name.partition("@")
    if kind == "kvref-c":
        return KvrefEngine(path, "c", threads, kv_dtype or args.kv_dtype)
    if kind == "kvref-c-int8":
        return KvrefEngine(path, "c", threads, kv_dtype or args.kv_dtype, activations="int8")
    if name == "kvref-numpy":
        return KvrefEngine(path, "numpy", threads, None)
    if name == "llama.cpp":
        return LlamaEngine(path, threads, n_ctx=max_positions(args), flash_attn=args.llama_flash_attn == "on")
    if name == "transformers":
        return TransformersEngine(path, threads)
    raise SystemExit(f"unknown engine {name!r}; expected one of {ENGINES}")


def max_positions(args) -> int:
    return max(args.prompt_tokens + args.new_tokens, args.prefill_tokens, args.context + args.context_steps,
               WARMUP_PROMPT + WARMUP_STEPS)


# ---- the worker: every case on one engine ---------------------------------------------------------

def decode_steps(engine, token, steps):
    """Time `steps` decode steps; -> (seconds, tokens selected)."""
    tokens = []
    start = time.perf_counter()
    for _ in range(steps):
        token = engine.feed([token])
        tokens.append(token)
    return time.perf_counter() - start, tokens


def fill(engine, ids):
    token = None
    for start in range(0, len(ids), FILL_CHUNK):
        token = engine.feed(ids[start:start + FILL_CHUNK])
    return token


def worker(args) -> dict:
    from kvref.formats.gguf import GGUFFile
    from kvref.text import Tokenizer
    from kvref.tools.bench import prompt_ids

    path = model_file(args.model)
    with GGUFFile(path) as f:
        tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
    threads = args.threads[0]
    start = time.perf_counter()
    engine = make_engine(args.worker, path, threads, args)
    out = {"engine": args.worker, "threads": threads, "load_s": time.perf_counter() - start, "info": engine.info}

    engine.reset(WARMUP_PROMPT + WARMUP_STEPS)
    decode_steps(engine, fill(engine, prompt_ids(tokenizer, WARMUP_PROMPT)), WARMUP_STEPS)
    perf = getattr(engine, "perf", lambda: None)
    reset_perf = getattr(engine, "_perf_reset", lambda: None)  # perf() then counts the timed part alone
    for case in args.cases:
        if case == "prefill":
            ids = prompt_ids(tokenizer, args.prefill_tokens)
            engine.reset(len(ids))
            reset_perf()
            t0 = time.perf_counter()
            engine.feed(ids)
            seconds = time.perf_counter() - t0
            out[case] = {"tokens": len(ids), "seconds": seconds, "tok_s": len(ids) / seconds, "perf": perf()}
        elif case == "decode":
            ids = prompt_ids(tokenizer, args.prompt_tokens)
            engine.reset(len(ids) + args.new_tokens)
            token = fill(engine, ids)
            reset_perf()
            seconds, tokens = decode_steps(engine, token, args.new_tokens)
            out[case] = {"prompt_tokens": len(ids), "steps": args.new_tokens, "seconds": seconds,
                         "tok_s": args.new_tokens / seconds, "tokens": [token] + tokens[:31], "perf": perf()}
        elif case == "batch":
            if not hasattr(engine, "feed_batch"):
                continue
            n = args.batch
            prompts = [prompt_ids(tokenizer, args.prompt_tokens * (b + 1))[-args.prompt_tokens:] for b in range(n)]
            engine.reset_batch(n, args.prompt_tokens + args.new_tokens)
            tokens = engine.feed_batch(prompts)
            reset_perf()
            t0 = time.perf_counter()
            for _ in range(args.new_tokens):
                tokens = engine.feed_batch([[t] for t in tokens])
            seconds = time.perf_counter() - t0
            out[case] = {"sequences": n, "steps": args.new_tokens, "seconds": seconds,
                         "tok_s": n * args.new_tokens / seconds, "perf": perf()}
        elif case == "context":
            ids = prompt_ids(tokenizer, args.context)
            engine.reset(len(ids) + args.context_steps)
            t0 = time.perf_counter()
            token = fill(engine, ids)
            fill_s = time.perf_counter() - t0
            reset_perf()
            seconds, _ = decode_steps(engine, token, args.context_steps)
            out[case] = {"context": len(ids), "steps": args.context_steps, "seconds": seconds,
                         "tok_s": args.context_steps / seconds, "fill_tok_s": len(ids) / fill_s, "perf": perf()}
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def probe_worker(args) -> dict:
    """The roofline's two halves at this thread count: the probe's read bandwidth, and the bytes a decode
    and a context step read (weights of the file, f16 K/V at the case's average cached positions)."""
    import kvref
    from kvref.tools import machine

    model = kvref.load(model_file(args.model), backend="c", threads=args.threads[0], activations="float32")
    roof = machine.read_bandwidth(model)
    weights = machine.weight_bytes_per_token(model)
    positions = {"decode": args.prompt_tokens + args.new_tokens / 2, "context": args.context + args.context_steps / 2}
    return {"engine": "probe", "threads": args.threads[0], "bandwidth_gb_s": roof["bandwidth_gb_s"],
            "range_gb_s": roof["range_gb_s"], "probe_bytes": roof["probe_bytes"], "weight_bytes": weights,
            "step_bytes": {case: weights + machine.kv_bytes_per_token(model, n, "float16")
                           for case, n in positions.items()}}


def model_file(path):
    from kvref.loader import model_path

    return model_path(path)


# ---- the driver ------------------------------------------------------------------------------------

def installed(engine) -> str | None:
    """None when the engine can run here, else why not."""
    import importlib.util

    needs = {"kvref-c": [], "kvref-c-int8": [], "kvref-numpy": [], "llama.cpp": ["llama_cpp"],
             "transformers": ["torch", "transformers", "gguf", "accelerate"]}[engine_kind(engine)]
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if engine_kind(engine) in ("kvref-c", "kvref-c-int8"):
        from kvref import native

        return None if native.available() else native.unavailable_reason()
    return f"not installed: {', '.join(missing)}" if missing else None


def run_worker(engine, threads, args) -> dict | None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), KVREF_THREADS=str(threads))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, "--threads", str(threads),
               "--cases", *args.cases] + size_arguments(args)
    try:
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"  {engine} at {threads} thread(s) timed out after {args.timeout} s", file=sys.stderr)
        return None
    if out.returncode != 0:  # reported and left out of the medians, not hidden
        tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"  {engine} at {threads} thread(s) failed with exit code {out.returncode}: {tail}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def size_arguments(args) -> list[str]:
    out = ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
           "--prefill-tokens", str(args.prefill_tokens), "--context", str(args.context),
           "--context-steps", str(args.context_steps), "--batch", str(args.batch),
           "--llama-flash-attn", args.llama_flash_attn]
    if args.model:
        out += ["--model", str(args.model)]
    if args.kv_dtype:
        out += ["--kv-dtype", args.kv_dtype]
    return out


def case_label(case, args) -> str:
    return {"decode": f"decode {args.new_tokens} after {args.prompt_tokens}",
            "prefill": f"prefill {args.prefill_tokens}",
            "context": f"decode {args.context_steps} at {args.context}",
            "batch": f"{args.batch} x {args.new_tokens} batched"}[case]


def environment() -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=HERE.parent, capture_output=True, text=True).stdout.strip()
        except OSError:
            return None

    so = sorted((HERE.parent / "kvref" / "native").glob("_kvref*.so"))
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "commit": git("rev-parse", "--short", "HEAD"), "modified_files": dirty.splitlines() if dirty else [],
            "native_module_built": datetime.datetime.fromtimestamp(so[0].stat().st_mtime).astimezone().isoformat(
                timespec="seconds") if so else None,
            "cpu": cpu(), "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_avg_start": list(os.getloadavg())}


def cpu() -> dict:
    """The CPU as /proc/cpuinfo names it (a VM's model name can be just "AMD EPYC": family 25 model 17
    is Zen 4), and whether it has AVX-512 and AMX."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return {"model_name": platform.processor() or None}
    flags = fields.get("flags", "").split()
    return {"model_name": fields.get("model name"), "family": fields.get("cpu family"), "model": fields.get("model"),
            "avx512": "avx512f" in flags, "amx": "amx_tile" in flags}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), type=engine_name)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="sequences of the batch case (default 8)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--context-steps", type=int, default=64)
    parser.add_argument("--kv-dtype", default="float16", help="kvref-c's K/V element type (default float16, "
                        "as llama.cpp's cache)")
    parser.add_argument("--llama-flash-attn", choices=["on", "off"], default="on")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per worker")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke test")
    parser.add_argument("--json", default=None, help="write every sample, median and ratio to this file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.new_tokens, args.prefill_tokens, args.context, args.context_steps = 1, 16, 64, 256, 8
    if args.worker:
        print(json.dumps(probe_worker(args) if args.worker == "probe" else worker(args)))
        return

    env = environment()
    engines = []
    for engine in args.engines:
        why = installed(engine)
        if why:
            print(f"{engine}: left out ({why})", file=sys.stderr)
        else:
            engines.append(engine)
    print(f"compare: {', '.join(engines)}; threads {args.threads}; cases {', '.join(args.cases)}; "
          f"{args.rounds} rounds; commit {env['commit']}"
          f"{' + ' + str(len(env['modified_files'])) + ' modified files' if env['modified_files'] else ''}; "
          f"load average {env['load_avg_start'][0]:.2f}; CPU {describe_cpu(env['cpu'])}", file=sys.stderr)
    started = time.perf_counter()
    runs, probes = [], []
    for r in range(args.rounds):
        order = engines[r % len(engines):] + engines[:r % len(engines)] if engines else []
        for threads in args.threads:
            probe = run_worker("probe", threads, args) if engines and installed("kvref-c") is None else None
            if probe is not None:
                probe["round"] = r + 1
                probes.append(probe)
                print(f"round {r + 1}/{args.rounds}: read probe   {threads} thread(s): "
                      f"{probe['bandwidth_gb_s']:.1f} GB/s", file=sys.stderr)
            for engine in order:
                t0 = time.perf_counter()
                load = os.getloadavg()[0]
                res = run_worker(engine, threads, args)
                if res is None:
                    continue
                res["round"], res["load_avg_before"], res["load_avg_after"] = r + 1, load, os.getloadavg()[0]
                runs.append(res)
                rates = ", ".join(f"{c} {res[c]['tok_s']:.1f}" for c in args.cases if c in res)
                print(f"round {r + 1}/{args.rounds}: {engine:<12} {threads} thread(s): {rates} tok/s "
                      f"({time.perf_counter() - t0:.0f} s; load average {load:.2f} -> {res['load_avg_after']:.2f})",
                      file=sys.stderr)
    elapsed = time.perf_counter() - started
    env["load_avg_end"] = list(os.getloadavg())

    medians, best = {}, {}  # (case, threads, engine) -> median / highest tok/s over rounds
    for case in args.cases:
        for threads in args.threads:
            for engine in engines:
                rates = [x[case]["tok_s"] for x in runs if x["engine"] == engine and x["threads"] == threads]
                if rates:
                    medians[(case, threads, engine)] = statistics.median(rates)
                    best[(case, threads, engine)] = max(rates)
    print(report(medians, runs, engines, args, env, elapsed))
    roof = rooflines(runs, probes, engines, args)
    if roof:
        print(roof)
    if args.rounds > 1:
        print(table(best, engines, args, "\nbest round (the least disturbed by other processes; a round another "
                    "process slowed shows as a gap between this table and the medians)"))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "environment": env, "elapsed_s": elapsed, "settings": {k: v for k, v in vars(args).items() if k != "worker"},
            "medians": [{"case": c, "threads": t, "engine": e, "tok_s": v, "best_tok_s": best[(c, t, e)]}
                        for (c, t, e), v in medians.items()],
            "runs": runs, "probes": probes}, indent=1))


def describe_cpu(c) -> str:
    return (f"{c.get('model_name')} (family {c.get('family')} model {c.get('model')}, "
            f"AVX-512 {'yes' if c.get('avx512') else 'no'}, AMX {'yes' if c.get('amx') else 'no'})")


def table(medians, engines, args, title) -> str:
    """Rows of tok/s per (case, threads), a column per engine, then each engine / llama.cpp."""
    lines = [title]
    width = {e: max(14, len(e) + 2) for e in engines}  # a column per engine, wide enough for its name
    ratio_width = {e: max(20, len(e) + 8) for e in engines}
    head = f"{'case':<24}{'threads':>8}" + "".join(f"{e:>{width[e]}}" for e in engines)
    others = [e for e in engines if e != "llama.cpp"]
    if "llama.cpp" in engines:
        head += "  |" + "".join(f"{e + '/llama':>{ratio_width[e]}}" for e in others)
    lines.append(head)
    for case in args.cases:
        for threads in args.threads:
            row = f"{case_label(case, args):<24}{threads:>8}"
            row += "".join(f"{medians[(case, threads, e)]:>{width[e]}.1f}" if (case, threads, e) in medians
                           else f"{'-':>{width[e]}}" for e in engines)
            base = medians.get((case, threads, "llama.cpp"))
            if "llama.cpp" in engines:
                row += "  |" + "".join(
                    f"{medians[(case, threads, e)] / base:>{ratio_width[e] - 1}.2f}x"
                    if base and (case, threads, e) in medians else f"{'-':>{ratio_width[e]}}" for e in others)
            lines.append(row)
    return "\n".join(lines)


def report(medians, runs, engines, args, env, elapsed) -> str:
    lines = [table(medians, engines, args, f"\nmedian tok/s over {args.rounds} round(s); ratio = engine / llama.cpp "
                   f"(commit {env['commit']}, {env['date']}, {elapsed / 60:.1f} min; load average "
                   f"{env['load_avg_start'][0]:.2f} -> {env['load_avg_end'][0]:.2f})")]
    if "context" in args.cases:
        fills = []
        for threads in args.threads:
            for e in engines:
                got = [x["context"]["fill_tok_s"] for x in runs if x["engine"] == e and x["threads"] == threads
                       and "context" in x]
                if got:
                    fills.append(f"{e} {threads}t {statistics.median(got):.0f}")
        lines.append(f"filling {args.context} positions by prefills of {FILL_CHUNK} (tok/s): " + ", ".join(fills))
    for a, b in (("kvref-c", "kvref-numpy"), ("kvref-numpy", "transformers"), ("kvref-c", "transformers")):
        for threads in args.threads:
            if ("decode", threads, a) in medians and ("decode", threads, b) in medians:
                lines.append(f"decode {a} / {b} at {threads} thread(s): "
                             f"{medians[('decode', threads, a)] / medians[('decode', threads, b)]:.2f}x")
    rss = []
    for e in engines:
        got = [x["peak_rss_bytes"] for x in runs if x["engine"] == e]
        if got:
            rss.append(f"{e} {max(got) / 2**20:.0f} MiB")
    lines.append("peak RSS per worker (all its cases): " + ", ".join(rss))
    agree = first_tokens(runs, engines)
    if agree:
        lines.append("greedy decode tokens equal to kvref-numpy's (of the first 32): " + agree)
    return "\n".join(lines)


def roofline_fractions(runs, probes, engine, threads, case) -> list[float]:
    """Each round's fraction of the roofline for one engine: its rate x the bytes a step reads / that
    round's probe bandwidth (rounds without a probe are left out)."""
    got = {x["round"]: x for x in probes if x["threads"] == threads}
    return [x[case]["tok_s"] * got[x["round"]]["step_bytes"][case] / (got[x["round"]]["bandwidth_gb_s"] * 1e9)
            for x in runs if x["engine"] == engine and x["threads"] == threads and case in x and x["round"] in got]


def rooflines(runs, probes, engines, args) -> str:
    """Per decode case and thread count: the probe's median bandwidth, the bytes a step reads, and each
    engine's median fraction of the roofline (its rate x those bytes / its round's probe bandwidth)."""
    lines = []
    for case in ("decode", "context"):
        for threads in args.threads:
            got = {x["round"]: x for x in probes if x["threads"] == threads}
            if case not in args.cases or not got:
                continue
            bandwidth = statistics.median(x["bandwidth_gb_s"] for x in got.values())
            step = next(iter(got.values()))["step_bytes"][case]
            parts = []
            for e in engines:
                fractions = roofline_fractions(runs, probes, e, threads, case)
                if fractions:
                    parts.append(f"{e} {100 * statistics.median(fractions):.0f} %")
            lines.append(f"roofline, {case_label(case, args)}, {threads} thread(s): probe {bandwidth:.1f} GB/s "
                         f"(median of {len(got)} round(s)), a step reads {step / 2**20:.1f} MiB (the file's weights "
                         f"+ f16 K/V); reached: " + ", ".join(parts))
    return "\n".join(lines)


def first_tokens(runs, engines) -> str:
    ref = next((x["decode"]["tokens"] for x in runs if x["engine"] == "kvref-numpy" and "decode" in x), None)
    if ref is None:
        return ""
    out = []
    for e in engines:
        got = next((x["decode"]["tokens"] for x in runs if x["engine"] == e and "decode" in x), None)
        if got is not None and e != "kvref-numpy":
            same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            out.append(f"{e} {same}")
    return ", ".join(out)


if __name__ == "__main__":
    main()
