"""Convert a zoo of models in one call: export, merge, verify and more, resumable, on many workers.

    from onnxmerge.batch import convert_many

    results = convert_many(["models/opus-mt-fr-en", "models/opus-mt-de-en"], "zoo-onnx", jobs=2)

Each model ends up in ``OUT/<name>/`` (``model.onnx`` and whatever the options add) with a
``manifest.json`` written last; ``OUT/results.jsonl`` gets one line per model. A rerun skips the
models whose folder is complete and intact and converts the others again.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxmerge.batch._runners import run_pool, run_ray, run_serial
from onnxmerge.batch._sources import Job, plan
from onnxmerge.batch._task import (
    CONVERTED,
    FAILED,
    SKIPPED,
    ModelResult,
    Options,
    check_features,
    finished,
    remove_stale_staging,
)
from onnxmerge.errors import InvalidArgumentError, MissingDependencyError

__all__ = [
    "convert_many",
    "plan",
    "Job",
    "ModelResult",
    "Options",
    "CONVERTED",
    "SKIPPED",
    "FAILED",
    "RESULTS_NAME",
    "RUNNERS",
]

RESULTS_NAME = "results.jsonl"
# Where the conversions run: this process, a pool of spawned worker processes, or Ray tasks.
RUNNERS = ("serial", "processes", "ray")
_UNSET: Any = object()


def convert_many(
    sources: Iterable[str | os.PathLike],
    output: str | os.PathLike | None = None,
    *,
    jobs: int | None = None,
    runner: str = "processes",
    ray_address: str | None = None,
    weights: str | None = None,
    search: str | None = None,
    num_beams: int = 4,
    web: bool = False,
    dtype: str | None = None,
    memory_bytes: int | None = None,
    tolerance: float = 1e-4,
    on_result: Callable[[ModelResult, int, int], None] | None = None,
    progress: Callable[[str], None] | None = None,
    **deprecated: Any,
) -> list[ModelResult]:
    """Convert every model of ``sources`` into ``output``; return one result per model.

    Args:
        sources: PyTorch checkpoint folders (exported with optimum first), optimum export
            folders or Hub repositories, or text files listing such folders one a line.
        output: the folder; each model goes to ``output/<name>/`` (the source folder's name).
        jobs: worker processes (default: one per CPU); ``0`` is ``runner="serial"``.
        runner: ``"processes"``, spawned workers each held to its model's declared memory;
            ``"serial"``, in this process; ``"ray"``, Ray tasks (on ``ray_address``, default
            this process's Ray session or a local cluster).
        weights: also quantize, to one of ``onnxmerge.quantize``'s precisions.
        search: also build ``generator.onnx`` with ``"greedy"`` or ``"beam"`` search.
        num_beams: beams per input of the beam generator.
        web: also write a web page.
        dtype: which files of an export holding several dtypes (transformers.js's names).
        memory_bytes: the memory each model declares, in place of the estimate from its files.
        tolerance: largest difference to the export that verification accepts.
        on_result: called with each result, the number done and the total.
        progress: called with a line per model as it finishes (``"name: converted (3/10)"``).
        **deprecated: ``out`` (now ``output``), ``ray`` (``True`` or a cluster address: now
            ``runner="ray"`` and ``ray_address``), ``generation`` (now ``search``).

    Models complete in ``output`` are reported as skipped; one that fails is reported with its
    error and leaves no output.

    Raises:
        InvalidArgumentError: an argument that would fail every model, before any work starts.
        MissingDependencyError: ``runner="ray"`` without Ray installed.
    """
    output, runner, ray_address, search = _renamed(deprecated, output, runner, ray_address, search)
    if jobs == 0 and runner == "processes":
        runner = "serial"
    # The memory cap is for workers; this process's own limits are left as they are.
    options = Options(weights, search, num_beams, web, tolerance, runner != "serial", dtype)
    _check_arguments(runner, ray_address, options)
    out = Path(output).absolute()
    out.mkdir(parents=True, exist_ok=True)
    planned = plan(sources)
    if memory_bytes is not None:
        planned = [dataclasses.replace(job, memory_bytes=memory_bytes) for job in planned]
    runs = _Runs(runner, ray_address, jobs, on_result, progress)
    return _convert_all(planned, out, options, runs)


@dataclass(frozen=True)
class _Runs:
    """Where the conversions run, and who hears of each result."""

    runner: str
    ray_address: str | None
    jobs: int | None
    on_result: Callable[[ModelResult, int, int], None] | None
    progress: Callable[[str], None] | None


def _convert_all(planned: list[Job], out: Path, options: Options, runs: _Runs) -> list[ModelResult]:
    """Convert what is not complete in ``out``, one line of ``results.jsonl`` per model."""
    results: list[ModelResult] = []
    with open(out / RESULTS_NAME, "w", encoding="utf-8") as log:

        def record(result: ModelResult) -> None:
            results.append(result)
            log.write(json.dumps(result.to_json()) + "\n")
            log.flush()
            if runs.on_result is not None:
                runs.on_result(result, len(results), len(planned))
            if runs.progress is not None:
                runs.progress(f"{result.name}: {result.status} ({len(results)}/{len(planned)})")

        todo = _to_convert(planned, out, options, record)
        for result in _run(todo, out, options, runs):
            record(result)
    return results


def _renamed(
    deprecated: dict[str, Any],
    output: str | os.PathLike | None,
    runner: str,
    ray_address: str | None,
    search: str | None,
) -> tuple[str | os.PathLike, str, str | None, str | None]:
    """The arguments under their names, from the deprecated spellings too."""
    unknown = set(deprecated) - {"out", "ray", "generation"}
    if unknown:
        raise TypeError(f"convert_many() got unexpected keyword arguments {sorted(unknown)}")
    for old, new in (("out", "output"), ("ray", "runner='ray'"), ("generation", "search")):
        if old in deprecated:
            warnings.warn(
                f"convert_many({old}=...) is deprecated; pass {new}",
                DeprecationWarning,
                stacklevel=3,
            )
    output = deprecated.get("out", output)
    if output is None:
        raise InvalidArgumentError("give the output folder", argument="output")
    ray = deprecated.get("ray", False)
    if ray:
        runner = "ray"
        ray_address = ray_address if ray is True else str(ray)
    return output, runner, ray_address, deprecated.get("generation", search)


def _check_arguments(runner: str, ray_address: str | None, options: Options) -> None:
    """Refuse what would fail every model, before anything is written."""
    if runner not in RUNNERS:
        raise InvalidArgumentError(
            f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}", argument="runner"
        )
    if ray_address is not None and runner != "ray":
        raise InvalidArgumentError(
            f"ray_address applies to runner='ray', not runner={runner!r}", argument="ray_address"
        )
    if runner == "ray" and importlib.util.find_spec("ray") is None:
        raise MissingDependencyError("runner='ray' (--ray) needs Ray: pip install 'onnxmerge[ray]'")
    check_features(options)


def _to_convert(
    planned: list[Job], out: Path, options: Options, record: Callable[[ModelResult], None]
) -> list[Job]:
    """The jobs not complete in ``out``; those that are are recorded as skipped."""
    todo = []
    for job in planned:
        done = finished(job, out, options)
        if done is not None:
            record(done)
        else:
            remove_stale_staging(out, job.name)
            todo.append(job)
    return todo


def _run(todo: list[Job], out: Path, options: Options, runs: _Runs) -> Iterator[ModelResult]:
    if not todo:
        return iter(())
    if runs.runner == "ray":
        return run_ray(todo, out, options, address=runs.ray_address)
    if runs.runner == "serial":
        return run_serial(todo, out, options)
    workers = min(runs.jobs or os.cpu_count() or 1, len(todo))
    return run_pool(todo, out, options, workers=workers)
