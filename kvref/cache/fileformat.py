"""The saved form of a KV cache: versioned, self-describing, checked before anything is built.

    offset 0    magic        8 bytes   b"KVREFKV\\0"
    offset 8    version      uint32 little-endian (FORMAT_VERSION)
    offset 12   header size  uint64 little-endian
    offset 20   header       UTF-8 JSON: model fingerprint, layout and its options, K/V dtypes, int8
                             group size, RoPE parameters, length, next_position, and an entry
                             {name, dtype, shape, offset, nbytes} for every array below
    ...         arrays       each starting at a multiple of 64 bytes, little-endian, C order:
                               positions    int64 [n]                 stored positions, ascending
                               k, v         [L, n, Hkv, D]            stored form (float, uint16 bfloat16, int8)
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

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import CacheError

MAGIC = b"KVREFKV\x00"
FORMAT_VERSION = 1
ALIGNMENT = 64
_PREFIX = struct.Struct("<8sIQ")  # magic, version, header size
_DIGEST = 32
_ARRAY_DTYPES = {"int64", "float64", "float32", "float16", "uint16", "int8"}


def save_cache(cache, path) -> None:
    sequence = cache.sequence
    if sequence.model is None:
        raise CacheError("this cache was not made by model.new_cache(), so it cannot name its model; "
                         "only such caches can be saved")
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
    body += hashlib.sha256(body).digest()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(body)
    os.replace(tmp, path)  # a reader never sees a half-written file


def read_cache_file(path):
    """Check a saved cache and return (header, {name: array}); raises CacheError naming the problem."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CacheError(f"cannot read cache file {str(path)!r}: {exc.strerror or exc}") from None
    where = f"cache file {str(path)!r}"
    if len(data) < _PREFIX.size + _DIGEST:
        raise CacheError(f"{where} is truncated: {len(data)} bytes")
    magic, version, header_size = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CacheError(f"{where} is not a kvref KV cache (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CacheError(f"{where} has format version {version}; this kvref reads version {FORMAT_VERSION}")
    if hashlib.sha256(data[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise CacheError(f"{where} is corrupt or truncated: its sha256 checksum does not match")
    end = _PREFIX.size + header_size
    if end > len(data) - _DIGEST:
        raise CacheError(f"{where}: header of {header_size} bytes runs past the end of the file")
    try:
        header = json.loads(data[_PREFIX.size:end].decode())
        entries = header["arrays"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CacheError(f"{where}: unreadable header ({exc})") from None
    arrays = {}
    for entry in entries:
        try:
            name, dtype, shape = entry["name"], np.dtype(entry["dtype"]), tuple(int(s) for s in entry["shape"])
            offset, nbytes = int(entry["offset"]), int(entry["nbytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheError(f"{where}: bad array entry {entry!r} ({exc})") from None
        if dtype.name not in _ARRAY_DTYPES or any(s < 0 for s in shape):
            raise CacheError(f"{where}: array {name!r} has dtype {dtype.name} and shape {shape}")
        if nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise CacheError(f"{where}: array {name!r} of shape {shape} cannot take {nbytes} bytes")
        if offset < end or offset + nbytes > len(data) - _DIGEST:
            raise CacheError(f"{where}: array {name!r} at bytes {offset}..{offset + nbytes} is outside the data")
        arrays[name] = np.frombuffer(data, dtype=dtype.newbyteorder("<"), count=nbytes // dtype.itemsize,
                                     offset=offset).reshape(shape).astype(dtype)
    return header, arrays


def load_cache(model, path, pool=None):
    """A new cache for `model` holding what `path` holds; see Model.load_cache."""
    header, arrays = read_cache_file(path)
    where = f"cache file {str(path)!r}"
    saved, ours = header.get("model") or {}, model.fingerprint()
    if saved.get("config_sha256") != ours["config_sha256"]:
        raise CacheError(f"{where} was saved for another model architecture: {saved.get('config')} "
                         f"is not this model's {ours['config']}")
    if saved.get("weights_sha256") != ours["weights_sha256"]:
        raise CacheError(f"{where} was saved from a model with other weights (same architecture); its K/V "
                         "would be wrong for this one")
    try:
        layout, options = header["layout"], dict(header["options"])
        n, next_position = int(header["length"]), int(header["next_position"])
        dtypes = dict(kv_dtype=None, k_dtype=header["k_dtype"], v_dtype=header["v_dtype"])
        group_size = header["group_size"]
        theta = header["rope"]["theta"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheError(f"{where}: header field missing or malformed ({exc})") from None
    if theta != model.kv_rope_theta:
        raise CacheError(f"{where}: keys were rotated with rope_theta={theta}; this model uses "
                         f"{model.kv_rope_theta}")
    c = model.config
    rows = arrays.get("layer_rows")
    for name in ("positions", "layer_rows", "token_ids"):
        if name in arrays and arrays[name].dtype != np.int64:
            raise CacheError(f"{where}: array {name!r} is {arrays[name].dtype}; expected int64")
    if rows is not None and (rows.shape != (c.n_layers,) or np.any(rows < 0) or np.any(rows > n)):
        raise CacheError(f"{where}: layer_rows must give each of {c.n_layers} layers 0..{n} rows")
    shape = (c.n_layers, n, c.n_kv_heads, c.head_dim) if rows is None else (int(rows.sum()), c.n_kv_heads, c.head_dim)
    need = {"positions": (n,), "k": shape, "v": shape, **({} if rows is None else {"layer_rows": (c.n_layers,)})}
    if "int8" in (dtypes["k_dtype"], dtypes["v_dtype"]):
        groups = c.head_dim // group_size if isinstance(group_size, int) and group_size > 0 else -1
        for name in ("k", "v"):
            if dtypes[f"{name}_dtype"] == "int8":
                need[f"{name}_scales"] = (*shape[:-1], groups)
    if "token_ids" in arrays and arrays["token_ids"].shape != (next_position,):
        raise CacheError(f"{where}: token_ids has shape {arrays['token_ids'].shape} for {next_position} positions")
    for name, expected in need.items():
        if name not in arrays or arrays[name].shape != expected:
            got = arrays[name].shape if name in arrays else "missing"
            raise CacheError(f"{where}: array {name!r} is {got}; expected shape {expected}")
    extra = set(arrays) - set(need) - {"token_ids", "last_logits"}
    if extra:
        raise CacheError(f"{where}: unexpected arrays {sorted(extra)}")
    positions = arrays["positions"]
    if np.any(np.diff(positions) <= 0) or (n and (positions[0] < 0 or positions[-1] >= next_position)):
        raise CacheError(f"{where}: positions are not ascending within 0..{next_position - 1}")
    if "last_logits" in arrays and arrays["last_logits"].shape != (c.vocab_size,):
        raise CacheError(f"{where}: last_logits has shape {arrays['last_logits'].shape}; expected ({c.vocab_size},)")
    if layout != "window" and (next_position != n or not np.array_equal(positions, np.arange(n))):
        raise CacheError(f"{where}: a {layout} cache holds positions 0..length-1 and next_position == length")
    known = {"contiguous": ("capacity",), "hybrid": ("capacity", "spare"),
             "paged": ("block_size", "num_blocks", "prefix_reuse"), "window": ("window", "sinks")}
    if layout not in known:
        raise CacheError(f"{where}: unknown layout {layout!r}; expected one of {sorted(known)}")
    if rows is not None and layout != "hybrid":
        raise CacheError(f"{where}: only a hybrid cache holds different positions per layer; this is {layout!r}")
    options = {name: options.get(name) for name in known[layout]}
    if pool is not None:
        if layout != "paged":
            raise CacheError(f"pool= applies to paged caches; {where} holds a {layout!r} cache")
        options = {"pool": pool}
    if layout in ("contiguous", "hybrid") and options["capacity"] is not None and n <= c.max_seq_len:
        options["capacity"] = min(int(options["capacity"]), c.max_seq_len)
    group = {"group_size": group_size} if group_size is not None else {}
    cache = model.new_cache(layout=layout, **dtypes, **group, **options)
    if (cache.k_dtype, cache.v_dtype, cache.group_size) != (header["k_dtype"], header["v_dtype"], group_size):
        cache.free()
        raise CacheError(f"{where} stores K/V as {header['k_dtype']}/{header['v_dtype']} (group {group_size}); "
                         f"the pool stores {cache.k_dtype}/{cache.v_dtype} (group {cache.group_size})")
    for name, codec in (("k", cache.k_codec), ("v", cache.v_codec)):
        if arrays[name].dtype != codec.storage_dtype:
            cache.free()
            raise CacheError(f"{where}: array {name!r} is {arrays[name].dtype}; {codec.name} is stored as "
                             f"{codec.storage_dtype}")
        if f"{name}_scales" in arrays and arrays[f"{name}_scales"].dtype != np.float32:
            cache.free()
            raise CacheError(f"{where}: array {name}_scales is {arrays[f'{name}_scales'].dtype}, not float32")
    bounds = np.cumsum([0, *rows]) if rows is not None else None
    raw_layers = [tuple(None if name not in arrays else arrays[name][layer] if rows is None
                        else arrays[name][bounds[layer]:bounds[layer + 1]]
                        for name in ("k", "k_scales", "v", "v_scales")) for layer in range(c.n_layers)]
    try:
        if n > cache.capacity and layout != "paged":  # a pool says CacheFullError itself, with its numbers
            raise CacheError(f"{where} holds {n} positions; the {layout} cache made for it holds {cache.capacity}")
        cache.sequence.replace(arrays.get("token_ids"), arrays.get("last_logits"))
        cache.load_rows(positions, next_position, raw_layers)  # a paged cache keys its blocks by those ids
    except BaseException:
        cache.free()
        raise
    return cache


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT
