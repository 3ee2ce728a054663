"""A Ray session started for one operation and ended after it.

``ray.init`` installs a SIGTERM handler of its own in the main thread, and ``ray.shutdown`` leaves
it there: a process that converted models on Ray would afterwards exit on SIGTERM through Ray's
handler instead of its own. What started Ray puts the process's handlers back when it ends it.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The signals whose handlers a Ray session may change.
SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How the package starts Ray: its workers' output and Ray's info lines stay out of the caller's.
QUIET_INIT: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}


@contextmanager
def ray_session(address: str | None, **init_options: Any) -> Iterator[bool]:
    """Ray for the ``with`` block: this process's session if it has one (yields False, and ends
    nothing), else ``ray.init(address, **init_options)`` (yields True), ended on the way out
    with SIGINT's and SIGTERM's handlers as they were before it started.

    Ray must be importable: callers check it first, to raise their own install hint.
    """
    import ray

    if ray.is_initialized():
        yield False
        return
    kept = handlers()
    ray.init(address=address, **init_options)
    try:
        yield True
    finally:
        ray.shutdown()
        restore(kept)


def handlers() -> dict[int, Any]:
    """SIGINT's and SIGTERM's handlers now."""
    return {sig: signal.getsignal(sig) for sig in SIGNALS}


def restore(kept: dict[int, Any]) -> None:
    """Put back handlers :func:`handlers` returned (only the main thread can set them; None is
    a handler not set from Python, which cannot be set back)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in kept.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
