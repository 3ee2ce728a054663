"""The limits a server runs under, checked before anything is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from onnxmerge.errors import InvalidArgumentError


@dataclass(frozen=True)
class Limits:
    """How much a server takes on.

    Attributes:
        max_batch_size: inputs run together in one batch, at most.
        batch_wait_ms: how long the oldest waiting request waits for company before its batch
            runs.
        max_queue: requests waiting for a batch, per model; past it a request gets 429.
        max_body_bytes: a larger request body gets 413.
        request_timeout_s: a request not answered by then gets 504 (and leaves the queue).
        api_key: when set, required (LibreTranslate's ``api_key`` field, ``Authorization:
            Bearer`` on ``/v1`` routes); 403 without it.
        threads: onnxruntime's intra-op threads of each model's session (None: onnxruntime's
            choice, one per core), as ``Seq2SeqModel(threads=)`` takes them.
        session_cache: a folder keeping onnxruntime's optimized graph of each merged file, as
            ``Seq2SeqModel(session_cache=)`` takes it: later starts load faster, and a float32
            model with a tied head runs greedy steps through the entry's int8 head. An export
            folder, merged into a new temporary folder at each start, opens without it.
            Kept as an absolute path: a Ray replica may start in another folder.
    """

    max_batch_size: int = 32
    batch_wait_ms: float = 5.0
    max_queue: int = 256
    max_body_bytes: int = 1_000_000
    request_timeout_s: float = 60.0
    api_key: str | None = None
    threads: int | None = None
    session_cache: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_queue", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(
                    f"{name} must be a whole number of at least 1, got {value!r}", argument=name
                )
        for name, lowest in (("batch_wait_ms", 0.0), ("request_timeout_s", 1e-3)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < lowest:
                raise InvalidArgumentError(
                    f"{name} must be a number of at least {lowest:g}, got {value!r}",
                    argument=name,
                )
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise InvalidArgumentError("api_key must be a non-empty string", argument="api_key")
        cache = self.session_cache
        if cache is not None:
            if not isinstance(cache, (str, os.PathLike)) or not os.fspath(cache):
                raise InvalidArgumentError(
                    f"session_cache must be a folder's path, got {cache!r}",
                    argument="session_cache",
                )
            cache = os.path.abspath(os.fspath(cache))
            if os.path.exists(cache) and not os.path.isdir(cache):
                raise InvalidArgumentError(
                    f"session_cache {cache} is a file; give a folder (it is made if missing)",
                    argument="session_cache",
                )
            object.__setattr__(self, "session_cache", cache)
        threads = self.threads
        if threads is not None and (
            not isinstance(threads, int) or isinstance(threads, bool) or threads < 1
        ):
            raise InvalidArgumentError(
                f"threads must be a whole number of at least 1 (or None), got {threads!r}",
                argument="threads",
            )


LIMIT_NAMES = tuple(f.name for f in fields(Limits))
