"""The one way onnxmerge opens an onnxruntime session, onnxruntime's type names as numpy's, the
processor facts that decide onnxruntime's kernels, and giving back the memory that loading a
session freed (Linux only; best effort elsewhere, where it does nothing).

A foundation module: the merge's checks and the runtime both open sessions through it, so nothing
here imports onnxruntime at module level."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# onnxruntime's type strings, as NodeArg.type gives them, to numpy dtypes.
ORT_TO_NUMPY = {
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(bool)": np.bool_,
}


def session_options(
    *, optimize: bool = True, threads: int | None = None, spinning: bool = True
) -> Any:
    """``onnxruntime.SessionOptions`` that log errors only.

    ``optimize=False`` runs the graph as written (a comparison must not test the optimiser);
    ``threads`` caps intra-op threads; ``spinning=False`` stops idle threads busy-waiting, which
    slows down torch running in the same process.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    # Each step is short and shape-changing: the memory-pattern planner does not pay off.
    options.enable_mem_pattern = False
    # onnxruntime warns about names it cannot rewrite inside If branches while optimizing; the
    # graph is still correct.
    options.log_severity_level = 3
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def open_session(
    source: str | os.PathLike | bytes,
    options: Any | None = None,
    providers: Sequence[Any] | None = None,
    *,
    mapped: bool = True,
) -> Any:
    """An ``onnxruntime.InferenceSession`` on a model file or its bytes; CPU unless told.

    Unless ``mapped`` is False, a file that holds its large weights inline is opened through
    its skeleton (:func:`mapped_skeleton`), so that onnxruntime maps those weights from inside
    the file instead of parsing them; ``options`` then has
    ``session.model_external_initializers_file_folder_path`` set to the file's folder (where the
    same options open a file in another folder, onnxruntime logs that it overwrites it). A
    session that saves its optimized graph (``optimized_model_filepath``) opens by path:
    onnxruntime resolves the data file it saves against that folder, not the saved model's.
    """
    import onnxruntime as ort

    options = options if options is not None else session_options()
    if not isinstance(source, bytes):
        source = os.fspath(source)
        skeleton = None
        if mapped and not options.optimized_model_filepath:
            skeleton = mapped_skeleton(source)
        if skeleton is not None:
            _set_config(options, _FOLDER_KEY, os.path.dirname(os.path.abspath(source)))
            source = skeleton
    session = ort.InferenceSession(
        source,
        sess_options=options,
        providers=list(providers) if providers else ["CPUExecutionProvider"],
    )
    if isinstance(source, bytes) and session.get_providers() == ["CPUExecutionProvider"]:
        # onnxruntime keeps the bytes for the session's life, to create it again on a fallback
        # provider when another provider fails; a session on the CPU alone never falls back.
        session._model_bytes = None
    return session


# Where onnxruntime resolves the external references of a model given as bytes.
_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def mapped_skeleton(path: str | os.PathLike) -> bytes | None:
    """The bytes of ``path``'s skeleton (``_wire.skeleton_bytes``): the model with each large
    ``raw_data`` of its main graph replaced by a reference into the file itself, which
    onnxruntime maps as it maps an external data file.

    None where the file is better opened by path: the skeleton cannot be built (a framing the
    wire reader refuses, a file that cannot be read), or it refers to no weight in the file (a
    model whose weights are in a data file already, are small, are stored as typed fields or
    lie only in subgraphs, which the skeleton leaves inline): onnxruntime then parses the same
    bytes either way.
    """
    from onnxmerge._wire import skeleton_bytes

    try:
        skeleton, externalised = skeleton_bytes(path)
    except Exception as error:  # WireFormatError, OSError
        logger.debug("%s opened by path: no skeleton (%s)", path, error)
        return None
    return skeleton if externalised else None


def _set_config(options: Any, key: str, value: str) -> None:
    try:
        if options.get_session_config_entry(key) == value:
            return
    except RuntimeError:  # not set
        pass
    options.add_session_config_entry(key, value)


def bind_output_into(binding: Any, name: str, array: np.ndarray) -> None:
    """Have onnxruntime write output ``name`` into ``array``, a contiguous CPU numpy array of
    the output's shape, which the caller keeps alive until the run ends."""
    binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def shared_pool_threads(runs: int, total: int | None = None) -> int:
    """Intra-op threads for a session that ``runs`` runs use at once, so that together they
    use ``total`` threads (default: every core): each run works on its caller's thread, and all
    share the session's pool of the other ``threads - 1``."""
    return max(1, (total or cores()) - runs + 1)


@functools.cache
def processor() -> tuple[str, frozenset[str] | None]:
    """The processor's model name and instruction sets, which onnxruntime's kernels are chosen
    by. Linux lists the sets (``flags`` on x86, ``Features`` on ARM); elsewhere they are None."""
    model, flags = platform.processor() or platform.machine(), None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = frozenset(value.split())
                break
    except OSError:
        pass
    return model, flags


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library with ``madvise`` typed, or None off Linux or where it cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    # The process's own symbols, the C library's among them: no library search (ctypes.util's
    # runs ldconfig in a child process, and importing it costs the process a megabyte).
    found = ctypes.CDLL(None, use_errno=True)
    if not hasattr(found, "madvise"):  # pragma: no cover - a C library without it
        return None
    found.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return found


def release_free_heap() -> None:
    """Give the memory freed while onnxruntime loaded the model back to the system.

    Loading parses the whole file and builds pre-packed weights; glibc keeps the freed parse
    buffers in the heap, where they count as resident memory (about half the file's size).
    """
    trim = getattr(libc(), "malloc_trim", None)
    if trim is None:
        logger.debug("malloc_trim is not available")
        return
    trim(0)
