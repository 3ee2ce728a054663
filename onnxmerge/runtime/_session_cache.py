"""A cache of onnxruntime's optimized graph, so that a model opens without being optimized again.

Creating a session spends much of its time in onnxruntime's graph optimizations: every change
re-resolves the whole graph, both ``If`` branches included. Asked for a cache folder, the first
open saves onnxruntime's optimized graph there (with its weights in a data file beside it); later
opens read that graph with the optimizations off. The merged file itself is never touched.

What is saved holds onnxruntime's own operators and suits one onnxruntime version, one processor
and one set of session settings: these name the entry's folder. The model's files (the model and
every file beside it, as the path was given: its external data may have any name) make the rest of
the name, so a changed file gets a new entry, which replaces the old one. An entry that does not
load is rebuilt; a cache that cannot be used leaves the model opening as without one.

Where a float32 model's head is tied, the graph saved is that of the model with a greedy head
(``onnxmerge/runtime/_greedy_source.py``), and the entry holds the tables that go with it.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onnxmerge._ort import open_session, processor

logger = logging.getLogger(__name__)

ENTRY_MODEL = "model.onnx"
ENTRY_DATA = "model.onnx_data"
# What an entry holds; a new layout gets new entries.
ENTRY_LAYOUT = 3  # 3: the greedy head returns its logits flat
# Where the model with a greedy head is written for onnxruntime to optimize, inside the entry.
_SOURCE = "source"
# The session settings that decide the graph onnxruntime optimizes to. Config entries cannot be
# listed back from SessionOptions, so they are not in the key (docs/runtime.md says so).
_GRAPH_SETTINGS = ("graph_optimization_level", "execution_mode")
# Where onnxruntime writes the optimized graph's weights: set only where the caller has not.
_SAVE_SETTINGS = {
    "session.optimized_model_external_initializers_file_name": ENTRY_DATA,
    "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
}
# A folder still being written after this long belongs to a load that was killed.
_ABANDONED_S = 3600


def open_with_cache(
    model: Path,
    cache_dir: str | os.PathLike,
    options: Any,
    providers: Sequence[Any] | None,
    *,
    mapped: bool = True,
) -> tuple[Any, Path, bool]:
    """An ``InferenceSession`` on ``model`` through the cache, the file it was opened from and
    whether this load wrote that file's entry.

    ``options`` comes back as it was given, except that the two settings saying where an
    optimized graph's weights go are added where they were not set. ``mapped``: as
    ``open_session`` takes it, where the model opens without the cache.
    """
    try:
        entry = entry_path(model, Path(cache_dir), options, providers)
        saved = (entry / ENTRY_MODEL).is_file()
    except OSError as error:
        return _without_cache(model, options, providers, error, mapped)
    if saved:  # read before anything is written: a read-only cache serves too
        try:
            return _open_saved(entry / ENTRY_MODEL, options, providers), entry / ENTRY_MODEL, False
        except Exception as error:  # a partial or foreign entry: rebuild it
            logger.debug("cache entry %s does not load (%s); writing it again", entry, error)
    # Only writing an entry needs these: a load that reads one imports neither.
    import shutil
    import tempfile

    try:
        if saved or (entry.exists() and not (entry / ENTRY_MODEL).is_file()):
            shutil.rmtree(entry)  # broken, or left half-deleted: it would block the new entry
    except OSError as error:
        return _without_cache(model, options, providers, error, mapped)
    # Every way out of the loop below sets it; the first value only keeps the type honest.
    why: Exception = RuntimeError("no cache entry was tried")
    for greedy in (True, False):  # a graph with a greedy head that fails: once more without
        try:
            building = Path(tempfile.mkdtemp(prefix=".building-", dir=_made(entry.parent)))
        except OSError as error:
            return _without_cache(model, options, providers, error, mapped)
        source = _greedy_source(model, building) if greedy else None
        try:
            _build(model, source, building, options, providers)
            published = _publish(building, entry)
        except Exception as error:  # e.g. a provider whose graph onnxruntime cannot save
            why = error
        else:
            try:  # read as every later load reads it: a fault shows now, not on the next load
                session = _open_saved(entry / ENTRY_MODEL, options, providers)
                return session, entry / ENTRY_MODEL, published
            except Exception as error:
                why = error
                if published:  # another process's entry is theirs to replace
                    shutil.rmtree(entry, ignore_errors=True)
        finally:
            shutil.rmtree(building, ignore_errors=True)
        logger.debug("cache entry for %s not written: %s", model, why)
        if source is None:
            break
    return _without_cache(model, options, providers, why, mapped)


def _greedy_source(model: Path, building: Path) -> Any:
    """The model with a greedy head (``runtime/_greedy_source.py``), written in ``building``;
    None where its head does not allow one or it cannot be written."""
    import shutil

    try:
        from onnxmerge.runtime._greedy_source import (
            write_greedy_source,  # onnx-ir: only when writing
        )

        return write_greedy_source(model, building / _SOURCE)
    except Exception as error:  # the entry is still worth having without it
        logger.debug("no greedy head for %s: %s", model, error)
        shutil.rmtree(building / _SOURCE, ignore_errors=True)
        return None


def _build(
    model: Path, source: Any, building: Path, options: Any, providers: Sequence[Any] | None
) -> None:
    """Save onnxruntime's optimized graph of ``model``, or of its greedy ``source``, in
    ``building``, with the greedy head's tables."""
    import shutil

    try:
        opened = source.path if source is not None else model
        session = _open_saving(opened, building / ENTRY_MODEL, options, providers)
        del session  # it maps the source's data, which goes next
        if source is not None:
            source.write_tables(building / ENTRY_MODEL)
    finally:
        shutil.rmtree(building / _SOURCE, ignore_errors=True)


def _without_cache(
    model: Path, options: Any, providers: Sequence[Any] | None, why: Exception, mapped: bool
) -> tuple[Any, Path, bool]:
    logger.debug("session cache not used for %s: %s", model, why)
    return open_session(model, options, providers, mapped=mapped), model, False


def entry_path(model: Path, cache_dir: Path, options: Any, providers: Sequence[Any] | None) -> Path:
    """The entry folder: named by the model's path and what the saved graph depends on, then by
    the state of the model's files."""
    # As given, not resolved: onnxruntime reads external data beside the path it is given.
    model = Path(os.path.abspath(model))
    depends_on = {
        "layout": ENTRY_LAYOUT,
        "model": str(model),
        "onnxruntime": _onnxruntime_version(),
        "processor": _processor(),
        "providers": [str(p) for p in providers or ["CPUExecutionProvider"]],
        "settings": {name: str(getattr(options, name)) for name in _GRAPH_SETTINGS},
    }
    files = [
        [p.name, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino]
        for p in sorted(model.parent.iterdir())
        if p.is_file() and (s := p.stat())
    ]
    return cache_dir / f"{model.stem}-{_digest(depends_on, 12)}-{_digest(files, 16)}"


def _digest(value: Any, length: int) -> str:
    # Imported here: OpenSSL's library adds 3 MB to every process that opens a model without a
    # session cache.
    import hashlib

    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:length]


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
    for key, value in _SAVE_SETTINGS.items():
        try:
            options.get_session_config_entry(key)  # the caller's own choice stays
        except RuntimeError:  # not set
            options.add_session_config_entry(key, value)
    try:
        return open_session(model, options, providers)
    finally:
        options.optimized_model_filepath = saved_to


def _publish(building: Path, entry: Path) -> bool:
    """Move a complete entry into place; drop the entries it replaces (same model and settings,
    older files) and folders that killed loads left. Whether this entry is the one in place."""
    import shutil

    if not (building / ENTRY_MODEL).is_file():
        logger.debug("onnxruntime saved no optimized graph; nothing cached")
        return False
    replaced = entry.name.rsplit("-", 1)[0] + "-"
    for old in entry.parent.glob(f"{replaced}*"):
        if old != entry:
            shutil.rmtree(old, ignore_errors=True)
    for old in entry.parent.glob(".building-*"):
        try:
            abandoned = time.time() - old.stat().st_mtime > _ABANDONED_S
        except OSError:
            continue
        if abandoned:
            shutil.rmtree(old, ignore_errors=True)
    try:
        building.rename(entry)
    except OSError:  # another process published the same entry first
        logger.debug("cache entry %s was written meanwhile", entry)
        return False
    return True


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _onnxruntime_version() -> str:
    import onnxruntime as ort

    return ort.__version__


def _processor() -> str:
    """The processor's instruction sets where they can be read; elsewhere only its names."""
    _, flags = processor()
    if flags is None:
        return f"{platform.machine()} {platform.processor()}"
    return f"{platform.machine()} {_digest(sorted(flags), 16)}"
