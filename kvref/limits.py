"""The ceilings on every number an untrusted file supplies, and the checks that apply them.

A GGUF file, a checkpoint's config.json or a saved cache can state any number. Each one is checked
for type and range before it sizes a table, an array or a loop: a bool, float, string or array where
an integer belongs is refused, never converted (no "2" -> 2, 2.7 -> 2, True -> 1). The ceilings are
far above every released model (the largest have ~128 layers, d_model 16k, 256k-token vocabularies,
10M-position contexts) and far below what would exhaust memory before a check further on could
refuse. docs/formats.md ("Bounds on untrusted numbers") lists every bound kvref applies.

This module also reads untrusted files and JSON with limits: only regular files (never a device, a
FIFO or a directory, which could block or never end), and JSON no larger or deeper than stated.
"""

from __future__ import annotations

import json
import os
import re
import stat

import numpy as np

from .errors import ConfigError

# ModelConfig field -> the largest value accepted (the smallest is 1)
CONFIG_CEILINGS = {
    "n_layers": 1024,
    "d_model": 2**16,
    "n_heads": 1024,
    "n_kv_heads": 1024,
    "head_dim": 4096,
    "d_ff": 2**20,
    "vocab_size": 2**24,
    "max_seq_len": 2**30,  # positions; a sliding window is bounded by the same number
    "n_experts": 2**12,  # routed experts of a layer (the largest released models have 384); groups are bounded alike
}
MAX_CONTEXT = CONFIG_CEILINGS["max_seq_len"]
# bytes the cache a model makes by default (new_cache() without capacity or num_blocks, hence
# generate() and Conversation without a cache) may take; a larger default asks for capacity=
DEFAULT_CACHE_BUDGET = 4 * 2**30
# blocks of a paged pool a saved cache file may ask for (each block costs ~100 bytes of bookkeeping
# besides its K/V, so a file of tiny blocks is bounded by this count, not by the budget)
MAX_POOL_BLOCKS = 2**20
MAX_JSON_DEPTH = 32  # nesting of arrays and objects in a JSON document read from a file or a request body
# a JSON file of a checkpoint directory (config.json, tokenizer.json, ...): the largest tokenizer.json
# files are tens of MB
MAX_JSON_FILE_BYTES = 2**28


def bounded_int(value, what: str, low: int, high: int, error=ConfigError) -> int:
    """`value` as a Python int in [low, high]: Python and NumPy integers only, never a bool, float,
    string or array. Raises `error` naming `what`, the value and the range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{what}={_show(value)} must be an integer in [{low}, {high}]")
    if not low <= value <= high:
        raise error(f"{what}={int(value)} must be an integer in [{low}, {high}]")
    return int(value)


def bounded_float(value, what: str, error=ConfigError, positive=True) -> float:
    """`value` as a finite float (positive unless told otherwise): Python and NumPy ints and floats only."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise error(f"{what}={_show(value)} must be a number")
    too_large = isinstance(value, int) and abs(value) >= 2**1000  # float() would raise OverflowError
    number = float("inf") if too_large else float(value)
    if not np.isfinite(number) or (positive and number <= 0):
        raise error(f"{what}={number} must be a {'positive ' if positive else ''}finite number")
    return number


def check_layer_count(n_layers: int, tensor_names, prefix: str, what: str, error) -> None:
    """`error` unless the tensors named `<prefix><i>.` ("blk.0.attn_q.weight" for prefix "blk.") are
    those of layers 0..n_layers-1 exactly. Run before any per-layer table is built: a stated count of
    2**31 layers must not build one to find out. (An index of more than 9 digits is no layer's.)"""
    matcher = re.compile(re.escape(prefix) + r"(\d{1,9})\.").match
    layers = {int(m.group(1)) for m in map(matcher, tensor_names) if m}
    if layers != set(range(n_layers)):
        raise error(f"{what}={n_layers}, but the tensors present are those of {len(layers)} layers"
                    + (f" numbered {min(layers)}..{max(layers)}" if layers else ""))


def _show(value) -> str:
    # a value as a message shows it: type and a bounded repr (an array of 10**6 items prints short)
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def open_regular_file(path, what: str, error):
    """An open binary file object for `path`, which must be a regular file (a symlink to one is
    fine). Devices, FIFOs, sockets and directories are refused before and after opening: os.stat
    says what the path is without opening it (opening a FIFO with no writer would block), and
    fstat of what was opened (non-blocking) closes the race with a path swapped in between.
    FileNotFoundError passes through, for callers to whom a missing file means something."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise error(f"{what} {os.fspath(path)!r} is not a regular file")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"cannot read {what} {os.fspath(path)!r}: {exc.strerror or exc}") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise error(f"{what} {os.fspath(path)!r} is not a regular file")
    return f


def read_exactly(f, n: int, what: str, error) -> bytes:
    """n bytes from `f`, or `error` if the file ends first (it shrank, or lied about its size)."""
    data = f.read(n)
    if len(data) != n:
        raise error(f"{what} ended after {len(data)} of {n} bytes")
    return data


_JSON_ESCAPES = re.compile(rb"\\.", re.DOTALL)
_JSON_STRINGS = re.compile(rb'"[^"]*"')
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'[]{}"')))


def bounded_json(text: bytes, what: str, error, max_depth: int = MAX_JSON_DEPTH):
    """JSON of `text`, refusing nesting deeper than max_depth before parsing (json.loads recurses once
    per level, so deep nesting would otherwise end in RecursionError or exhaust the stack). The size
    bound is the caller's: it reads at most that many bytes."""
    # the brackets outside strings, found at C speed: escapes out, then all but brackets and quotes,
    # then the (now escape-free) strings
    structure = _JSON_STRINGS.sub(b"", _JSON_ESCAPES.sub(b"", text).translate(None, _NOT_STRUCTURE))
    brackets = np.frombuffer(structure, dtype=np.uint8)
    steps = ((brackets == ord("[")) | (brackets == ord("{"))).astype(np.int64) - (
        (brackets == ord("]")) | (brackets == ord("}")))
    if steps.size and int(np.cumsum(steps).max()) > max_depth:
        raise error(f"{what} nests JSON deeper than {max_depth} levels")
    try:
        return json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(f"{what} cannot be read as JSON ({exc})") from None


def read_json_file(path, what: str, error, max_bytes: int = MAX_JSON_FILE_BYTES):
    """The JSON document in the regular file `path`: at most max_bytes, nested at most MAX_JSON_DEPTH
    deep; `error` naming `what` for anything else (FileNotFoundError passes through, for callers to
    whom a missing file means something)."""
    with open_regular_file(path, what, error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise error(f"{what} {os.fspath(path)!r} has {size:,} bytes; at most {max_bytes:,} are read")
        text = read_exactly(f, size, f"{what} {os.fspath(path)!r}", error)
    return bounded_json(text, f"{what} {os.fspath(path)!r}", error)
