"""The machine a benchmark runs on, and what it lets a decode step reach: the read bandwidth of the fixed
probe, the bytes a step reads (weights, K/V) and the roofline they give, the process's memory, the
BLAS threads of the NumPy backend, and the facts a report names (CPU, load, version).
(kvref bench's module docstring says how each is measured.)"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

READ_TRIES = 7  # reads of the cache's K/V whose median rate times one read (kv_read)


def median(values):
    """statistics.median(values), imported here: statistics imports decimal, fractions and random
    (~0.5 MiB resident), which `kvref run` would otherwise load with the CLI."""
    import statistics

    return statistics.median(values)


def llc_bytes() -> int:
    """The largest CPU cache (sysfs, cpu0), or 32 MiB where sysfs does not say."""
    sizes = []
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=32 << 20)


def read_bandwidth(model, tries=READ_TRIES) -> dict:
    """Bytes per second the forward's threads read from memory: a buffer 4x the last-level cache (whole
    probe units), touched first, then read `tries` times whole (see the module docstring)."""
    threads = threads_of(model) or 1
    unit = 1 << 20
    nbytes = -(-4 * llc_bytes() // unit) * unit
    raw = np.ones(nbytes + 64, dtype=np.uint8)
    buf = raw[-raw.ctypes.data % 64:][:nbytes]  # 64-byte aligned, as the vector loads want
    probe = getattr(model.ops, "read_probe", None)
    seconds = []
    for _ in range(tries):
        if probe is None:
            seconds.extend(read_seconds([buf], threads, tries=1))
            continue
        start = time.perf_counter()
        probe(buf)
        seconds.append(time.perf_counter() - start)
    rates = sorted(nbytes / s for s in seconds)
    return {"bandwidth_gb_s": median(rates) / 1e9, "range_gb_s": [rates[0] / 1e9, rates[-1] / 1e9],
            "probe_bytes": nbytes, "threads": threads, "loads": getattr(model.ops, "isa", None) or "numpy"}


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every tensor but the embedding table, of which one row
    (none apart when the LM head is the table itself: the head reads all of it); of a mixture's expert
    stacks, the n_experts_used experts one position runs (expert_bytes); the int8 mode's projections as
    their packed copies (kvref.native.fused)."""
    w = model.weights
    stacks = {id(t) for lw in w.layers for t in expert_stacks(lw)}
    tensors = [t for lw in w.layers for t in vars(lw).values() if t is not None and id(t) not in stacks]
    tensors += [w.output_norm, w.output]
    row = 0 if w.output is w.tok_embeddings else tensor_nbytes(w.tok_embeddings) // model.config.vocab_size
    fused = getattr(model, "fused", None)
    read = tensor_nbytes if fused is None else \
        lambda t: fused.read_nbytes(t) if hasattr(t, "ggml_type") else tensor_nbytes(t)
    return sum(read(t) for t in tensors) + row + expert_bytes(model)["active"]


def expert_stacks(lw) -> list:
    """A layer's tensors with one slice per expert (LayerWeights.experts_*), the ones a step reads in part."""
    return [t for name, t in vars(lw).items() if name.startswith("experts_") and t is not None]


def expert_bytes(model) -> dict:
    """Bytes of a mixture's experts: "all" the model holds, and the "active" ones one position runs
    (n_experts_used of n_experts in each MoE layer); 0 for a dense model."""
    c = model.config
    total = sum(tensor_nbytes(t) for lw in model.weights.layers for t in expert_stacks(lw))
    return {"all": total, "active": total * c.n_experts_used // c.n_experts if c.n_experts else 0}


def kv_bytes_per_token(model, positions, kv_dtype) -> int:
    """Bytes of K/V one decode step at `positions` cached positions reads: each layer's attended ones."""
    c = model.config
    per_layer = kv_cache_bytes(model, 1, kv_dtype) // c.n_layers  # one position of one layer
    return int(sum(min(positions, c.window(layer) or positions) for layer in range(c.n_layers)) * per_layer)


def roofline(model, kv_dtype, decode_positions, context_positions) -> dict:
    """The measured read bandwidth and, per decode case (average positions given), the bytes a step
    reads and the fastest rate those bytes allow."""
    roof = read_bandwidth(model)
    weights = weight_bytes_per_token(model)
    for name, positions in (("decode", decode_positions), ("context", context_positions)):
        if positions:
            kv = kv_bytes_per_token(model, positions, kv_dtype)
            roof[name] = {"weight_bytes": weights, "kv_bytes": kv,
                          "roofline_tok_s": roof["bandwidth_gb_s"] * 1e9 / (weights + kv)}
    return roof


def tensor_nbytes(t) -> int:
    """Bytes of a tensor as held: an array's, or a QuantizedTensor's blocks."""
    return int(t.data.nbytes if hasattr(t, "data") and not isinstance(t, np.ndarray) else t.nbytes)


def read_seconds(arrays, threads=1, tries=READ_TRIES) -> list[float]:
    """Seconds to read every byte of `arrays` once, `tries` times: `threads` Python threads each take
    np.max over its share of every array (a uint8 view: a reduction that keeps up with the cache and
    releases the GIL, so the figure is the memory's). For arrays larger than the last-level cache
    this is DRAM; a smaller cache is partly read from that cache, as attention reads it."""
    from concurrent.futures import ThreadPoolExecutor

    flat = [a.reshape(-1).view(np.uint8) for a in arrays]
    splits = [np.array_split(f, threads) for f in flat]
    shares = [[parts[i] for parts in splits] for i in range(threads)]

    def read(share):
        for part in share:
            part.max(initial=0)

    seconds = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(tries):
            start = time.perf_counter()
            list(pool.map(read, shares))
            seconds.append(time.perf_counter() - start)
    return seconds


def kv_read(split, cache, kv_bytes, threads) -> dict:
    """Attention time per decode step beside the time to read that K/V once from memory (the floor a
    memory-bound attention cannot beat; their ratio is the figure judged). The cache's own arrays are
    read READ_TRIES times right after the profiled pass, with as many threads as the forward used; the
    median read rate gives the time of kv_bytes (the K/V of every layer at the context length; the
    arrays also hold the slots of the decoded steps)."""
    arrays = [a for _, a in cache.store.arrays()]  # K, V and any int8 scales (a paged cache: its pool's)
    stored = sum(a.nbytes for a in arrays)
    seconds = read_seconds(arrays, threads)
    rates = sorted(stored / s for s in seconds)
    rate = median(rates)
    read_ms = 1e3 * kv_bytes / rate
    attention_ms = split["ms_per_token"]["attention"]
    return {"kv_bytes": kv_bytes, "bandwidth_gb_s": rate / 1e9,
            "bandwidth_range_gb_s": [rates[0] / 1e9, rates[-1] / 1e9], "threads": threads, "read_ms": read_ms,
            "attention_ms": attention_ms, "ratio": attention_ms / read_ms}


def kv_cache_bytes(model, positions, kv_dtype) -> int:
    # what `positions` positions of this K/V type occupy and a step reads: elements plus int8 scales
    # and kivi4 (scale, zero) pairs at the default group size
    from ..cache import bytes_per_position

    c = model.config
    kv_heads, width, _, latent_dim = c.cache_geometry()  # MLA: one latent key per layer and position
    return positions * bytes_per_position(c.n_layers, kv_heads, width, kv_dtype, latent_dim=latent_dim)


def kvref_version():
    from .. import __version__

    return __version__


# ---- machine, threads, memory ----------------------------------------------------------------------

def machine(load_start=None) -> dict:
    return {"cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(), "cpu": _cpu_name(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__,
            "load_avg_start": list(load_start) if load_start else None, "load_avg_end": list(os.getloadavg())}


def _cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def threads_of(model):
    """Threads the model's kernels run on: the native pool's size, or the NumPy BLAS thread count."""
    n = getattr(model.ops, "threads", None)
    return n if n is not None else blas_threads()


def _blas_functions():
    """(get, set) of the OpenBLAS NumPy links, found in this process' mapped libraries, or (None, None)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None, None
    libs = sorted({line.split()[-1] for line in maps.splitlines() if "openblas" in line.lower() and ".so" in line})
    for path in libs:
        try:
            dll = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas_", "openblas_"):
            for suffix in ("64_", ""):
                get = getattr(dll, f"{prefix}get_num_threads{suffix}", None)
                put = getattr(dll, f"{prefix}set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    get.restype = ctypes.c_int
                    put.argtypes = [ctypes.c_int]
                    return get, put
    return None, None


def blas_threads(n: int | None = None) -> int | None:
    """NumPy's OpenBLAS thread count (set it first when n is given); None when it cannot be read."""
    get, put = _blas_functions()
    if get is None:
        return None
    if n is not None:
        put(int(n))
    return int(get())


def current_rss() -> int | None:
    return _status_bytes("VmRSS")


def peak_rss() -> dict:
    """Peak resident set size of this process so far: getrusage (KiB on Linux) and VmHWM."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    maxrss *= 1 if sys.platform == "darwin" else 1024
    return {"maxrss": maxrss, "vmhwm": _status_bytes("VmHWM")}


def _status_bytes(field) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
