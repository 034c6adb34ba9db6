"""Every failure a user can act on has its own KVRefError subclass.

Messages name the offending value and what was expected. Subclasses also derive from the
builtin exception a caller would reach for (ValueError, IndexError, ...), so generic handlers
keep working.
"""


class KVRefError(Exception):
    """Base class of every error kvref raises on purpose."""


class ConfigError(KVRefError, ValueError):
    """A ModelConfig (or a file's architecture metadata) is inconsistent."""


class TokenError(KVRefError, IndexError):
    """A token id is outside the vocabulary, or token input is not a 1-D list of ints."""


class ShapeError(KVRefError, ValueError):
    """An array has the wrong shape, dtype or memory layout for the operation."""


class DTypeError(KVRefError, TypeError):
    """A dtype name or value that kvref does not support."""


class ContextOverflowError(KVRefError, ValueError):
    """More positions than the model's max_seq_len."""


class CacheFullError(KVRefError, ValueError):
    """A KV cache has no room for the positions being appended."""


class CacheError(KVRefError, ValueError):
    """A cache operation that the layout cannot do exactly, or a cache used with the wrong model."""


class SamplingError(KVRefError, ValueError):
    """Sampling or penalty parameters out of range (temperature, top_k, top_p, min_p, seed, penalties),
    or a sampling filter given with greedy decoding, where it would do nothing."""


class GGUFError(KVRefError, ValueError):
    """A GGUF file is malformed, truncated or uses something kvref does not support."""


class SafetensorsError(KVRefError, ValueError):
    """A safetensors file (or its index) is malformed, truncated, or lies about its tensors."""


class TokenizerError(KVRefError, ValueError):
    """The tokenizer metadata is missing or inconsistent, or text cannot be encoded."""


class ModelNotFoundError(KVRefError, FileNotFoundError):
    """No model file at the given path, or the default model package is not installed."""


class BackendError(KVRefError, RuntimeError):
    """The requested kernel backend is unknown or unavailable."""


class GenerationError(KVRefError, ValueError):
    """Generation arguments that cannot work together (a negative token budget, a cache with use_cache=False,
    an empty stop string, an unknown setting)."""


class ScoringError(KVRefError, ValueError):
    """Scoring that cannot be done as asked: a first token with nothing before it, windows that do not
    fit the text, a saved base run of another text, model or windows."""


class InputFileError(KVRefError, ValueError):
    """An input file cannot be read as what it should be (a text that is not UTF-8, a file of saved
    log-probabilities that is not one)."""


class RequestError(KVRefError, ValueError):
    """An HTTP request to `kvref serve` that cannot be served as sent: an unknown field, a field of the
    wrong type or out of range, a prompt too long for the context or the pool. `param` names the field
    (None for the body as a whole); `status` is the HTTP status the server answers with."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code
