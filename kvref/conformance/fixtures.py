"""`kvref fixtures export DIR -m MODEL`: reference data another engine's CI can compare against without kvref.

One .npz per prompt and a manifest.json (schema in docs/fixtures.md, versioned by SCHEMA_VERSION).
Everything comes from the float32 spec on the model file's weights, one execution from position 0.

K is stored after RoPE, per kv head, with head dimensions in the half-split order of Hugging Face's
`rotate_half` (pair i = dims (i, i + D/2)), whatever order kvref computes in. kvref rotates adjacent
pairs (2i, 2i + 1) (kvref/formats/architectures.py: llama GGUF files hold Q/K rows permuted that way,
and HF checkpoints and the other GGUF architectures are permuted to it at load), so its dimension 2i
is HF's i and 2i + 1 is HF's i + D/2: to_half_split undoes that. V is never rotated or permuted.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .. import __version__
from .engine import ConformanceError

SCHEMA_VERSION = 1


def to_half_split(k) -> np.ndarray:
    # [..., D] adjacent-pair order -> [..., D] rotate_half order: (x0, x2, x4, ..., x1, x3, x5, ...)
    return np.concatenate([k[..., 0::2], k[..., 1::2]], axis=-1)


def prompt_arrays(model, ids) -> dict:
    """The arrays of one prompt's file: ids, positions, logits and every layer's K/V."""
    cache = model.new_cache(layout="contiguous", capacity=len(ids))
    logits = model.forward(list(ids), cache, all_logits=True)  # [T, V]
    k = np.stack([to_half_split(np.asarray(cache.keys(layer))) for layer in range(cache.n_layers)])  # [L, T, Hkv, D]
    v = np.stack([np.asarray(cache.values(layer)) for layer in range(cache.n_layers)])  # [L, T, Hkv, D]
    text = model.tokenizer.decode(list(ids)) if model.tokenizer is not None else ""
    return {"schema_version": np.int64(SCHEMA_VERSION), "prompt": np.array(text),
            "token_ids": np.asarray(ids, dtype=np.int64), "positions": np.arange(len(ids), dtype=np.int64),
            "logits": logits.astype(np.float32), "k": k.astype(np.float32), "v": v.astype(np.float32)}


def manifest(model, model_name: str, files) -> dict:
    c = model.config
    return {
        "schema_version": SCHEMA_VERSION, "generator": f"kvref {__version__}", "model": model_name,
        "model_fingerprint": {k: model.fingerprint()[k] for k in ("config_sha256", "weights_sha256")},
        "config": {"n_layers": c.n_layers, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
                   "vocab_size": c.vocab_size, "rope_theta": c.rope_theta, "rope_local_theta": c.rope_local_theta,
                   "layer_windows": list(c.layer_windows) if c.layer_windows else None},
        "arrays": {"prompt": "str: the ids decoded (special tokens as text; empty without a tokenizer)",
                   "token_ids": "int64 [T]", "positions": "int64 [T]", "logits": "float32 [T, V], row t predicts t+1",
                   "k": "float32 [L, T, Hkv, D] after RoPE, head dims in rotate_half order",
                   "v": "float32 [L, T, Hkv, D]"},
        "rope_dim_order": "half_split", "computed_by": "kvref float32 NumPy spec, one execution from position 0",
        "files": files,
    }


def export(model, directory, prompts, model_name: str) -> list:
    """Write prompt_<i>.npz for every prompt and manifest.json into directory; return the paths."""
    if model.dtype != "float32" or model.backend != "numpy":
        raise ConformanceError(f"fixtures come from the float32 spec; got a {model.dtype} model on {model.backend}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    files, written = [], []
    for i, ids in enumerate(prompts):
        path = out / f"prompt_{i}.npz"
        np.savez(path, **prompt_arrays(model, ids))
        files.append({"file": path.name, "positions": len(ids)})
        written.append(path)
    path = out / "manifest.json"
    path.write_text(json.dumps(manifest(model, model_name, files), indent=1) + "\n")
    return [*written, path]
