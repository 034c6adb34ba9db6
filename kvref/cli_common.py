"""What the kvref subcommands share: the model arguments, the count type, byte sizes for people.

cli.py (the `kvref` command and most subcommands) and bench.py (`kvref bench`) both use these, so
they live below both: cli registers bench's subcommand, and bench never imports cli.
"""

from __future__ import annotations

import argparse


def add_model_arguments(p):
    p.add_argument("-m", "--model", help="GGUF file (default: $KVREF_MODEL, else SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default="auto", choices=["auto", "numpy", "c"])


def count(text: str) -> int:
    """argparse type: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
