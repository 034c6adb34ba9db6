"""`kvref models [DIR ...]`: the models a user already has, each with the name `-m` takes.

Three places: the packaged short names (installed or not), the local Hugging Face cache (folders kvref
reads, or a single GGUF file; kvref.loader.hf_cache_dir says where), and GGUF files under the folders
given. Nothing is downloaded or assembled to list them.
"""

from __future__ import annotations

from pathlib import Path

from ..loader import hf_cache_dir, hf_cache_models, packaged_models
from .common import human_bytes


def add_models(commands):
    p = commands.add_parser("models", help="list the models -m can name: packaged, in the Hugging Face cache, "
                                           "and GGUF files in the given folders")
    p.add_argument("folders", nargs="*", type=Path, metavar="DIR", help="folders to search for .gguf files")
    p.set_defaults(run=run_models)


def run_models(args) -> int:
    rows = [("packaged (-m NAME)", None, None)]
    rows += [(name, size, str(path) if path is not None else note) for name, path, size, note in packaged_models()]
    rows.append((f"Hugging Face cache {hf_cache_dir()} (-m org/name)", None, None))
    rows += [(repo_id, size, str(path)) for repo_id, path, size in hf_cache_models()] or [("(none)", None, "")]
    for folder in args.folders:
        rows.append((f"GGUF files in {folder} (-m PATH)", None, None))
        files = [f for f in sorted(folder.rglob("*.gguf")) if f.is_file()] if folder.is_dir() else []
        rows += [(str(f), f.stat().st_size, "") for f in files] or [
            ("(none)" if folder.is_dir() else "(not a folder)", None, "")]
    width = max(len(name) for name, _, where in rows if where is not None)
    for name, size, where in rows:
        if where is None:  # a section's heading
            print(f"{name}:")
        else:
            print(f"  {name:<{width}}  {human_bytes(size) if size is not None else '':>10}  {where}".rstrip())
    return 0
