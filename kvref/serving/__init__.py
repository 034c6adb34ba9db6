"""`kvref serve`: an OpenAI-compatible HTTP server on continuous batching and the paged prefix cache.

    pip install ".[serve]" && kvref serve            # http://127.0.0.1:8080/v1, the default model

Three layers, each usable alone:

    protocol.py  request bodies checked field by field into a Spec (RequestError -> HTTP 400)
    engine.py    one thread (EngineThread) that owns a kvref.generation.batch.Engine (prefix reuse, chunked prefill,
                 preemption, n > 1 by copy-on-write forks) and turns its tokens into text events
    app.py       the Starlette app: routes, server-sent events, /metrics, API key, body limit

The server is above the API (DESIGN.md): it uses Model, the paged cache and the Scheduler as any other
program would, and nothing in kvref imports it. Its dependencies (starlette, uvicorn) come with the
`serve` extra; the core package does not need them.
"""

from __future__ import annotations

import dataclasses
import socket

from . import engine as _engine
from .engine import EngineThread, Job
from .protocol import Limits, Spec


def create_server(model, model_name: str, *, host="127.0.0.1", port=8080, max_batch=8, num_blocks=None,
                  block_size=16, kv_dtype=None, prefill_chunk=256, api_key=None, limits: Limits = Limits(),
                  max_body_bytes=None, log_level="info", shutdown_timeout=10.0):
    """A uvicorn Server running the app over a new EngineThread (not started: call .run(), or .run(sockets=[s])).

    On SIGTERM or Ctrl-C it stops accepting connections, lets the requests in flight finish for up to
    shutdown_timeout seconds, then cancels the rest (their streams end, their sequences leave the batch)."""
    import uvicorn

    from .app import MAX_BODY_BYTES, create_app

    # n sequences of one request run side by side, so n cannot exceed the batch
    limits = dataclasses.replace(limits, max_n=min(limits.max_n, max_batch))
    engine = EngineThread(model, max_batch=max_batch, num_blocks=num_blocks, block_size=block_size, kv_dtype=kv_dtype,
                    prefill_chunk=prefill_chunk)
    app = create_app(model, engine, model_name, api_key=api_key, limits=limits,
                     max_body_bytes=MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout)
    server = uvicorn.Server(config)
    server.engine = engine
    return server


def bind(host="127.0.0.1", port=0) -> socket.socket:
    """A listening socket (port 0: a free port, read back with getsockname()) for Server.run(sockets=[...])."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def __getattr__(name):
    if name == "Engine":  # deprecated: kvref.serving.EngineThread
        return _engine.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EngineThread", "Job", "Limits", "Spec", "bind", "create_server"]
