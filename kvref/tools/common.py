"""What the kvref subcommands share: the model arguments, the number types, byte sizes for people,
the progress line and the machine's free memory.

cli.py (the `kvref` command and most subcommands) and bench.py (`kvref bench`) both use these, so
they live below both: cli registers bench's subcommand, and bench never imports cli.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..backends import PROGRAM_ACTIVATIONS, default_activations


def add_model_arguments(p):
    p.add_argument("-m", "--model", help="GGUF file, Hugging Face checkpoint directory, short name (smollm2, "
                                         "gemma3-270m) or org/name in the local Hugging Face cache (`kvref "
                                         "models` lists them); default: $KVREF_MODEL, else SmolLM2-135M-Instruct")
    p.add_argument("--backend", default="auto", choices=["auto", "numpy", "c"],
                   help="auto (default): the C kernels when built, else the NumPy spec")


def add_activations_argument(p):
    """--exact, for the commands that run a model for speed (run, chat, serve, bench, perplexity)."""
    default = {"auto": "the C forward rounds each projection's input to 8-bit blocks, as llama.cpp does",
               "int8": "8-bit blocks", "float32": "float32"}[PROGRAM_ACTIVATIONS]
    p.add_argument("--exact", action="store_true",
                   help=f"float32 activations: every projection reads its input unrounded (default: "
                        f"$KVREF_ACTIVATIONS, else {default})")


def activations(args) -> str:
    """The activation mode of a program's model: float32 with --exact, else KVREF_ACTIVATIONS, else the
    programs' default (kvref.backends.PROGRAM_ACTIVATIONS)."""
    return "float32" if args.exact else default_activations(PROGRAM_ACTIVATIONS)


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


def plural(n, word) -> str:
    """'1 thread', '2 threads', '1,024 tokens'; an unknown count (None) says so."""
    return f"{word}s: unknown" if n is None else f"{n:,} {word}{'' if n == 1 else 's'}"


def line_editing(stream) -> bool:
    """Line editing and history for input() (arrow keys, Ctrl-R) through the stdlib readline, where the
    interpreter has it and `stream` is a terminal; False otherwise: input() then reads plain lines. The
    import is the whole hook, so only an interactive command calls this (a pipe needs none of it)."""
    if not stream.isatty():
        return False
    try:
        import readline  # noqa: F401  (importing it makes input() edit lines and keep a history)
    except ImportError:  # Windows, or a Python built without it
        return False
    return True


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
