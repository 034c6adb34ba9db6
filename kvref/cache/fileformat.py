"""The saved form of a KV cache: versioned, self-describing, checked before anything is built.

    offset 0    magic        8 bytes   b"KVREFKV\\0"
    offset 8    version      uint32 little-endian (FORMAT_VERSION)
    offset 12   header size  uint64 little-endian
    offset 20   header       UTF-8 JSON: model fingerprint, layout and its options, K/V dtypes, int8
                             group size, RoPE parameters, length, next_position, and an entry
                             {name, dtype, shape, offset, nbytes} for every array below
    ...         arrays       each starting at a multiple of 64 bytes, little-endian, C order:
                               positions    int64 [n]                 stored positions, ascending
                               k, v         [L, n, Hkv, D]            stored form (float, uint16 bfloat16, int8);
                                                                      a latent (MLA) cache: Hkv 1, D the
                                                                      latent key's width, v [L, n, 1, 0]
                               k_scales ..  float32 [L, n, Hkv, D/g]  int8 scales (only for int8)
                               layer_rows   int64 [L]                 only when layers hold different
                                                                      numbers of positions (hybrid): layer
                                                                      l holds the last layer_rows[l] of
                                                                      `positions`, and k, v, scales are
                                                                      the layers' rows one after another,
                                                                      [sum of layer_rows, Hkv, D]
                               token_ids    int64 [next_position]     when known
                               last_logits  float [V]                 so generation resumes exactly
    last 32     sha256 of every byte before it

K/V are written in their stored form and loaded back byte for byte: nothing is re-quantized, and a
paged cache may be loaded into a pool of another block size. `load_cache` checks the magic, the
version, the checksum, the model fingerprint and every array's bounds and shape before it creates
the cache, and a cache that fails while being filled is freed: a bad file never leaves a half-loaded
cache behind (nor blocks taken from a shared pool).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from ..digest import sha256_bulk
from ..errors import CacheError
from ..limits import bounded_int, bounded_json, open_regular_file, read_exactly
from ..moved import moved_names
from .quant import KIVI, Codecs
from .registry import layout_class, layout_names, options_by_layout
from .shape import CacheShape

MAGIC = b"KVREFKV\x00"
FORMAT_VERSION = 1
ALIGNMENT = 64
_PREFIX = struct.Struct("<8sIQ")  # magic, version, header size
_DIGEST = 32
_ARRAY_DTYPES = {"int64", "float64", "float32", "float16", "uint16", "int8"}
ARRAY_NAMES = ("positions", "layer_rows", "k", "k_scales", "v", "v_scales", "token_ids", "last_logits")
MAX_HEADER_BYTES = 2**20  # a header is a few kB: the config, the options and one entry per array
MAX_ARRAY_DIMS = 4
MAX_FILE_OFFSET = 2**62  # offsets, sizes and dimensions; the file's own size bounds them further


def save_problem(cache) -> str | None:
    """Why this format cannot hold `cache` (None when it can): cache.capabilities.save asks it."""
    if cache.sequence.model is None:
        return ("this cache was not made by model.new_cache(), so it cannot name its model; only such caches "
                "can be saved")
    if KIVI in (cache.k_dtype, cache.v_dtype):
        return (f"a {cache.dtype_name} cache cannot be saved: format version {FORMAT_VERSION} stores K/V row by "
                f"row, and kivi4 K lives in groups of positions with a float16 residual; save a float16 or int8 cache")
    return None


def save_cache(cache, path) -> None:
    problem = save_problem(cache)
    if problem is not None:
        raise CacheError(problem)
    sequence = cache.sequence
    positions = cache.positions().astype(np.int64)
    arrays = [("positions", positions)]
    raw = [cache.read_raw(layer) for layer in range(cache.n_layers)]
    rows = np.array([len(r[0]) for r in raw], dtype=np.int64)
    uniform = bool(np.all(rows == len(positions)))
    if not uniform:
        arrays.append(("layer_rows", rows))
    for i, name in enumerate(("k", "k_scales", "v", "v_scales")):
        if raw[0][i] is not None:  # scales only for int8
            arrays.append((name, (np.stack if uniform else np.concatenate)([r[i] for r in raw])))
    if sequence.token_ids is not None:
        arrays.append(("token_ids", np.asarray(sequence.token_ids, dtype=np.int64)))
    if sequence.last_logits is not None:
        arrays.append(("last_logits", np.asarray(sequence.last_logits)))
    header = {
        "format": "kvref KV cache",
        "version": FORMAT_VERSION,
        "model": sequence.model,
        "layout": cache.layout,
        "options": cache.layout_options(),
        "n_layers": cache.n_layers, "n_kv_heads": cache.n_kv_heads, "head_dim": cache.head_dim,
        "k_dtype": cache.k_dtype, "v_dtype": cache.v_dtype, "group_size": cache.group_size,
        "latent_dim": cache.latent_dim,  # MLA: V is not stored, it is K's first latent_dim values
        "rope": {"theta": cache.rope_theta, "pairs": "adjacent (x[2i], x[2i+1])",
                 "keys": "stored after RoPE at their absolute positions"},
        "length": cache.length, "next_position": cache.next_position,
        "arrays": [],
    }
    # offsets depend on the header size, which depends on the offsets: lay out with a fixed-width guess
    blobs = [np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False) for _, a in arrays]
    for reserve in (len(json.dumps(header)) + 256 * len(arrays) + 256,) * 2:
        offset = _align(_PREFIX.size + reserve)
        header["arrays"] = []
        for (name, _), blob in zip(arrays, blobs):
            header["arrays"].append({"name": name, "dtype": blob.dtype.name, "shape": list(blob.shape),
                                     "offset": offset, "nbytes": blob.nbytes})
            offset = _align(offset + blob.nbytes)
        text = json.dumps(header, sort_keys=True).encode()
        if len(text) <= reserve:
            break
    else:  # pragma: no cover - the reserve is generous
        raise CacheError("header layout failed")
    body = bytearray(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(text)) + text)
    for entry, blob in zip(header["arrays"], blobs):
        body += bytes(entry["offset"] - len(body))
        body += blob.tobytes()
    body += sha256_bulk(body).digest()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(body)
    os.replace(tmp, path)  # a reader never sees a half-written file


def read_cache_file(path, max_bytes=None):
    """Check a saved cache and return (header, {name: array}); raises CacheError naming the problem.

    The file is untrusted. Only a regular file is opened (never a device, FIFO or directory); the
    prefix and the header are read first, the header is parsed with bounded size and depth and every
    array entry is checked, and only then is the rest read: exactly the bytes the header describes,
    and no more than max_bytes (load_cache: the largest file the model's cache could have written).
    """
    where = f"cache file {str(path)!r}"
    try:
        f = open_regular_file(path, "cache file", CacheError)
    except FileNotFoundError:
        raise CacheError(f"cannot read cache file {str(path)!r}: no such file") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        head, header = _read_header(f, size, where)
        entries = _array_entries(header, len(head), size - _DIGEST, where)
        described = max([len(head), *(offset + nbytes for _, _, _, offset, nbytes in entries)]) + _DIGEST
        if described != size:
            raise CacheError(f"{where} is truncated or corrupt: it has {size} bytes; its header describes {described}")
        if max_bytes is not None and size > max_bytes:
            raise CacheError(f"{where} has {size:,} bytes; a cache of this model takes at most {max_bytes:,}")
        data = head + read_exactly(f, size - len(head), where, CacheError)
    if sha256_bulk(memoryview(data)[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise CacheError(f"{where} is corrupt or truncated: its sha256 checksum does not match")
    arrays = {name: np.frombuffer(data, dtype=dtype.newbyteorder("<"), count=nbytes // dtype.itemsize,
                                  offset=offset).reshape(shape).astype(dtype)
              for name, dtype, shape, offset, nbytes in entries}
    return header, arrays


def _read_header(f, size, where):
    # -> (the bytes of prefix and header, the parsed header), read with the header's size bounded
    if size < _PREFIX.size + _DIGEST:
        raise CacheError(f"{where} is truncated: {size} bytes")
    prefix = read_exactly(f, _PREFIX.size, where, CacheError)
    magic, version, header_size = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CacheError(f"{where} is not a kvref KV cache (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CacheError(f"{where} has format version {version}; this kvref reads version {FORMAT_VERSION}")
    if header_size > MAX_HEADER_BYTES or _PREFIX.size + header_size > size - _DIGEST:
        raise CacheError(f"{where}: a header of {header_size} bytes does not fit in the file ({size} bytes) "
                         f"or exceeds {MAX_HEADER_BYTES}")
    text = read_exactly(f, header_size, where, CacheError)
    return prefix + text, bounded_json(text, f"{where}: the header", CacheError)


def largest_file(shape) -> int:
    """Bytes of the largest file a cache of this model (a CacheShape) can save: every array at
    max_seq_len positions in the widest types (float64 K/V with int8-sized scale groups of 1), the
    header and padding."""
    c = shape
    per_position = 2 * c.n_layers * c.n_kv_heads * c.head_dim * (8 + 4) + 8 + 8  # K, V, scales; position, id
    return (MAX_HEADER_BYTES + _PREFIX.size + len(ARRAY_NAMES) * ALIGNMENT + _DIGEST
            + c.max_seq_len * per_position + 8 * c.n_layers + 8 * c.vocab_size)


def _array_entries(header, data_start, data_end, where):
    # -> [(name, dtype, shape, offset, nbytes)], each checked for type, size and place in the file
    entries = header.get("arrays") if isinstance(header, dict) else None
    if not isinstance(entries, list) or len(entries) > len(ARRAY_NAMES):
        raise CacheError(f"{where}: the header must be an object whose 'arrays' lists at most "
                         f"{len(ARRAY_NAMES)} arrays")
    checked, names = [], set()
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"name", "dtype", "shape", "offset", "nbytes"}:
            raise CacheError(f"{where}: bad array entry {_short(entry)}; expected name, dtype, shape, offset, nbytes")
        name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
        if name not in ARRAY_NAMES or name in names:
            raise CacheError(f"{where}: array name {_short(name)} is unknown or repeated; expected {ARRAY_NAMES}")
        names.add(name)
        if (not isinstance(dtype, str) or dtype not in _ARRAY_DTYPES or not isinstance(shape, list)
                or len(shape) > MAX_ARRAY_DIMS):
            raise CacheError(f"{where}: array {name!r} has dtype {_short(dtype)} and shape {_short(shape)}; "
                             f"expected one of {sorted(_ARRAY_DTYPES)} and at most {MAX_ARRAY_DIMS} dimensions")
        shape = tuple(bounded_int(s, f"{where}: a dimension of array {name!r}", 0, MAX_FILE_OFFSET, CacheError)
                      for s in shape)
        offset, nbytes = (bounded_int(entry[k], f"{where}: {k} of array {name!r}", 0, MAX_FILE_OFFSET, CacheError)
                          for k in ("offset", "nbytes"))
        dtype = np.dtype(dtype)
        if nbytes != math.prod(shape) * dtype.itemsize:  # Python ints: the product cannot wrap
            raise CacheError(f"{where}: array {name!r} of shape {shape} cannot take {nbytes} bytes")
        if offset < data_start or offset + nbytes > data_end:
            raise CacheError(f"{where}: array {name!r} at bytes {offset}..{offset + nbytes} is outside the data "
                             f"(bytes {data_start}..{data_end}): the file is truncated or corrupt")
        checked.append((name, dtype, shape, offset, nbytes))
    return checked


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


KV_NAMES = ("float32", "float64", "float16", "bfloat16", "int8")

__getattr__ = moved_names(__name__, {
    "LAYOUT_OPTIONS": ("kvref.cache.registry.options_by_layout()",
                       options_by_layout),
})


def load_cache(path, shape: CacheShape, factory, pool=None):
    """A new cache holding what `path` holds, for the model `shape` describes; see Model.load_cache.

    factory(layout, k_dtype=, v_dtype=, group_size=, **options) makes the empty cache (Model.new_cache);
    pool=: the sequence goes into that pool instead of one made from the file's options.
    """
    header, arrays = read_cache_file(path, largest_file(shape))
    where = f"cache file {str(path)!r}"
    _check_model(header, shape, where)
    fields = _header_fields(header, shape, where)
    n, next_position = fields["length"], fields["next_position"]
    rows = _check_arrays(arrays, fields, shape, where)
    positions = arrays["positions"]
    if np.any(np.diff(positions) <= 0) or (n and (positions[0] < 0 or positions[-1] >= next_position)):
        raise CacheError(f"{where}: positions are not ascending within 0..{next_position - 1}")
    codecs = Codecs.named(fields["k_dtype"], fields["v_dtype"], shape.head_dim, fields["group_size"],
                          latent_dim=shape.latent_dim)
    if pool is not None:
        options = {"pool": pool}
    else:
        options = _saved_options(fields["cls"], fields["options"], shape, where)
        if options.positions():  # the layout bounds its default size itself
            shape.check_budget(options.positions(), codecs, where, fields["cls"])
        options = vars(options)
    group = {"group_size": fields["group_size"]} if fields["group_size"] is not None else {}
    cache = factory(fields["cls"].layout, k_dtype=fields["k_dtype"], v_dtype=fields["v_dtype"], **group, **options)
    try:
        _check_storage(cache, arrays, fields, where)
        cache.sequence.replace(arrays.get("token_ids"), arrays.get("last_logits"))
        _load_rows(cache, arrays, rows, next_position, where)  # a paged cache keys its blocks by those ids
    except BaseException:
        cache.free()
        raise
    return cache


def _load_rows(cache, arrays, rows, next_position, where):
    # the arrays' rows into the empty cache, layer by layer: (k, k_scales, v, v_scales), None if absent
    bounds = np.cumsum([0, *rows]) if rows is not None else None
    raw_layers = [tuple(None if name not in arrays else arrays[name][layer] if rows is None
                        else arrays[name][bounds[layer]:bounds[layer + 1]]
                        for name in ("k", "k_scales", "v", "v_scales")) for layer in range(cache.n_layers)]
    try:
        cache.load_rows(arrays["positions"], next_position, raw_layers)
    except CacheError as exc:  # the layout refuses what the file holds
        raise CacheError(f"{where}: {exc}") from None


def _saved_options(cls, saved: dict, shape, where):
    # the layout's options as the file records them, each bounded before anything is allocated
    values = {}
    for f in dataclasses.fields(cls.Options):
        kind, value = f.metadata.get("kind"), saved.get(f.name)
        if value is None or kind is object:  # the default; an object (a pool) is never saved
            continue
        if kind is bool and not isinstance(value, bool):
            raise CacheError(f"{where}: options.{f.name} is {_short(value)}; expected true or false")
        if kind is int:
            high = f.metadata["file_high"]
            high = shape.max_seq_len if high == "max_seq_len" else MAX_FILE_OFFSET if high is None else high
            value = bounded_int(value, f"{where}: options.{f.name}", f.metadata["low"], high, CacheError)
        values[f.name] = value
    return cls.Options(**values).loaded(shape)


def _check_model(header, shape, where):
    saved, ours = header.get("model"), shape.model
    if not isinstance(saved, dict):
        raise CacheError(f"{where}: the header's 'model' must be an object naming the model (Model.fingerprint)")
    if saved.get("config_sha256") != ours["config_sha256"]:
        raise CacheError(f"{where} was saved for another model architecture: {_short(saved.get('config'))} "
                         f"is not this model's {ours['config']}")
    if saved.get("weights_sha256") != ours["weights_sha256"]:
        raise CacheError(f"{where} was saved from a model with other weights (same architecture); its K/V "
                         "would be wrong for this one")


def _header_fields(header, shape, where):
    # every header field the load reads, type-checked and bounded by the model
    layout, options, rope = header.get("layout"), header.get("options"), header.get("rope")
    if not isinstance(layout, str) or layout not in layout_names():
        raise CacheError(f"{where}: unknown layout {_short(layout)}; expected one of {list(layout_names())}")
    if not isinstance(options, dict) or not isinstance(rope, dict):
        raise CacheError(f"{where}: the header's 'options' and 'rope' must be objects")
    n = bounded_int(header.get("length"), f"{where}: length", 0, shape.max_seq_len, CacheError)
    fields = {
        "cls": layout_class(layout), "options": options, "length": n,
        "next_position": bounded_int(header.get("next_position"), f"{where}: next_position", n, shape.max_seq_len,
                                     CacheError),
        "group_size": None if header.get("group_size") is None else bounded_int(
            header["group_size"], f"{where}: group_size", 1, shape.head_dim, CacheError),
    }
    for name in ("k_dtype", "v_dtype"):
        if header.get(name) not in KV_NAMES:
            raise CacheError(f"{where}: {name} is {_short(header.get(name))}; expected one of {KV_NAMES}")
        fields[name] = header[name]
    if header.get("latent_dim") != shape.latent_dim:  # files from before MLA have none: not latent
        raise CacheError(f"{where}: latent_dim is {_short(header.get('latent_dim'))}; this model's cache has "
                         f"{shape.latent_dim}")
    theta = rope.get("theta")
    theta = tuple(theta) if isinstance(theta, list) else theta  # per layer (NoPE layers), as JSON stores a tuple
    if theta != shape.rope_theta:
        raise CacheError(f"{where}: keys were rotated with rope_theta={_short(theta)}; this model uses "
                         f"{shape.rope_theta}")
    return fields


def _check_arrays(arrays, fields, shape, where):
    # every array's dtype, shape and values against the header fields and the model; -> layer_rows or None
    c, n = shape, fields["length"]
    for name in ("positions", "layer_rows", "token_ids"):
        if name in arrays and arrays[name].dtype != np.int64:
            raise CacheError(f"{where}: array {name!r} is {arrays[name].dtype}; expected int64")
    rows = arrays.get("layer_rows")
    if rows is not None and (rows.shape != (c.n_layers,) or np.any(rows < 0) or np.any(rows > n)):
        raise CacheError(f"{where}: layer_rows must give each of {c.n_layers} layers 0..{n} rows")
    kv = (c.n_layers, n, c.n_kv_heads, c.head_dim) if rows is None else (int(rows.sum()), c.n_kv_heads, c.head_dim)
    widths = {"k": c.head_dim, "v": 0 if c.latent_dim is not None else c.head_dim}  # a latent cache stores no V
    need = {"positions": (n,), "k": kv, "v": (*kv[:-1], widths["v"]),
            **({} if rows is None else {"layer_rows": (c.n_layers,)})}
    group_size = fields["group_size"]
    for name in ("k", "v"):
        if fields[f"{name}_dtype"] == "int8":
            groups = widths[name] // group_size if group_size is not None else -1
            need[f"{name}_scales"] = (*kv[:-1], groups)
    if "token_ids" in arrays:
        need["token_ids"] = (fields["next_position"],)
    if "last_logits" in arrays:
        need["last_logits"] = (c.vocab_size,)
    for name, expected in need.items():
        if name not in arrays or arrays[name].shape != expected:
            got = arrays[name].shape if name in arrays else "missing"
            raise CacheError(f"{where}: array {name!r} is {got}; expected shape {expected}")
    extra = set(arrays) - set(need)
    if extra:
        raise CacheError(f"{where}: unexpected arrays {sorted(extra)}")
    ids = arrays.get("token_ids")
    if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= c.vocab_size):
        raise CacheError(f"{where}: token_ids holds ids outside the vocabulary [0, {c.vocab_size})")
    logits = arrays.get("last_logits")
    if logits is not None and (logits.dtype not in (np.float32, np.float64) or not np.all(np.isfinite(logits))):
        raise CacheError(f"{where}: last_logits must be finite float32 or float64; they are {logits.dtype}"
                         + ("" if logits.dtype.kind != "f" else " with non-finite values"))
    return rows


def _check_storage(cache, arrays, fields, where):
    # the cache the header asked for stores K/V exactly as the arrays hold them
    if (cache.k_dtype, cache.v_dtype, cache.group_size) != (fields["k_dtype"], fields["v_dtype"], fields["group_size"]):
        raise CacheError(f"{where} stores K/V as {fields['k_dtype']}/{fields['v_dtype']} (group "
                         f"{fields['group_size']}); the pool stores {cache.k_dtype}/{cache.v_dtype} "
                         f"(group {cache.group_size})")
    for name, codec in (("k", cache.k_codec), ("v", cache.v_codec)):
        if arrays[name].dtype != codec.storage_dtype:
            raise CacheError(f"{where}: array {name!r} is {arrays[name].dtype}; {codec.name} is stored as "
                             f"{codec.storage_dtype}")
        if f"{name}_scales" in arrays and arrays[f"{name}_scales"].dtype != np.float32:
            raise CacheError(f"{where}: array {name}_scales is {arrays[f'{name}_scales'].dtype}, not float32")


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT
