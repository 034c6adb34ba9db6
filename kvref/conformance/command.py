"""The `kvref conformance` and `kvref fixtures` subcommands (registered by kvref.tools.cli)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..tools.common import add_model_arguments
from .checks import CHECKS
from .engine import ConformanceError
from .kvref_engine import LAYOUTS, KVRefEngine
from .spec import Spec
from .suite import SUITES, failed, make_plan, markdown, max_positions, run_suite, table, to_json, verdict

ENGINES = ("kvref", "transformers", "llama-cpp-python", "openai-http")


def add_conformance(commands):
    p = commands.add_parser("conformance", help="check an inference engine against the spec (docs/conformance.md)",
                            description="Run an engine through the golden comparison with the float32 spec and "
                                        "the metamorphic cache checks; print a table of checks with evidence. "
                                        "Exit status 1 when a check fails.")
    p.add_argument("engine", choices=ENGINES, help="the engine to check: kvref itself, transformers (-m a "
                                                   "Hugging Face directory), llama-cpp-python, or a server "
                                                   "speaking the OpenAI API (openai-http, --url)")
    add_model_arguments(p)
    p.add_argument("--suite", choices=sorted(SUITES), default="quick",
                   help="quick (default: 2 prompts of 64 positions, 8 greedy tokens) or full (4 of 128, 32, "
                        "and the sliding-window check past windows up to 636 positions)")
    p.add_argument("--layout", choices=LAYOUTS, action="append", default=None,
                   help="kvref engine: the cache layout (repeatable; default: every layout), on --backend "
                        "numpy, c, or auto: both (numpy only where the native module is not built)")
    p.add_argument("--kv-dtype", default=None, help="kvref engine: K/V element type (default: the model's)")
    p.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto",
                   help="llama-cpp-python: flash attention (default auto: llama.cpp's choice, on for the CPU)")
    p.add_argument("--swa-full", action="store_true",
                   help="llama-cpp-python: a full-size cache for sliding-window layers (default: the window cache)")
    p.add_argument("--url", default=None, help="openai-http: the server's base URL (http://host:port)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="openai-http: sent as `Authorization: Bearer KEY` (a server started with an API key)")
    p.add_argument("--precision", choices=["float32", "quantized"], default="float32",
                   help="openai-http: which bounds apply (docs/conformance.md): float32 (a server computing in "
                        "float32 with float32 K/V, default) or quantized (float16 K/V, 8-bit activations)")
    p.add_argument("--check", action="append", default=None, help="run only this check (repeatable)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    p.add_argument("--report", metavar="FILE", default=None, help="write the results as a Markdown report")
    p.set_defaults(run=run_conformance)


def add_fixtures(commands):
    p = commands.add_parser("fixtures", help="export reference fixtures for other engines' tests (docs/fixtures.md)")
    actions = p.add_subparsers(dest="action", required=True, help="export (the only action)")
    export = actions.add_parser("export", help="prompts, token ids, logits and per-layer K/V as .npz")
    export.add_argument("directory", help="where to write prompt_<i>.npz and manifest.json (made if missing)")
    add_model_arguments(export)
    export.add_argument("--suite", choices=sorted(SUITES), default="quick", help="which prompts (as conformance)")
    export.set_defaults(run=run_fixtures)


def spec_model(model_arg):
    from ..loader import load

    return load(model_arg, backend="numpy", dtype="float32")


def kvref_models(args, spec) -> list:
    """The kvref engine's models: --backend auto runs both backends (the numpy one is the spec's model:
    its caches are the engine's own, so the layouts are still what is checked)."""
    from .. import native
    from ..loader import load

    if args.backend == "numpy":
        return [spec.model]
    if args.backend == "auto" and not native.available():
        return [spec.model]
    model = load(args.model, backend="c")
    return [spec.model, model] if args.backend == "auto" else [model]


def engines_for(args, spec):
    """The engine(s) the arguments name: kvref gives one per layout."""
    name, n = args.engine, max_positions(args.suite)
    if name == "kvref":
        return [KVRefEngine(model, layout, n, args.kv_dtype) for model in kvref_models(args, spec)
                for layout in (args.layout or LAYOUTS)]
    if name == "transformers":
        from ..loader import resolve
        from .hf_engine import HFEngine

        return [HFEngine(resolve(args.model), n)]  # org/name: the cached folder, never a download
    if name == "llama-cpp-python":
        from ..loader import model_path
        from .llama_engine import LlamaCppEngine

        flash = {"auto": None, "on": True, "off": False}[args.flash_attn]
        return [LlamaCppEngine(model_path(args.model), spec.vocab_size, n, swa_full=args.swa_full, flash_attn=flash)]
    from .http_engine import OpenAIHTTPEngine

    return [OpenAIHTTPEngine(args.url, spec, precision=args.precision, api_key=args.api_key)]


def _is_folder(model) -> bool:
    from ..errors import ModelNotFoundError
    from ..loader import resolve

    try:
        return resolve(model).is_dir()
    except ModelNotFoundError:
        return False


def check_arguments(args) -> None:
    """What an engine needs, checked before any model loads."""
    if args.engine == "transformers" and (args.model is None or not _is_folder(args.model)):
        raise ConformanceError("the transformers engine needs -m <Hugging Face checkpoint directory> (or org/name "
                               "in the local Hugging Face cache)")
    if args.engine == "openai-http" and not args.url:
        raise ConformanceError("the openai-http engine needs --url http://host:port (the server's base URL)")
    if args.engine != "openai-http" and (args.url or args.api_key):
        raise ConformanceError(f"--url and --api-key apply to openai-http only, not to {args.engine}")
    if args.engine != "llama-cpp-python" and (args.flash_attn != "auto" or args.swa_full):
        raise ConformanceError(f"--flash-attn and --swa-full apply to llama-cpp-python only, not to {args.engine}")
    if args.engine != "kvref" and args.backend != "auto":
        raise ConformanceError("--backend applies to the kvref engine only; the spec always runs on numpy")
    if args.engine != "openai-http" and args.precision != "float32":
        raise ConformanceError(f"--precision applies to openai-http only; {args.engine} states its own")
    if args.engine != "kvref" and (args.layout or args.kv_dtype):
        raise ConformanceError(f"--layout and --kv-dtype apply to the kvref engine only, not to {args.engine}")
    unknown = sorted(set(args.check or ()) - set(CHECKS))
    if unknown:
        raise ConformanceError(f"no check named {', '.join(unknown)}; the checks are {', '.join(CHECKS)}")


def run_conformance(args) -> int:
    check_arguments(args)
    model = spec_model(args.model)
    spec = Spec(model)
    plan = make_plan(model, args.suite)
    model_name = str(args.model or "smollm2")
    reports, payloads, runs = [], [], []
    for engine in engines_for(args, spec):
        try:
            results = run_suite(engine, spec, plan, args.check,
                                progress=lambda name: print(f"kvref conformance: {name} ...", file=sys.stderr,
                                                            flush=True))
        finally:
            engine.close()
        print(table(results, engine.describe()), flush=True)
        print()
        reports.append(markdown(results, engine.describe(), model_name))
        payloads.append(to_json(results, engine.describe(), model_name, plan))
        runs.append(results)
    print(verdict(runs))
    if args.report:
        Path(args.report).write_text("\n".join(reports))
    if args.json:
        Path(args.json).write_text(payloads[0] if len(payloads) == 1 else "[" + ",\n".join(payloads) + "]")
    return 1 if any(failed(results) for results in runs) else 0


def run_fixtures(args) -> int:
    from .fixtures import export

    if args.backend == "c":
        raise ConformanceError("fixtures come from the float32 NumPy spec; --backend c does not apply")
    model = spec_model(args.model)
    written = export(model, args.directory, make_plan(model, args.suite).prompts, str(args.model or "smollm2"))
    for path in written:
        print(path)
    return 0
