"""The one rule for comparing two computations of the same logits, with its per-dtype constants.

    |actual - reference| <= atol + rtol * |reference|        elementwise

The reference is the more exact computation (a float64 spec run is the oracle for everything).
Alongside pass/fail, a comparison reports what a reader needs to judge it: the largest absolute
difference, how often the top-1 token agrees, and the KL divergence of the next-token distributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES = {
    # Same arithmetic in a different association order (one matmul over T rows vs T matmuls over
    # one row): float64 rounding (2**-53 ~ 1.1e-16) grows by at most a few hundred through a
    # 4-layer model, far below 1e-10.
    "float64": Tolerance(atol=1e-10, rtol=1e-10),
    # float32 rounds at 2**-24 ~ 6e-8 per operation; BLAS sums a T-row product in a different
    # order than T one-row products, and the differences pass through every layer. Measured over
    # 300 random models (1-4 layers, E <= 48, head_dim <= 64, 64 positions, token by token vs one
    # prefill): worst |diff| 2.5e-5 with logits up to ~5, i.e. ~120 ulps of the largest logit.
    # 1e-4 keeps a 4x margin; a real bug (a wrong position, a missing or extra key) moves logits
    # by O(0.1).
    "float32": Tolerance(atol=1e-4, rtol=1e-4),
}


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
    """Compare logits ([V] or [T, V]) under the tolerance of `dtype` (the less exact side's dtype)."""
    tol = TOLERANCES[np.dtype(dtype).name]
    a = np.atleast_2d(np.asarray(actual, dtype=np.float64))
    r = np.atleast_2d(np.asarray(reference, dtype=np.float64))
    if a.shape != r.shape:
        raise ValueError(f"shapes differ: actual {a.shape}, reference {r.shape}")
    diff = np.abs(a - r)
    ok = bool(np.all(diff <= tol.atol + tol.rtol * np.abs(r)))
    top1 = float(np.mean(np.argmax(a, axis=-1) == np.argmax(r, axis=-1)))
    return Comparison(ok, float(diff.max()), top1, float(np.max(kl_divergence(r, a))), tol)


def log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def kl_divergence(reference_logits, actual_logits):
    # [..., V] x2 -> [...]: KL(P_reference || P_actual)
    lp, lq = log_softmax(reference_logits), log_softmax(actual_logits)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def assert_close(actual, reference, dtype, what: str = "") -> Comparison:
    result = compare(actual, reference, dtype)
    assert result.ok, f"{what}: {result}"
    return result
