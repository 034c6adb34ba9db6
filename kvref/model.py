"""Model: config + weights + kernel set, with the checks that guard the public entry points."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import numpy as np

from . import backends
from .cache import CacheShape, Codecs, KVCache, dtype_name, layout_names, make
from .cache.fileformat import load_cache
from .cache.registry import AUTO, options_by_layout
from .config import FAMILY_FIELDS, ModelConfig
from .digest import sha256
from .errors import CacheError, ContextOverflowError, DTypeError, TokenError
from .executor import NativeExecutor, SpecExecutor
from .generation.config import GenerationConfig
from .moved import deprecated, moved_names
from .scoring import SCORE_CHUNK, score
from .text.frontend import TextFrontEnd
from .weights import Weights, freeze, random_weights

MODEL_DTYPES = ("float32", "float64")

__getattr__ = moved_names(__name__, {
    "LAYOUTS": ("kvref.cache.layout_names()", lambda: (AUTO, *layout_names())),
    "LAYOUT_OPTIONS": ("kvref.cache.registry.options_by_layout()",
                       options_by_layout),
})


class Model:
    """A decoder-only transformer ready to run: `forward` is prefill and decode alike."""

    def __init__(self, config: ModelConfig, weights: Weights, dtype="float32", backend="auto",
                 tokenizer=None, chat_template: str | None = None, threads: int | None = None,
                 generation_config: GenerationConfig | None = None, activations: str | None = None):
        self.config = config
        self.dtype = model_dtype(dtype)
        self.backend = backends.resolve(backend, self.dtype, config)
        # C keeps pointers into the native backend's weights: read-only memory nothing public can
        # resize, free or write (kvref.weights.freeze). The spec reads them through NumPy only and
        # keeps them as given (freezing would copy every dequantized array once more at load).
        self.weights = freeze(weights) if self.backend == "c" else weights
        self.ops = backends.kernels(self.backend, threads)  # the kernel set (kvref.executor.KernelSet)
        # the fused C forward (kvref.native.fused) on the native backend when it can take the weights,
        # feeding its projections `activations` (backends.fused_forward); None (and why): every execution
        # runs the shared decoder kernel by kernel
        self.fused, self._no_fused = backends.fused_forward(self.backend, config, self.weights, activations)
        self.text = TextFrontEnd(tokenizer, chat_template,
                                 GenerationConfig() if generation_config is None else generation_config)

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, dtype="float32", backend="auto",
               threads: int | None = None, activations: str | None = None) -> "Model":
        """Deterministic random weights (see kvref.weights.random_weights)."""
        dtype = model_dtype(dtype)
        return cls(config, random_weights(config, seed, dtype), dtype, backend, threads=threads,
                   activations=activations)

    def new_cache(self, layout="auto", kv_dtype=None, capacity=None, *, k_dtype=None, v_dtype=None,
                  group_size=None, block_size=None, num_blocks=None, prefix_reuse=None, pool=None,
                  window=None, sinks=None, spare=None, **options) -> KVCache:
        """An empty KV cache for this model; K/V are stored in the model dtype unless kv_dtype says otherwise.

        layout     "auto": "hybrid" for a model with sliding-window layers, else "contiguous" |
                   "contiguous" (capacity, default max_seq_len) | "hybrid" (capacity as contiguous;
                   each window layer a ring of its window + spare slots, spare=64) | "paged"
                   (block_size=16, num_blocks = enough for one max_seq_len sequence,
                   prefix_reuse=False; or pool= an existing BlockPool to add a sequence to) |
                   "window" (window=W required, sinks=0) | any other registered layout
                   (kvref.cache.registry), whose own options come as further keywords
        kv_dtype   None (model dtype) | "float32" | "float16" | "bfloat16" | "int8" | "kivi4" for K
                   and V; k_dtype / v_dtype set one of them; group_size: elements per int8 scale, and
                   kivi4's group (positions per K scale, elements per V scale) (default 32 when
                   head_dim allows, else head_dim); kivi4 K needs the contiguous or paged layout
        An option that does not apply to the layout is an error, never ignored.
        """
        codecs = self._codecs(kv_dtype, k_dtype, v_dtype, group_size)
        return make(self.cache_shape(), codecs, layout, capacity=capacity, block_size=block_size,
                    num_blocks=num_blocks, prefix_reuse=prefix_reuse, pool=pool, window=window, sinks=sinks,
                    spare=spare, **options)

    def cache_shape(self) -> CacheShape:
        """What a cache needs to know of this model (kvref.cache.CacheShape)."""
        c = self.config
        kv_heads, k_width, _, latent_dim = c.cache_geometry()  # MLA: one latent key per position
        return CacheShape(c.n_layers, kv_heads, k_width, c.max_seq_len, c.vocab_size, c.layer_windows,
                          self.kv_rope_theta, self.fingerprint(), latent_dim)

    @deprecated("model.cache_shape().check_budget(positions, codecs, what)")
    def check_cache_budget(self, positions: int, k_dtype: str, v_dtype: str, group_size=None,
                           what: str = "a cache") -> None:
        _, k_width, _, latent_dim = self.config.cache_geometry()
        codecs = Codecs.named(k_dtype, v_dtype, k_width, group_size, latent_dim=latent_dim)
        self.cache_shape().check_budget(positions, codecs, what)

    @property
    def kv_rope_theta(self) -> float | None:
        """The RoPE base every cached key was rotated with, which a context shift needs: one number, or one
        per layer with None for a NoPE layer (SmolLM3), whose keys a shift leaves as they are; None when it
        differs between layers (Gemma 3's local and global bases) or the frequencies are scaled, so a
        cache refuses to shift."""
        c = self.config
        if c.rope_local_theta not in (None, c.rope_theta) or c.rope_scaling is not None:
            return None
        if c.nope_layers:
            return tuple(None if c.layer_rope(i) is None else c.rope_theta for i in range(c.n_layers))
        return c.rope_theta

    def load_cache(self, path, pool=None) -> KVCache:
        """A cache holding what cache.save(path) wrote, for this model only (see kvref/cache/fileformat.py).

        Refuses a file saved from another model (config or weights), a corrupt or truncated file, or
        a future format version, with a CacheError naming the problem; nothing is half-loaded.
        A paged cache is loaded into a new pool, or into `pool` (any block size) if given.
        """
        return load_cache(path, self.cache_shape(), self.new_cache, pool=pool)

    def fingerprint(self) -> dict:
        """What identifies this model to a saved cache: its config, and a hash of a sample of its weights.

        The weight sample (every norm gain, and three embedding rows) is cheap and changes with any
        retraining or different random seed; K/V computed by one model are wrong for another.
        """
        if getattr(self, "_fingerprint", None) is None:
            # family fields at their defaults (Llama's) are left out, so adding one to ModelConfig
            # does not change the fingerprint of any model saved before
            config = {name: value for name, value in dataclasses.asdict(self.config).items()
                      if name not in FAMILY_FIELDS}
            config.update(self.config.family_fields())
            w = self.weights
            sample = [w.output_norm, *(g for lw in w.layers for g in (lw.attn_norm, lw.ffn_norm)),
                      self.ops.embed(w.tok_embeddings, np.array([0, self.config.vocab_size // 2,
                                                                 self.config.vocab_size - 1]))]
            digest = sha256()
            for a in sample:
                digest.update(np.ascontiguousarray(a, dtype=np.float64).tobytes())
            self._fingerprint = {
                "config": config,
                "config_sha256": sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
                "weights_sha256": digest.hexdigest(),
            }
        return self._fingerprint

    def _codecs(self, kv_dtype, k_dtype, v_dtype, group_size) -> Codecs:
        # the K/V types asked for (else the model dtype), each one the backend's kernels read
        base = self.dtype if kv_dtype is None else dtype_name(kv_dtype)
        names = (base if k_dtype is None else dtype_name(k_dtype), base if v_dtype is None else dtype_name(v_dtype))
        allowed = backends.KV_DTYPES[self.backend]
        for name in names:
            if name not in allowed:
                raise CacheError(f"kv_dtype {name!r} is not supported by the {self.backend!r} backend; "
                                 f"expected one of {allowed}")
        asked = any(x is not None for x in (kv_dtype, k_dtype, v_dtype, group_size))
        _, k_width, _, latent_dim = self.config.cache_geometry()
        if latent_dim is not None and v_dtype is None:
            names = (names[0], names[0])  # no V is stored: kv_dtype and k_dtype name the latent key's type
        return Codecs.named(*names, k_width, group_size, asked, latent_dim)

    def forward(self, token_ids, cache: KVCache | None = None, all_logits: bool = False):
        """Run the new tokens at positions cache.next_position.. and append their K/V to `cache`.

        One call with many tokens is a prefill; one call with a single token is a decode step; both
        are this same code. `cache=None` recomputes from position 0 with a cache thrown away after.
        Returns the last position's logits [V], or every new position's [T, V] with all_logits.
        The execution is a transaction (cache.begin): it commits the new positions, their ids and the
        last logits together, and on any error (Ctrl-C included) the cache is left exactly as it was.
        """
        ids = self.check_tokens(token_ids)
        if cache is None:
            self.check_context(0, len(ids))
            cache = self.new_cache(capacity=len(ids))
        executor = self.executor(cache)
        self.check_context(cache.next_position, len(ids))
        with cache.begin(ids) as execution:
            logits = executor.run([execution], all_logits)[0]  # [T or 1, V]
        return logits if all_logits else logits[0]

    def executor(self, cache: KVCache):
        """What runs executions on `cache` for this model (kvref.executor): the native executor (the fused
        C forward) when it can use the cache in place, else the spec executor over this model's kernels,
        its `fallback` saying why not C. Chosen the first time a cache comes to this model and kept on the
        cache (`cache.executor`), since its layout and K/V types never change; the cache is checked then
        (check_cache). The native one is given up if the weights were rebound since (kvref.weights)."""
        bound = getattr(cache, "executor", None)  # anything but a KVCache is refused by check_cache
        if bound is None or bound.owner is not self:
            self.check_cache(cache)
            bound = cache.executor = self._choose_executor(cache)
        if bound.name == "native" and not self.fused.serves(self.weights):
            return SpecExecutor(self.ops, self, "the weights were rebound after the fused C forward was built "
                                "from them")
        return bound

    def with_kernels(self, kernels, why: str) -> "Model":
        """A copy of this model sharing its config, weights and text front end, whose every execution runs
        the shared decoder over `kernels` (a KernelSet: kvref bench's timing shims, say), `why` being
        what its executors give as their fallback."""
        other = copy.copy(self)
        other.ops, other.fused, other._no_fused = kernels, None, why
        return other

    def batch_executor(self, caches):
        """The executor of one execution over several caches: the native one when every cache's is,
        else the spec executor (the fallback of the first cache that needs it)."""
        executors = [self.executor(cache) for cache in caches]
        fallback = next((e for e in executors if e.name != "native"), None)
        return executors[0] if fallback is None else fallback

    def _choose_executor(self, cache):
        if self.fused is None:
            return SpecExecutor(self.ops, self, self._no_fused)
        problem = self.fused.cache_problem(cache)
        if problem is None:
            return NativeExecutor(self.fused, self.ops, self)
        return SpecExecutor(self.ops, self, problem)

    def score(self, token_ids, context=(), cache: KVCache | None = None, chunk_size: int = SCORE_CHUNK):
        """Per-token log-probabilities of a continuation: [len(token_ids)] float64, element i being
        log p(token_ids[i] | context, token_ids[:i]). The context (a prompt) is run, not scored; with
        an empty one, the first token is scored with the last logits of `cache`. Positions run in
        executions of at most chunk_size with every position's logits (kvref.scoring)."""
        return score(self, token_ids, context, cache, chunk_size)

    def fused_problem(self, cache: KVCache) -> str | None:
        """Deprecated: `model.executor(cache).fallback`."""
        warnings.warn("Model.fused_problem(cache) is deprecated; use model.executor(cache).fallback",
                      DeprecationWarning, stacklevel=2)
        return self.executor(cache).fallback

    # ---- the native forward's counters ----------------------------------------------------------------

    @property
    def activations(self) -> str | None:
        """How the C forward feeds its projections: "float32" (exact) or "int8" (KVREF_ACTIVATIONS); None
        when the model runs the shared decoder (the spec backend, or weights the C forward cannot read)."""
        return None if self.fused is None else self.fused.activations

    def timings(self) -> dict | None:
        """Seconds the C forward spent since the model was made or reset_timings(), by kernel family:
        {"projections", "attention", "other": seconds, "calls": C forwards, "expert_bytes": the routed experts'
        bytes read}. None when the forward keeps no
        counters (the shared decoder; kvref.tools.bench times it with shims around each kernel instead)."""
        return None if self.fused is None else self.fused.timings()

    def reset_timings(self) -> None:
        if self.fused is not None:
            self.fused.reset_timings()

    # ---- the text front end (model.text), read through the model ------------------------------------

    @property
    def tokenizer(self):
        """The model's tokenizer (model.text.tokenizer); None for a model made from weights alone."""
        return self.text.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer):
        self.text.tokenizer = tokenizer

    @property
    def chat_template(self) -> str | None:
        return self.text.chat_template

    @chat_template.setter
    def chat_template(self, template):
        self.text = dataclasses.replace(self.text, chat_template=template)  # checked as at load

    @property
    def generation_config(self) -> GenerationConfig:
        """What kvref.generate does unless told otherwise (model.text.generation_config)."""
        return self.text.generation_config

    @generation_config.setter
    def generation_config(self, config: GenerationConfig):
        self.text.generation_config = config

    @deprecated("model.text.chat_ids(messages)")
    def chat_ids(self, messages, add_generation_prompt=True) -> list[int]:
        return self.text.chat_ids(messages, add_generation_prompt)

    @deprecated("model.text.chat_text(messages)")
    def chat_text(self, messages, add_generation_prompt=True) -> str:
        return self.text.chat_text(messages, add_generation_prompt)

    def check_tokens(self, token_ids) -> np.ndarray:
        """Token ids as a non-empty 1-D int64 array, every id in [0, vocab_size)."""
        try:
            ids = np.asarray(token_ids)
        except (ValueError, TypeError) as exc:  # ragged nesting, or objects NumPy cannot arrange
            raise TokenError(f"token ids must be a non-empty 1-D sequence of ints ({exc})") from None
        if ids.ndim != 1 or ids.size == 0:
            raise TokenError(f"token ids must be a non-empty 1-D sequence; got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise TokenError(f"token ids must be integers; got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise TokenError(
                f"token id {int(ids[i])} at index {i} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids.astype(np.int64)

    def check_context(self, start: int, n_new: int) -> None:
        if start + n_new > self.config.max_seq_len:
            raise ContextOverflowError(
                f"positions {start}..{start + n_new - 1} exceed max_seq_len={self.config.max_seq_len} "
                f"({start} already used + {n_new} new)")

    def check_cache(self, cache) -> None:
        """CacheError unless `cache` was made for this model: its shapes, and the model named by
        cache.sequence.model (a cache filled by another model holds K/V that are wrong for this one)."""
        c = self.config
        if not isinstance(cache, KVCache):
            raise CacheError(f"expected a KVCache from model.new_cache(); got {type(cache).__name__}")
        kv_heads, k_width, _, latent_dim = c.cache_geometry()  # MLA: one latent key, and its latent width
        got = (cache.n_layers, cache.n_kv_heads, cache.head_dim)
        if got != (c.n_layers, kv_heads, k_width) or cache.latent_dim != latent_dim:
            raise CacheError(
                f"cache shape (layers, kv heads, head_dim) = {got}, latent_dim {cache.latent_dim} does not match "
                f"the model's {(c.n_layers, kv_heads, k_width)}, latent_dim {latent_dim}")
        owner, ours = cache.sequence.model, self.fingerprint()
        if owner is None:
            raise CacheError("this cache was not made by a model, so nothing says whose K/V it holds; make it "
                             "with model.new_cache() or model.load_cache()")
        if owner is not ours and (owner.get("config_sha256"), owner.get("weights_sha256")) != (
                ours["config_sha256"], ours["weights_sha256"]):
            raise CacheError("this cache belongs to another model (other config or weights): its K/V would be "
                             "wrong for this one; make one with this model's new_cache()")


def model_dtype(dtype) -> str:
    name = dtype_name(dtype)
    if name not in MODEL_DTYPES:
        raise DTypeError(f"model dtype {name!r} is not supported; expected one of {MODEL_DTYPES}")
    return name

