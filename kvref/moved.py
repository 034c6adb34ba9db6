"""Names that moved (CHANGELOG.md, "Moved"): kept for one release, each use warning where they are now."""

from __future__ import annotations

import functools
import importlib
import sys
import types
import warnings


def moved_names(module: str, names: dict):
    """A module-level __getattr__ serving the old `names` ({old name: (what to use now, a function
    returning the value)}) with a DeprecationWarning."""

    def __getattr__(name):
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        use, value = names[name]
        warnings.warn(f"{module}.{name} is deprecated; use {use}", DeprecationWarning, stacklevel=2)
        return value()

    return __getattr__


def deprecated(use: str):
    """Method decorator: the method still works, warning that `use` replaces it."""

    def wrap(method):
        @functools.wraps(method)
        def warned(self, *args, **kwargs):
            warnings.warn(f"{type(self).__name__}.{method.__name__} is deprecated; use {use}", DeprecationWarning,
                          stacklevel=2)
            return method(self, *args, **kwargs)

        return warned

    return wrap


# modules that moved into subpackages (issue 26): old path -> new path
MOVED_MODULES = {
    "kvref.batch": "kvref.generation.batch",
    "kvref.generate": "kvref.generation.generate",
    "kvref.sampling": "kvref.generation.sampling",
    "kvref.speculative": "kvref.generation.speculative",
    "kvref.generation_config": "kvref.generation.config",
    "kvref.stream": "kvref.generation.stream",
    "kvref.conversation": "kvref.generation.conversation",
    "kvref.chat": "kvref.text.chat",
    "kvref.tokenizer": "kvref.text",
    **{f"kvref.tokenizer.{m}": f"kvref.text.{m}"
       for m in ("bytelevel", "core", "gguf", "hf", "pieces", "sentencepiece", "vocab")},
    "kvref.serve": "kvref.serving",
    **{f"kvref.serve.{m}": f"kvref.serving.{m}" for m in ("app", "engine", "protocol")},
    "kvref.cli": "kvref.tools.cli",
    "kvref.cli_common": "kvref.tools.common",
    "kvref.cli_info": "kvref.tools.info",
    "kvref.bench": "kvref.tools.bench",
    "kvref.perplexity": "kvref.tools.perplexity",
}


class MovedModule(types.ModuleType):
    """An old module path: every name read from it comes from the module at the new path, with a
    DeprecationWarning. The new module is imported on first use, so an old path costs nothing until then
    (kvref.tools and kvref.serving pull in argparse, jinja2 or starlette)."""

    def __init__(self, old: str, new: str):
        super().__init__(old, f"moved to {new}")
        self._new = new

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):  # the import system's own probes (__path__, ...)
            raise AttributeError(name)
        warnings.warn(f"{self.__name__} is deprecated; use {self._new}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(self._new), name)


def install_moved_modules() -> None:
    """Each old module path answers imports for one release (kvref/__init__ runs this once)."""
    for old, new in MOVED_MODULES.items():
        sys.modules.setdefault(old, MovedModule(old, new))
