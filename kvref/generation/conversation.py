"""A chat over one KV cache: each turn prefills only the tokens the cache does not already hold.

Each turn renders the whole conversation with the model's chat template and tokenizes it. The
longest prefix shared with the ids of the cached positions (the cache's sequence records them with
every execution) is reused as is; the cache is truncated to that prefix (normally a no-op) and only
the rest is prefilled. This is the articles'
point at conversation scale: turn n does not pay again for turns 1..n-1. (A hybrid cache can go back
only a little way; when the shared prefix ends further back than its rings reach, the turn starts
again from an empty cache.)

An interrupted reply (the caller closes the reply early, or Ctrl-C arrives while it is generated)
is a normal end of a turn. The cache keeps exactly the positions whose executions committed, and
the conversation keeps the reply as the token ids that were selected, in a message

    {"role": "assistant", "content": <their text>, "token_ids": [...], "interrupted": True}

Its text is for people; the prompt of every later turn takes the ids themselves, never the text
tokenized again (which need not give the same ids, and would cut a half-selected UTF-8 character):
the template renders the conversation with a placeholder in place of the content, the text around
each placeholder is tokenized, and the ids are put in between. The template closes the interrupted
turn as it closes any other (its end-of-turn marker was never selected, so it is prefilled with the
next turn), and the next turn reuses every committed position.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import CacheFullError, KVRefError, TokenizerError
from .generate import generate, prefill_in_chunks, resolve_config
from .stream import TextStream


@dataclass(frozen=True)
class TurnStats:
    reused: int  # positions whose K/V came from earlier turns
    computed: int  # new positions prefilled for this turn
    dropped: int = 0  # oldest messages dropped to fit the cache (drop_oldest)


class Conversation:
    """cache: the KV cache of the whole conversation (default model.new_cache()).
    drop_oldest: when a turn would not fit the cache, drop the oldest user/assistant pairs (never the
    system message nor the new message) until it does, instead of refusing the turn."""

    def __init__(self, model, system: str | None = None, cache=None, drop_oldest: bool = False):
        if model.tokenizer is None or not model.chat_template:
            raise TokenizerError("this model has no chat template (tokenizer.chat_template)")
        self.model = model
        self.messages = [] if system is None else [{"role": "system", "content": system}]
        self.cache = model.new_cache() if cache is None else cache
        self.drop_oldest = drop_oldest
        self.last_turn: TurnStats | None = None
        # stands in for the content of a message given as ids while the template renders; random, so
        # no text a user types can pass for it (os.urandom, as secrets.token_hex, whose hmac import
        # loads OpenSSL's libcrypto)
        self._placeholder = f"\x00kvref-{os.urandom(8).hex()}-"

    def prompt_ids(self) -> list[int]:
        """The conversation so far, rendered with the template and ending in the assistant's cue;
        a message with "token_ids" (an interrupted reply) enters as exactly those ids."""
        spliced = [m["token_ids"] for m in self.messages if "token_ids" in m]
        if not spliced:
            return self.model.text.chat_ids(self.messages)
        marked, n = [], 0
        for m in self.messages:
            if "token_ids" in m:
                m, n = dict(m, content=f"{self._placeholder}{n}\x00"), n + 1
            marked.append(m)
        parts = re.split(re.escape(self._placeholder) + "([0-9]+)\x00", self.model.text.chat_text(marked))
        # parts: text, index, text, index, ..., text
        if parts[1::2] != [str(i) for i in range(len(spliced))]:
            raise TokenizerError("the chat template dropped, repeated or reordered a message's content, so an "
                                 "interrupted reply cannot be put back as its token ids")
        ids = []
        for i, text in enumerate(parts[0::2]):
            ids += self.model.tokenizer.encode(text, special=True)
            if i < len(spliced):
                ids += spliced[i]
        return ids

    def say(self, text: str, max_new_tokens: int | None = None, config=None, progress=None, **settings):
        """Add a user message; yield the reply's token ids as they are selected.

        config / settings: as kvref.generate's (the model's generation_config by default). The reply
        ends at an end id (EOS, end of turn) or a stop string; the message keeps the text before them.
        progress(done, total): called while a long turn is prefilled (prefill_in_chunks). Closing
        the generator early, or an exception while it runs (KeyboardInterrupt), ends the turn with
        the reply so far kept as an interrupted message (see the module docstring).
        """
        before = list(self.messages)
        self.messages.append({"role": "user", "content": text})
        try:
            config = resolve_config(self.model, config, max_new_tokens, settings)
            ids, dropped = self._fitting_prompt(max(config.max_new_tokens - 1, 0))
            reused = min(shared_prefix(ids, self.cache.sequence.token_ids or []), len(ids) - 1)
            if not self.cache.capabilities.truncate(reused):
                reused = 0  # a hybrid cache's rings have moved past the shared prefix: prefill it all again
            self.model.check_context(reused, len(ids) - reused + max(config.max_new_tokens - 1, 0))
        except Exception:
            self.messages = before  # a refused turn leaves the conversation as it was
            raise
        self.cache.truncate(reused)
        self.last_turn = TurnStats(reused=reused, computed=len(ids) - reused, dropped=dropped)
        reply, outcome = [], "interrupted"
        try:
            rest = prefill_in_chunks(self.model, ids[reused:], self.cache, progress)
            for token in generate(self.model, rest, config=config, cache=self.cache):
                reply.append(token)
                yield token
            outcome = "ended"
        except KVRefError:
            if not reply:
                outcome = "refused"  # generate refused its arguments, or the first execution failed
            raise
        finally:
            self._end_turn(reply, config, outcome, before)

    def _fitting_prompt(self, n_after):
        """prompt_ids() of a conversation that leaves n_after positions free in the cache, and how many
        messages were dropped for it (drop_oldest); CacheFullError when it cannot fit."""
        first = 1 if self.messages[0]["role"] == "system" else 0
        dropped = 0
        while True:
            ids = self.prompt_ids()
            if len(ids) + n_after <= self.cache.capacity:
                return ids, dropped
            if not self.drop_oldest or len(self.messages) - first < 3:
                self.model.check_context(0, len(ids) + n_after)  # beyond the model itself: say so first
                raise CacheFullError(
                    f"the conversation's {len(ids)} positions and {n_after + 1} new tokens do not fit a cache of "
                    f"{self.cache.capacity}" + ("" if self.drop_oldest else "; old turns can be dropped (drop_oldest=True, "
                                                             "kvref chat --context-overflow truncate)"))
            del self.messages[first:first + 2]  # the oldest user message and its reply
            dropped += 2

    def _end_turn(self, reply, config, outcome, before):
        tokenizer = self.model.tokenizer
        end_ids = config.end_ids(tokenizer)
        if outcome == "refused":
            self.messages = before  # as it was; the cache keeps what committed
        elif outcome == "ended" or (reply and reply[-1] in end_ids):
            content = TextStream(tokenizer, config.stop, end_ids).text(reply)  # the text before a stop
            self.messages.append({"role": "assistant", "content": content})
        else:
            self.messages.append({"role": "assistant", "content": tokenizer.decode(reply),
                                  "token_ids": list(reply), "interrupted": True})


def shared_prefix(a, b) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
