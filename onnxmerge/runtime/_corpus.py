"""Many inputs through ``generate()``: read ahead, sort by length, cut batches, run them (several
at once if asked), restore order.

CTranslate2's ``translate_batch`` and ``translate_iterable`` batch this way: inputs of similar
length go together, so little of a batch is padding, and a budget of examples or of padded tokens
bounds each batch. A result is cut back to what ``generate()`` returns for its input alone: a
row in a batch runs on (padded) until the batch's last row ends.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from onnxmerge.errors import GenerationError

if TYPE_CHECKING:
    from concurrent.futures import Future

T = TypeVar("T")
R = TypeVar("R")

BATCH_TYPES = ("examples", "tokens")
# Inputs read ahead, in batches' worth: enough for sorting to group similar lengths (CTranslate2
# reads 16 batches ahead as well).
READ_AHEAD_BATCHES = 16


class Stopped(Exception):
    """Raised in a call of ``ordered_map`` whose caller has left: nothing reads its result."""


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise GenerationError(
            f"{name} must be an integer, got {type(value).__name__}", argument=name
        )
    if value < 1:
        raise GenerationError(f"{name} must be at least 1, got {value}", argument=name)


def check_batching(max_batch_size: Any, batch_type: Any, parallel_batches: Any = 1) -> None:
    _check_count("max_batch_size", max_batch_size)
    _check_count("parallel_batches", parallel_batches)
    if batch_type not in BATCH_TYPES:
        raise GenerationError(
            f"batch_type must be one of {', '.join(map(repr, BATCH_TYPES))}, got {batch_type!r}: "
            "'examples' counts inputs per batch, 'tokens' the padded batch's source tokens",
            argument="batch_type",
        )


def windows(
    items: Iterable[Any], lengths: Any, max_batch_size: int, batch_type: str
) -> Iterator[list[Any]]:
    """``items`` in consecutive lists of about ``READ_AHEAD_BATCHES`` batches' worth;
    ``lengths(item)`` is an item's length in tokens."""
    budget = max_batch_size * READ_AHEAD_BATCHES
    window: list[Any] = []
    used = 0
    for item in items:
        window.append(item)
        used += lengths(item) if batch_type == "tokens" else 1
        if used >= budget:
            yield window
            window, used = [], 0
    if window:
        yield window


def cut_batches(
    lengths: Sequence[int],
    keys: Sequence[Any],
    max_batch_size: int,
    batch_type: str,
    parallel: int = 1,
) -> list[list[int]]:
    """Indices of each batch: longest first, only equal ``keys`` together, each batch within the
    budget (``tokens``: rows times the longest row); an input over the budget goes alone.

    With ``parallel`` batches at once and ``examples``, each key's inputs are cut into a
    multiple of ``parallel`` batches of sizes that differ by one at most: cut full, the last
    batch of a window would run alone while the other threads wait (5 batches of 300 inputs at
    64 keep one of two threads busy for the fifth)."""
    order = sorted(range(len(lengths)), key=lambda i: (keys[i], -lengths[i]))
    batches: list[list[int]] = []
    for _, group in itertools.groupby(order, key=keys.__getitem__):
        items = list(group)
        if batch_type == "examples" and parallel > 1:
            batches += _balanced(items, max_batch_size, parallel)
        else:
            batches += _within_budget(items, lengths, max_batch_size, batch_type)
    return batches


def _within_budget(
    items: list[int], lengths: Sequence[int], most: int, batch_type: str
) -> list[list[int]]:
    """``items`` in order, each batch taking the next while the budget holds it."""
    batches: list[list[int]] = []
    for i in items:
        if batches:
            rows = len(batches[-1]) + 1
            size = rows if batch_type == "examples" else rows * lengths[batches[-1][0]]
            if size <= most:
                batches[-1].append(i)
                continue
        batches.append([i])
    return batches


def _balanced(items: list[int], most: int, parallel: int) -> list[list[int]]:
    """``items`` in order, cut into the fewest batches of at most ``most`` whose count is a
    multiple of ``parallel`` (or one per item), the first ones a row larger where they differ."""
    count = -(-len(items) // most)
    count = min(-(-count // parallel) * parallel, len(items))
    size, larger = divmod(len(items), count)
    starts = [b * size + min(b, larger) for b in range(count + 1)]
    return [items[start:end] for start, end in itertools.pairwise(starts)]


def pad_right(arrays: Sequence[np.ndarray], value: int) -> np.ndarray:
    """Rows ``[1, n_i]`` stacked into ``[rows, max n_i]``, filled with ``value`` on the right."""
    width = max(a.shape[1] for a in arrays)
    out = np.full((len(arrays), width), value, dtype=arrays[0].dtype)
    for row, array in enumerate(arrays):
        out[row, : array.shape[1]] = array[0]
    return out


def own_length(sequences: np.ndarray, prompt_len: int, eos: Sequence[int] | None) -> int:
    """The length ``generate()`` gives these sequences (one input's) alone: each ends at its
    first generated eos, or runs to the end; the longest decides."""
    if eos is None or not len(eos) or sequences.shape[1] <= prompt_len:
        return sequences.shape[1]
    ended = np.isin(sequences[:, prompt_len:], np.asarray(eos))
    ends = np.where(ended.any(axis=1), ended.argmax(axis=1) + prompt_len + 1, sequences.shape[1])
    return int(ends.max())


def ordered_map(
    function: Callable[[T], R],
    items: Iterable[T],
    parallel: int,
    stop: threading.Event | None = None,
) -> Generator[R, None, None]:
    """``map(function, items)``, with up to ``parallel`` calls at once on threads of their own.

    Items are read and results yielded on the caller's thread, in order. A few items are
    queued beyond those running, so a thread that finishes early starts the next at once rather
    than wait for the oldest. An error from ``items`` is raised after the results of the items
    before it; one from ``function`` when its result is due, and the queued calls are dropped.
    Where the caller leaves before the last result (an error, ``close()``, Ctrl-C), ``stop`` is
    set before the running calls are waited for, so that calls which watch it can end early
    (raising ``Stopped``).
    """
    if parallel <= 1:
        yield from map(function, items)
        return
    pending: deque[Future[R]] = deque()
    iterator = iter(items)
    finished = False
    # Imported here: a process that never runs batches side by side does without it.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(parallel, thread_name_prefix="onnxmerge-batch") as pool:
        try:
            while True:
                try:
                    item = next(iterator)
                except StopIteration:
                    break
                except Exception:
                    while pending:
                        yield pending.popleft().result()
                    raise
                pending.append(pool.submit(function, item))
                if len(pending) > 2 * parallel:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
            finished = True
        finally:
            if stop is not None and not finished:
                stop.set()
            for future in pending:
                future.cancel()
