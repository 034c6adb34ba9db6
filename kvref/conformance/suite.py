"""Running the suite: the plan (prompts as token ids), every check in order, and the report.

Prompts are token ids made once by the spec's tokenizer (a chat-templated one where the model has a
template) and sent as ids to every engine, so tokenization is never part of what is compared. A model
without a tokenizer (a tiny random checkpoint) gets seeded random ids.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import numpy as np

from .checks import CHECKS, CheckResult, Context, Plan, run_check
from .engine import ConformanceError

TEXTS = (
    "The KV cache stores, for every layer, the keys and values of the positions already processed, so that a "
    "decode step computes one new position instead of the whole sequence again. Its size grows with the context.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(20)])  # the first twenty numbers of the sequence, one per line",
    "In 1869 the Suez Canal opened, shortening the sea route between Europe and Asia by thousands of kilometres; "
    "ships no longer had to sail around the Cape of Good Hope, and trade patterns changed for a century.",
)
CHAT = "Explain in two sentences why a paged KV cache helps a server run many requests at once."
# prompts, positions each, greedy tokens, positions an engine must hold (full: past Gemma 3's window
# of 512). Prompts reach past three blocks of 16 so that chunk, fork and shift boundaries fall inside.
SUITES = {"quick": (2, 64, 8, 160), "full": (4, 128, 32, 640)}


def make_plan(model, suite: str = "quick", block_size: int = 16, seed: int = 0) -> Plan:
    n_prompts, length, greedy, max_positions = SUITES[suite]
    if model.config.max_seq_len < length + greedy:
        raise ConformanceError(f"the model's context ({model.config.max_seq_len} positions) is shorter than the "
                               f"{suite} suite's prompts + greedy tokens ({length} + {greedy})")
    prompts = [fit(p, length, model, seed + i) for i, p in enumerate(prompt_ids(model)[:n_prompts])]
    while len(prompts) < n_prompts:
        prompts.append(fit([], length, model, seed + len(prompts)))
    windows = [w for w in (model.config.layer_windows or ()) if w is not None]
    window = min(windows) if windows else None
    long_prompt = None
    if window is not None and window + 4 <= min(max_positions, model.config.max_seq_len):
        long_prompt = fit(sum(prompts, []), window + 4, model, seed)
    return Plan(prompts, greedy, block_size, window, long_prompt)


def prompt_ids(model) -> list:
    tok = model.tokenizer
    if tok is None:
        return []
    out = []
    if model.chat_template:
        out.append(model.text.chat_ids([{"role": "user", "content": CHAT}]))
    out += [tok.encode(text, add_special=True) for text in TEXTS]
    return out


def fit(ids, n: int, model, seed: int) -> list:
    """ids cut or grown to n positions: repeated, or seeded random ids when there are none."""
    ids = [int(t) for t in ids]
    if not ids:
        rng = np.random.default_rng(seed)
        return [int(t) for t in rng.integers(0, model.config.vocab_size, n)]
    while len(ids) < n:
        ids += ids
    return ids[:n]


def max_positions(suite: str) -> int:
    return SUITES[suite][3]


def run_suite(engine, spec, plan: Plan, names=None, progress=None) -> list:
    """Every check in CHECKS order, or those named in their order: a list of CheckResult."""
    ctx = Context(engine, spec, plan)
    results = []
    for name in names or CHECKS:
        start = time.perf_counter()
        if progress is not None:
            progress(name)
        try:
            result = run_check(name, ctx)
        except Exception as exc:  # noqa: BLE001 — an engine crashing inside a check is a finding, reported
            result = CheckResult(name, "error", f"{type(exc).__name__}: {exc}")
        result.metrics["seconds"] = round(time.perf_counter() - start, 2)
        results.append(result)
    return results


def table(results, engine_info: dict) -> str:
    """The plain-text table the CLI prints: one line per check, then its evidence and threshold."""
    lines = ["engine: " + ", ".join(f"{k} {v}" for k, v in engine_info.items()), ""]
    width = max(len(r.name) for r in results)
    for r in results:
        lines.append(f"{r.name:<{width}}  {r.status.upper():<7}  {r.evidence}")
        if r.threshold:
            lines.append(f"{'':<{width}}  {'':<7}  threshold: {r.threshold}")
    lines += ["", counts(results)]
    return "\n".join(lines)


def counts(results) -> str:
    """'30 pass, 2 refused': how many checks ended in each status, in a fixed order."""
    n = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "refused", "skip", "error")}
    return ", ".join(f"{k} {s}" for s, k in n.items() if k)


def verdict(runs) -> str:
    """The last line of `kvref conformance`: PASS or FAIL over every engine run (a list of result lists,
    one per engine configuration), the counts, and the checks that failed."""
    results = [r for run in runs for r in run]
    bad = sorted({r.name for r in results if failed([r])})
    head = "FAIL" if bad else "PASS"
    where = f"{len(results)} checks on {len(runs)} engine configuration{'' if len(runs) == 1 else 's'}"
    return f"conformance: {head}: {where}: {counts(results)}" + (f" (failed: {', '.join(bad)})" if bad else "")


def markdown(results, engine_info: dict, model_name: str) -> str:
    lines = [f"# kvref conformance: {engine_info.get('engine')} on {model_name}", "",
             "| setting | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in engine_info.items()]
    lines += ["", "| check | claim | result | evidence | threshold |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        claim = CHECKS[r.name][2]
        lines.append(f"| {r.name} | {claim} | **{r.status}** | {r.evidence.replace('|', '/')} | {r.threshold} |")
    return "\n".join(lines) + "\n"


def to_json(results, engine_info: dict, model_name: str, plan: Plan) -> str:
    return json.dumps({"version": 1, "model": model_name, "engine": engine_info,
                       "plan": {"prompt_lengths": [len(p) for p in plan.prompts], "greedy_tokens": plan.greedy_tokens,
                                "block_size": plan.block_size, "window": plan.window},
                       "checks": [asdict(r) for r in results]}, indent=1, default=str)


def failed(results) -> bool:
    return any(r.status in ("fail", "error") for r in results)
