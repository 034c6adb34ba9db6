"""Deterministic mutations of fuzz inputs: the same (seed, corpus) always gives the same inputs.

Byte-level operations in the manner of libFuzzer's (flip, set, insert, erase, copy a range, put an
interesting integer, splice in another corpus entry, insert a dictionary token), plus one aware of
the cache file's JSON header: a field set to an awkward value, the header size fixed up after.
"""

from __future__ import annotations

import json
import random
import struct

# integers at and around every size and sign limit, written in 1, 2, 4 or 8 little-endian bytes
INTERESTING = [0, 1, 2, 3, 7, 8, 16, 31, 32, 64, 127, 128, 255, 256, 4095, 4096, 32767, 32768, 65535, 65536,
               2**24, 2**25, 2**30, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53, 2**62, 2**63 - 1, 2**63,
               2**64 - 1]
# awkward JSON values for a header field
JSON_VALUES = [None, True, False, 0, -1, 1, 2.5, 1e300, float("nan"), 2**31, 2**62, 2**63, 2**64, 10**30, "", "3",
               "float32", "int8", [], [1], [2**62, 4], [[[]]], {}, {"a": 1}]
# tokens that make template and metadata mutations meaningful
DICTIONARY = {
    "chat": ["{{ ", " }}", "{% ", " %}", "{% for x in range(99999) %}", "{% endfor %}", "{% if ", "{% endif %}",
             "{% set ns = namespace(s='x') %}", "{% set ns.s = ns.s ~ ns.s %}", "{% macro f(n) %}", "{% endmacro %}",
             "f(n)", "f(10)", "loop(", "loop.index", "messages", "message['content']", "|join('", "|center(",
             "|replace('", "|indent(", "|list", "|sort", "|length", "|tojson", "** ", " * ", " ~ ", " % ", "10**",
             "9999999", "range(", "'x' * ", ".format(", ".ljust(", "raise_exception('no')", "namespace(",
             "dict(", ".items()", "recursive", "__class__", "__init__", "{{ 'a' }}", "{#", "#}", "{%- raw %}"],
    "gguf": ["GGUF", "llama.", "blk.0.", "blk.1.", "tokenizer.ggml.", "general.alignment", "general.architecture",
             "qwen3", "gemma3", "context_length", "block_count", "chat_template", "rope.scaling.type", "linear"],
    "tokenizer": ["<|im_start|>", "<|im_end|>", "\u0120", "the", "\n\n", "  ", "\ud7ff", "\U0001f600", "'s", "123"],
}


def mutate(data: bytes, rng: random.Random, corpus: list[bytes], target: str) -> bytes:
    if target == "cache" and rng.random() < 0.5:
        changed = _mutate_cache_header(data, rng)
        if changed is not None:
            return changed
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3, 4, 8))):
        out = _byte_mutation(out, rng, corpus, DICTIONARY.get(target, ()))
    return bytes(out[:1 << 20])


def _offset(out, rng):
    # most structure (headers, metadata, tensor tables) is near the start
    span = len(out) if rng.random() < 0.3 else min(len(out), 4096)
    return rng.randrange(span + 1)


def _byte_mutation(out: bytearray, rng, corpus, dictionary) -> bytearray:
    kind = rng.randrange(9)
    at = _offset(out, rng)
    if kind == 0 and out:  # flip a bit
        at = min(at, len(out) - 1)
        out[at] ^= 1 << rng.randrange(8)
    elif kind == 1 and out:  # set a byte
        out[min(at, len(out) - 1)] = rng.randrange(256)
    elif kind == 2:  # insert random bytes
        out[at:at] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 2, 4, 8, 16))))
    elif kind == 3 and out:  # erase a range
        del out[at:at + rng.choice((1, 2, 4, 8, 64, 512))]
    elif kind == 4 and out:  # copy a range elsewhere
        start = rng.randrange(len(out))
        piece = out[start:start + rng.choice((1, 4, 8, 32, 256))]
        out[at:at + (len(piece) if rng.random() < 0.5 else 0)] = piece
    elif kind in (5, 6):  # an interesting integer, overwriting
        size = rng.choice((1, 2, 4, 8))
        value = rng.choice(INTERESTING) % (1 << (8 * size))
        if rng.random() < 0.3:
            value = (-value) % (1 << (8 * size))
        out[at:at + size] = value.to_bytes(size, "little")
    elif kind == 7 and corpus:  # splice with another corpus entry
        other = rng.choice(corpus)
        cut = rng.randrange(len(other) + 1)
        out = out[:at] + bytearray(other[cut:cut + rng.choice((16, 256, 4096, 1 << 20))])
    elif dictionary:  # insert a dictionary token
        token = rng.choice(dictionary).encode("utf-8", "surrogatepass")
        out[at:at] = token
    return out


def _mutate_cache_header(data: bytes, rng) -> bytes | None:
    # set one field of the JSON header (at any depth) to an awkward value, then fix the header size
    # and keep the arrays where they were
    if len(data) < 20:
        return None
    (size,) = struct.unpack_from("<Q", data, 12)
    try:
        header = json.loads(data[20:20 + size])
    except ValueError:
        return None
    room = _first_array_offset(header, len(data)) - 20  # of the header as it was: the arrays stay put
    paths = list(_paths(header))
    if not paths:
        return None
    *parents, last = rng.choice(paths)
    node = header
    for key in parents:
        node = node[key]
    node[last] = rng.choice(JSON_VALUES)
    text = json.dumps(header).encode()
    if len(text) > room:
        return None
    return data[:12] + struct.pack("<Q", len(text)) + text.ljust(room, b"\0") + data[20 + room:]


def _paths(node, prefix=()):
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


def _first_array_offset(header, default):
    offsets = [a.get("offset") for a in header.get("arrays", []) if isinstance(a, dict)] if isinstance(
        header, dict) and isinstance(header.get("arrays"), list) else []
    offsets = [o for o in offsets if isinstance(o, int) and 20 <= o <= default]
    return min(offsets, default=default)
