"""The named checks: each runs an engine through one claim and returns pass/fail with its evidence.

Two kinds (docs/conformance.md gives every threshold and why):

- golden:  the engine against the float32 spec on the same weights (`golden`, `greedy`,
           `context_shift`, whose reference is the spec's own shift), under the engine's
           ConformanceBounds (kvref.tolerance): mean and max KL, and top-1 disagreements only at
           near-ties of the spec;
- metamorphic: the engine against itself, two ways of computing the same positions that must agree
           (`chunking`, `batch`, `prefix_cache`, `save_restore`, `fork`, `rollback`,
           `sliding_window`): worst KL within same_engine_kl, top-1 equal but at near-ties.

A check needs capabilities (NEEDS); without one it is skipped, saying which. An operation the
engine has but refuses in this state (Refused) makes the check "refused", with the engine's reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..tolerance import CONFORMANCE_FLOAT32, CONFORMANCE_QUANTIZED
from .engine import Refused, Rows
from .spec import divergence

BOUNDS = {"float32": CONFORMANCE_FLOAT32, "quantized": CONFORMANCE_QUANTIZED}


@dataclass
class Plan:
    """What the checks run: prompts (token ids), greedy steps, the block size chunk boundaries and
    prefix blocks align to, and the model's smallest sliding window (None: no window layers)."""

    prompts: list
    greedy_tokens: int
    block_size: int
    window: int | None = None
    long_prompt: list | None = None  # longer than the window, for the sliding-window check


@dataclass
class CheckResult:
    name: str
    status: str  # "pass" | "fail" | "skip" | "refused" | "error"
    evidence: str
    threshold: str = ""
    metrics: dict = field(default_factory=dict)


def fmt(x: float) -> str:
    return f"{x:.2g}"


class Context:
    """What every check reads: the engine, the spec, the plan and the bounds that apply."""

    def __init__(self, engine, spec, plan: Plan):
        self.engine, self.spec, self.plan = engine, spec, plan
        self.bounds = BOUNDS[engine.precision]
        self._live = []

    def new(self):
        seq = self.engine.new_sequence()
        self._live.append(seq)
        return seq

    def adopt(self, seq):
        self._live.append(seq)
        return seq

    def release(self):
        """Free every sequence the check made (the engine's cache is reused by the next check)."""
        while self._live:
            self.engine.free(self._live.pop())

    def run(self, ids, chunks=None, last_only=False) -> Rows:
        """A new sequence running ids in one execution, or in executions of the given sizes."""
        seq = self.new()
        return self.feed(seq, ids, chunks, last_only)

    def feed(self, seq, ids, chunks=None, last_only=False) -> Rows:
        ids = list(ids)
        sizes = chunks or [len(ids)]
        parts, start = [], 0
        for n in sizes:
            parts.append(self.engine.forward(seq, ids[start:start + n], last_only))
            start += n
        return parts[-1] if last_only else Rows.concat(parts)


# ---- comparing ------------------------------------------------------------------------------------

class Tally:
    """Comparisons of one check, summed up into a verdict and a line of evidence. Rows the engine left
    out (Rows.missing) are not compared: each is listed as skipped, with the engine's reason."""

    def __init__(self, max_kl: float, near_tie: float, mean_kl: float | None = None):
        self.max_kl, self.near_tie, self.mean_kl = max_kl, near_tie, mean_kl
        self.kl, self.where, self.ties, self.bugs, self.skipped = [], [], [], [], []

    def add(self, what: str, reference, actual: Rows, offset: int = 0):
        self.skipped.extend(f"{what} @{offset + i} ({why})" for i, why in sorted(actual.missing.items()))
        rows = actual.reported()  # [T'] the positions the engine gave a distribution for
        d = divergence(np.atleast_2d(reference)[rows], actual.take(rows))
        self.kl.extend(d.kl)
        self.where.extend(f"{what} @{offset + i}" for i in rows)
        for j in d.disagreements:
            entry = f"{what} @{offset + rows[j]} (margin {fmt(d.margin[j])})"
            (self.ties if d.margin[j] < self.near_tie else self.bugs).append(entry)

    def result(self, name: str, extra: str = "") -> CheckResult:
        threshold = (f"max KL <= {fmt(self.max_kl)}" + (f", mean KL <= {fmt(self.mean_kl)}" if self.mean_kl else "")
                     + f", top-1 flips only where the margin < {fmt(self.near_tie)}")
        skipped = (f"; {len(self.skipped)} position{'s' * (len(self.skipped) > 1)} skipped, "
                   "the engine gave no distribution there: "
                   + ", ".join(self.skipped[:4]) + (" ..." if len(self.skipped) > 4 else "")) if self.skipped else ""
        if not self.kl:
            return CheckResult(name, "skip", "no position compared" + skipped + extra, threshold,
                               {"positions": 0, "skipped": self.skipped})
        kl = np.asarray(self.kl)
        worst = int(np.argmax(kl))
        mean = float(kl.mean())
        ok = kl[worst] <= self.max_kl and not self.bugs and (self.mean_kl is None or mean <= self.mean_kl)
        evidence = (f"{len(kl)} positions: max KL {fmt(kl[worst])} at {self.where[worst]}, mean KL {fmt(mean)}, "
                    f"top-1 {1 - (len(self.ties) + len(self.bugs)) / len(kl):.1%}")
        if self.ties:
            evidence += f"; near-ties: {', '.join(self.ties[:4])}" + (" ..." if len(self.ties) > 4 else "")
        if self.bugs:
            evidence += f"; top-1 flips beyond a near-tie: {', '.join(self.bugs[:4])}"
        metrics = {"positions": len(kl), "max_kl": float(kl[worst]), "mean_kl": mean, "near_ties": self.ties,
                   "flips": self.bugs, "skipped": self.skipped}
        return CheckResult(name, "pass" if ok else "fail", evidence + skipped + extra, threshold, metrics)


def golden_tally(ctx) -> Tally:
    b = ctx.bounds
    return Tally(b.max_kl, b.near_tie, b.mean_kl)


def same_tally(ctx) -> Tally:
    b = ctx.bounds
    return Tally(b.same_engine_kl, b.near_tie)


def full(rows: Rows) -> np.ndarray:
    # the [T, V] log-probabilities of an engine with full logits (the metamorphic checks need them)
    return rows.full


# ---- golden ---------------------------------------------------------------------------------------

def check_golden(ctx) -> CheckResult:
    """Per-position log-probabilities of prompt + the spec's greedy continuation (teacher-forced)."""
    tally = golden_tally(ctx)
    for i, prompt in enumerate(ctx.plan.prompts):
        tokens, _ = ctx.spec.greedy(prompt, ctx.plan.greedy_tokens)
        ids = list(prompt) + tokens
        tally.add(f"prompt {i}", ctx.spec.rows(ids), ctx.run(ids))
        ctx.release()
    note = "" if "full_logits" in ctx.engine.capabilities else " (KL from top-k: a lower bound, spec.py)"
    return tally.result("golden", note)


def check_greedy(ctx) -> CheckResult:
    """The engine's own greedy decode (one decode step per token) against the spec's. A step whose row
    the engine left out ends that prompt's comparison there (its token is unknown), reported as skipped."""
    n, firsts, flips, skipped, decoded = ctx.plan.greedy_tokens, [], [], [], 0
    for i, prompt in enumerate(ctx.plan.prompts):
        want, spec_rows = ctx.spec.greedy(prompt, n)
        seq = ctx.new()
        row = ctx.engine.forward(seq, prompt, last_only=True)
        for step in range(n):
            if row.missing:
                skipped.append(f"prompt {i} from step {step} ({row.missing[0]})")
                break
            got = int(row.top1()[0])
            if got != want[step]:
                margin = spec_rows[step][want[step]] - spec_rows[step][got]
                (firsts if margin < ctx.bounds.near_tie else flips).append(
                    f"prompt {i} step {step}: {got} for {want[step]} (spec margin {fmt(margin)})")
                break
            if step + 1 < n:
                row = ctx.engine.forward(seq, [got], last_only=True)
        else:
            decoded += 1
        ctx.release()
    total = len(ctx.plan.prompts)
    evidence = f"{decoded}/{total} prompts decode the spec's {n} greedy tokens"
    if firsts:
        evidence += "; near-tie divergences: " + "; ".join(firsts)
    if flips:
        evidence += "; divergences beyond a near-tie: " + "; ".join(flips)
    if skipped:
        evidence += "; not compared, the engine gave no distribution: " + "; ".join(skipped)
    return CheckResult("greedy", "fail" if flips else "pass", evidence,
                       f"a divergence only where the spec's margin < {fmt(ctx.bounds.near_tie)}",
                       {"decoded": decoded, "prompts": total, "near_ties": firsts, "flips": flips, "skipped": skipped})


def check_context_shift(ctx) -> CheckResult:
    """Drop keep..keep+n-1, continue: against the spec shifting its own cache (KVCache.shift)."""
    bs, tally = ctx.plan.block_size, golden_tally(ctx)
    prompt, other = ctx.plan.prompts[0], ctx.plan.prompts[-1]
    ids, continuation = prompt[:3 * bs + 5], other[:6]
    for keep, n in ((4, bs + 3), (1, bs)):
        seq = ctx.new()
        ctx.engine.forward(seq, ids, last_only=True)
        ctx.engine.shift(seq, n, keep)
        tally.add(f"keep {keep} drop {n}", ctx.spec.shifted(ids, n, keep, continuation),
                  ctx.engine.forward(seq, continuation))
        ctx.release()
    return tally.result("context_shift", f" (after {len(ids)} positions)")


# ---- metamorphic ----------------------------------------------------------------------------------

def chunkings(n: int, bs: int) -> dict:
    """Named ways to split n positions into executions: boundaries at block multiples, beside them,
    and token by token across a block boundary."""
    def sizes(bounds):
        edges = [0, *sorted(b for b in set(bounds) if 0 < b < n), n]
        return [b - a for a, b in zip(edges, edges[1:])]

    return {f"boundaries at block multiples {bs}, {2 * bs}": sizes([bs, 2 * bs, 3 * bs]),
            f"boundaries beside them {bs - 1}, {bs + 1}, {2 * bs - 1}": sizes([bs - 1, bs + 1, 2 * bs - 1]),
            f"token by token over {bs - 2}..{bs + 2}": sizes(range(bs - 2, bs + 3))}


def check_chunking(ctx) -> CheckResult:
    tally = same_tally(ctx)
    for i, prompt in enumerate(ctx.plan.prompts):
        whole = full(ctx.run(prompt))
        for name, sizes in chunkings(len(prompt), ctx.plan.block_size).items():
            tally.add(f"prompt {i} {name}", whole, ctx.run(prompt, sizes))
        ctx.release()
    return tally.result("chunking", " (against one execution)")


def check_batch(ctx) -> CheckResult:
    """Three sequences of different lengths in one batch, then one batched decode step, against each alone."""
    prompts = [p[:len(p) - 7 * i] for i, p in enumerate((ctx.plan.prompts * 3)[:3])]
    steps = [[p[b]] for b, p in enumerate(prompts)]  # one decode step each, different tokens
    tally = same_tally(ctx)
    alone = []
    for p, step in zip(prompts, steps):
        seq = ctx.new()
        alone.append((full(ctx.engine.forward(seq, p)), full(ctx.engine.forward(seq, step))))
    seqs = [ctx.new() for _ in prompts]
    batched = ctx.engine.forward_batch(seqs, prompts)
    decoded = ctx.engine.forward_batch(seqs, steps)
    for b, (rows, step_rows) in enumerate(alone):
        tally.add(f"sequence {b} prefill", rows, batched[b])
        tally.add(f"sequence {b} decode", step_rows, decoded[b], len(prompts[b]))
    ctx.release()
    return tally.result("batch", " (against each sequence alone)")


def check_prefix_cache(ctx) -> CheckResult:
    """A request whose first blocks an earlier request computed == the same request cold. Two warm-up
    requests share their *second* block (S) after different first blocks (P, Q): a prefix key that
    forgets the previous block hands the request [Q S ...] the S computed after P. An engine with no
    cold path (a server) is compared with the spec instead, under the golden bounds."""
    bs = ctx.plan.block_size
    a, b = ctx.plan.prompts[0], ctx.plan.prompts[1 % len(ctx.plan.prompts)]
    P, S, Q = a[:bs], a[bs:2 * bs], b[:bs] if b[:bs] != a[:bs] else a[2 * bs:3 * bs]
    tail = a[2 * bs:2 * bs + 7]
    request = Q + S + tail
    for warm in (P + S + b[-3:], Q + S + a[-2:]):
        seq, _, _ = ctx.engine.prefill_cached(warm)
        ctx.adopt(seq)
        ctx.release()  # freed: their blocks stay indexed for reuse
    seq, cached, reused = ctx.engine.prefill_cached(request)
    ctx.adopt(seq)
    if reused == 0:
        return CheckResult("prefix_cache", "skip", "the engine reused no cached position: nothing to compare")
    start = max(reused, 0)  # reused < 0: the engine cannot say how many; every position was returned
    try:
        cold_seq, cold = ctx.engine.prefill_cold(request)
        ctx.adopt(cold_seq)
    except Refused:
        cold = None
    if cold is not None and cold.full is not None:
        tally, against = same_tally(ctx), "against the request cold"
        tally.add("request [Q S tail]", full(cold)[start:], cached, start)
    else:
        tally, against = golden_tally(ctx), "against the spec: the engine has no cold path"
        tally.add("request [Q S tail]", ctx.spec.rows(request)[start:], cached, start)
    reuse = f"{reused} positions reused" if reused > 0 else "positions reused: not reported"
    return tally.result("prefix_cache", f" ({reuse}, {against})")


def check_save_restore(ctx) -> CheckResult:
    """Save after a prefill, disturb the engine, restore, continue == never saved."""
    bs, prompt, other = ctx.plan.block_size, ctx.plan.prompts[0], ctx.plan.prompts[-1]
    head, rest = prompt[:2 * bs], prompt[2 * bs:2 * bs + 9]
    seq = ctx.new()
    before = full(ctx.engine.forward(seq, head))
    reference = full(ctx.engine.forward(seq, rest))
    ctx.release()
    seq = ctx.new()
    ctx.engine.forward(seq, head)
    state = ctx.engine.save(seq)
    ctx.engine.forward(seq, other[:5])  # the saved sequence moves on, then goes
    ctx.release()
    ctx.run(other[:bs + 3])  # another sequence runs between save and restore (it may reuse the blocks)
    restored = ctx.adopt(ctx.engine.restore(state))
    last = ctx.engine.last_rows(restored)
    tally = same_tally(ctx)
    if last is not None:
        tally.add("restored last logits", before[-1:], last, len(head) - 1)
    tally.add("continuation", reference, ctx.engine.forward(restored, rest), len(head))
    ctx.release()
    result = tally.result("save_restore", " (against never saved)")
    if last is None:
        result.status = "fail"
        result.evidence = "the restored sequence has no last logits to select its next token from; " + result.evidence
    return result


def check_fork(ctx) -> CheckResult:
    """Parent and child after a fork go on with different tokens, interleaved; each == never forked."""
    bs, prompt, other = ctx.plan.block_size, ctx.plan.prompts[0], ctx.plan.prompts[-1]
    head = prompt[:2 * bs + 3]  # a partly filled last block: both writers must copy it
    a1, a2, b1, b2 = prompt[2 * bs + 3:2 * bs + 8], prompt[2 * bs + 8:2 * bs + 11], other[:4], other[4:9]
    tally = same_tally(ctx)
    want_a = full(ctx.run(head + a1 + a2))[len(head):]
    want_b = full(ctx.run(head + b1 + b2))[len(head):]
    ctx.release()
    parent = ctx.new()
    ctx.engine.forward(parent, head, last_only=True)
    child = ctx.adopt(ctx.engine.fork(parent))
    got_b1 = ctx.engine.forward(child, b1)
    got_a1 = ctx.engine.forward(parent, a1)
    got_b2 = ctx.engine.forward(child, b2)
    got_a2 = ctx.engine.forward(parent, a2)
    tally.add("parent", want_a, Rows.concat([got_a1, got_a2]), len(head))
    tally.add("child", want_b, Rows.concat([got_b1, got_b2]), len(head))
    ctx.release()
    return tally.result("fork", " (against never forked)")


def check_rollback(ctx) -> CheckResult:
    """Append tokens, remove them, append others == never appended (at and off a block multiple)."""
    bs, prompt, other = ctx.plan.block_size, ctx.plan.prompts[0], ctx.plan.prompts[-1]
    tally = same_tally(ctx)
    for keep in (2 * bs, 2 * bs + 5):
        head, after = prompt[:keep], prompt[keep:keep + 6]
        want = full(ctx.run(head + after))[keep:]
        seq = ctx.new()
        ctx.engine.forward(seq, head + other[:bs + 2], last_only=True)
        ctx.engine.rollback(seq, keep)
        tally.add(f"rollback to {keep}", want, ctx.engine.forward(seq, after), keep)
        ctx.release()
    return tally.result("rollback", " (against never appended)")


def check_sliding_window(ctx) -> CheckResult:
    """Decode step by step past the smallest window == one execution over the same positions."""
    w, ids = ctx.plan.window, ctx.plan.long_prompt
    probes = sorted({w - 1, w, w + 1, len(ids) - 1})
    tally = same_tally(ctx)
    seq = ctx.new()
    start = w - 3
    ctx.engine.forward(seq, ids[:start], last_only=True)
    stepped = {}
    for p in range(start, len(ids)):
        row = ctx.engine.forward(seq, [ids[p]], last_only=True)
        if p in probes:
            stepped[p] = row
    ctx.release()
    for p in probes:
        tally.add("decode vs one execution", full(ctx.run(ids[:p + 1], last_only=True)), stepped[p], p)
        ctx.release()
    spec_last = ctx.spec.last(ids)[None]
    golden = golden_tally(ctx)
    golden.add("spec", spec_last, stepped[len(ids) - 1], len(ids) - 1)
    result = tally.result("sliding_window", f" (window {w}, {len(ids)} positions)")
    g = golden.result("spec")
    result.evidence += f"; last position against the spec: {g.evidence}"
    if g.status != "pass":
        result.status = "fail"
    return result


# name -> (function, capabilities it needs, what it claims)
CHECKS = {
    "golden": (check_golden, (), "per-position log-probabilities == the float32 spec's"),
    "greedy": (check_greedy, ("incremental",), "greedy decode == the spec's, or diverges at a near-tie"),
    "chunking": (check_chunking, ("incremental", "full_logits"), "prefill in one chunk == any chunking"),
    "batch": (check_batch, ("batch", "full_logits"), "a sequence alone == in a batch with others"),
    "prefix_cache": (check_prefix_cache, ("prefix_cache",), "cold == prefix-cached"),
    "save_restore": (check_save_restore, ("save_restore", "full_logits"), "save, restore, continue == never saved"),
    "fork": (check_fork, ("fork", "full_logits"), "a fork and its parent are isolated"),
    "rollback": (check_rollback, ("rollback", "full_logits"), "rollback == never appended"),
    "sliding_window": (check_sliding_window, ("incremental", "full_logits", "sliding_window"),
                       "decode past the window == recomputation"),
    "context_shift": (check_context_shift, ("context_shift",), "context shift == the spec's shift"),
}
QUICK = ("golden", "greedy", "chunking", "batch", "prefix_cache", "save_restore", "fork", "rollback",
         "sliding_window", "context_shift")


def run_check(name: str, ctx) -> CheckResult:
    function, needs, _ = CHECKS[name]
    missing = [c for c in needs if c not in ctx.engine.capabilities]
    if missing:
        return CheckResult(name, "skip", f"{ctx.engine.label} lacks {', '.join(missing)}")
    if name == "sliding_window" and ctx.plan.window is None:
        return CheckResult(name, "skip", "the model has no sliding-window layers")
    if name == "sliding_window" and ctx.plan.long_prompt is None:
        return CheckResult(name, "skip", f"the window ({ctx.plan.window}) is longer than the suite's positions allow")
    try:
        return function(ctx)
    except Refused as refusal:
        return CheckResult(name, "refused", str(refusal))
    finally:
        ctx.release()
