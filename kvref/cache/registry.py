"""Layouts that register themselves, and `make`, which builds a cache by its layout's name.

A layout is a KVCache subclass in a file of its own that declares

    layout     its name: what model.new_cache(layout=...) asks for and a saved file records
    Options    a frozen dataclass of its keyword options (a LayoutOptions), each field an option(),
               checked when the options are made: a bad value is a CacheError naming it
    create(shape, codecs, options)    a classmethod: an empty cache for a model of that CacheShape,
               storing K/V with those Codecs
    position_bytes(shape, codecs)     a classmethod: the bytes one position takes in such a cache, by
               which the memory budget counts (CacheShape.check_budget) and cache.bytes_per_position
    layout_options()   the options a saved file records, so that loading makes the same layout

and registers itself with the @register class decorator; kvref/cache/__init__.py imports the file.
Nothing else names a layout: Model.new_cache, cache files and the conformance suite ask the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from ..errors import CacheError
from .quant import Codecs
from .shape import CacheShape

AUTO = "auto"  # the hybrid layout for a model with window layers, else the contiguous one

_LAYOUTS: dict[str, type] = {}


def register(cls):
    """Class decorator: make the layout `cls.layout` available to make() and to cache files."""
    name = cls.layout
    if name == AUTO or name in _LAYOUTS:
        raise CacheError(f"a layout named {name!r} is already registered")
    _LAYOUTS[name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a registered layout (a test's own); its caches keep working, new ones cannot be made."""
    _LAYOUTS.pop(name)


def layout_names() -> tuple:
    """The registered layouts' names, sorted."""
    return tuple(sorted(_LAYOUTS))


def options_by_layout() -> dict:
    """{name: its option names} of every registered layout."""
    return {name: _LAYOUTS[name].Options.names() for name in layout_names()}


def layout_class(name, shape: CacheShape | None = None) -> type:
    """The registered layout called `name`; "auto" picks one for the shape's layers."""
    if name == AUTO and shape is not None:
        name = "hybrid" if shape.has_windows else "contiguous"
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise CacheError(f"cache layout {name!r} is not available; expected one of {(AUTO, *layout_names())}")
    return _LAYOUTS[name]


def option(default=None, *, low: int = 1, file_high=None):
    """An integer option of a layout: at least `low`, or None for the layout's default. file_high bounds
    what a saved file may ask for: "max_seq_len" (the model's), a number, or None (only the memory
    budget bounds it)."""
    return field(default=default, metadata={"kind": int, "low": low, "file_high": file_high})


def flag(default=None):
    """A True/False option of a layout (None: the layout's default)."""
    return field(default=default, metadata={"kind": bool})


def handle(default=None):
    """An option that is an object (paged: pool=, an existing BlockPool): create checks it; never saved."""
    return field(default=default, metadata={"kind": object})


@dataclass(frozen=True)
class LayoutOptions:
    """Base of a layout's Options: every option() and flag() field is checked when they are made."""

    def __post_init__(self):
        for f in fields(self):
            check_option(f, getattr(self, f.name))

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in fields(cls))

    def positions(self) -> int | None:
        """Positions per layer these options allocate; None: the layout's default size, which create
        bounds by the memory budget (CacheShape.check_budget) itself."""
        return None

    def loaded(self, shape: CacheShape) -> "LayoutOptions":
        """These options as read from a saved file, made fit for the model loading it."""
        return self


def check_option(f, value) -> None:
    """CacheError unless `value` suits the option field `f` (None always does: the default)."""
    kind = f.metadata.get("kind")
    if value is None or kind is object:
        return
    if kind is bool:
        if not isinstance(value, bool):
            raise CacheError(f"{f.name}={value!r} must be True or False")
        return
    low = f.metadata["low"]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        expected = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise CacheError(f"{f.name}={value!r} must be {expected}")


def make(shape: CacheShape, codecs: Codecs, layout=AUTO, **options):
    """An empty cache of the named layout for a model of `shape`; options by keyword, None meaning the
    layout's default. An option the layout does not have is an error, never ignored."""
    cls = layout_class(layout, shape)
    given = {name: value for name, value in options.items() if value is not None}
    names = cls.Options.names()
    foreign = sorted(set(given) - set(names))
    if foreign:
        raise CacheError(f"{', '.join(foreign)} do{'es' if len(foreign) == 1 else ''} not apply to layout "
                         f"{cls.layout!r}; its options are {names}")
    try:
        cache = cls.create(shape, codecs, cls.Options(**given))
    except MemoryError:  # arrays the machine cannot hold: the caller can ask for fewer positions
        raise CacheError("not enough memory for the K/V arrays of this cache; ask for fewer positions "
                         "(capacity=, num_blocks=, window=) or a smaller kv_dtype") from None
    cache.sequence.model = shape.model
    return cache
