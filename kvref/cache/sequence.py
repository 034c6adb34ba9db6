"""What the executions recorded about one cache's positions: the session state beside the storage."""

from __future__ import annotations

import numpy as np


class Sequence:
    """What the executions recorded about one cache's positions: the session state beside the storage.

    model        fingerprint of the model whose K/V the cache holds (Model.fingerprint()); None for a
                 cache not made by a model, which Model.forward refuses
    token_ids    ids of positions 0..next_position-1 (a copy); None once some positions were not
                 computed from known ids (raw K/V appended without ids, a context shift)
    last_logits  logits [V] (read-only) of the last position of the last execution: what the next
                 token is drawn from (kvref.resume); None when no execution has run since positions
                 were removed (truncate)

    Every commit updates them together with the cache's length, so they never disagree.
    """

    def __init__(self, model=None, token_ids=(), last_logits=None):
        self.model = model
        self.replace(token_ids, last_logits)

    def __repr__(self):
        n = "unknown" if self._token_ids is None else len(self._token_ids)
        return f"Sequence(token ids: {n}, last logits: {self.last_logits is not None})"

    @property
    def token_ids(self) -> list | None:
        return None if self._token_ids is None else list(self._token_ids)

    @property
    def n_token_ids(self) -> int | None:
        """How many ids are known (None: unknown), without copying them."""
        return None if self._token_ids is None else len(self._token_ids)

    def ids(self, start: int, end: int) -> list:
        """token_ids[start:end] without copying the rest; the ids must be known."""
        return self._token_ids[start:end]

    def copy(self) -> "Sequence":
        return Sequence(self.model, self._token_ids, self.last_logits)

    def record(self, token_ids, last_logits) -> None:
        """A commit: the new positions' ids (None: unknown) and the last logits (a private read-only copy
        already: Execution.check_complete made it)."""
        if token_ids is None or self._token_ids is None:
            self._token_ids = None  # some position's id is unknown from now on
        else:
            self._token_ids.extend(token_ids)
        self.last_logits = last_logits

    def replace(self, token_ids, last_logits=None) -> None:
        """Positions came from elsewhere (a saved file, an adopted prefix): their ids (None: unknown)
        and the logits of their last position (None: not known)."""
        self._token_ids = None if token_ids is None else [int(t) for t in token_ids]
        self.last_logits = None if last_logits is None else readonly(np.array(last_logits, copy=True))

    def trim(self, n: int) -> None:
        """Positions >= n are gone (truncate): their ids go, and the last logits, which were a gone position's."""
        if n == 0:
            self._token_ids = []  # an empty cache knows the ids of all of its (no) positions
        elif self._token_ids is not None:
            del self._token_ids[n:]
        self.last_logits = None

    def forget_ids(self) -> None:
        """The K/V no longer equal a plain run of the ids (a shift): the ids stop describing them."""
        self._token_ids = None


def readonly(a):
    """A read-only view of `a`: what the cache hands out of what it keeps."""
    view = a.view()
    view.flags.writeable = False
    return view
