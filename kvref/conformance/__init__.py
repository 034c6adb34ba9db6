"""`kvref conformance ENGINE`: check an inference engine against the spec (docs/conformance.md).

    engine.py          the adapter protocol: Rows, capabilities, Refused
    kvref_engine.py    kvref itself, either backend, any cache layout (the suite's control)
    hf_engine.py       transformers in process (DynamicCache)
    llama_engine.py    llama-cpp-python in process (its C API: sequences, seq_rm/seq_cp, state)
    http_engine.py     any OpenAI-compatible server (/v1/completions, token-id prompts, top logprobs)
    spec.py            the float32 spec as the oracle; KL from full or top-k log-probabilities
    checks.py          the named checks, golden and metamorphic
    suite.py           the plan, the run and the report
    fixtures.py        `kvref fixtures export`: prompts, ids, logits, per-layer K/V as .npz
"""

from .checks import CHECKS, CheckResult, Plan
from .engine import CAPABILITIES, ConformanceError, Engine, Refused, Rows
from .kvref_engine import KVRefEngine
from .spec import Spec, divergence
from .suite import make_plan, run_suite

__all__ = ["CAPABILITIES", "CHECKS", "CheckResult", "ConformanceError", "Engine", "KVRefEngine", "Plan", "Refused",
           "Rows", "Spec", "divergence", "make_plan", "run_suite"]
