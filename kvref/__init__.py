"""kvref: a reference decoder-only transformer whose KV cache is an explicit object."""

import sys

from .cache import ContiguousCache, KVCache, cache_bytes
from .config import ModelConfig
from .errors import (BackendError, CacheError, CacheFullError, ConfigError, ContextOverflowError, DTypeError,
                     GenerationError, GGUFError, InputFileError, KVRefError, ModelNotFoundError, SafetensorsError,
                     SamplingError, ScoringError, ShapeError, TokenError, TokenizerError)
from .generation.config import GenerationConfig
from .generation.conversation import Conversation
from .generation.generate import generate, resume
from .generation.speculative import SpeculationStats
from .generation.stream import TextStream
from .loader import load
from .model import Model
from .moved import MOVED_MODULES, install_moved_modules
from .text import Tokenizer

__version__ = "0.1.0"

# the old module paths (kvref.batch, kvref.cli, ...) keep answering for one release, with a warning
install_moved_modules()


def __getattr__(name):
    # `import kvref.batch` then `kvref.batch.X`: an old module path read as an attribute of kvref
    moved = MOVED_MODULES.get(f"kvref.{name}")
    if moved is None:
        raise AttributeError(f"module 'kvref' has no attribute {name!r}")
    return sys.modules[f"kvref.{name}"]

__all__ = [
    "BackendError", "CacheError", "CacheFullError", "ConfigError", "ContextOverflowError",
    "ContiguousCache", "Conversation", "DTypeError", "GenerationConfig", "GenerationError", "GGUFError",
    "InputFileError", "KVCache", "KVRefError", "Model", "ModelConfig", "ModelNotFoundError", "SafetensorsError",
    "SamplingError", "ScoringError", "ShapeError", "SpeculationStats", "TextStream", "TokenError", "TokenizerError",
    "Tokenizer", "cache_bytes", "generate", "load", "resume",
]
