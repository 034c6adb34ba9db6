"""The engine-adapter protocol: what the conformance suite asks of an engine, and what an engine says it can do.

An engine runs *sequences*: handles it makes with new_sequence() and extends with forward(seq, ids),
which returns the next-token log-distribution of every new position (Rows). The optional operations
below are each named by a capability; an adapter lists the capabilities it has, and the suite runs a
check only when the engine has every capability the check needs (else the check is skipped, saying
which capability is missing). An engine that has a capability but refuses the operation for a given
state (llama.cpp removing positions from a window cache) raises Refused: the check reports it.

    capability      operation                                    what kvref calls it
    incremental     forward(seq, ids) extends a kept sequence    Model.forward on a cache
    full_logits     Rows carry all V log-probabilities           (else the engine's top-k)
    batch           forward_batch(seqs, id_lists)                kvref.generation.batch.forward_batch
    prefix_cache    prefill_cached(ids) -> (seq, rows, reused)   PagedCache.prefill_reuse
                    (rows of the positions after the reused ones;
                    reused -1: not reported, all rows returned),
                    prefill_cold(ids): the same without reuse
    save_restore    save(seq) -> state; restore(state) -> seq;   cache.save / model.load_cache
                    last_rows(seq): the logits a restored
                    sequence selects its next token from
    fork            fork(seq) -> an independent copy             cache.fork (llama.cpp: seq_cp)
    rollback        rollback(seq, n): keep positions < n         cache.truncate (seq_rm)
    context_shift   shift(seq, n, keep): drop keep..keep+n-1,     cache.shift (seq_rm + seq_add)
                    later positions move down by n
    sliding_window  runs models with sliding-window layers       the hybrid cache
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import KVRefError

CAPABILITIES = ("incremental", "full_logits", "batch", "prefix_cache", "save_restore", "fork", "rollback",
                "context_shift", "sliding_window")


class ConformanceError(KVRefError, ValueError):
    """A conformance run that cannot be set up as asked: an unknown engine, a missing option (an HF
    directory, a URL), an engine whose vocabulary differs from the spec's, a server answering off protocol."""


class Refused(KVRefError, RuntimeError):
    """The engine has the capability but refused this operation in this state (said why)."""


@dataclass
class Rows:
    """Next-token log-probabilities of T positions: every token's (full [T, V]), or the engine's k
    most likely (top_ids, top_logprobs [T, k], most likely first). `missing` names the rows the engine
    answered without a distribution ({row: why}, a server that leaves entries out): such a row holds
    placeholders (-inf), and the checks compare the other rows and report these as skipped."""

    full: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    missing: dict = field(default_factory=dict)

    @classmethod
    def from_logits(cls, logits) -> "Rows":
        z = np.atleast_2d(np.asarray(logits, dtype=np.float64))  # [T, V]
        z = z - z.max(axis=-1, keepdims=True)
        return cls(full=z - np.log(np.exp(z).sum(axis=-1, keepdims=True)))

    def __len__(self) -> int:
        return len(self.full if self.full is not None else self.top_ids)

    def top1(self) -> np.ndarray:
        # -> [T] the engine's most likely token at each position (a placeholder on a missing row)
        return self.full.argmax(axis=-1) if self.full is not None else self.top_ids[:, 0]

    def reported(self) -> np.ndarray:
        """[T'] the indices of the rows that are not missing, in order."""
        return np.array([i for i in range(len(self)) if i not in self.missing], dtype=np.int64)

    def take(self, rows) -> "Rows":
        """The given rows (indices of rows that are not missing)."""
        if self.full is not None:
            return Rows(full=self.full[rows])
        return Rows(top_ids=self.top_ids[rows], top_logprobs=self.top_logprobs[rows])

    @staticmethod
    def concat(parts) -> "Rows":
        offsets = np.cumsum([0] + [len(p) for p in parts])
        missing = {int(start) + i: why for p, start in zip(parts, offsets) for i, why in p.missing.items()}
        if parts[0].full is not None:
            return Rows(full=np.concatenate([p.full for p in parts]), missing=missing)
        return Rows(top_ids=np.concatenate([p.top_ids for p in parts]),
                    top_logprobs=np.concatenate([p.top_logprobs for p in parts]), missing=missing)


class Engine:
    """Base of every adapter: the protocol, with each optional operation refusing by default."""

    name = "engine"
    capabilities: frozenset = frozenset()
    # which ConformanceBounds of kvref.tolerance apply (kvref.conformance.checks.BOUNDS)
    precision = "float32"

    @property
    def label(self) -> str:
        """The engine as messages name it."""
        return self.name

    def describe(self) -> dict:
        """What was run: engine version, backend, cache options (the report's header)."""
        return {"engine": self.name}

    def new_sequence(self):
        raise NotImplementedError

    def forward(self, seq, ids, last_only: bool = False) -> Rows:
        """Run ids at the sequence's next positions: the rows of every new position, or of the last one."""
        raise NotImplementedError

    def free(self, seq) -> None:
        """Release the sequence's cache (no-op where nothing is held)."""

    def close(self) -> None:
        """Release the engine (model, context, server connection)."""

    def forward_batch(self, seqs, id_lists) -> list:
        raise Refused(f"{self.name} cannot run a batch")

    def prefill_cached(self, ids):
        raise Refused(f"{self.name} has no prefix cache")

    def prefill_cold(self, ids):
        """A new sequence running ids without reusing any cached prefix: (seq, rows)."""
        seq = self.new_sequence()
        return seq, self.forward(seq, ids)

    def save(self, seq):
        raise Refused(f"{self.name} cannot save a sequence")

    def restore(self, state):
        raise Refused(f"{self.name} cannot restore a sequence")

    def last_rows(self, seq) -> Rows | None:
        raise Refused(f"{self.name} does not expose a sequence's last logits")

    def fork(self, seq):
        raise Refused(f"{self.name} cannot fork a sequence")

    def rollback(self, seq, n: int) -> None:
        raise Refused(f"{self.name} cannot remove positions")

    def shift(self, seq, n: int, keep: int) -> None:
        raise Refused(f"{self.name} cannot shift positions")
