"""merge_adjacent's two ways of merging (kvref.text.pieces): by rounds, for long pieces, gives
exactly the symbols the heap gives, whatever the ranks: learned in order, with ties (SentencePiece
scores), or in any order (the rounds then hand over to the heap)."""

import random

from hypothesis import given
from hypothesis import strategies as st

from kvref.text import pieces
from kvref.text.pieces import merge_by_heap


def ranks(kind: str, seed: int):
    """A rank function over strings, fixed by `seed`: some pairs have none (None)."""

    def rank(a, b):
        draw = random.Random(f"{seed}:{a}|{b}")
        if len(a + b) > 8 or draw.random() < 0.2:
            return None
        if kind == "learned in order":  # a longer symbol's pairs rank after its parts'
            return len(a + b) * 100 + draw.random()
        if kind == "ties":
            return len(a + b) * 100 + draw.randint(0, 2)
        return draw.randint(0, 20)

    return rank


@given(symbols=st.lists(st.sampled_from("abcd"), min_size=2, max_size=200),
       kind=st.sampled_from(["learned in order", "ties", "any order"]), seed=st.integers(0, 2**32))
def test_merging_by_rounds_gives_the_heaps_symbols_whatever_the_ranks(symbols, kind, seed):
    rank = ranks(kind, seed)
    assert pieces._Rounds(list(symbols), rank).merge() == merge_by_heap(list(symbols), rank)


def test_a_piece_of_long_piece_symbols_merges_by_rounds_and_a_shorter_one_by_the_heap(monkeypatch):
    rank = ranks("learned in order", 0)
    calls = []
    monkeypatch.setattr(pieces, "merge_by_heap", lambda s, r: calls.append(len(s)) or merge_by_heap(s, r))
    pieces.merge_adjacent(list("ab" * (pieces.LONG_PIECE // 2)), rank)
    assert calls == []
    pieces.merge_adjacent(list("ab" * (pieces.LONG_PIECE // 2 - 1)), rank)
    assert calls == [pieces.LONG_PIECE - 2]
