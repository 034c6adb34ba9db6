"""A chat over one KV cache: each turn prefills only the tokens the cache does not already hold.

Each turn renders the whole conversation with the model's chat template and tokenizes it. The
longest prefix shared with the ids of the cached positions (the cache's sequence records them with
every execution) is reused as is; the cache is truncated to that prefix (normally a no-op) and only
the rest is prefilled. This is the articles'
point at conversation scale: turn n does not pay again for turns 1..n-1. (A hybrid cache can go back
only a little way; when the shared prefix ends further back than its rings reach, the turn starts
again from an empty cache.)
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import TokenizerError
from .generate import generate, resolve_config
from .stream import TextStream


@dataclass(frozen=True)
class TurnStats:
    reused: int  # positions whose K/V came from earlier turns
    computed: int  # new positions prefilled for this turn


class Conversation:
    def __init__(self, model, system: str | None = None):
        if model.tokenizer is None or not model.chat_template:
            raise TokenizerError("this model has no chat template (tokenizer.chat_template)")
        self.model = model
        self.messages = [] if system is None else [{"role": "system", "content": system}]
        self.cache = model.new_cache()
        self.last_turn: TurnStats | None = None

    def prompt_ids(self) -> list[int]:
        """The conversation so far, rendered with the template and ending in the assistant's cue."""
        return self.model.chat_ids(self.messages)

    def say(self, text: str, max_new_tokens: int | None = None, config=None, **settings):
        """Add a user message; yield the reply's token ids as they are selected.

        config / settings: as kvref.generate's (the model's generation_config by default). The reply
        ends at an end id (EOS, end of turn) or a stop string; the message keeps the text before them.
        """
        self.messages.append({"role": "user", "content": text})
        try:
            config = resolve_config(self.model, config, max_new_tokens, settings)
            ids = self.prompt_ids()
            reused = min(shared_prefix(ids, self.cache.sequence.token_ids or []), len(ids) - 1)
            if not self.cache.can_truncate(reused):
                reused = 0  # a hybrid cache's rings have moved past the shared prefix: prefill it all again
            self.model.check_context(reused, len(ids) - reused + max(config.max_new_tokens - 1, 0))
        except Exception:
            self.messages.pop()  # a refused turn leaves the conversation as it was
            raise
        self.cache.truncate(reused)
        self.last_turn = TurnStats(reused=reused, computed=len(ids) - reused)
        reply = []
        for token in generate(self.model, ids[reused:], config=config, cache=self.cache):
            reply.append(token)
            yield token
        tokenizer = self.model.tokenizer
        content = TextStream(tokenizer, config.stop, config.end_ids(tokenizer)).text(reply)
        self.messages.append({"role": "assistant", "content": content})


def shared_prefix(a, b) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
