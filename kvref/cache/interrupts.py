"""Ctrl-C held while a cache's bookkeeping changes, so that a commit or an abort never stops half made."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_deferring = False  # a sigint_deferred block is open (in the main thread, the only one that defers)


@contextmanager
def sigint_deferred():
    # Hold Ctrl-C until the block ends, then deliver it as usual. Python runs signal handlers in the
    # main thread only, so only there can a KeyboardInterrupt split the block; the handler installed
    # meanwhile just notes the signal. A block inside another one is already covered by it.
    global _deferring
    if _deferring or threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)
