"""uvicorn around the app, draining on SIGTERM: new requests get 503 (``/health`` too), the
requests in flight finish within ``drain_s``, then the server exits."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any, cast

import uvicorn

from onnxmerge.errors import InvalidArgumentError
from onnxmerge.serve._app import ServerState, create_app
from onnxmerge.serve._limits import LIMIT_NAMES


class Server(uvicorn.Server):
    """A uvicorn server over an app of :func:`create_app` that drains before it exits.

    The first SIGTERM or SIGINT starts the drain; a second one exits at once.
    ``stopped_by`` is the signal that ended it (None when it ended otherwise).
    """

    def __init__(self, config: uvicorn.Config, drain_s: float):
        super().__init__(config)
        self.drain_s = drain_s
        self.stopped_by: int | None = None
        self._drain_until: float | None = None
        self.state: ServerState = cast(Any, config.app).state.serve

    def drain(self) -> None:
        """Stop taking requests and exit once those in flight are answered (at most
        ``drain_s`` from now). Safe to call from a signal handler or another thread."""
        self.state.draining = True
        if self._drain_until is None:
            self._drain_until = time.monotonic() + self.drain_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Start draining on the first signal; a second one exits at once."""
        if self._drain_until is not None:  # a second signal: no more waiting
            self.should_exit = True
            self.force_exit = True
            return
        self.stopped_by = sig
        self.drain()

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's periodic check: exit once draining is done or its time is up."""
        if await super().on_tick(counter):
            return True
        if self.state.load_error is not None:
            return True
        if self._drain_until is None:
            return False
        return self.state.in_flight == 0 or time.monotonic() >= self._drain_until


def run(
    models: Mapping[str, str | os.PathLike],
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    drain_s: float = 30.0,
    sock: socket.socket | None = None,
    log_level: str = "info",
    **limits: Any,
) -> int | None:
    """Serve ``models`` over HTTP until SIGTERM or SIGINT, then drain and return.

    Args:
        models: served name -> merged file or export folder, as for :func:`create_app`.
        host: the address to bind; the default answers this machine only.
        port: the port (0: one the system picks).
        drain_s: how long requests in flight may take to finish after the signal.
        sock: a bound socket to serve on instead of ``host`` and ``port``.
        log_level: uvicorn's log level.
        **limits: :func:`create_app`'s limits (``max_batch_size``, ``batch_wait_ms``,
            ``max_queue``, ``max_body_bytes``, ``request_timeout_s``, ``api_key``) and
            ``threads``.

    Returns:
        The signal that ended the server (``signal.SIGTERM``), or None.

    Raises:
        InvalidArgumentError: a bad model, limit or option; nothing is loaded.
        Exception: what loading a model raised (the server stops).
    """
    unknown = sorted(set(limits) - set(LIMIT_NAMES))
    if unknown:
        raise InvalidArgumentError(
            f"unknown limits {unknown}; the limits are {', '.join(LIMIT_NAMES)}",
            argument=unknown[0],
        )
    if not isinstance(drain_s, (int, float)) or isinstance(drain_s, bool) or drain_s < 0:
        raise InvalidArgumentError(
            f"drain_s must be at least 0, got {drain_s!r}", argument="drain_s"
        )
    app = create_app(models, **limits)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # The drain has waited drain_s for the requests already; what is left is cut off.
        timeout_graceful_shutdown=1,
        lifespan="on",
    )
    server = Server(config, drain_s)
    server.run(sockets=[sock] if sock is not None else None)
    if server.state.load_error is not None:
        raise server.state.load_error
    return server.stopped_by


__all__ = ["Server", "run"]
