"""TextStream: text out as soon as it is final, never a stop string or what follows it, for any token split."""

import codecs

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvref.errors import GenerationError
from kvref.generation.stream import TextStream


class ByteTokens:
    """A stand-in tokenizer whose tokens are given byte strings (any split of a text, even inside a
    UTF-8 character): what StreamDecoder reads of a tokenizer."""

    class model:
        strip_leading_space = False

    def __init__(self, pieces):
        self.pieces = list(pieces)
        self.eos_ids = frozenset()

    def token_bytes(self, token_id):
        return self.pieces[token_id]


@st.composite
def byte_splits(draw, data: bytes):
    """data cut at random byte offsets (UTF-8 characters split too) into non-empty pieces."""
    cuts = sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=12))) if len(data) > 1 else []
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


chars = st.characters(exclude_categories=("Cs",))
words = st.text(st.sampled_from("ab\n é€😀") | chars, max_size=12)
stops = st.lists(st.text(st.sampled_from("ab\n é€😀"), min_size=1, max_size=4), min_size=1, max_size=3)


def run(pieces, stop, end_ids=()):
    """Push every piece until the stream stops: (shown text, after each push the text shown so far, index
    of the token that stopped it or None)."""
    stream = TextStream(ByteTokens(pieces), stop, end_ids)
    shown, stopped_at = [], None
    for i in range(len(pieces)):
        shown.append(stream.push(i))
        if stream.stopped:
            stopped_at = i
            break
    shown.append(stream.flush())
    return "".join(shown), shown, stopped_at


@given(st.data(), words, stops, words)
def test_the_text_shown_is_the_text_before_the_first_stop_string_for_any_token_split(data, before, stop, after):
    text = before + stop[0] + after
    pieces = data.draw(byte_splits(text.encode()))
    shown, _, stopped_at = run(pieces, stop)
    first = min(i for i in (text.find(s) for s in stop) if i >= 0)
    assert shown == text[:first]
    # the stream stops with the token whose bytes complete the first stop string's characters
    ends = [len(b"".join(pieces[:k + 1])) for k in range(len(pieces))]
    expected = next(k for k, end in enumerate(ends)
                    if any(s in text.encode()[:end].decode("utf-8", "ignore") for s in stop))
    assert stopped_at == expected


@given(st.data(), words, stops)
def test_without_a_stop_string_in_the_text_everything_is_shown_and_less_than_a_stop_string_is_held(data, text, stop):
    text = text or "a"
    stop = [s for s in stop if s not in text] or ["\x00"]
    pieces = data.draw(byte_splits(text.encode()))
    full = b"".join(pieces).decode("utf-8", "replace")
    stream = TextStream(ByteTokens(pieces), stop)
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    shown = decoded = ""
    for i, piece in enumerate(pieces):
        shown += stream.push(i)
        decoded += utf8.decode(piece)
        assert decoded.startswith(shown)
        assert len(decoded) - len(shown) < max(map(len, stop))  # held back: at most a stop string's beginning
    assert shown + stream.flush() == full and not stream.stopped


@given(st.data(), words, words)
def test_an_end_id_ends_the_text_without_its_own_text(data, before, after):
    before = before or "a"
    pieces = data.draw(byte_splits(before.encode())) + [b"<eos>", after.encode() or b"z"]
    shown, _, stopped_at = run(pieces, (), end_ids={len(pieces) - 2})
    assert shown == before and stopped_at == len(pieces) - 2


def test_an_end_id_releases_text_held_as_the_beginning_of_a_stop_string():
    assert run([b"a\n", b"<eos>"], ["\n\n"], end_ids={1})[0] == "a\n"


def test_a_stop_string_inside_one_token_cuts_that_token():
    shown, parts, stopped_at = run([b"Paris.", b"\n\nThe", b" answer"], ["\n\n"])
    assert (shown, stopped_at) == ("Paris.", 1)


def test_a_stop_string_that_never_completes_is_shown_at_the_end():
    assert run([b"a", b"\n"], ["\n\n"])[0] == "a\n"


def test_bad_stop_strings_and_pushing_after_the_end_are_errors():
    with pytest.raises(GenerationError, match="non-empty"):
        TextStream(ByteTokens([b"a"]), [""])
    with pytest.raises(GenerationError, match="list of strings"):
        TextStream(ByteTokens([b"a"]), "\n")
    stream = TextStream(ByteTokens([b"ab"]), ["b"])
    assert stream.push(0) == "a" and stream.stopped
    with pytest.raises(GenerationError, match="has ended"):
        stream.push(0)
