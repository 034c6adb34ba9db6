"""`kvref bench`: prefill and decode speed, decode speed over a long cache, where the time of a
token goes, and peak memory, for one model, backend and thread count.

    kvref bench [-m PATH] [--backend c|numpy|auto] [--threads N] [--prompt-tokens 32]
                [--new-tokens 128] [--context N] [--prefill-tokens 512] [--repeat R] [--json]

What is measured (every rate is a median over --repeat runs, after one warm-up run):

  prefill    one execution over a --prefill-tokens prompt into an empty cache: tokens / seconds
  decode     a --prompt-tokens prompt is prefilled (not timed), then --new-tokens decode steps, each
             one forward over the token just selected plus the greedy choice of the next: steps / seconds
  context    the cache is filled with --context positions by prefills of FILL_CHUNK positions (not
             timed), then --context-steps decode steps are timed as above; every repeat decodes from
             a fork of the filled cache, so each reads the same cache length
  split      a separate profiled pass of each of the above (one run): milliseconds per token by
             kernel family, from a KernelClock (below)
  kv read    the context cache's stored K/V arrays read READ_TRIES times with as many threads as the
             forward (np.max): attention's time per token beside the time to read that K/V once
             at the median rate, the floor a memory-bound attention cannot beat
  roofline   the read bandwidth of this machine, measured in the same run with the forward's threads
             by a fixed probe (a buffer 4x the last-level cache, read whole READ_TRIES times with
             the native kernels' vector loads; the NumPy backend reads it with np.max), and for each
             decode case the bytes one step reads (every weight but the embedding table, one
             embedding row, and the K/V of the positions each layer attends to, on average over the
             timed steps): bandwidth / bytes is the fastest a step can be; measured / that, the
             fraction of the roofline reached
  memory     peak RSS of the process (getrusage ru_maxrss and /proc/self/status VmHWM) as the GGUF
             file size + the bytes of the largest cache used + the rest, the runtime overhead
             (interpreter, libraries, tokenizer, scratch); with --budget MIB, whether the peak stayed
             within that many MiB

The targets these figures are judged against, and the figures measured, are in docs/benchmarks.md.

Kernel families: projections (matmul: Q/K/V/O, the MLP and the LM head), attention, other (embedding,
RMSNorm, RoPE, SwiGLU), and python: the rest of the wall time of an execution (the decoder's loop,
residual adds, cache writes, argument checks, the greedy choice).

A KernelClock is where the split comes from; two sources feed the same report:

  - "native counters": the model's forward keeps its own timers (the fused C forward does:
    Model.timings() -> {"projections", "attention", "other": seconds, "calls": forwards}, and
    Model.reset_timings()); the pass runs the normal forward;
  - "kernel shims": the model's kernel set (model.ops) is wrapped so that every kernel call is
    timed, and the profiled pass runs the shared decoder kernel by kernel with it. On the native
    backend this is the kernel-by-kernel path, not the fused forward: the report names its source.

Timing shims add two clock reads and some bookkeeping to every kernel call, so the profiled pass is
kept apart from the timed runs: the rates are never measured with instrumentation on.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..executor import describe
from ..generation.sampling import greedy
from .common import (Progress, activations, add_activations_argument, add_model_arguments, count, count_in,
                     human_bytes, plural)
from .machine import (READ_TRIES, blas_threads, current_rss, expert_bytes, kv_cache_bytes, kv_read, kvref_version,
                      machine, median, peak_rss, roofline, tensor_nbytes, threads_of)


FAMILIES = ("projections", "attention", "other")
#: which family each kernel of the kernel set belongs to
KERNEL_FAMILY = {"matmul": "projections", "matmul_experts": "projections", "attention": "attention",
                 "embed": "other", "rms_norm": "other", "rope": "other", "swiglu": "other", "geglu": "other",
                 "route": "other"}
FILL_CHUNK = 512  # positions per prefill when filling the cache for --context (bounds attention scratch)
WARMUP_PROMPT, WARMUP_STEPS = 8, 4

# Real text for prompts: repeated to any length, the same for every engine (benchmarks/compare.py)
PASSAGE = (
    "The KV cache stores the keys and values of every position already processed, so that each new "
    "token only needs its own query, key and value. Without it, every decode step would recompute the "
    "whole history from the first position, and the work of generating a text would grow with the square "
    "of its length. With it, a decode step reads the cache once and appends one position. The price is "
    "memory: two vectors per layer, per kv head and per position, which for a long conversation can "
    "exceed the size of the weights themselves. Grouped-query attention shares each key and value head "
    "among several query heads and shrinks the cache by the same factor. ")


# ---- prompts ---------------------------------------------------------------------------------------

def prompt_ids(tokenizer, n: int, vocab_size: int | None = None) -> list[int]:
    """n token ids of real text (PASSAGE repeated) from `tokenizer`; without one, n fixed ids in
    [0, vocab_size). Deterministic: every engine and every run gets the same prompt."""
    if n <= 0:
        return []
    if tokenizer is None:
        return [int(i) for i in (np.arange(n, dtype=np.int64) * 7919 + 13) % vocab_size]
    one = tokenizer.encode(PASSAGE)
    return (one * (n // len(one) + 1))[:n]


def model_prompt(model, n: int) -> list[int]:
    return prompt_ids(model.tokenizer, n, model.config.vocab_size)


# ---- kernel clocks ---------------------------------------------------------------------------------

class TimedOps:
    """A kernel set that times every call of another one, by kernel family (the "kernel shims")."""

    def __init__(self, ops):
        self._ops = ops
        self.seconds = dict.fromkeys(FAMILIES, 0.0)
        self.calls = 0
        self.expert_bytes = 0  # bytes of experts' matrices matmul_experts read: each expert named once per call
        for name, family in KERNEL_FAMILY.items():
            setattr(self, name, self._shim(getattr(ops, name), family))
        timed_experts = self.matmul_experts

        def matmul_experts(x, w, experts):  # [R, K], [X, N, K], [R] -> [R, N]
            self.expert_bytes += len(np.unique(experts)) * tensor_nbytes(w) // w.shape[0]
            return timed_experts(x, w, experts)

        self.matmul_experts = matmul_experts

    def _shim(self, kernel, family):
        clock, seconds = time.perf_counter, self.seconds

        def timed(*args, **kwargs):
            start = clock()
            try:
                return kernel(*args, **kwargs)
            finally:
                seconds[family] += clock() - start
                self.calls += 1

        timed.__name__ = getattr(kernel, "__name__", family)
        return timed

    def __getattr__(self, name):  # anything else the decoder may look up (constants, helpers)
        return getattr(self._ops, name)


class ShimClock:
    """KernelClock over kernel shims: `model` is a copy of the model running the spec executor over TimedOps."""

    source = "kernel shims"

    def __init__(self, model):
        self.ops = TimedOps(model.ops)
        self.model = model.with_kernels(self.ops, "kvref bench times the shared decoder kernel by kernel")

    def reset(self):
        self.ops.seconds.update(dict.fromkeys(FAMILIES, 0.0))
        self.ops.calls = 0
        self.ops.expert_bytes = 0

    def read(self) -> dict:
        return dict(self.ops.seconds)

    @property
    def expert_bytes(self) -> int:
        return self.ops.expert_bytes


class CounterClock:
    """KernelClock over the counters the model's forward keeps itself (Model.timings())."""

    source = "native counters"

    def __init__(self, model):
        self.model = model
        self.calls = 0
        self.expert_bytes = 0  # the routed experts' bytes the C forward read, as of the last read()

    def reset(self):
        self.model.reset_timings()

    def read(self) -> dict:
        t = self.model.timings()
        self.calls = int(t["calls"])
        self.expert_bytes = int(t["expert_bytes"])
        return {f: float(t[f]) for f in FAMILIES}


def kernel_clock(model, source: str = "auto"):
    """A KernelClock for `model`: "native" counters, "shims", or "auto" (counters when the forward has
    them, else shims)."""
    if source not in ("auto", "native", "shims"):
        raise ConfigError(f"profile source {source!r} is unknown; expected 'auto', 'native' or 'shims'")
    if source in ("auto", "native") and model.timings() is not None:
        return CounterClock(model)
    if source == "native":
        raise ConfigError(f"the {model.backend!r} backend's forward keeps no kernel counters; use --profile shims")
    return ShimClock(model)


# ---- measurements ----------------------------------------------------------------------------------

QUIET = Progress(enabled=False)


def time_prefill(model, ids, kv_dtype=None) -> float:
    """Seconds of one execution over `ids` into an empty cache."""
    cache = model.new_cache(capacity=len(ids), kv_dtype=kv_dtype)
    start = time.perf_counter()
    model.forward(ids, cache)
    return time.perf_counter() - start


def time_decode(model, cache, first_token: int, steps: int, progress=None, label="decode") -> float:
    """Seconds of `steps` decode steps (forward over the last selected token + greedy choice)."""
    progress = progress or QUIET
    token = first_token
    start = time.perf_counter()
    for i in range(steps):
        token = greedy(model.forward([token], cache))
        progress(f"{label} step {i + 1}/{steps}")
    return time.perf_counter() - start


def fill(model, cache, ids, progress=None, label="filling the cache") -> int:
    """Prefill `ids` in chunks of FILL_CHUNK positions; returns the greedy token after the last one."""
    progress = progress or QUIET
    logits = None
    for start in range(0, len(ids), FILL_CHUNK):
        logits = model.forward(ids[start:start + FILL_CHUNK], cache)
        progress(f"{label} {min(start + FILL_CHUNK, len(ids))}/{len(ids)} positions")
    return greedy(logits)


def profile(clock, prompt, steps, kv_dtype=None, cache=None, progress=None, label="profile") -> dict | None:
    """Milliseconds per token by kernel family: a prefill of `prompt` when steps == 0, else `steps`
    decode steps after it. With `cache` (already filled), decode continues it and prompt is [the next token].
    python = the wall time not spent inside a kernel. None when a CounterClock's forward did not run."""
    runner = clock.model
    if steps == 0:
        cache = runner.new_cache(capacity=len(prompt), kv_dtype=kv_dtype)
        clock.reset()
        start = time.perf_counter()
        runner.forward(prompt, cache)
        wall, n = time.perf_counter() - start, len(prompt)
    else:
        if cache is None:
            cache = runner.new_cache(capacity=len(prompt) + steps, kv_dtype=kv_dtype)
            token = fill(runner, cache, prompt, progress, f"{label}: filling")
        else:
            token = prompt[-1]
        clock.reset()
        wall, n = time_decode(runner, cache, token, steps, progress, label), steps
    seconds = clock.read()
    if isinstance(clock, CounterClock) and clock.calls == 0:
        return None  # the forward did not run where its counters are (it fell back to the decoder)
    ms = {f: 1e3 * seconds[f] / n for f in FAMILIES}
    total = 1e3 * wall / n
    ms["python"] = max(total - sum(ms.values()), 0.0)
    result = {"source": clock.source, "tokens": n, "ms_per_token": ms, "total_ms_per_token": total}
    if runner.config.n_experts:  # a mixture: the bytes of the experts its routers chose, counted
        result["expert_bytes_per_token"] = clock.expert_bytes / n
    return result


def run(model, *, prompt_tokens=32, new_tokens=128, context=0, context_steps=64, prefill_tokens=512,
        repeat=3, kv_dtype=None, profile_source="auto", split=True, progress=None, model_path=None,
        budget_bytes=None) -> dict:
    """Run every measurement on `model`; a JSON-ready dict (see the module docstring). budget_bytes: a
    limit on peak RSS the memory figures are judged against (None: no verdict)."""
    progress = progress or QUIET
    for name, value in (("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens), ("context", context),
                        ("context_steps", context_steps), ("prefill_tokens", prefill_tokens), ("repeat", repeat)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigError(f"{name}={value!r} must be a whole number >= 0")
    if repeat < 1:
        raise ConfigError("repeat must be at least 1")
    if new_tokens and not prompt_tokens:
        raise ConfigError("decode needs a prompt: --prompt-tokens must be at least 1")
    max_len = model.config.max_seq_len
    for what, n in (("prefill-tokens", prefill_tokens), ("prompt-tokens + new-tokens", prompt_tokens + new_tokens),
                    ("context + context-steps", context + context_steps if context else 0)):
        if n > max_len:
            raise ConfigError(f"{what} = {n} exceeds the model's max_seq_len = {max_len}")
    clock = kernel_clock(model, profile_source) if split else None
    kv = model.dtype if kv_dtype is None else kv_dtype
    rss_before = current_rss()
    load_start = os.getloadavg()

    progress("warm-up", force=True)
    warm = model_prompt(model, min(WARMUP_PROMPT, max_len - WARMUP_STEPS))
    cache = model.new_cache(capacity=len(warm) + WARMUP_STEPS, kv_dtype=kv_dtype)
    executor = describe(model.executor(cache))  # every cache of the run has this layout and K/V type
    time_decode(model, cache, fill(model, cache, warm), WARMUP_STEPS)

    prefill_s, decode_s, context_s = [], [], []
    prefill_prompt = model_prompt(model, prefill_tokens)
    decode_prompt = model_prompt(model, prompt_tokens)
    cache_sizes = [0]
    for r in range(repeat):
        tag = f"run {r + 1}/{repeat}:"
        if prefill_tokens:
            progress(f"{tag} prefill {prefill_tokens} tokens", force=True)
            prefill_s.append(time_prefill(model, prefill_prompt, kv_dtype))
            cache_sizes.append(kv_cache_bytes(model, prefill_tokens, kv))
        if new_tokens:
            cache = model.new_cache(capacity=prompt_tokens + new_tokens, kv_dtype=kv_dtype)
            token = fill(model, cache, decode_prompt)
            decode_s.append(time_decode(model, cache, token, new_tokens, progress, f"{tag} decode"))
            cache_sizes.append(cache.nbytes)
    result_context = None
    if context and context_steps:
        ids = model_prompt(model, context)
        cache = model.new_cache(capacity=context + context_steps, kv_dtype=kv_dtype)
        start = time.perf_counter()
        token = fill(model, cache, ids, progress, f"context {context}: filling")
        fill_s = time.perf_counter() - start
        for r in range(repeat):
            run = cache.fork()  # every run decodes from the same filled cache (a hybrid cannot roll back far)
            context_s.append(time_decode(model, run, token, context_steps, progress,
                                         f"context {context}: run {r + 1}/{repeat}"))
            cache_sizes.append(run.nbytes)
            run.free()
        result_context = {"context": context, "steps": context_steps, **_rate(context_steps, context_s),
                          "fill_tok_s": context / fill_s}
        context_cache, context_token = cache, token  # the profiled pass decodes over the same cache

    splits = {}
    if clock is not None:
        plans = [("prefill", prefill_prompt, 0), ("decode", decode_prompt, new_tokens)]
        if result_context:
            plans.append(("context", [context_token], context_steps))
        for name, ids, steps in plans:
            if not ids or not (steps or name == "prefill"):
                continue
            for attempt in range(2):
                cache = None
                if name == "context":
                    cache = context_cache.fork()
                got = profile(clock, ids, steps, kv_dtype, cache, progress, f"profiling {name}")
                if got is not None:
                    break
                clock = ShimClock(model)  # the counters stayed at zero: the forward fell back to the decoder
            splits[name] = got
    peak = peak_rss()
    progress("measuring the read bandwidth", force=True)
    roof = roofline(model, kv, prompt_tokens + new_tokens / 2 if new_tokens else None,
                    context + context_steps / 2 if result_context else None)
    for name, rate in (("decode", new_tokens and _rate(new_tokens, decode_s)), ("context", result_context)):
        if rate:
            roof[name]["fraction"] = rate["tok_s"] / roof[name]["roofline_tok_s"]
    if splits.get("context"):
        progress("reading the cache's K/V", force=True)
        splits["context"]["kv_read"] = kv_read(splits["context"], context_cache, kv_cache_bytes(model, context, kv),
                                               threads_of(model) or 1)
    progress.done()

    file_bytes = Path(model_path).stat().st_size if model_path else None
    cache_max = max(cache_sizes)
    memory = {"peak_rss_bytes": peak["maxrss"], "vmhwm_bytes": peak["vmhwm"], "rss_before_bytes": rss_before,
              "file_bytes": file_bytes, "cache_bytes": cache_max}
    if file_bytes is not None:
        memory["overhead_bytes"] = peak["maxrss"] - file_bytes - cache_max  # < 0: file pages never read
    if budget_bytes is not None:
        memory["budget_bytes"] = budget_bytes
        memory["within_budget"] = bool(peak["maxrss"] <= budget_bytes)
    return {
        "kvref_version": kvref_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(load_start),
        "model": {"path": str(model_path) if model_path else None, "file_bytes": file_bytes,
                  "n_layers": model.config.n_layers, "d_model": model.config.d_model,
                  "vocab_size": model.config.vocab_size},
        "backend": model.backend,
        "threads": threads_of(model),
        "isa": getattr(model.ops, "isa", None),
        "executor": executor,
        "kv_dtype": kv,
        "settings": {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "context": context,
                     "context_steps": context_steps, "prefill_tokens": prefill_tokens, "repeat": repeat},
        "prefill": {"tokens": prefill_tokens, **_rate(prefill_tokens, prefill_s)} if prefill_tokens else None,
        "decode": {"prompt_tokens": prompt_tokens, "steps": new_tokens, **_rate(new_tokens, decode_s)}
        if new_tokens else None,
        "context_decode": result_context,
        "split": splits,
        "roofline": roof,
        "experts": {**expert_bytes(model), "experts": model.config.n_experts, "used": model.config.n_experts_used}
        if model.config.n_experts else None,
        "memory": memory,
    }





def _rate(n, seconds) -> dict:
    med = median(seconds)
    return {"tok_s": n / med, "ms_per_token": 1e3 * med / n, "seconds": [round(s, 6) for s in seconds]}


# ---- the command -----------------------------------------------------------------------------------

def add_bench(commands):
    """Register `kvref bench` on the CLI's subcommands."""
    p = commands.add_parser("bench", help="prefill/decode tokens/s, time per token by kernel family, peak memory")
    add_model_arguments(p)
    add_activations_argument(p)
    p.add_argument("--threads", type=count, default=None,
                   help="native pool size, or NumPy BLAS threads (default: KVREF_THREADS, else every core)")
    p.add_argument("--prompt-tokens", type=count, default=32, help="prompt before the decode steps (default 32)")
    p.add_argument("--new-tokens", type=count, default=128, help="decode steps timed (default 128; 0 skips)")
    p.add_argument("--prefill-tokens", type=count, default=512, help="prompt timed as one prefill (default 512; 0 skips)")
    p.add_argument("--context", type=count, default=0, help="also time decode at N cached positions (default 0: skip)")
    p.add_argument("--context-steps", type=count, default=64, help="decode steps timed at --context (default 64)")
    p.add_argument("--kv-dtype", default=None, help="K/V element type of the cache (default: the model dtype)")
    p.add_argument("--repeat", type=count, default=3, help="timed runs; medians are reported (default 3)")
    p.add_argument("--profile", default="auto", choices=["auto", "native", "shims", "none"],
                   help="source of the per-kernel split (default auto: native counters when the forward has them)")
    p.add_argument("--budget", type=count_in(1), default=None, metavar="MIB",
                   help="a limit on the process's peak RSS, in MiB: the memory line then says whether the run "
                        "stayed within it (docs/benchmarks.md's target is the file + the cache + 60 MB); "
                        "default: the figures alone, no verdict")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run_bench)


def run_bench(args) -> int:
    from ..loader import load, model_path

    progress = Progress(label="kvref bench")
    path = model_path(args.model)
    progress(f"loading {path.name}", force=True)
    model = load(path, backend=args.backend, threads=args.threads, activations=activations(args))
    if model.backend == "numpy" and args.threads is not None and blas_threads(args.threads) is None:
        print("kvref bench: cannot set NumPy's BLAS threads here; set OPENBLAS_NUM_THREADS before starting",
              file=sys.stderr)
    result = run(model, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, context=args.context,
                 context_steps=args.context_steps, prefill_tokens=args.prefill_tokens, repeat=args.repeat,
                 kv_dtype=args.kv_dtype, profile_source="auto" if args.profile == "none" else args.profile,
                 split=args.profile != "none", progress=progress, model_path=path,
                 budget_bytes=None if args.budget is None else args.budget * 2**20)
    result["command"] = command_line(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(report(result))
    return 0


def command_line(args) -> str:
    """The kvref bench command that reproduces this run, every setting spelled out."""
    parts = ["kvref bench"]
    if args.model:
        parts.append(f"-m {args.model}")
    parts.append(f"--backend {args.backend}")
    if args.threads is not None:
        parts.append(f"--threads {args.threads}")
    parts += [f"--prompt-tokens {args.prompt_tokens}", f"--new-tokens {args.new_tokens}",
              f"--prefill-tokens {args.prefill_tokens}"]
    if args.context:
        parts.append(f"--context {args.context} --context-steps {args.context_steps}")
    if args.kv_dtype:
        parts.append(f"--kv-dtype {args.kv_dtype}")
    parts.append(f"--repeat {args.repeat}")
    if args.profile != "auto":
        parts.append(f"--profile {args.profile}")
    if args.budget is not None:
        parts.append(f"--budget {args.budget}")
    return " ".join(parts + (["--json"] if args.json else []))


def report(r: dict) -> str:
    """The human-readable table of a run() result."""
    m = r["model"]
    name = Path(m["path"]).name if m["path"] else "model"
    size = f" ({human_bytes(m['file_bytes'])})" if m["file_bytes"] else ""
    load = r["machine"]["load_avg_start"]
    repeat = r["settings"]["repeat"]
    lines = [f"kvref bench: {name}{size}, backend {r['backend']} ({plural(r['threads'], 'thread')}"
             + (f", {r['isa']}" if r["isa"] else "") + f"), K/V {r['kv_dtype']}, "
             + (f"medians of {repeat} runs" if repeat != 1 else "1 run") + f"; load average {load[0]:.2f} at start",
             f"  executor: {r['executor']}"]
    if r["prefill"]:
        p = r["prefill"]
        lines.append(f"  prefill  {p['tokens']:>5} tokens                  {p['tok_s']:9.1f} tok/s"
                     f"  ({p['ms_per_token'] * p['tokens'] / 1e3:.3f} s)")
    if r["decode"]:
        d = r["decode"]
        lines.append(f"  decode   {d['steps']:>5} steps after {d['prompt_tokens']:>5}       {d['tok_s']:9.1f} tok/s"
                     f"  ({d['ms_per_token']:.2f} ms/token)")
    if r["context_decode"]:
        c = r["context_decode"]
        lines.append(f"  decode   {c['steps']:>5} steps at {c['context']:>6} cached  {c['tok_s']:9.1f} tok/s"
                     f"  ({c['ms_per_token']:.2f} ms/token; filled at {c['fill_tok_s']:.1f} tok/s)")
    if r["split"]:
        sources = sorted({s["source"] for s in r["split"].values() if s})
        lines.append(f"time per token by kernel family, ms (profiled pass, {' + '.join(sources)}):")
        lines.append(f"  {'':<9}{'projections':>12}{'attention':>11}{'other':>8}{'python':>8}{'total':>8}")
        for what, s in r["split"].items():
            if s:
                ms = s["ms_per_token"]
                lines.append(f"  {what:<9}{ms['projections']:>12.3f}{ms['attention']:>11.3f}{ms['other']:>8.3f}"
                             f"{ms['python']:>8.3f}{s['total_ms_per_token']:>8.3f}")
    experts = r.get("experts")
    if experts:
        counted = [f"{what} {human_bytes(s['expert_bytes_per_token'])}" for what, s in r["split"].items()
                   if s and "expert_bytes_per_token" in s]
        lines.append(f"experts read per token (profiled pass): {', '.join(counted) or 'not profiled'}; the active "
                     f"experts' bytes {human_bytes(experts['active'])} of {human_bytes(experts['all'])} "
                     f"({experts['used']} of {experts['experts']} experts per MoE layer)")
    read = (r["split"].get("context") or {}).get("kv_read")
    if read:
        lines.append(f"attention at {r['settings']['context']} cached: {read['attention_ms']:.2f} ms per token = "
                     f"{read['ratio']:.2f}x the time to read its K/V once ({human_bytes(read['kv_bytes'])} at "
                     f"{read['bandwidth_gb_s']:.1f} GB/s, the median of {READ_TRIES} reads of the cache with "
                     f"{plural(read['threads'], 'thread')}: {read['bandwidth_range_gb_s'][0]:.1f}-"
                     f"{read['bandwidth_range_gb_s'][1]:.1f} GB/s)")
    roof = r.get("roofline")
    if roof:
        lines.append(f"roofline: reads at {roof['bandwidth_gb_s']:.1f} GB/s ({roof['range_gb_s'][0]:.1f}-"
                     f"{roof['range_gb_s'][1]:.1f}; median of {READ_TRIES} reads of {human_bytes(roof['probe_bytes'])} "
                     f"with {plural(roof['threads'], 'thread')}, {roof['loads']} loads)")
        for name in ("decode", "context"):
            case = roof.get(name)
            if case and "fraction" in case:
                step = case["weight_bytes"] + case["kv_bytes"]
                lines.append(f"  {name:<8} {human_bytes(step)} per step (weights {human_bytes(case['weight_bytes'])}"
                             f" + K/V {human_bytes(case['kv_bytes'])}): at most {case['roofline_tok_s']:.1f} tok/s;"
                             f" {case['fraction']:.0%} of it reached")
    lines.append(memory_line(r["memory"]))
    return "\n".join(lines)


def memory_line(mem: dict) -> str:
    """Peak RSS as file + cache + runtime overhead; a verdict only against a budget the user gave."""
    line = f"memory: peak RSS {human_bytes(mem['peak_rss_bytes'])}"
    if mem["vmhwm_bytes"]:
        line += f" (VmHWM {human_bytes(mem['vmhwm_bytes'])})"
    if mem["file_bytes"] is None:
        line += f"; largest cache {human_bytes(mem['cache_bytes'])}"
    else:
        overhead = mem["overhead_bytes"]
        line += (f" = file {human_bytes(mem['file_bytes'])} + largest cache {human_bytes(mem['cache_bytes'])} "
                 + (f"+ runtime overhead {human_bytes(overhead)}" if overhead >= 0 else
                    f"- {human_bytes(-overhead)} of the file never read"))
    if "budget_bytes" in mem:
        budget = mem["budget_bytes"]
        line += (f"; within the --budget of {human_bytes(budget)}" if mem["within_budget"] else
                 f"; OVER the --budget of {human_bytes(budget)} by {human_bytes(mem['peak_rss_bytes'] - budget)}")
    return line
