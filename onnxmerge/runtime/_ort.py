"""The one way onnxmerge opens an onnxruntime session, onnxruntime's type names as numpy's, and
the processor facts that decide onnxruntime's kernels."""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

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
) -> Any:
    """An ``onnxruntime.InferenceSession`` on a model file or its bytes; CPU unless told."""
    import onnxruntime as ort

    if not isinstance(source, bytes):
        source = os.fspath(source)
    return ort.InferenceSession(
        source,
        sess_options=options if options is not None else session_options(),
        providers=list(providers) if providers else ["CPUExecutionProvider"],
    )


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
