"""kvref: a reference decoder-only transformer whose KV cache is an explicit object."""

from .cache import ContiguousCache, KVCache, cache_bytes
from .config import ModelConfig
from .errors import (BackendError, CacheError, CacheFullError, ConfigError, ContextOverflowError,
                     DTypeError, GenerationError, GGUFError, InputFileError, KVRefError, ModelNotFoundError,
                     SafetensorsError, SamplingError, ScoringError, ShapeError, TokenError, TokenizerError)
from .conversation import Conversation
from .generate import generate, resume
from .generation_config import GenerationConfig
from .loader import load
from .model import Model
from .speculative import SpeculationStats
from .stream import TextStream
from .tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "BackendError", "CacheError", "CacheFullError", "ConfigError", "ContextOverflowError",
    "ContiguousCache", "Conversation", "DTypeError", "GenerationConfig", "GenerationError", "GGUFError",
    "InputFileError", "KVCache", "KVRefError", "Model", "ModelConfig", "ModelNotFoundError", "SafetensorsError",
    "SamplingError", "ScoringError", "ShapeError", "SpeculationStats", "TextStream", "TokenError", "TokenizerError",
    "Tokenizer", "cache_bytes", "generate", "load", "resume",
]
