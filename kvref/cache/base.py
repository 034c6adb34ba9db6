"""The one interface every KV cache layout implements, and the memory formula.

A cache stores, for every layer, the keys and values of the positions already processed, per kv
head; it never stores queries (a later position needs only its own query). K is stored *after*
RoPE: a key is rotated once, for the absolute position it was computed at, and read as is by every
later query. The price: moving a key to another position (a context shift) means rotating it
again by the difference, which RoPE allows because rotations compose.

An execution (prefill or decode step) uses the interface in three moves:

    positions = cache.next_positions(T)      # checks room first: a full cache fails before any work
    k_all, v_all, k_pos = cache.update(layer, k_new, v_new)   # once per layer
    cache.advance(T)                          # commit: only now does cache.length grow

`update` writes the new K/V beside what is stored and returns everything the new queries may attend
to; until `advance`, the stored length is unchanged, so an execution that fails halfway leaves the
cache as it was (`abort` releases whatever it had reserved). Occupancy is bookkeeping (`length`),
never inferred from the stored values.

Operations beyond an execution (truncate, fork, shift, save, free, and `reorder` over a list of
caches) each come with a capability check (`can_truncate(n)`, `can_fork()`, `can_shift(n)`): a
layout that cannot do an operation *exactly* raises CacheError saying why; nothing no-ops silently.
"""

from __future__ import annotations

import numpy as np

from ..errors import CacheError, CacheFullError, ShapeError
from .quant import ELEMENT_BYTES, Codec, dtype_name  # noqa: F401  (ELEMENT_BYTES, dtype_name re-exported)

# K can be moved to another position (re-rotated) without rounding history a second time only when
# it is stored at least as wide as the arithmetic that rotates it.
SHIFTABLE_K_DTYPES = ("float64", "float32")


def cache_bytes(n_layers: int, n_tokens: int, n_kv_heads: int, head_dim: int, dtype="float16") -> int:
    """2 (K and V) x layers x tokens x kv heads x head_dim x bytes per element, exactly."""
    return 2 * n_layers * n_tokens * n_kv_heads * head_dim * ELEMENT_BYTES[dtype_name(dtype)]


def bytes_per_position(n_layers, n_kv_heads, head_dim, k_dtype, v_dtype=None, group_size=None) -> int:
    """Bytes one position occupies in every layer: K and V vectors per kv head, plus int8 scales."""
    k = Codec(k_dtype, head_dim, group_size)
    v = Codec(k_dtype if v_dtype is None else v_dtype, head_dim, group_size)
    return n_layers * n_kv_heads * (k.bytes_per_vector() + v.bytes_per_vector())


class KVCache:
    """Interface of a KV cache for one sequence; layouts subclass it.

    length        positions whose K/V are stored
    next_position absolute position of the next new token (== length unless a layout drops positions)
    capacity      positions the cache can hold
    nbytes        bytes of the stored K/V (cache_bytes of `length` positions, plus any int8 scales)
    token_ids     ids of positions 0..next_position-1 when every execution came through Model.forward
    last_logits   logits [V] of the last position of the last execution (what the next token is drawn from)
    """

    layout = "abstract"

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype, *, v_dtype=None,
                 group_size=None, rope_theta=None):
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.k_codec = Codec(dtype, head_dim, group_size)
        self.v_codec = Codec(dtype if v_dtype is None else v_dtype, head_dim, group_size)
        k, v = self.k_codec.name, self.v_codec.name
        self.dtype_name = k if k == v else f"{k}/{v}"
        self.rope_theta = rope_theta  # needed to re-rotate keys (shift); recorded in saved files
        self.last_logits = None
        self.model_fingerprint = None  # set by Model.new_cache: names the model in saved files
        self._token_ids: list | None = []
        self._freed = False

    # ---- accounting -----------------------------------------------------------------------------

    @property
    def k_dtype(self) -> str:
        return self.k_codec.name

    @property
    def v_dtype(self) -> str:
        return self.v_codec.name

    @property
    def group_size(self) -> int | None:
        """Elements per int8 scale along head_dim (None when neither K nor V is int8)."""
        return self.k_codec.group_size or self.v_codec.group_size

    @property
    def length(self) -> int:
        raise NotImplementedError

    @property
    def next_position(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        raise NotImplementedError

    @property
    def bytes_per_position(self) -> int:
        return self.n_layers * self.n_kv_heads * (self.k_codec.bytes_per_vector() + self.v_codec.bytes_per_vector())

    @property
    def nbytes(self) -> int:
        return self.length * self.bytes_per_position

    @property
    def token_ids(self):
        """Token ids of positions 0..next_position-1, or None if some execution bypassed Model.forward."""
        return None if self._token_ids is None else list(self._token_ids)

    @property
    def freed(self) -> bool:
        return self._freed

    def positions(self) -> np.ndarray:
        """Absolute positions of the stored K/V, ascending: [length]."""
        return np.arange(self.length)

    def stats(self) -> dict:
        """Every accounting number of this cache in one dict (what `kvref memory` and benchmarks print)."""
        return {"layout": self.layout, "k_dtype": self.k_dtype, "v_dtype": self.v_dtype,
                "group_size": self.group_size, "length": self.length, "next_position": self.next_position,
                "capacity": self.capacity, "nbytes": self.nbytes, "bytes_per_position": self.bytes_per_position}

    # ---- one execution ---------------------------------------------------------------------------

    def can_append(self, n_new: int) -> bool:
        """Whether an execution of n_new positions fits now."""
        return not self._freed and n_new <= self.capacity - self.length

    def next_positions(self, n_new: int) -> np.ndarray:
        """Absolute positions of `n_new` new tokens; raises CacheFullError if they do not fit."""
        self._check_live()
        free = self.capacity - self.length
        if n_new > free:
            raise CacheFullError(
                f"cannot append {n_new} positions: the cache holds {self.length} of {self.capacity} "
                f"({free} free)")
        return np.arange(self.next_position, self.next_position + n_new)  # [T]

    def update(self, layer: int, k: np.ndarray, v: np.ndarray):
        """Store K/V of the new positions for `layer`; return (k_all, v_all, k_positions).

        k, v: [T, Hkv, D] -> k_all, v_all: [S, Hkv, D] (one dtype), k_positions: [S]
        New K/V are read back as stored (quantized layouts included), so how an input is split into
        executions never changes what a query sees.
        """
        raise NotImplementedError

    def advance(self, n_new: int) -> None:
        """Commit the `n_new` positions written by `update` in every layer."""
        raise NotImplementedError

    def abort(self) -> None:
        """Forget an execution that will not be committed (its reservation, its staged K/V)."""

    def after_forward(self, token_ids, last_logits) -> None:
        """Called by Model.forward after a committed execution: record its ids and last logits.

        The ids are kept only while they account for every position (an execution run straight
        through spec.decoder.forward leaves them unknown); layouts that reuse K/V by token ids
        (the paged pool's prefix index) read them here.
        """
        ids = [int(t) for t in token_ids]
        if self._token_ids is not None and len(self._token_ids) + len(ids) == self.next_position:
            self._token_ids.extend(ids)
        else:
            self._token_ids = None
        self.last_logits = None if last_logits is None else np.array(last_logits, copy=True)

    def append(self, k, v, token_ids=None):
        """Store K/V of new positions in every layer at once: k, v [L, T, Hkv, D] (tools and tests)."""
        k, v = np.asarray(k), np.asarray(v)
        if k.ndim != 4 or k.shape[0] != self.n_layers:
            raise ShapeError(f"k has shape {k.shape}; expected [{self.n_layers}, T, {self.n_kv_heads}, {self.head_dim}]")
        T = k.shape[1]
        self.next_positions(T)
        try:
            for layer in range(self.n_layers):
                self.update(layer, k[layer], v[layer])
        except BaseException:
            self.abort()
            raise
        self.advance(T)
        if token_ids is not None:
            self.after_forward(token_ids, None)
        else:
            self._token_ids = None

    # ---- reading ---------------------------------------------------------------------------------

    def read(self, layer: int):
        """Stored K and V of `layer` in position order, decoded: ([length, Hkv, D], [length, Hkv, D])."""
        raise NotImplementedError

    def read_raw(self, layer: int):
        """Stored (k, k_scales, v, v_scales) of `layer` in position order, as stored (scales None if float)."""
        raise NotImplementedError

    def keys(self, layer: int) -> np.ndarray:
        # -> [length, Hkv, D], read-only, decoded to K's read dtype
        k, ks, _, _ = self.read_raw(layer)
        return _readonly(self.k_codec.decode(k, ks))

    def values(self, layer: int) -> np.ndarray:
        # -> [length, Hkv, D], read-only, decoded to V's read dtype
        _, _, v, vs = self.read_raw(layer)
        return _readonly(self.v_codec.decode(v, vs))

    # ---- operations, each with its capability check -----------------------------------------------

    def can_truncate(self, n: int) -> bool:
        return not self._freed and self._truncate_problem(n) is None

    def truncate(self, n: int) -> None:
        """Forget every position >= n (roll back rejected tokens); afterwards next_position == n."""
        self._check_live()
        self.abort()
        problem = self._truncate_problem(n)
        if problem is not None:
            raise CacheError(f"cannot truncate to {n}: {problem}")
        self._truncate(n)
        if n == 0:
            self._token_ids = []  # an empty cache knows the ids of all of its (no) positions
        elif self._token_ids is not None:
            del self._token_ids[n:]

    def can_fork(self) -> bool:
        return not self._freed

    def fork(self) -> "KVCache":
        """An independent cache holding the same positions (layouts may share storage copy-on-write)."""
        self._check_live()
        self.abort()
        child = self._fork()
        child.model_fingerprint = self.model_fingerprint
        child._token_ids = self.token_ids
        child.last_logits = None if self.last_logits is None else self.last_logits.copy()
        return child

    def can_shift(self, n: int = 1, keep: int = 0) -> bool:
        return not self._freed and self._shift_problem(n, keep) is None

    def shift(self, n: int, keep: int = 0) -> None:
        """Context shift: drop positions keep..keep+n-1 and move every later position down by n.

        Kept keys after the gap are rotated again by -n (RoPE rotations compose), so the cache then
        holds what a model that never saw the dropped positions would read at the new positions, up to
        float rounding of one extra rotation. Needs K stored as float32/float64 (SHIFTABLE_K_DTYPES):
        a narrower K would be rounded a second time, which no layout ever does to history.
        """
        self._check_live()
        self.abort()
        problem = self._shift_problem(n, keep)
        if problem is not None:
            raise CacheError(f"cannot shift by {n} after {keep} kept positions: {problem}")
        self._shift(n, keep)
        # the K/V now differ from what a plain prefill of the kept ids would give: ids no longer describe them
        self._token_ids = None

    def free(self) -> None:
        """Release the storage (a paged cache returns its blocks to the pool); the cache is unusable after."""
        if self._freed:
            return
        self.abort()
        self._free()
        self._freed = True

    def save(self, path) -> None:
        """Write this cache to `path` in the versioned kvref format (see kvref/cache/fileformat.py).

        The file names the model it belongs to (a fingerprint of config and weights, given by
        Model.new_cache); model.load_cache(path) refuses any other model.
        """
        from .fileformat import save_cache

        self._check_live()
        self.abort()
        save_cache(self, path)

    # ---- hooks for the layouts ---------------------------------------------------------------------

    def _truncate_problem(self, n):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            return f"n must be an integer, not {n!r}"
        if not 0 <= n <= self.length:
            return f"the cache holds {self.length} positions"
        return None

    def _shift_problem(self, n, keep):
        for name, value in (("n", n), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                return f"{name}={value!r} must be an integer >= 0"
        if n == 0:
            return "n must be at least 1"
        if self.k_dtype not in SHIFTABLE_K_DTYPES:
            return (f"K is stored as {self.k_dtype}; rotating it again would round history a second time "
                    f"(shift needs K in {SHIFTABLE_K_DTYPES})")
        if self.rope_theta is None:
            return "the cache does not know the model's rope_theta (make it with model.new_cache)"
        if keep + n > self.next_position:
            return f"positions {keep}..{keep + n - 1} are not all before next_position {self.next_position}"
        return None

    def _layout_options(self) -> dict:
        """Layout parameters a saved file records so load makes the same layout."""
        return {}

    def _load_rows(self, positions, next_position, raw_layers) -> None:
        """Fill an empty cache from saved rows: positions [n], raw_layers[l] = (k, ks, v, vs) [n, ...]."""
        raise NotImplementedError

    def _check_live(self):
        if self._freed:
            raise CacheError("this cache was freed; make a new one with model.new_cache() or fork a live one")

    def _check_kv(self, layer, k, v):
        expected = (self.n_kv_heads, self.head_dim)
        if not 0 <= layer < self.n_layers:
            raise ShapeError(f"layer {layer} out of range: the cache has {self.n_layers} layers")
        for name, a in (("k", k), ("v", v)):
            if a.ndim != 3 or a.shape[1:] != expected:
                raise ShapeError(f"{name} has shape {a.shape}; expected [T, {expected[0]}, {expected[1]}]")
        if k.shape != v.shape:
            raise ShapeError(f"k shape {k.shape} != v shape {v.shape}")

    def _rerotate(self, k, n):
        # [S, Hkv, D] keys stored after RoPE at positions p -> the same keys at positions p - n
        from ..spec.ops import rope

        return rope(k, np.full(k.shape[0], -n, dtype=np.int64), self.rope_theta)


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
    for i in set(idx):
        if not caches[i].can_fork():
            raise CacheError(f"cache {i} cannot be forked (it was freed)")
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


def _readonly(a):
    view = a.view()
    view.flags.writeable = False
    return view
