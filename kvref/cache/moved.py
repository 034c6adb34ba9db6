"""Names that moved (CHANGELOG.md, "Moved"): kept for one release, each use warning where they are now."""

from __future__ import annotations

import functools
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
