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
    changed = None
    if target == "cache" and rng.random() < 0.5:
        changed = _mutate_cache_header(data, rng)
    elif target == "gguf" and rng.random() < 0.4:
        changed = _generate_gguf(rng)
    elif target == "safetensors" and rng.random() < 0.5:
        changed = _mutate_json_file(data, rng)
    if changed is not None:
        return changed if rng.random() < 0.8 else _byte_mutation(bytearray(changed), rng, corpus, ())
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


# GGUF keys whose values size or steer what kvref builds, and values of every type to put there
GGUF_KEYS = ["llama.block_count", "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
             "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.key_length",
             "llama.rope.dimension_count", "llama.vocab_size", "llama.attention.layer_norm_rms_epsilon",
             "llama.rope.freq_base", "llama.rope.scaling.type", "llama.rope.scaling.factor",
             "llama.attention.sliding_window", "general.alignment", "general.architecture", "tokenizer.ggml.model",
             "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
             "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
             "tokenizer.ggml.eot_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix",
             "tokenizer.chat_template", "general.sampling.temp", "general.sampling.top_k", "general.sampling.top_p",
             "general.sampling.min_p", "general.sampling.penalty_repeat", "general.sampling.penalty_last_n"]


def _gguf_value(rng):
    from kvref.formats.gguf import ValueType as V

    number = rng.choice(INTERESTING)
    return rng.choice([
        (V.UINT32, number % 2**32), (V.INT32, -(number % 2**31)), (V.UINT64, number), (V.INT64, -(number % 2**63)),
        (V.UINT8, number % 256), (V.FLOAT32, rng.choice([0.0, -1.0, 2.7, 3e38, float("nan"), float("inf")])),
        (V.FLOAT64, rng.choice([1e-300, 1e300, float("-inf"), 2.0])), (V.BOOL, rng.random() < 0.5),
        (V.STRING, rng.choice(["", "2", "llama", "gemma3", "qwen3", "gpt2", "linear", "{{ 1 }}", "a" * 300])),
        (V.ARRAY, (V.UINT8, [1, 2])), (V.ARRAY, (V.INT32, [number % 2**31] * 3)), (V.ARRAY, (V.STRING, ["a", "b c"])),
        (V.ARRAY, (V.FLOAT32, [1.0, float("nan")])), (V.ARRAY, (V.ARRAY, [(V.UINT8, [1])])),
    ])


def _generate_gguf(rng) -> bytes:
    # a whole tiny model whose metadata holds one to three awkward values, or leaves keys out, or whose
    # shape disagrees with what the metadata says
    from ..gguf_writer import tiny_model

    metadata = {key: _gguf_value(rng) for key in rng.sample(GGUF_KEYS, rng.choice((1, 1, 2, 3)))}
    drop = rng.sample(GGUF_KEYS, 1) if rng.random() < 0.2 else []
    heads = rng.choice((1, 2, 4))
    return tiny_model(n_layers=rng.choice((1, 2, 3)), d_model=4 * heads, n_heads=heads,
                      n_kv_heads=rng.choice((1, heads)), d_ff=rng.choice((8, 16)), context=rng.choice((8, 64, 1 << 20)),
                      metadata=metadata, drop=drop)


def _mutate_json_file(data: bytes, rng) -> bytes | None:
    # config.json (starts with "{") or a safetensors header (8-byte size, then JSON): one field set to
    # an awkward value
    offset = 0 if data[:1] == b"{" else 8
    size = len(data) if offset == 0 else struct.unpack_from("<Q", data)[0] if len(data) >= 8 else 0
    try:
        doc = json.loads(data[offset:offset + size])
    except ValueError:
        return None
    if not _set_one_field(doc, rng):
        return None
    text = json.dumps(doc).encode()
    return text if offset == 0 else struct.pack("<Q", len(text)) + text + data[8 + size:]


def _set_one_field(doc, rng) -> bool:
    """Set one field of a JSON document, at any depth, to an awkward value; False if it has none."""
    paths = list(_paths(doc))
    if not paths:
        return False
    *parents, last = rng.choice(paths)
    node = doc
    for key in parents:
        node = node[key]
    node[last] = rng.choice(JSON_VALUES)
    return True


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
    if not _set_one_field(header, rng):
        return None
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
