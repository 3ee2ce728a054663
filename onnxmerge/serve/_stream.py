"""``POST /v1/generate`` with ``"stream": true``: Server-Sent Events, one per new id, as the
runtime's search gives them (``TextGenerator.stream_tokens``).

A stream runs alone, not in a batch: its steps run on a thread of the pool, one at a time as
the response is sent, beside the batching worker (onnxruntime runs a session's calls
concurrently). A client that leaves stops it: the next event cannot be sent, and the search
is closed between steps.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Generator
from typing import Any

import anyio
import numpy as np
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from onnxmerge.runtime import TextGenerator
from onnxmerge.serve._batcher import failed
from onnxmerge.serve._metrics import Metrics
from onnxmerge.serve._models import LockedTokenizer, RequestError, ServedModel

_Pieces = Generator[tuple[int | None, str | None], None, None]
_END = object()


def _pieces(served: ServedModel, example: Any, options: dict[str, Any]) -> _Pieces:
    """(id, text piece) per new id; the piece is None for a model without a tokenizer."""
    inputs = (
        {name: value[None] for name, value in example.items()}
        if isinstance(example, dict)
        else {"input_ids": example[None]}
    )
    if served.tokenizer is None:
        for step in served.model.stream(inputs, **options):
            for token in step.get(0, np.empty(0, np.int64)).tolist():
                yield token, None
        return
    tokenizer = LockedTokenizer(served.tokenizer, served.tokenizer_lock)
    yield from TextGenerator(served.model, tokenizer).stream_tokens(inputs, **options)


class _Steps:
    """A search's pieces, stepped from the event loop on pool threads, closed between steps."""

    def __init__(self, pieces: _Pieces):
        self._pieces = pieces
        self._lock = threading.Lock()

    def _next(self) -> Any:
        with self._lock:
            return next(self._pieces, _END)

    def _close(self) -> None:
        with self._lock:  # after a step running now: a generator cannot close while it runs
            self._pieces.close()

    async def next(self) -> Any:
        return await run_in_threadpool(self._next)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):  # also when the response was cancelled
            await run_in_threadpool(self._close)


async def stream_response(
    served: ServedModel, example: Any, options: dict[str, Any], metrics: Metrics
) -> StreamingResponse:
    """The SSE response of one request; a bad setting is a 400 before the response starts.

    Raises:
        RequestError: 400 for settings or inputs the model refuses.
    """
    if int(options.get("num_return_sequences") or 1) != 1:
        raise RequestError("a stream gives one sequence: leave out num_return_sequences")
    steps = _Steps(_pieces(served, example, options))
    try:
        first = await steps.next()  # checks the settings: the first step runs
    except Exception as error:
        await steps.close()
        raise failed(error) from error

    async def events() -> AsyncIterator[str]:
        item = first
        try:
            while item is not _END:
                token, piece = item
                if token is not None:
                    metrics.new_tokens.labels(served.name).inc()
                yield f"data: {json.dumps({'token': token, 'text': piece})}\n\n"
                try:
                    item = await steps.next()
                except Exception as error:  # the answer has begun: its status is sent
                    yield f"data: {json.dumps({'error': str(failed(error))})}\n\n"
                    return
            yield "data: [DONE]\n\n"
        finally:
            await steps.close()

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
