"""The one rule for comparing two computations of the same logits, with its per-dtype constants.

    |actual - reference| <= atol + rtol * |reference|        elementwise

The reference is the more exact computation (a float64 spec run is the oracle for everything).
Alongside pass/fail, a comparison reports what a reader needs to judge it: the largest absolute
difference, how often the top-1 token agrees, and the KL divergence of the next-token distributions.

Every bound the tests state lives here, named, with the arithmetic it covers and why it has its
size: the two per-dtype rules (FLOAT64, FLOAT32), the rules of narrower comparisons, the building
blocks of derived bounds (u, gamma, UNDERFLOW_SLACK), and measured bounds with their measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .spec.ops import log_softmax


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# Same arithmetic in a different association order (one matmul over T rows vs T matmuls over
# one row): float64 rounding (2**-53 ~ 1.1e-16) grows by at most a few hundred through a
# 4-layer model, far below 1e-10.
FLOAT64 = Tolerance(atol=1e-10, rtol=1e-10)
# float32 rounds at 2**-24 ~ 6e-8 per operation; BLAS sums a T-row product in a different
# order than T one-row products, and the differences pass through every layer. Measured over
# 300 random models (1-4 layers, E <= 48, head_dim <= 64, 64 positions, token by token vs one
# prefill): worst |diff| 2.5e-5 with logits up to ~5, i.e. ~120 ulps of the largest logit.
# 1e-4 keeps a 4x margin; a real bug (a wrong position, a missing or extra key) moves logits
# by O(0.1).
FLOAT32 = Tolerance(atol=1e-4, rtol=1e-4)

TOLERANCES = {"float64": FLOAT64, "float32": FLOAT32}


# ---- building blocks of derived bounds ----------------------------------------------------------

FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24  # u: one float32 rounding to nearest moves a value by <= u |value|


def gamma(n):
    """n u / (1 - n u): bounds the relative error of any n-term float32 sum or dot product, in any
    order, with or without FMA (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 3.1)."""
    return n * FLOAT32_UNIT_ROUNDOFF / (1 - n * FLOAT32_UNIT_ROUNDOFF)


# Added to bounds built from magnitudes, which are 0 where every product underflows: below the
# smallest normal float32 (2**-126 ~ 1.2e-38) results lose relative precision, but each operation
# still errs by at most 2**-150 ~ 7e-46, so 1e-37 covers thousands of them and no real value.
UNDERFLOW_SLACK = 1e-37

# RoPE in float64, rounded once to float32, on two implementations: float64 cos/sin of different
# libraries differ by a few 2**-53, which can flip that final rounding (one float32 ulp, <= 2**-23
# relative) and adds 2**-48 (|x_even| + |x_odd|) of its own.
ROPE_FLOAT32_RTOL = 2.0 ** -23
ROPE_FLOAT64_TRIG_ATOL = 2.0 ** -48  # times |x_even| + |x_odd| of the pair

# The int8 activation mode rounds x to q = rint(x / d), |x / d| <= 127: x * (1/d) carries <= 2u
# relative error before rint, so x - q d is at most d (1/2 + 254 u) = d (1/2 + 2**-16) per value.
INT8_ACTIVATION_ROUNDING = 0.5 + 2.0 ** -16  # in steps d of the block

# An int8 cache element is rint(x / scale) * scale: half a step, plus the float32 roundings of the
# division and the product (a few u of 127 steps: 1e-5 of a step is ~170 u).
INT8_KV_ROUNDING = 0.5 + 1e-5  # in steps (the group's scale)
# kivi4: the same half step of rint, of the group's scale (max - min) / 15; the float32 rounding of
# (x - zero) / scale and of q * scale + zero is bounded separately, relative to |x|
KIVI4_KV_ROUNDING = 0.5 + 1e-5

# An int8 K is scored with the query rounded like the int8 activation mode's blocks, per group b of the
# K scales (kvref.spec.ops.int8_key_scores): q_j - d_b q8_j is at most d_b INT8_ACTIVATION_ROUNDING, so
# against q . k over the decoded K (k_j = ks_b k8_j) a score moves by at most
#     scale sum_b d_b (1/2 + 2**-16) ks_b sum_{j in b} |k8_j|
# The group dot products I_b are exact integers; the float32 steps after them (fl(d_b scale), its product
# with ks_b, that with fl(I_b), and the sum of the D/g terms) add at most
#     gamma(D/g + 3) scale sum_b d_b ks_b sum_{j in b} |q8_j k8_j|
# and the softmax and value sum keep attention's own bound (tests/test_native.py, attention_bound).
INT8_KEY_QUERY_ROUNDING = INT8_ACTIVATION_ROUNDING  # in steps d_b of the query's group


# ---- narrower rules: one comparison each ---------------------------------------------------------

# One position's float32 logits computed as the last row of a 3-position execution and as the only
# row: the LM head may sum a row in another order for 1 row than for 3 (BLAS; the native kernels
# switch paths only at KVREF_GEMM_MIN_T = 9 rows). Measured: 2.4e-7 (1 ulp of the largest logit, 2.8) on the spec
# backend, 0 on the native one; 1e-6 is 4 ulps there.
FLOAT32_SAME_POSITION = Tolerance(atol=1e-6, rtol=1e-7)
# A decode step over a cache of at most 3 positions vs recomputing those <= 4 positions, float32,
# 2 layers (tests/test_model.py): the FLOAT32 situation on a history too short to accumulate much.
# Measured worst 7.2e-7; 1e-5 leaves ~14x.
FLOAT32_SHORT_HISTORY = Tolerance(atol=1e-5, rtol=1e-7)
# Two float32 runs of a real model that sum in different orders (decode steps against a one-shot
# prefill, a ring's attention against a full cache's, the C ring pass against the spec's): single
# roundings carried through every layer and grown by the activations' scale (Gemma 3's residual
# stream is large): measured up to 7e-4 on logits of ~25 on Gemma 3 270M; 2e-3 is ~3x that.
FLOAT32_REORDERED = Tolerance(atol=2e-3, rtol=1e-4)
# Speculative decoding: a verification execution computes the drafted positions as rows of one
# execution where plain decoding runs them one by one, and the cached K/V it leaves were computed that
# way too, so later steps read slightly different history: the FLOAT32_REORDERED situation on float32
# models (measured on random models: 1.4e-6 on the native backend, where rows 1-3 sum alike and 4+ do
# not, 1.2e-6 on the spec backend, whose BLAS sums 1 row and T rows differently), FLOAT64's on float64
# ones. Each logit may move by the bound, so a greedy selection can differ only where the top-2 margin
# is below twice it (speculative_margin_bound).
SPECULATIVE_VERIFICATION = {"float32": FLOAT32_REORDERED, "float64": FLOAT64}

def near_tie(logits, tolerance: Tolerance = FLOAT32_REORDERED) -> bool:
    """Whether two computations of these logits within `tolerance` could select different tokens: the
    top-2 margin is at most twice the bound at the largest of the two (each may move by atol + rtol |x|).
    Tests that compare greedy tokens of two float32 runs (alone vs batched, cold vs prefix-cached) accept a
    difference only at such a step, and report it."""
    z = np.sort(np.asarray(logits, dtype=np.float64))[-2:]  # [second, first]
    return bool(z[1] - z[0] <= margin_bound(z, tolerance))


def margin_bound(logits, tolerance: Tolerance) -> float:
    """Twice one logit's bound at the largest |logit|: two computations of these logits within
    `tolerance` agree on the top token wherever its lead is larger."""
    return 2 * (tolerance.atol + tolerance.rtol * float(np.max(np.abs(logits))))


# float16 K/V (11 significant bits: 2**-11 relative per element) against recomputation with float32
# K/V, last position, on any configuration of tests.conftest.configs, including degenerate shapes
# (d_model 4 feeding head_dim 64) that amplify K/V error and that QUANTIZED_LOGIT_BOUNDS leaves out.
# Measured worst over 300 of them (native backend, any chunking): 7.1e-3; 5e-2 leaves 7x.
FLOAT16_KV_LAST_LOGITS = Tolerance(atol=5e-2, rtol=1e-7)

# How far a quantized cache may move next-token logits against the same model with a float32 cache,
# as a fraction of the row's largest |logit|:  max|diff| <= bound x max|reference|  per position.
# A stored element carries relative error 2**-11 (float16), 2**-8 (bfloat16) or up to 1/254 of its
# group's max|x| (int8); attention and the later layers carry that into the logits. Measured over 300
# random models with d_model >= 16 and head_dim in {16, 32, 64} (1-4 layers, 64 positions): worst
# 1.2e-3 (float16), 7.8e-3 (bfloat16), 2.2e-2 (int8, default group). The bounds keep ~4x margin.
# kivi4 has 15 steps where int8 has 254 (a step of (max - min) / 15 of a channel's group of positions
# or a token's group of elements): worst 0.28 over the same 300 models (median 0.085), bound 0.8 (~3x).
# Degenerate shapes (d_model 5 feeding head_dim 30) amplify any K/V error far more and are not covered.
# On SmolLM2 the figures that matter are KL and top-1 (benchmarks/cache_quality.py, docs/cache-layouts.md).
QUANTIZED_LOGIT_BOUNDS = {"float16": 5e-3, "bfloat16": 3e-2, "int8": 8e-2, "kivi4": 0.8}
# The native attention over an int8 K rounds the query to 8 bits per group too (INT8_KEY_QUERY_ROUNDING):
# the same relative step as K's own rounding, so its logits stay within the int8 bound of the float-query
# attention the decoder runs on the decoded K, on the models QUANTIZED_LOGIT_BOUNDS covers (d_model >= 16).
# Measured over 150 random models of tests/test_native_fused.py (any family, layout and chunking, up to
# the first step where the two picked different tokens): worst 1.4e-2 of the row's largest |logit|.
# Degenerate shapes are out of its reach as they are of the cache's: with d_model 5 feeding 12 heads of
# head_dim 26 (QK-norm, 3 layers), the rounded query alone moved logits of 2.75 by 0.25 (9%), 18x what the
# int8 K itself moved them (0.014), while the C forward equalled the decoder on the same int8-key
# attention bit for bit: a per-element step of 1/254 of a group's max, but the tiny residual stream
# carries no averaging to shrink it, so no model-independent end-to-end bound exists there.
INT8_KEY_LOGIT_BOUND = QUANTIZED_LOGIT_BOUNDS["int8"]

# Bounds on SmolLM2 over 128 positions of docs/kv-cache.md against the float32 cache, as
# (mean KL in nats, top-1 agreement) per (K type, V type). Measured (benchmarks/cache_quality.py
# --positions 128, native backend): mean KL 5.6e-7 / 2.9e-5 / 1.05e-3 nats and top-1 100% / 100% /
# 96.1% for float16 / bfloat16 / int8 (group 32, the query rounded to 8 bits against the int8 K:
# INT8_KEY_QUERY_ROUNDING); the bounds leave ~3x (int8) to ~10x room on KL.
SMOLLM2_QUANTIZED_KV_BOUNDS = {("float16", "float16"): (5e-6, 0.99), ("bfloat16", "bfloat16"): (2e-4, 0.96),
                               ("int8", "int8"): (3e-3, 0.95), ("float16", "int8"): (3e-4, 0.96),
                               ("kivi4", "kivi4"): (0.1, 0.85)}
# kivi4 (group 32), measured the same way: mean KL 2.2e-2 in one prefill (every K quantized) and
# 1.4e-2 token by token, top-1 91.4% both; 0.1 leaves ~4.5x on KL, 0.85 eight positions on top-1.

# Logits that must differ (another seed, a changed token, a dropped position) differ by more than
# this: such changes move a random model's logits by O(0.1) to O(1) (the largest element of a changed
# token's own logits moved by >= 0.44 over 300 models of tests.conftest.configs; seeds 7 and 8 of
# tests/test_model.py differ by 3.5), float rounding by < 1e-6. So "not within VISIBLE_CHANGE" means
# a real change, with orders of magnitude on both sides (rtol is numpy.allclose's default).
VISIBLE_CHANGE = Tolerance(atol=1e-6, rtol=1e-5)

# A float64 spec kernel against its definition written out the long way (tests/test_ops.py): both
# round at 2**-53 ~ 1.1e-16 a handful of times on O(1) values, so 1e-12 relative leaves ~10**4 roundings
# (atol for probabilities that underflow toward 0 in one formula and not the other).
FLOAT64_KERNEL = Tolerance(atol=1e-15, rtol=1e-12)
# Attention in float64 against per-head loops: the exp of scores up to |q||k|/sqrt(D) ~ 10 and sums
# over up to 12 keys, where outputs near 0 come from cancelling terms of size ~1: 1e-10 relative,
# 1e-12 absolute, still ~10**4 roundings.
FLOAT64_ATTENTION = Tolerance(atol=1e-12, rtol=1e-10)
# RoPE scores at positions (m, n) and (m + s, n + s): float64 cos/sin of angles up to ~540 radians
# carry absolute error ~540 x 2**-53 ~ 6e-14 each; over D <= 32 terms of size ~1, 1e-9 (relative to
# 1 + |score|) is far above that and far below any real dependence on absolute position (O(1)).
ROPE_OFFSET_RTOL = 1e-9
# A float32 kernel against its float64 definition (softmax, SwiGLU, int8 scales = max / 127): a few
# float32 roundings (u ~ 6e-8 each) and exp/tanh within a few ulps: 1e-6 ~ 17 u.
FLOAT32_KERNEL_RTOL = 1e-6
# A float16 softmax summed in float64 over 4096 entries: each probability rounds to float16 once
# (2**-11 ~ 4.9e-4 relative), so the sum is within 4.9e-4 of 1; 1e-3 is 2x that.
FLOAT16_SUM_RTOL = 1e-3
# Token frequencies of 20000 seeded draws against the distribution: the standard deviation of a
# frequency p is sqrt(p (1 - p) / 20000) <= 0.0035, so 0.02 is ~6 standard deviations.
SAMPLING_FREQUENCY_ATOL = 0.02


@dataclass(frozen=True)
class Comparison:
    ok: bool
    max_abs_diff: float
    top1_agreement: float  # fraction of rows whose argmax agrees
    max_kl: float  # largest KL(softmax(reference) || softmax(actual)) over rows, in nats
    tolerance: Tolerance

    def __str__(self):
        return (f"max |diff| = {self.max_abs_diff:.3g} (atol {self.tolerance.atol:g}, rtol "
                f"{self.tolerance.rtol:g}), top-1 agreement {self.top1_agreement:.1%}, max KL {self.max_kl:.3g}")


def compare(actual, reference, dtype) -> Comparison:
    """Compare logits ([V] or [T, V]) under the tolerance of `dtype` (the less exact side's dtype),
    or under a Tolerance given instead (one of the named rules above)."""
    tol = dtype if isinstance(dtype, Tolerance) else TOLERANCES[np.dtype(dtype).name]
    a = np.atleast_2d(np.asarray(actual, dtype=np.float64))
    r = np.atleast_2d(np.asarray(reference, dtype=np.float64))
    if a.shape != r.shape:
        raise ValueError(f"shapes differ: actual {a.shape}, reference {r.shape}")
    diff = np.abs(a - r)
    ok = bool(np.all(diff <= tol.atol + tol.rtol * np.abs(r)))
    top1 = float(np.mean(np.argmax(a, axis=-1) == np.argmax(r, axis=-1)))
    return Comparison(ok, float(diff.max()), top1, float(np.max(kl_divergence(r, a))), tol)


def kl_divergence(reference_logits, actual_logits):
    # [..., V] x2 -> [...]: KL(P_reference || P_actual)
    lp, lq = log_softmax(reference_logits), log_softmax(actual_logits)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def assert_close(actual, reference, dtype, what: str = "") -> Comparison:
    result = compare(actual, reference, dtype)
    assert result.ok, f"{what}: {result}"
    return result


def speculative_margin_bound(logits, dtype) -> float:
    """Top-2 margin below which a speculative step's greedy selection may differ from plain decoding's:
    twice one logit's bound (SPECULATIVE_VERIFICATION) at the row's largest |logit|."""
    return margin_bound(logits, SPECULATIVE_VERIFICATION[np.dtype(dtype).name])


# ---- conformance (kvref/conformance, docs/conformance.md): an engine against the float32 spec -----

@dataclass(frozen=True)
class ConformanceBounds:
    """What an engine may differ from the float32 spec on the same file's weights, per position's
    next-token distribution (KL(spec || engine), nats), and what counts as a near-tie."""

    mean_kl: float  # mean over the scored positions
    max_kl: float  # worst position
    near_tie: float  # a top-1 disagreement is a near-tie when the spec's top-2 margin is below this
    same_engine_kl: float  # worst position of an engine against itself (chunking, batch, cache ops)


# An engine computing in float32 on the same float32 weights (kvref on either backend, transformers
# on a float32 checkpoint): logits differ by summation order only, up to FLOAT32_REORDERED's 2e-3 on
# logits of ~25 (Gemma 3); a logit perturbation d moves KL by at most ~max(d)^2 / 2 = 2e-6, so a
# max of 1e-5 and a mean of 1e-6 hold with room, while a wrong position, key or block moves KL by
# 1e-3 and more. Top-2 margins below 1e-2 can flip under 2e-3 logit noise. Against itself, an
# engine reorders sums even less (chunk boundaries, batch rows): the same 1e-5.
CONFORMANCE_FLOAT32 = ConformanceBounds(mean_kl=1e-6, max_kl=1e-5, near_tie=1e-2, same_engine_kl=1e-5)
# An engine that rounds on the way: a float16 K/V cache (2**-11 relative per element) and activations
# rounded to 8-bit blocks before each quantized matmul (llama.cpp on the CPU, kvref's int8 activation
# mode). Measured against the float32 spec on the same GGUF weights with llama.cpp without flash
# attention (SmolLM2 Q4_1, the quick suite: docs/conformance.md): mean KL 4.4e-3, worst position
# 2.3e-2; against itself (chunking, batch, fork, rollback) worst 1.2e-2. The bounds keep ~4x above
# each (max 0.1, mean 0.02, same engine 0.05). A position at KL 0.1 can have two logits moved ~0.25
# nats against each other, so a top-2 margin below 0.5 can flip: a near-tie for this class.
CONFORMANCE_QUANTIZED = ConformanceBounds(mean_kl=2e-2, max_kl=1e-1, near_tie=0.5, same_engine_kl=5e-2)
