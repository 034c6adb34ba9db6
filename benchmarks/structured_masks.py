"""Constrained decoding: the time to compute one token mask, and the one-time compile, for llguidance
and outlines-core, on SmolLM2's 49,152-token and Gemma 3's 262,144-token vocabularies.

    python benchmarks/structured_masks.py [--models smollm2,gemma3-270m] [--repeats 5]

Each library gets the vocabulary as token byte strings, as kvref.generation.grammar gives them
(TokenizerView: Tokenizer.token_bytes; control tokens out of the grammar's reach). Two constraints: a JSON schema with nested fields and an enum,
and plain JSON mode (any JSON object; outlines-core has only regular languages, so its JSON mode is
its bounded-depth regex of {"type": "object"}). One fixed valid document is walked token by token: a
mask before every token, then the token is consumed. Printed: the median and 90th-percentile mask time
per token over the walk (median of --repeats walks), the first walk's first mask (llguidance builds its
lexer lazily, so its grammar's one-time cost lands there), and the compile time (tokenizer setup; grammar
or index build).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import kvref
from kvref.generation.grammar import TokenizerView, grammar_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "colour": {"enum": ["red", "green", "blue"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "colour", "address", "tags"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "colour": "green",
            "address": {"city": "London", "zip": "W1"}, "tags": ["maths", "engines"]}
JSON_MODE = {"type": "object"}
CONSTRAINTS = {"schema": SCHEMA, "json mode": JSON_MODE}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        self.lib = llguidance
        self.tokenizer = grammar_tokenizer(tokenizer)  # what kvref.generation.grammar uses
        self.mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)  # [ceil(V / 32)] bits

    def compile(self, schema):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.lib.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def walk(self, matcher, ids) -> list[float]:
        times = []
        for token in ids:
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
            times.append(time.perf_counter() - start)
            if not matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")
        matcher.reset()
        return times


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer):
        import outlines_core
        self.lib = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for i, piece in enumerate(TokenizerView(tokenizer).tokens):
            if piece and i not in tokenizer.eos_ids and not piece.startswith(b"\xff"):
                by_bytes.setdefault(piece, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_id, by_bytes)
        self.mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)  # [ceil(V / 32)] bits

    def compile(self, schema):
        regex = self.lib.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.lib.Index(regex, self.vocabulary)

    def walk(self, index, ids) -> list[float]:
        guide, times = self.lib.Guide(index), []
        for token in ids:
            start = time.perf_counter()
            guide.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)
            times.append(time.perf_counter() - start)
            guide.advance(token, return_tokens=False)
        return times


def timed(f, *args):
    start = time.perf_counter()
    result = f(*args)
    return result, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--libraries", default="llguidance,outlines-core")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    libraries = {cls.name: cls for cls in (LLGuidance, OutlinesCore)}
    # compact separators: what both libraries' schema grammars accept without optional whitespace
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    print(f"document: {text}")
    print(f"{'vocabulary':>10} {'library':>14} {'constraint':>10} {'setup s':>8} {'compile s':>9} "
          f"{'tokens':>6} {'mask µs (median)':>16} {'p90 µs':>8} {'first µs':>9}")
    for name in args.models.split(","):
        tokenizer = kvref.load(name).tokenizer
        ids = tokenizer.encode(text)
        for library in args.libraries.split(","):
            engine, setup = timed(libraries[library], tokenizer)
            for label, schema in CONSTRAINTS.items():
                compiled, compile_s = timed(engine.compile, schema)
                walks = [engine.walk(compiled, ids) for _ in range(args.repeats)]
                medians = [statistics.median(w) for w in walks]
                p90 = statistics.median(float(np.percentile(w, 90)) for w in walks)
                print(f"{tokenizer.vocab_size:>10,} {library:>14} {label:>10} {setup:>8.2f} {compile_s:>9.3f} "
                      f"{len(ids):>6} {statistics.median(medians) * 1e6:>16.1f} {p90 * 1e6:>8.1f} {walks[0][0] * 1e6:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
