"""What every model's worker shares: a bounded queue of requests, each with the future of its
answer, and one thread that runs them off the event loop."""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, Protocol, TypeVar

from onnxmerge.serve._metrics import Metrics
from onnxmerge.serve._models import RequestError, ServedModel


class Waiting(Protocol):
    """A request in a queue: the future its answer is set on."""

    future: asyncio.Future


Request = TypeVar("Request", bound=Waiting)


class ModelQueue(Generic[Request]):
    """The waiting requests of one model and its worker; subclasses run them (``_work``)."""

    def __init__(self, served: ServedModel, metrics: Metrics, *, max_queue: int):
        self.served = served
        self._metrics = metrics
        self._max_queue = max_queue
        self._waiting: deque[Request] = deque()
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"onnxmerge-{served.name}")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._work())

    async def _work(self) -> None:
        raise NotImplementedError

    async def _stop(self, unfinished: list[Request]) -> None:
        """Stop the worker; ``unfinished`` and every waiting request are answered 503."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for request in [*unfinished, *self._waiting]:
            if not request.future.done():
                request.future.set_exception(RequestError("the server is shutting down", 503))
        self._waiting.clear()
        self._executor.shutdown(wait=True)

    def _enqueue(self, request: Request) -> None:
        """Queue ``request`` and wake the worker.

        Raises:
            RequestError: 429 when ``max_queue`` requests are waiting already.
        """
        self._drop_abandoned()
        if len(self._waiting) >= self._max_queue:
            raise RequestError(
                f"too many requests waiting for model {self.served.name!r} "
                f"({self._max_queue}); retry later",
                429,
                {"Retry-After": "1"},
            )
        self._waiting.append(request)
        self._queue_changed()
        self._arrived.set()

    def _drop_abandoned(self) -> None:
        """Requests past their deadline or whose client left (their future done) leave unrun."""
        if any(request.future.done() for request in self._waiting):
            self._waiting = deque(r for r in self._waiting if not r.future.done())
            self._queue_changed()

    def _queue_changed(self) -> None:
        self._metrics.queue_depth.labels(self.served.name).set(len(self._waiting))
