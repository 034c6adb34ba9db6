"""Structured output: a grammar masks the logits, so every token selected keeps the output a prefix of
the grammar's language, and generation can end (at an end id) only where the output is complete.

    select = Constrained(Sampler(...), Grammar(tokenizer, json_schema={"type": "object"}))
    token = select(logits, history)      # masked logits -> the same Sampler -> the grammar moves on

The grammar is a JSON schema (json_schema=) or a Lark grammar in llguidance's dialect (grammar=), built
by llguidance (the structured extra: pip install 'kvref[structured]'), chosen over outlines-core by the
measurements in docs/benchmarks.md ("Structured output"): its masks are computed per token from a
lazily built lexer, so any JSON schema and plain JSON mode compile in milliseconds on 262,144 tokens,
where outlines-core precomputes an index of every state and token ahead (3 s for a small schema,
unbounded JSON only as a depth-limited regex). The grammar sees each token as the bytes it decodes
to (Tokenizer.token_bytes); control tokens are out of its reach, except the end ids, which it allows
once the output is complete.
"""

from __future__ import annotations

import json
import weakref

import numpy as np

from ..errors import GenerationError
from ..text.vocab import CONTROL, UNKNOWN, UNUSED

EXTRA = "pip install 'kvref[structured]'"
# token types that stand for no text a grammar could match
OUT_OF_REACH = frozenset({CONTROL, UNKNOWN, UNUSED})
# kvref Tokenizer -> its llguidance.LLTokenizer (building one takes 2 s on 262,144 tokens)
# JSON written one way, with json.dumps's separators and no other whitespace: a model cannot wander
# in optional whitespace (a schema's "x-guidance" options can still ask for it)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_GRAMMAR_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _llguidance():
    try:
        import llguidance
    except ImportError as error:
        raise GenerationError(f"structured output (grammar=, json_schema=) needs the structured extra "
                              f"({EXTRA}): {error}") from None
    return llguidance


def grammar_tokenizer(tokenizer):
    """The llguidance tokenizer of a kvref Tokenizer: every token's bytes, the end ids, made once."""
    if tokenizer not in _GRAMMAR_TOKENIZERS:
        llguidance = _llguidance()
        if not tokenizer.eos_ids:
            raise GenerationError("structured output needs an end id to end the output at; the tokenizer has none")
        _GRAMMAR_TOKENIZERS[tokenizer] = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(TokenizerView(tokenizer)), eos_token=sorted(tokenizer.eos_ids))
    return _GRAMMAR_TOKENIZERS[tokenizer]


class TokenizerView:
    """What llguidance.TokenizerWrapper reads of a tokenizer: .tokens, each token's bytes (control tokens
    made unreachable), the end and special ids, and encoding."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eos_ids)
        self.bos_token_id = tokenizer.bos_id
        out_of_reach = [t in OUT_OF_REACH for t in tokenizer.token_types]
        # llguidance's convention: a token whose bytes start with 0xFF (never in UTF-8) is special
        self.tokens = [b"\xff" + tokenizer.tokens[i].encode() if out_of_reach[i] else tokenizer.token_bytes(i)
                       for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i, special in enumerate(out_of_reach) if special]

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", "replace"))


class Grammar:
    """One output's grammar and where the output is in it: the tokens allowed next, then the token taken.

    Exactly one of json_schema (a dict, or its JSON text) and grammar (Lark text in llguidance's dialect,
    which also takes `%json {...}` and regular expressions) is given; a schema or grammar that cannot
    be built, or that allows no output, is a GenerationError.
    """

    def __init__(self, tokenizer, *, json_schema=None, grammar=None):
        llguidance = _llguidance()
        text = grammar_text(llguidance, json_schema, grammar)
        self.vocab_size = tokenizer.vocab_size
        self.matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer), text, log_level=0)
        if self.matcher.is_error():
            raise GenerationError(f"the {_kind(json_schema)} cannot be used: {self.matcher.get_error()}")
        self.bits = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)  # [ceil(V / 32)], token i at bit i
        self.allowed()  # a grammar that allows nothing fails here, before any token is selected

    def allowed(self) -> np.ndarray:
        """Which tokens may come next: [V] bool."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        allowed = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
        if self.matcher.is_error() or not allowed.any():
            reason = self.matcher.get_error() if self.matcher.is_error() else "no token continues the output"
            raise GenerationError(f"the grammar allows no next token: {reason}")
        return allowed

    def masked(self, logits) -> np.ndarray:
        """The logits with every token the grammar does not allow next at -inf."""
        # [V'] -> [V'] (V' >= V: ids past the tokenizer's vocabulary are never allowed)
        logits = np.asarray(logits)
        allowed = np.zeros(len(logits), dtype=bool)
        allowed[:self.vocab_size] = self.allowed()
        return np.where(allowed, logits, -np.inf)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise GenerationError(f"token {token} does not continue the grammar: {self.matcher.get_error()}")


def grammar_text(llguidance, json_schema, grammar) -> str:
    """llguidance's grammar text for a JSON schema or a Lark grammar."""
    if (json_schema is None) == (grammar is None):
        raise GenerationError("give one of json_schema= and grammar=")
    if grammar is not None:
        if not isinstance(grammar, str):
            raise GenerationError(f"grammar= takes Lark grammar text (str); got {type(grammar).__name__}")
        return grammar
    if isinstance(json_schema, str):
        try:
            json_schema = json.loads(json_schema)
        except json.JSONDecodeError as error:
            raise GenerationError(f"json_schema= is not JSON: {error}") from None
    if not isinstance(json_schema, dict):
        raise GenerationError(f"json_schema= takes a JSON object (a dict); got {type(json_schema).__name__}")
    return llguidance.LLMatcher.grammar_from_json_schema(json_schema, defaults=JSON_LAYOUT)


def _kind(json_schema) -> str:
    return "grammar" if json_schema is None else "JSON schema"


class Constrained:
    """A Sampler whose logits a Grammar masks first; the grammar takes each token selected."""

    def __init__(self, sampler, grammar: Grammar):
        self.sampler, self.grammar = sampler, grammar

    def __call__(self, logits, history=()) -> int:
        token = self.sampler(self.grammar.masked(logits), history)
        self.grammar.consume(token)
        return token
