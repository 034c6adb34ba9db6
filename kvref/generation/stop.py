"""When a sequence's generation ends: one rule for kvref.generate, the batch Scheduler and the server.

A generation ends after an end id (the model's EOS and end of turn unless ignore_eos, and the
settings' stop_ids) or after the token that completes a stop string; that token is the last one
selected. Stop strings are found in the decoded text (kvref.generation.stream.TextStream), so they
need a tokenizer; ids alone need none, and are checked without decoding anything unless the caller
wants the text too (the server streams it).
"""

from __future__ import annotations

from ..errors import GenerationError
from .config import GenerationConfig
from .stream import TextStream


class StopCondition:
    """One sequence's end: push(token) -> the text that token made final; `ended` once it ended."""

    def __init__(self, tokenizer, config: GenerationConfig, text: bool = False):
        """text: decode every token (push returns the text; flush the rest), not only with stop strings."""
        if config.stop and tokenizer is None:
            raise GenerationError("stop strings need a tokenizer to read the text; this model has none "
                                  "(give stop_ids instead)")
        self.tokenizer, self.config, self.wants_text = tokenizer, config, text
        self.end_ids = config.end_ids(tokenizer)
        decode = tokenizer is not None and (text or config.stop)
        self.stream = TextStream(tokenizer, config.stop, self.end_ids) if decode else None
        self.ended = False

    @classmethod
    def of_ids(cls, stop_ids) -> "StopCondition":
        """Ends after any of these ids only (no tokenizer, no text)."""
        return cls(None, GenerationConfig(stop_ids=stop_ids))

    def fresh(self) -> "StopCondition":
        """The same condition for another sequence (a sibling of n > 1), nothing pushed yet."""
        return StopCondition(self.tokenizer, self.config, self.wants_text)

    def push(self, token: int) -> str:
        """The text this token makes final ("" without text, or while it is held back)."""
        if self.ended:
            raise GenerationError("this generation has ended (an end id or a stop string); nothing follows it")
        if self.stream is None:
            self.ended = token in self.end_ids
            return ""
        text = self.stream.push(token)
        self.ended = self.stream.stopped
        return text

    def ends_after(self, token: int) -> bool:
        """push(token), for whether the generation ends after it."""
        self.push(token)
        return self.ended

    def flush(self) -> str:
        """At the end: the text still held back (a stop string's beginning that never completed)."""
        return "" if self.stream is None else self.stream.flush()
