"""Whisper models' transcriptions: one queue per model, each recording run alone (long-form
decoding does not batch recordings together) on a thread of its own, in arrival order, so the
event loop keeps answering while one runs."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxmerge.serve._batcher import failed
from onnxmerge.serve._metrics import Metrics
from onnxmerge.serve._model_queue import ModelQueue
from onnxmerge.serve._models import LockedTokenizer, ServedModel

logger = logging.getLogger(__name__)


class _Abandoned(Exception):
    """Raised between windows once the request has left (its deadline, or its client)."""


@dataclass
class Recording:
    """One request's audio, its ``transcribe()`` settings and the future of its answer."""

    audio: np.ndarray
    rate: int
    options: dict[str, Any]
    future: asyncio.Future
    # Set on the event loop when the future is done; read between windows by the worker.
    left: threading.Event = field(default_factory=threading.Event)


class Transcriber(ModelQueue[Recording]):
    """The queue and the worker of one Whisper model."""

    def __init__(self, served: ServedModel, metrics: Metrics, *, max_queue: int):
        super().__init__(served, metrics, max_queue=max_queue)
        self._running: Recording | None = None

    async def stop(self) -> None:
        # The running recording stops at its next window; the waiting ones are not run.
        await self._stop([self._running] if self._running is not None else [])

    def submit(self, audio: np.ndarray, rate: int, options: dict[str, Any]) -> asyncio.Future:
        """Queue a recording; its future gets a ``Transcription`` or a :class:`RequestError`.

        Raises:
            RequestError: 429 when ``max_queue`` recordings are waiting already.
        """
        recording = Recording(audio, rate, options, asyncio.get_running_loop().create_future())
        self._enqueue(recording)
        recording.future.add_done_callback(lambda _: recording.left.set())
        return recording.future

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            recording = self._waiting.popleft()
            self._queue_changed()
            if recording.future.done():  # left while it waited
                continue
            self._running = recording
            try:
                result = await loop.run_in_executor(self._executor, self._run, recording)
            except _Abandoned:
                continue
            except Exception as error:  # the worker must outlive any recording
                result = failed(error)
            finally:
                self._running = None
            if recording.future.done():
                continue
            if isinstance(result, BaseException):
                recording.future.set_exception(result)
            else:
                recording.future.set_result(result)

    def _run(self, recording: Recording) -> Any:
        """Transcribe on the worker's thread; stops between windows once the request left."""
        from onnxmerge.runtime.speech import transcribe

        def heard(done: float, total: float) -> None:
            if recording.left.is_set():
                raise _Abandoned

        served = self.served
        tokenizer = LockedTokenizer(served.tokenizer, served.tokenizer_lock)
        result = transcribe(
            served.model,
            recording.audio,
            recording.rate,
            tokenizer=tokenizer,
            progress=heard,
            **recording.options,
        )
        self._metrics.new_tokens.labels(served.name).inc(
            sum(len(segment.tokens) for segment in result.segments)
        )
        return result
