"""Concurrent requests for one model, run together: one worker per model takes the requests
waiting in its queue (up to ``max_batch_size`` inputs of the same generation options, waiting
at most ``batch_wait_s`` for company) and runs them through ``generate_many`` on a thread of its
own, so the event loop keeps answering while a batch runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxmerge.errors import OnnxMergeError
from onnxmerge.serve._metrics import Metrics
from onnxmerge.serve._model_queue import ModelQueue
from onnxmerge.serve._models import RequestError, ServedModel

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """One request's inputs, generation options and the future its answer is set on."""

    inputs: list[Any]  # each a 1-D array of ids or a mapping of encoder inputs
    options: dict[str, Any]
    want_text: bool
    future: asyncio.Future
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = json.dumps(self.options, sort_keys=True)


@dataclass
class Answer:
    """Per input: its rows of ids (``[num_return_sequences, length]``) and their texts."""

    rows: list[np.ndarray]
    texts: list[list[str]] | None


def failed(error: Exception) -> RequestError:
    """A failed run as its request's answer: 400 for an input the model refuses, 500 for
    anything else (logged; the message says no more than the kind of error)."""
    if isinstance(error, (OnnxMergeError, ValueError)):
        return RequestError(str(error))
    logger.error("generation failed: %r", error)
    return RequestError(f"generation failed ({type(error).__name__})", 500)


class Batcher(ModelQueue[Job]):
    """The queue and the batching worker of one model."""

    def __init__(
        self,
        served: ServedModel,
        metrics: Metrics,
        *,
        max_batch_size: int,
        batch_wait_s: float,
        max_queue: int,
    ):
        super().__init__(served, metrics, max_queue=max_queue)
        self._max_batch_size = max_batch_size
        self._batch_wait_s = batch_wait_s

    async def stop(self) -> None:
        await self._stop([])

    def submit(self, inputs: list[Any], options: dict[str, Any], want_text: bool) -> asyncio.Future:
        """Queue a request; its future gets an :class:`Answer` or a :class:`RequestError`.

        Raises:
            RequestError: 429 when ``max_queue`` requests are waiting already.
        """
        job = Job(inputs, options, want_text, asyncio.get_running_loop().create_future())
        self._enqueue(job)
        # A request that leaves (its deadline) wakes the worker, which drops it from its batch.
        job.future.add_done_callback(lambda _: self._arrived.set())
        return job.future

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            if not batch:
                continue
            try:
                answers = await loop.run_in_executor(self._executor, self._run, batch)
            except Exception as error:  # the worker must outlive any batch
                logger.exception("a batch of model %r failed", self.served.name)
                answers = [failed(error)] * len(batch)
            for job, answer in zip(batch, answers, strict=True):
                if job.future.done():  # its deadline passed while it ran
                    continue
                if isinstance(answer, BaseException):
                    job.future.set_exception(answer)
                else:
                    job.future.set_result(answer)

    async def _collect(self) -> list[Job]:
        """The next batch: the oldest request, then those with its options that fit, arriving
        within the batching window. Requests past their deadline leave it before it runs; an
        empty batch means every request in it left."""
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        self._drop_abandoned()
        if not self._waiting:
            return []
        first = self._waiting.popleft()
        self._queue_changed()
        batch = [first]
        deadline = time.monotonic() + self._batch_wait_s
        while True:
            batch = [job for job in batch if not job.future.done()]
            size = sum(len(job.inputs) for job in batch)
            if not batch or size >= self._max_batch_size:
                break
            for job in list(self._waiting):
                fits = size + len(job.inputs) <= self._max_batch_size
                if job.key == first.key and fits and not job.future.done():
                    self._waiting.remove(job)
                    batch.append(job)
                    size += len(job.inputs)
            left = deadline - time.monotonic()
            if size >= self._max_batch_size or left <= 0:
                break
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
        self._queue_changed()
        return batch

    def _run(self, batch: list[Job]) -> list[Answer | BaseException]:
        """Run a batch on the worker's thread; where it fails, each request alone, so that an
        error is its own request's."""
        self._metrics.batch_size.labels(self.served.name).observe(
            sum(len(job.inputs) for job in batch)
        )
        try:
            flat = [example for job in batch for example in job.inputs]
            owners = [job for job in batch for _ in job.inputs]
            rows = self._generate(flat, batch[0].options, owners)
        except Exception as error:
            if len(batch) == 1:
                return [failed(error)]
            return [answer for job in batch for answer in self._run([job])]
        answers: list[Answer | BaseException] = []
        start = 0
        for job in batch:
            own = rows[start : start + len(job.inputs)]
            start += len(job.inputs)
            texts = [self.served.decode(r) for r in own] if job.want_text else None
            answers.append(Answer(own, texts))
        return answers

    def _generate(
        self, inputs: list[Any], options: dict[str, Any], owners: list[Job]
    ) -> list[np.ndarray]:
        """The batch's rows; an input whose request left (its client, or its deadline: the
        future is done) leaves the running batch at its next step."""
        model = self.served.model
        rows = list(
            model.generate_many(
                inputs,
                max_batch_size=self._max_batch_size,
                abandoned=lambda index: owners[index].future.done(),
                **options,
            )
        )
        prompt = 1  # every row starts with the decoder start token
        self._metrics.new_tokens.labels(self.served.name).inc(
            sum(int(r.shape[0] * (r.shape[1] - prompt)) for r in rows)
        )
        return rows
