"""Beam search over a batch of caches: reorder forks what is chosen twice and frees what is not chosen."""

from __future__ import annotations

import numpy as np

from ..errors import CacheError


def reorder(caches: list, indices) -> list:
    """Beam search over a batch of caches: entry i of the result continues from caches[indices[i]].

    Returns the new list. A cache chosen once is moved as is; one chosen k > 1 times is forked k - 1
    times (a paged cache shares its blocks); caches chosen by nobody are freed. All forks are made
    before anything is freed, so a failure leaves every cache as it was.
    """
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
        raise CacheError(f"indices must be a 1-D sequence of integers; got {indices!r}")
    idx = [int(i) for i in idx]
    bad = [i for i in idx if not 0 <= i < len(caches)]
    if bad:
        raise CacheError(f"reorder index {bad[0]} is out of range for {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise CacheError("reorder needs distinct caches; the same cache appears twice")
    for i, cache in enumerate(caches):
        if cache.executing:
            raise CacheError(f"cache {i} has an open execution; finish it before reordering")
    for i in set(idx):
        fork = caches[i].capabilities.fork
        if not fork:
            raise CacheError(f"cache {i} cannot be forked ({fork.reason})")
    seen, out, forks = set(), [], []
    try:
        for i in idx:
            if i in seen:
                child = caches[i].fork()
                forks.append(child)
                out.append(child)
            else:
                seen.add(i)
                out.append(caches[i])
    except BaseException:
        for child in forks:
            child.free()
        raise
    for i, cache in enumerate(caches):
        if i not in seen:
            cache.free()
    return out
