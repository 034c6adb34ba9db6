"""The kernels of the spec, in NumPy, written as the definition rather than for speed.

Shape legend (used in every shape comment in kvref):
    T   new positions in this execution        S   positions attended to (cached + new)
    H   query heads      Hkv  kv heads          G   H // Hkv, query heads per kv head
    D   head_dim         E    d_model           F   d_ff         V   vocab_size
    N   output rows of a weight matrix          K   input columns of a weight matrix
    X   experts of a MoE layer   k  experts each position runs   Fx  an expert's d_ff   R  rows (T x k)

The native module provides the same names with the same meaning; the decoder calls them by name.
Weights stay in file layout: a projection matrix is [N, K] (out, in), so y = x @ W.T.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def embed(table, token_ids):
    # [V, E], [T] -> [T, E]
    return table[token_ids]


def matmul(x, w):
    # [T, K], [N, K] -> [T, N]
    return x @ w.T


def matmul_experts(x, w, experts):
    # [R, K], [X, N, K], [R] expert ids -> [R, N]: row r through the matrix of expert experts[r]
    # A mixture's projection (kvref.spec.decoder.moe): the rows of each expert are taken together, so
    # only the experts named are read, each once.
    y = np.empty((x.shape[0], w.shape[1]), dtype=np.result_type(x.dtype, w.dtype))
    for e in np.unique(experts):
        rows = experts == e
        y[rows] = matmul(x[rows], w[e])
    return y


class Router(NamedTuple):
    """How a mixture's router chooses and weighs each position's experts (ModelConfig's router fields)."""
    n_used: int  # k experts per position
    score: str = "softmax"  # "softmax" over the X experts, or an independent "sigmoid" per expert
    n_groups: int = 1  # grouped top-k (DeepSeek): the X experts form this many equal groups, and ...
    n_groups_used: int = 1  # ... each position chooses from its best this-many groups
    group_score: str = "top2_sum"  # a group's score: its two best choices summed, or its "max"
    normalize: bool = False  # the k weights divided by their sum (norm_topk_prob)
    scaling: float = 1.0  # the weights multiplied by it (routed_scaling_factor)


def route(logits, selection_bias, router: Router):
    # [T, X] router logits, [X] or None -> experts [T, k] int64 (best first), weights [T, k]
    scores = softmax(logits) if router.score == "softmax" else sigmoid(logits)  # [T, X]
    choice = scores if selection_bias is None else scores + selection_bias  # [T, X]: chooses, never weights
    if router.n_groups > 1:
        choice = best_groups_only(router, choice)
    # best first; ties go to the lower id, and a NaN score (from a NaN activation) sorts last
    experts = np.argsort(-choice, axis=-1, kind="stable")[:, :router.n_used]  # [T, k]
    weights = np.take_along_axis(scores, experts, axis=-1)  # [T, k]: the unbiased scores of the chosen
    if router.normalize:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    return experts, weights * np.asarray(router.scaling, dtype=weights.dtype)


def best_groups_only(router: Router, choice):
    # [T, X] -> [T, X]: grouped top-k (DeepSeek): the X experts form n_groups equal groups, each scored by
    # the sum of its two best choices or by its best; experts outside a position's n_groups_used best
    # groups become -inf, so they are never chosen
    T, X = choice.shape
    groups = choice.reshape(T, router.n_groups, X // router.n_groups)  # [T, G, X/G]
    if router.group_score == "top2_sum":
        group_scores = np.sum(np.sort(groups, axis=-1)[..., -2:], axis=-1)  # [T, G]
    else:
        group_scores = np.max(groups, axis=-1)  # [T, G]
    best = np.argsort(-group_scores, axis=-1, kind="stable")[:, :router.n_groups_used]  # [T, G_used]
    keep = np.zeros(group_scores.shape, dtype=bool)  # [T, G]
    np.put_along_axis(keep, best, True, axis=-1)
    return np.where(keep[:, :, None], groups, -np.inf).reshape(T, X)


def rms_norm(x, weight, eps):
    # [T, E], [E] -> [T, E]
    # The mean square is taken in at least float32 so float16 inputs do not overflow it.
    acc = np.result_type(x.dtype, np.float32)
    ms = np.mean(np.square(x, dtype=acc), axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps)).astype(x.dtype) * weight


def rope_frequencies(head_dim, theta, scaling=None):
    # -> [D/2] float64: pair i turns by theta**(-2i/D) per position, unless `scaling` stretches it:
    #   ("linear", factor)                       every frequency / factor
    #   ("llama3", factor, low_freq_factor, high_freq_factor, original_max_positions)
    #       wavelengths longer than original / low_freq_factor are divided by factor, those shorter
    #       than original / high_freq_factor kept, and the band between blended linearly (Llama 3.1+)
    #   ("factors", (f_0, ...))                  frequency i / f_i (the llama3 blend, as GGUF files store it)
    #   ("yarn", factor, beta_fast, beta_slow, original_max_positions, attention_factor, truncate)
    #       see yarn_frequencies; the attention factor is not a frequency (ModelConfig.score_scale)
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling[0] == "linear":
        return inv_freq / scaling[1]
    if scaling[0] == "factors":
        return inv_freq / np.asarray(scaling[1], dtype=np.float64)
    if scaling[0] == "yarn":
        return yarn_frequencies(inv_freq, theta, *scaling[1:5], truncate=scaling[6])
    _, factor, low, high, original = scaling
    wavelen = 2 * np.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)  # 0: long waves, 1: short
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def yarn_frequencies(inv_freq, theta, factor, beta_fast, beta_slow, original, truncate):
    # [D/2] -> [D/2] (YaRN, arXiv 2309.00071, as transformers computes it): pair i keeps its frequency
    # when it turns more than beta_fast times over the original context, is divided by factor when it
    # turns fewer than beta_slow times, and is blended linearly in pair index between the two.
    D = 2 * inv_freq.shape[0]

    def pair_of(turns):  # the (fractional) pair index whose wave turns `turns` times over `original`
        return D * np.log(original / (turns * 2 * np.pi)) / (2 * np.log(theta))

    low, high = pair_of(beta_fast), pair_of(beta_slow)
    if truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # transformers' guard against dividing by zero
    ramp = np.clip((np.arange(D // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)  # 0: kept, 1: divided
    return ramp * inv_freq / factor + (1 - ramp) * inv_freq


def yarn_mscale(factor, coefficient=1.0):
    # YaRN's attention factor rule (transformers' get_mscale): 0.1 coefficient ln(factor) + 1, 1 for factor <= 1
    return 1.0 if factor <= 1 else float(0.1 * coefficient * np.log(factor) + 1.0)


def yarn_attention_factor(factor, mscale=None, mscale_all_dim=None):
    # YaRN's default attention factor when a config gives none (transformers' rule): yarn_mscale(factor), or
    # with DeepSeek's mscale and mscale_all_dim the ratio of the rule's values with each as the coefficient
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def rope_angles(positions, head_dim, theta, dtype, scaling=None):
    # [T] -> [T, D/2]: pair i at position p turns by p times its frequency
    inv_freq = rope_frequencies(head_dim, theta, scaling)
    return np.outer(np.asarray(positions, dtype=np.float64), inv_freq).astype(dtype)


def rope(x, positions, theta, scaling=None):
    # [T, nh, D], [T] -> [T, nh, D]
    # Rotates adjacent pairs (x[2i], x[2i+1]) by an angle proportional to the absolute position,
    # the convention of the original Llama and of GGUF files (see docs/formats.md). Computed in
    # float64 then rounded once, so float32 and float64 runs differ only by that rounding.
    angles = rope_angles(positions, x.shape[-1], theta, np.float64, scaling)[:, None, :]  # [T, 1, D/2]
    cos, sin = np.cos(angles), np.sin(angles)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def softmax(scores, axis=-1):
    """Softmax along `axis`, subtracting the row max first; accumulates in at least float32.

    A row in which every entry is -inf (every key masked) has no distribution to normalise: it
    yields all zeros, so the attention output for such a row is the zero vector, never NaN. A row
    holding a NaN or +inf yields NaN in every entry: a bad score never becomes a probability (see
    `attention` for the whole rule).
    """
    acc = np.result_type(scores.dtype, np.float32)
    s = scores.astype(acc, copy=False)
    row_max = np.max(s, axis=axis, keepdims=True)  # NaN if the row holds one
    empty = np.isneginf(row_max)  # every entry -inf
    with np.errstate(invalid="ignore"):  # +inf - +inf: the NaN the rule asks for
        e = np.exp(s - np.where(empty, 0.0, row_max))
    total = np.sum(e, axis=axis, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=~empty).astype(scores.dtype)


def log_softmax(logits):
    """log p of every token of next-token distributions, in float64 (scoring, logprobs, KL): [..., V] ->
    [..., V]. Subtracting the row max first keeps exp from overflowing."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def soft_cap(x, cap):
    # [...] -> [...]: cap * tanh(x / cap), Gemma 2's squashing of attention scores and final logits into
    # (-cap, cap), in x's dtype. A non-finite x stays as it is: tanh would turn an infinity into a finite
    # +-cap and hide it from attention's rule for non-finite scores.
    c = np.asarray(cap, dtype=x.dtype)
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(x), c * np.tanh(x / c), x)


def attention(q, k, v, q_positions, k_positions, scale=None, window=None, softcap=None, sinks=None):
    # [T, H, D], [S, Hkv, D], [S, Hkv, Dv], [T], [S], sinks [H] or None -> [T, H, Dv]; Dv == D but in MLA (decoder.latent_attention_block)
    # Causal by position, not by index: query at position p sees every stored key at a position
    # <= p, and with a layer window W only those > p - W (its last W positions, itself included),
    # whatever the cache holds and however the input was split into executions. The cache decides
    # which positions it still holds (a window layout drops old ones).
    # GQA without copying K/V: query head h reads kv head h // G, expressed as a group axis.
    # scale: what scores are multiplied by; None: 1/sqrt(D). softcap: scaled scores -> soft_cap(scores,
    # softcap) before the mask and softmax (Gemma 2); None: as they are.
    # sinks (gpt-oss): one learned logit per query head that joins every softmax of that head as a
    # score with no value: it takes probability mass away from the keys, so a head may attend to
    # "nothing". Not the sink *positions* a window cache keeps (docs/cache-layouts.md).
    #
    # Non-finite values are never hidden, and a key a query does not see never reaches it:
    #   - a query head whose scores over the keys it sees include a non-finite one (NaN, +inf or
    #     -inf: from a non-finite q or k, or a product that overflows) outputs NaN in every element;
    #   - otherwise its probabilities are finite, and output element i is NaN exactly when the
    #     value element i of a key it sees is not finite (the weighted sum is NaN, never +-inf);
    #   - a key it does not see contributes nothing, whatever its K and V hold (0 x NaN is never
    #     formed), and a query that sees no key outputs zeros;
    #   - a sink logit is one more score the head sees: a non-finite one makes the head NaN.
    # Finite values whose weighted sums overflow float32 are outside the rule (and any model).
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    G = H // Hkv
    qg = q.reshape(T, Hkv, G, D).transpose(1, 2, 0, 3)  # [Hkv, G, T, D]
    kh = k.transpose(1, 2, 0)  # [Hkv, D, S]
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite scores: the rule below
        if scale is None:
            scores = (qg @ kh[:, None]) / np.sqrt(D).astype(q.dtype)  # [Hkv, G, T, S]
        else:
            scores = (qg @ kh[:, None]) * np.asarray(scale, dtype=q.dtype)  # [Hkv, G, T, S]
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    return attend(scores, v, q_positions, k_positions, window, sinks).reshape(T, H, v.shape[-1])


def attend(scores, v, q_positions, k_positions, window=None, sinks=None):
    # [Hkv, G, T, S] scores, [S, Hkv, Dv], [T], [S], [H] or None -> [T, Hkv, G, Dv]: attention's masking,
    # softmax (with the sink logits in its denominator) and weighted sum of values, with its rule for non-finite values (see `attention`)
    vh = v.transpose(1, 0, 2)  # [Hkv, S, D]
    k_pos, q_pos = np.asarray(k_positions)[None, :], np.asarray(q_positions)[:, None]
    visible = k_pos <= q_pos  # [T, S]
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = np.where(np.isfinite(scores), scores, np.nan)  # a seen -inf must not look masked
    scores = np.where(visible, scores, -np.inf)
    bad_v = ~np.isfinite(vh)  # [Hkv, S, D]
    if sinks is None:
        p = softmax(scores)  # [Hkv, G, T, S], 0 at every key not seen
    else:  # the sink is a last column of scores, seen by every query; its probability multiplies no value
        Hkv, G, T, _ = scores.shape
        sink = np.asarray(sinks, dtype=scores.dtype).reshape(Hkv, G, 1, 1)
        sink = np.broadcast_to(np.where(np.isfinite(sink), sink, np.nan), (Hkv, G, T, 1))
        p = softmax(np.concatenate([scores, sink], axis=-1))[..., :-1]  # [Hkv, G, T, S]
    out = p @ np.where(bad_v, 0, vh)[:, None]  # [Hkv, G, T, D]: 0 x V only ever with V finite
    if bad_v.any():  # NaN where a seen key's value element is not finite
        seen_bad = visible.astype(np.float32) @ bad_v.astype(np.float32) > 0  # [Hkv, T, D]
        out = np.where(seen_bad[:, None], np.nan, out)
    return out.transpose(2, 0, 1, 3)


def quantize_query(q, group_size):
    # [..., D] float32 -> (q8 [..., D] int32 in [-127, 127], d [..., D/g] float32): q rounded to 8 bits
    # per group of `group_size` elements as the int8 activation mode rounds its blocks: d = max|q| / 127,
    # q8 = rint(q * (1/d)), ties to even, every step one float32 rounding. An all-zero group has d = 0
    # and q8 = 0; a group holding a NaN or an infinity has d = NaN, which every score it enters keeps.
    q = np.asarray(q, dtype=np.float32)
    groups = q.reshape(*q.shape[:-1], q.shape[-1] // group_size, group_size)  # [..., D/g, g]
    finite = np.isfinite(groups).all(axis=-1)
    with np.errstate(invalid="ignore"):
        d = np.where(finite, np.abs(groups).max(axis=-1) / np.float32(127), np.float32(np.nan)).astype(np.float32)
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=finite & (d != 0))
        q8 = np.where(finite[..., None], np.clip(np.rint(groups * inv[..., None]), -127, 127), 0)
    return q8.astype(np.int32).reshape(q.shape), d


def int8_key_scores(q, k8, k_scales, scale=None):
    # [T, H, D] float32, [S, Hkv, D] int8, [S, Hkv, D/g] float32 -> [Hkv, G, T, S] float32
    # Scores against K stored as int8 with one scale per group of g elements (kvref/cache/quant.py),
    # computed with integers, as the native kernels compute them: q is rounded per group
    # (quantize_query), the group's dot product I_b = sum_j q8_j k8_j is exact, and
    #     score = sum over b, in order from 0, of fl(I_b) * (fl(d_b * scale) * k_scale_b)
    # each operation one float32 rounding. scale None is fl(1/sqrt(D)), the scale C is given.
    T, H, D = q.shape
    S, Hkv, ng = k_scales.shape
    G, g = H // Hkv, D // ng
    scale = np.float32(1 / np.sqrt(D) if scale is None else scale)
    q8, d = quantize_query(q, g)  # [T, H, D], [T, H, D/g]
    qg = q8.reshape(T, Hkv, G, ng, g).astype(np.int64)
    dot = np.einsum("thgbj,shbj->hgtsb", qg, k8.reshape(S, Hkv, ng, g).astype(np.int64))  # [Hkv, G, T, S, D/g]
    e = (d * scale).reshape(T, Hkv, G, ng).transpose(1, 2, 0, 3)[:, :, :, None, :]  # [Hkv, G, T, 1, D/g]
    ks = k_scales.transpose(1, 0, 2)[:, None, None]  # [Hkv, 1, 1, S, D/g]
    with np.errstate(invalid="ignore", over="ignore"):
        terms = dot.astype(np.float32) * (e * ks)
        scores = np.zeros(terms.shape[:-1], np.float32)
        for b in range(ng):
            scores = scores + terms[..., b]
    return scores


def attention_int8_keys(q, k8, k_scales, v, q_positions, k_positions, scale=None, window=None, softcap=None, sinks=None):
    # [T, H, D], [S, Hkv, D] int8, [S, Hkv, D/g] float32, [S, Hkv, Dv] float, [T], [S], [H] -> [T, H, Dv]
    # The attention the native kernels compute over an int8 K: `attention` with the scores of
    # int8_key_scores (the query rounded to 8 bits per group) in place of q . k over the decoded K.
    T, H, D = q.shape
    scores = int8_key_scores(q, k8, k_scales, scale)  # [Hkv, G, T, S]
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    return attend(scores, v, q_positions, k_positions, window, sinks).reshape(T, H, v.shape[-1])


def sigmoid(x):
    # 1 / (1 + exp(-x)), written through tanh so large |x| cannot overflow exp
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x):
    # x * sigmoid(x)
    return x * sigmoid(x)


def swiglu(gate, up):
    # [T, F], [T, F] -> [T, F]
    return silu(gate) * up


def gelu_tanh(x):
    # GELU with its tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    c = np.asarray(np.sqrt(2.0 / np.pi), dtype=x.dtype)
    return 0.5 * x * (1.0 + np.tanh(c * (x + np.asarray(0.044715, dtype=x.dtype) * x * x * x)))


def geglu(gate, up):
    # [T, F], [T, F] -> [T, F]: Gemma's gated MLP, GELU (tanh form) in place of SiLU
    return gelu_tanh(gate) * up


SWIGLU_OAI_ALPHA = 1.702  # gpt-oss: the gain inside its sigmoid (x sigmoid(1.702 x) is GELU's sigmoid form)
SWIGLU_OAI_LIMIT = 7.0  # gpt-oss: gate clamped above at it, up to [-it, it]


def swiglu_oai(gate, up):
    # [T, F], [T, F] -> [T, F]: gpt-oss's clamped SwiGLU, min(gate, L) sigmoid(alpha min(gate, L))
    # (clip(up, -L, L) + 1). The clamps keep a NaN a NaN (np.minimum and np.clip propagate it).
    alpha, limit = (np.asarray(c, dtype=gate.dtype) for c in (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT))
    g = np.minimum(gate, limit)
    u = np.clip(up, -limit, limit)
    return g * (0.5 * (1.0 + np.tanh(0.5 * (alpha * g)))) * (u + np.asarray(1.0, dtype=up.dtype))
