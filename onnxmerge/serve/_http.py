"""What every request passes through before its route: the draining gate, the body-size limit
and the metrics of requests by route and status."""

from __future__ import annotations

import json
import time
from typing import Any

from onnxmerge.serve._metrics import Metrics

# Routes counted under their own path; anything else is "other", so that a scan of made-up paths
# cannot grow the metrics without bound.
ROUTES = frozenset(
    {
        "/health",
        "/metrics",
        "/translate",
        "/languages",
        "/v1/generate",
        "/v1/models",
        "/v1/audio/transcriptions",
    }
)
# Answered while draining, and not counted as work in flight.
_PROBES = frozenset({"/health", "/metrics"})
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


async def send_json(send: Any, status: int, body: dict, headers: dict[str, str] | None = None):
    payload = json.dumps(body).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})


class Gate:
    """ASGI middleware: 503 while draining, 413 past ``max_body_bytes``, and the counts.

    ``state`` is the app's :class:`ServerState` (``draining`` and ``in_flight`` are read and
    written here, on the event loop only)."""

    def __init__(self, app: Any, state: Any, metrics: Metrics, max_body_bytes: int):
        self.app = app
        self.state = state
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else "other"
        status = [500]

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        probe = path in _PROBES
        started = time.perf_counter()
        if not probe:
            self.state.in_flight += 1
            self.metrics.in_flight.inc()
        try:
            await self._answer(scope, receive, counted_send, probe)
        finally:
            if not probe:
                self.state.in_flight -= 1
                self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)

    async def _answer(self, scope: dict, receive: Any, send: Any, probe: bool) -> None:
        if self.state.draining and not probe:
            await send_json(send, 503, {"error": "the server is shutting down"})
            return
        if scope["method"] not in _WITH_BODY:
            await self.app(scope, receive, send)
            return
        body = await self._read_body(scope, receive)
        if body is None:
            await send_json(
                send,
                413,
                {"error": f"the request body is larger than {self.max_body_bytes} bytes"},
            )
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect

        await self.app(scope, replay, send)

    async def _read_body(self, scope: dict, receive: Any) -> bytes | None:
        """The whole body, or None once it is past the limit (the rest is not read)."""
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit():
                if int(value) > self.max_body_bytes:
                    return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
