"""What a cache can do exactly, asked in one place: `cache.capabilities`.

    caps = cache.capabilities
    caps.fork               a fork now (the cache is live and no execution is open)
    caps.save               a save now (made for a model, in K/V types the file format stores)
    caps.in_place           its K/V read and written where they lie (the native forward)
    caps.shift()            a shift, ever (its layout, K type and RoPE allow one); caps.shift(n, keep): that one, now
    caps.append(n_new)      an execution of n_new positions fits now
    caps.truncate(n)        a truncation to position n, now, exactly
    caps.roll_back(n_new)   whether an execution of n_new positions, run now, could be truncated away again
                            exactly, to any position from today's next_position on (speculative decoding)

Each answer is a Can: true when the operation can be done exactly, else false with `reason`, the
sentence the operation itself raises CacheError with. Nothing no-ops silently: what a Can refuses,
the operation refuses. Layouts answer through the hooks of Capable (KVCache inherits it); the codec
answers for its own rules (kivi4 K: truncation only at a group's edge, kvref/cache/quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..moved import deprecated
from .fileformat import save_problem
from .quant import SHIFTABLE_K_DTYPES


def k_shift_problem(k_dtype: str) -> str | None:
    """Why K stored as k_dtype cannot be shifted (None when it can): the shift's reason on every layout
    that shifts, which the CLI recognises to name the --kv-dtype that would do."""
    if k_dtype in SHIFTABLE_K_DTYPES:
        return None
    return (f"K is stored as {k_dtype}; rotating it again would round history a second time (a shift needs K "
            f"stored as {' or '.join(SHIFTABLE_K_DTYPES)})")


@dataclass(frozen=True)
class Can:
    """Whether one operation can be done exactly: true, or false with the reason it cannot."""

    reason: str | None = None

    def __bool__(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class Capabilities:
    """What `cache` can do, asked when needed (see the module docstring): every answer a Can."""

    cache: Capable

    @property
    def fork(self) -> Can:
        return Can(self.cache._idle_problem())

    @property
    def save(self) -> Can:
        return Can(self.cache._idle_problem() or save_problem(self.cache))

    @property
    def in_place(self) -> Can:
        return Can(self.cache._storage_problem())

    def shift(self, n: int | None = None, keep: int = 0) -> Can:
        if n is None:  # whatever positions it holds: only the layout, the K type and the RoPE matter
            return Can(self.cache._shift_problem())
        return Can(self.cache._idle_problem() or self.cache._shift_problem(n, keep))

    def append(self, n_new: int) -> Can:
        return Can(self.cache._append_problem(n_new))

    def truncate(self, n: int) -> Can:
        return Can(self.cache._idle_problem() or self.cache._truncate_problem(n))

    def roll_back(self, n_new: int) -> Can:
        return Can(self.cache._idle_problem() or self.cache._rollback_problem(n_new))


class Capable:
    """The capability half of KVCache: `capabilities`, and the hooks that answer it, each returning the
    reason an operation cannot be done exactly (None when it can). Layouts override the hooks."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(self)

    def _idle_problem(self) -> str | None:
        if self._freed:
            return "this cache was freed"
        if self.executing:
            return "an execution is open on this cache"
        return None

    def _append_problem(self, n_new) -> str | None:
        if self._freed:
            return "this cache was freed"
        free = self.capacity - self.length
        return None if n_new <= free else f"{n_new} new positions do not fit: {free} of {self.capacity} are free"

    def _truncate_problem(self, n) -> str | None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            return f"n must be an integer, not {n!r}"
        if not 0 <= n <= self.length:
            return f"the cache holds {self.length} positions"
        return self.k_codec.truncate_problem(self.length, n)

    def _rollback_problem(self, n_new) -> str | None:
        # The layouts that keep every position (contiguous, paged) can always roll back, unless the
        # K codec cannot (kivi4 K completing a group of positions)
        if isinstance(n_new, bool) or not isinstance(n_new, (int, np.integer)) or n_new < 0:
            return f"n_new={n_new!r} must be an integer >= 0"
        return self.k_codec.rollback_problem(self.length, n_new)

    def _shift_problem(self, n=None, keep=0) -> str | None:
        # n=None: whether this cache could ever shift, whatever positions it holds
        if n is not None:
            for name, value in (("n", n), ("keep", keep)):
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                    return f"{name}={value!r} must be an integer >= 0"
            if n == 0:
                return "n must be at least 1"
        problem = k_shift_problem(self.k_dtype)
        if problem is not None:
            return problem
        if self.rope_theta is None:
            return "the cache does not know the model's rope_theta (make it with model.new_cache)"
        if n is not None and keep + n > self.next_position:
            return f"positions {keep}..{keep + n - 1} are not all before next_position {self.next_position}"
        return None

    def _storage_problem(self) -> str | None:
        return "this cache was freed" if self._freed else None

    # ---- the names cache.capabilities replaces (CHANGELOG.md, "Moved"), kept for one release ------------

    @deprecated("cache.capabilities.append(n_new)")
    def can_append(self, n_new: int) -> bool:
        return bool(self.capabilities.append(n_new))

    @deprecated("cache.capabilities.truncate(n)")
    def can_truncate(self, n: int) -> bool:
        return bool(self.capabilities.truncate(n))

    @deprecated("cache.capabilities.roll_back(n_new)")
    def can_roll_back(self, n_new: int) -> bool:
        return bool(self.capabilities.roll_back(n_new))

    @deprecated("cache.capabilities.fork")
    def can_fork(self) -> bool:
        return bool(self.capabilities.fork)

    @deprecated("cache.capabilities.shift(n, keep)")
    def can_shift(self, n: int = 1, keep: int = 0) -> bool:
        return bool(self.capabilities.shift(n, keep))

    @deprecated("cache.capabilities.roll_back(n_new).reason")
    def rollback_problem(self, n_new: int) -> str | None:
        return self._rollback_problem(n_new)

    @deprecated("cache.capabilities.shift().reason")
    def shift_problem(self) -> str | None:
        return self._shift_problem()

    @deprecated("cache.capabilities.in_place.reason")
    def storage_problem(self) -> str | None:
        return self._storage_problem()
