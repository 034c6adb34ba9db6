"""What the kvref subcommands share: the model arguments, the number types, byte sizes for people,
the progress line and the machine's free memory.

cli.py (the `kvref` command and most subcommands) and bench.py (`kvref bench`) both use these, so
they live below both: cli registers bench's subcommand, and bench never imports cli.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..backends import DEFAULT_ACTIVATIONS


def add_model_arguments(p):
    p.add_argument("-m", "--model", help="GGUF file, Hugging Face checkpoint directory, short name (smollm2, "
                                         "gemma3-270m) or org/name in the local Hugging Face cache (`kvref "
                                         "models` lists them); default: $KVREF_MODEL, else SmolLM2-135M-Instruct")
    p.add_argument("--backend", default="auto", choices=["auto", "numpy", "c"],
                   help="auto (default): the C kernels when built, else the NumPy spec")


def add_activations_argument(p):
    """--exact, for the commands that run a model for speed (run, chat, serve, bench, perplexity)."""
    other = "8-bit blocks, as llama.cpp rounds them" if DEFAULT_ACTIVATIONS == "int8" else "float32"
    p.add_argument("--exact", action="store_true",
                   help=f"float32 activations: every projection of the C forward reads its input unrounded "
                        f"(default: $KVREF_ACTIVATIONS, else {other})")


def activations(args) -> str | None:
    """The activation mode --exact asks for; None: the default (kvref.backends.default_activations)."""
    return "float32" if args.exact else None


def count(text: str) -> int:
    """argparse type: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def count_in(low: int, high: int | None = None):
    """argparse type: a whole number in [low, high] (argparse names the flag in its message)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: expected a whole number >= {low}"
                                             + ("" if high is None else f" and <= {high}"))
        return value

    return parse


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable); None when unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Progress:
    """One self-overwriting status line on stderr, only when stderr is a terminal (never in a pipe).

    label: the line's prefix ("kvref bench"); after: seconds to wait from creation before the
    first line shows, so work that ends sooner prints nothing.
    """

    def __init__(self, enabled=None, stream=None, label="kvref", after=0.0):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label = label
        self._start = time.monotonic()
        self._after = after
        self._last = 0.0
        self._width = 0

    def __call__(self, text, force=False):
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._start >= self._after and (force or now - self._last >= 0.1):
            self._last = now
            line = f"{self.label}: {text}"
            self.stream.write("\r" + line.ljust(self._width))
            self.stream.flush()
            self._width = len(line)

    def done(self):
        """Erase the line, so what follows starts at the left margin of a clean line."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
