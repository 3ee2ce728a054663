"""A cache of onnxruntime's optimized graph, so that a model opens without being optimized again.

Creating a session spends much of its time in onnxruntime's graph optimizations: every change
re-resolves the whole graph, both ``If`` branches included. Asked for a cache folder, the first
open saves onnxruntime's optimized graph there (with its weights in a data file beside it); later
opens read that graph with the optimizations off. The merged file itself is never touched.

What is saved holds onnxruntime's own operators and suits one onnxruntime version, one processor
and one set of session settings, so all of these are in the entry's key, with the model's files
(path, size and modification time). An entry that does not load is rebuilt; a folder that
cannot be written leaves the model opening as without a cache. One entry is kept per model path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onnxmerge.runtime.memory import is_data_file_of
from onnxmerge.sessions import open_session

logger = logging.getLogger(__name__)

ENTRY_MODEL = "model.onnx"
ENTRY_DATA = "model.onnx_data"
# The session settings that decide the graph onnxruntime optimizes to. Config entries cannot be
# listed back from SessionOptions, so they are not in the key (docs/runtime.md says so).
_GRAPH_SETTINGS = ("graph_optimization_level", "execution_mode")


def open_with_cache(
    model: Path, cache_dir: str | os.PathLike, options: Any, providers: Sequence[Any] | None
) -> tuple[Any, Path]:
    """An ``InferenceSession`` on ``model`` through the cache, and the file it was opened from.

    ``options`` is left as it was given.
    """
    entry = entry_path(model, Path(cache_dir), options, providers)
    if (entry / ENTRY_MODEL).is_file():
        try:
            return _open_saved(entry / ENTRY_MODEL, options, providers), entry / ENTRY_MODEL
        except Exception as error:  # a partial or foreign entry: rebuild it
            logger.debug("cache entry %s does not load (%s); writing it again", entry, error)
            shutil.rmtree(entry, ignore_errors=True)
    try:
        building = Path(tempfile.mkdtemp(prefix=".building-", dir=_made(entry.parent)))
    except OSError as error:
        logger.debug("cannot write the session cache %s (%s); opening without it", cache_dir, error)
        return open_session(model, options, providers), model
    try:
        session = _open_saving(model, building / ENTRY_MODEL, options, providers)
        _publish(building, entry)
    except Exception as error:  # e.g. a provider whose graph onnxruntime cannot save
        logger.debug("cannot save the optimized graph of %s (%s); not cached", model, error)
        return open_session(model, options, providers), model
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return session, model


def entry_path(
    model: Path, cache_dir: Path, options: Any, providers: Sequence[Any] | None
) -> Path:
    """The entry folder: named after the model's path, keyed by everything the saved graph
    depends on."""
    model = model.resolve()
    key = {
        "files": [
            [p.name, p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(model.parent.iterdir())
            if p == model or is_data_file_of(model)(p)
        ],
        "onnxruntime": _onnxruntime_version(),
        "processor": _processor(),
        "providers": [str(p) for p in providers or ["CPUExecutionProvider"]],
        "settings": {name: str(getattr(options, name)) for name in _GRAPH_SETTINGS},
    }
    place = hashlib.sha256(str(model).encode()).hexdigest()[:12]
    state = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"{model.stem}-{place}-{state}"


def _open_saved(path: Path, options: Any, providers: Sequence[Any] | None) -> Any:
    import onnxruntime as ort

    level = options.graph_optimization_level
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        return open_session(path, options, providers)
    finally:
        options.graph_optimization_level = level


def _open_saving(model: Path, target: Path, options: Any, providers: Sequence[Any] | None) -> Any:
    saved_to = options.optimized_model_filepath
    options.optimized_model_filepath = str(target)
    # Only read while a path is set above, so these stay harmless in the caller's options.
    _set_entry(options, "session.optimized_model_external_initializers_file_name", ENTRY_DATA)
    _set_entry(options, "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    try:
        return open_session(model, options, providers)
    finally:
        options.optimized_model_filepath = saved_to


def _set_entry(options: Any, key: str, value: str) -> None:
    try:
        if options.get_session_config_entry(key) == value:
            return  # set by an earlier open: setting it again makes onnxruntime print a warning
    except RuntimeError:  # not set yet
        pass
    options.add_session_config_entry(key, value)


def _publish(building: Path, entry: Path) -> None:
    """Move a complete entry into place, and drop the entries of the same model it replaces."""
    if not (building / ENTRY_MODEL).is_file():
        logger.debug("onnxruntime saved no optimized graph; nothing cached")
        return
    place = entry.name.rsplit("-", 1)[0] + "-"
    for old in entry.parent.glob(f"{place}*"):
        if old != entry:
            shutil.rmtree(old, ignore_errors=True)
    try:
        building.rename(entry)
    except OSError:  # another process published the same entry first
        logger.debug("cache entry %s was written meanwhile", entry)


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _onnxruntime_version() -> str:
    import onnxruntime as ort

    return ort.__version__


def _processor() -> str:
    """The processor's model and instruction sets, which onnxruntime's kernels depend on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return f"{platform.machine()} {hashlib.sha256(line.encode()).hexdigest()[:16]}"
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"
