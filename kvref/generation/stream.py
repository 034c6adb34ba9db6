"""Streaming a generation as text: token ids in, text out as soon as it is final, cut at stop strings.

Text a reader has been shown cannot be taken back, so a TextStream holds text back while it may
still turn out to be part of something that must not be shown:

  - the bytes of an incomplete UTF-8 character (a character may be split over tokens: StreamDecoder);
  - the end of the text while it is the beginning of a stop string ("\\n" when "\\n\\n" stops): it is
    released once the next text shows it is not, or at the end (flush);
  - everything from the first stop string on, which may begin or end in the middle of a token or span
    several tokens: the stream stops there, and the text before it is all that is ever shown;
  - an end id (EOS, end of turn) ends the text without showing its own.

    stream = TextStream(model.tokenizer, stop=["\\n\\n"], end_ids=config.end_ids(model.tokenizer))
    for token in kvref.generate(model, ids, stop=["\\n\\n"]):
        print(stream.push(token), end="")
    print(stream.flush())

Whatever the split of a text into tokens, the pushes and the flush together equal the decoded text
cut before its first stop string, and they hold back less than the longest stop string.
kvref.generate ends a generation with the same rule, so the token that completes a stop string is
the last one it yields.
"""

from __future__ import annotations

from ..errors import GenerationError
from ..text import StreamDecoder
from .config import check_stop_strings


class TextStream:
    """Token ids in, text out (push, flush); `stopped` once a stop string or an end id was met."""

    def __init__(self, tokenizer, stop=(), end_ids=()):
        self.stop = check_stop_strings(stop)
        self.end_ids = frozenset(end_ids)
        self._decoder = StreamDecoder(tokenizer)
        self._held = ""  # decoded text not shown yet: it may be the beginning of a stop string
        self.stopped = False
        self._finished = False

    def push(self, token_id) -> str:
        """The text this token makes final ("" while it is held back)."""
        if self._finished:
            raise GenerationError("this text stream has ended (a stop string, an end id or flush); "
                                  "make a new TextStream for new text")
        if token_id in self.end_ids:
            self.stopped = True
            return self._finish()
        self._held += self._decoder.push(token_id)
        return self._release(final=False)

    def text(self, token_ids) -> str:
        """Everything this stream shows for these ids, pushed one by one, then flushed."""
        shown = "".join(self.push(token) for token in token_ids)
        return shown + self.flush()

    def flush(self) -> str:
        """At the end of the ids: the text still held back (a stop string's beginning that never
        completed; U+FFFD for a character that never completed). "" after a stop."""
        return "" if self._finished else self._finish()

    def _finish(self) -> str:
        self._held += self._decoder.flush()
        text = self._release(final=True)
        self._finished = True
        return text

    def _release(self, final: bool) -> str:
        cut = first_stop(self._held, self.stop)
        if cut is not None:
            self.stopped = self._finished = True
            text, self._held = self._held[:cut], ""
            return text
        keep = 0 if final else stop_prefix_length(self._held, self.stop)
        end = len(self._held) - keep
        text, self._held = self._held[:end], self._held[end:]
        return text


def first_stop(text: str, stop) -> int | None:
    """Where the first occurrence of any stop string in `text` begins; None if there is none."""
    starts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(starts) if starts else None


def stop_prefix_length(text: str, stop) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string (text to hold back)."""
    longest = max((len(s) for s in stop), default=1)
    for n in range(min(len(text), longest - 1), 0, -1):
        if any(s.startswith(text[-n:]) for s in stop):
            return n
    return 0
