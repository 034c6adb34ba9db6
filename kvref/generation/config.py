"""GenerationConfig: every setting of one generation in one frozen, checked value, and the defaults a
model file gives.

kvref decodes greedily unless a temperature is given, by the caller or by the model file: a
reference tool is deterministic by default. A model's defaults (`model.generation_config`) are
kvref's own, replaced by what its file recommends:

  Hugging Face generation_config.json (as transformers reads it): with "do_sample": true,
      "temperature" (default 1.0), "top_k" (default 50, 0 = off), "top_p" (default 1.0 = off) and
      "min_p"; without it transformers decodes greedily and so does kvref. "repetition_penalty"
      applies either way, over the whole token history as transformers counts it.
  GGUF general.sampling.* (llama.cpp's keys): temp, top_k (<= 0 = off), top_p (1 = off),
      min_p (0 = off), penalty_repeat, penalty_last_n (-1 = the whole history).

Other sampling keys of these files (typical_p, mirostat, ...) name methods kvref does not have; they
are not read. Settings given to generate() or on the command line replace the file's
(GenerationConfig.updated); choosing greedy decoding there drops the sampling filters the file
recommended, since they only shape a sampled distribution.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ConfigError, GenerationError, SamplingError
from ..limits import bounded_float, bounded_int, read_json_file
from .sampling import check_penalties, check_sampling

SAMPLING_FILTERS = ("top_k", "top_p", "min_p")
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_PENALTY_LAST_N = 64  # llama.cpp's repeat_last_n


@dataclass(frozen=True)
class GenerationConfig:
    """One generation's settings. Checked when made (GenerationError / SamplingError naming the value)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # tokens to select at most
    temperature: float = 0.0  # 0: greedy (argmax); > 0: sample from softmax(logits / temperature)
    top_k: int | None = None  # sampling filters (kvref.generation.sampling); None = off; only with temperature > 0
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None  # the sampler's generator; None = fresh entropy (no effect when greedy)
    repetition_penalty: float = 1.0  # > 0; 1 = off (transformers / llama.cpp repeat_penalty)
    frequency_penalty: float = 0.0  # 0 = off (OpenAI / llama.cpp); negative values favour repeats
    presence_penalty: float = 0.0
    # previous tokens the penalties count: the last N of the token history (prompt and selected
    # tokens); None = all of it (transformers), 0 = none (penalties off)
    penalty_last_n: int | None = DEFAULT_PENALTY_LAST_N
    stop: tuple[str, ...] = ()  # stop strings: generation ends with the token that completes one
    stop_ids: frozenset[int] = field(default_factory=frozenset)  # ids that end generation, besides the model's
    ignore_eos: bool = False  # True: go on past the model's end ids (tokenizer.eos_ids)

    def __post_init__(self):
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise GenerationError(f"max_new_tokens={n!r} must be an integer >= 0")
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p)
        if self.temperature == 0:
            given = [f"{name}={getattr(self, name)!r}" for name in SAMPLING_FILTERS if getattr(self, name) is not None]
            if given:
                raise SamplingError(f"{', '.join(given)} has no effect with greedy decoding (temperature 0): "
                                    "give a temperature > 0 to sample, or leave the filter out")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
                                      or self.seed < 0):
            raise SamplingError(f"seed={self.seed!r} must be None or an integer >= 0")
        check_penalties(self.repetition_penalty, self.frequency_penalty, self.presence_penalty, self.penalty_last_n)
        object.__setattr__(self, "stop", check_stop_strings(self.stop))
        object.__setattr__(self, "stop_ids", check_stop_ids(self.stop_ids))
        if not isinstance(self.ignore_eos, bool):
            raise GenerationError(f"ignore_eos={self.ignore_eos!r} must be True or False")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def updated(self, **settings) -> "GenerationConfig":
        """This config with some fields replaced (any field by name; an unknown name is an error).

        Settings given here win. Choosing greedy decoding (temperature=0) drops the sampling filters
        this config had, unless they are given here too (then they are refused: they would do nothing).
        """
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise GenerationError(f"unknown generation setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                                  f"GenerationConfig has {', '.join(f.name for f in dataclasses.fields(self))}")
        if settings.get("temperature", self.temperature) == 0:
            settings = {**{name: None for name in SAMPLING_FILTERS}, **settings}
        return dataclasses.replace(self, **settings)

    def end_ids(self, tokenizer) -> frozenset[int]:
        """Ids after which generation ends: stop_ids, and the model's end ids (EOS, end of turn, the
        file's eos_token_id list: tokenizer.eos_ids) unless ignore_eos."""
        if self.ignore_eos or tokenizer is None:
            return self.stop_ids
        return self.stop_ids | tokenizer.eos_ids


def check_stop_strings(stop) -> tuple[str, ...]:
    if isinstance(stop, str):
        raise GenerationError(f"stop={stop!r} must be a list of strings, not one string")
    stop = tuple(stop)
    for s in stop:
        if not isinstance(s, str) or not s:
            raise GenerationError(f"stop string {s!r} must be a non-empty str (an empty one would match "
                                  "before any text)")
    return stop


def check_stop_ids(ids) -> frozenset[int]:
    ids = tuple(ids)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
            raise GenerationError(f"stop id {i!r} must be an integer >= 0")
    return frozenset(int(i) for i in ids)


# ---- the defaults a model file gives ------------------------------------------------------------------

def from_hf_generation_config(values: dict, source: str = "generation_config.json") -> GenerationConfig:
    """Defaults from a Hugging Face generation_config.json's fields, as transformers applies them."""
    settings = {}
    if values.get("do_sample") is True:
        settings["temperature"] = values.get("temperature", 1.0)
        top_k, top_p = values.get("top_k", 50), values.get("top_p", 1.0)
        settings["top_k"] = None if top_k in (0, None) else top_k
        settings["top_p"] = None if top_p in (1, None) else top_p
        settings["min_p"] = values.get("min_p")
    if values.get("repetition_penalty") not in (None, 1, 1.0):
        settings["repetition_penalty"] = values["repetition_penalty"]
        settings["penalty_last_n"] = None  # transformers penalizes every token of input_ids
    return _from_file(settings, source)


def from_gguf_metadata(metadata: dict, source: str = "GGUF general.sampling") -> GenerationConfig:
    """Defaults from a GGUF file's general.sampling.* keys, as llama.cpp applies them."""
    def get(key, integer=False):
        # a number of the file's own type (no string, bool or array is converted), finite; ints in int32
        name = f"general.sampling.{key}"
        value = metadata.get(name)
        if value is None:
            return None
        if integer:
            return bounded_int(value, name, -2**31, 2**31 - 1)
        return bounded_float(value, name, positive=False)

    temp, top_k, top_p, min_p = get("temp"), get("top_k", integer=True), get("top_p"), get("min_p")
    repeat, last_n = get("penalty_repeat"), get("penalty_last_n", integer=True)
    settings = {}
    if temp is not None:
        settings["temperature"] = max(temp, 0.0)  # llama.cpp: temp <= 0 is greedy
    if top_k is not None and top_k > 0:
        settings["top_k"] = top_k
    if top_p is not None and top_p < 1:
        settings["top_p"] = top_p
    if min_p is not None and min_p > 0:
        settings["min_p"] = min_p
    if repeat is not None:
        settings["repetition_penalty"] = repeat
    if last_n is not None:
        settings["penalty_last_n"] = None if last_n == -1 else last_n
    return _from_file(settings, source)


def from_hf_directory(directory) -> GenerationConfig:
    """Defaults from a checkpoint directory's generation_config.json; kvref's own without one."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return GenerationConfig()
    values = read_json_file(path, "generation_config.json", ConfigError)
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return from_hf_generation_config(values, str(path))


def _from_file(settings: dict, source: str) -> GenerationConfig:
    if settings.get("temperature", 0) == 0:
        for name in SAMPLING_FILTERS:  # the file decodes greedily: its filters would do nothing
            settings.pop(name, None)
    for name, value in settings.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{source}: {name}={value!r} is not a finite number")
    try:
        return GenerationConfig(**settings)
    except (GenerationError, SamplingError) as error:
        raise ConfigError(f"{source}: {error}") from None
