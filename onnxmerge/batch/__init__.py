"""Convert a zoo of models in one call: export, merge, verify and more, resumable, on many workers.

    from onnxmerge.batch import convert_many

    results = convert_many(["models/opus-mt-fr-en", "models/opus-mt-de-en"], "zoo-onnx", jobs=2)

Each model ends up in ``OUT/<name>/`` (``model.onnx`` and whatever the options add) with a
``manifest.json`` written last; ``OUT/results.jsonl`` gets one line per model. A rerun skips the
models whose folder is complete and intact and converts the others again.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

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
]

RESULTS_NAME = "results.jsonl"


def convert_many(
    sources: Iterable[str | os.PathLike],
    out: str | os.PathLike,
    *,
    jobs: int | None = None,
    ray: bool | str = False,
    weights: str | None = None,
    generation: str | None = None,
    num_beams: int = 4,
    web: bool = False,
    dtype: str | None = None,
    memory_bytes: int | None = None,
    tolerance: float = 1e-4,
    on_result: Callable[[ModelResult, int, int], None] | None = None,
) -> list[ModelResult]:
    """Convert every model of ``sources`` into ``out``; return one result per model.

    Args:
        sources: PyTorch checkpoint folders (exported with optimum first), optimum export
            folders, or text files listing such folders one a line.
        out: the output folder; each model goes to ``out/<name>/``, ``<name>`` being the source
            folder's name (with parent folders added where two names collide).
        jobs: worker processes (default: one per CPU); ``0`` converts in this process, without
            the memory cap of workers.
        ray: ``True`` or a cluster address to run each model as a Ray task instead.
        weights: also quantize the weights to this type (``onnxmerge.quantize``).
        generation: also build ``generator.onnx`` with ``"greedy"`` or ``"beam"`` search.
        num_beams: beams for ``generation="beam"``.
        web: also build a web page that runs the model (``onnxmerge.web.build_site``).
        dtype: which files of an export holding several dtypes (Hub repositories laid out for
            transformers.js: ``"fp32"``, ``"q8"``, ...; see :mod:`onnxmerge.export_layout`).
        memory_bytes: the memory each model declares and is held to, instead of the estimate
            from its input sizes.
        tolerance: largest difference to the export that verification accepts.
        on_result: called with each result, the number done and the total, as models finish.

    Models already complete in ``out`` are reported as skipped. A model that fails is reported
    with its error and leaves no output; the others go on.

    Raises:
        OnnxMergeError: when an option needs a part of onnxmerge that is not installed.
    """
    options = Options(
        weights=weights,
        generation=generation,
        num_beams=num_beams,
        web=web,
        tolerance=tolerance,
        dtype=dtype,
        # The cap is for workers; this process's own limits are left as they are.
        limit_memory=bool(ray) or jobs != 0,
    )
    check_features(options)
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    planned = plan(sources)
    if memory_bytes is not None:
        planned = [dataclasses.replace(job, memory_bytes=memory_bytes) for job in planned]
    results: list[ModelResult] = []
    with open(out / RESULTS_NAME, "w", encoding="utf-8") as log:

        def record(result: ModelResult) -> None:
            results.append(result)
            log.write(json.dumps(result.to_json()) + "\n")
            log.flush()
            if on_result is not None:
                on_result(result, len(results), len(planned))

        todo = []
        for job in planned:
            done = finished(job, out, options)
            if done is not None:
                record(done)
            else:
                remove_stale_staging(out, job.name)
                todo.append(job)
        if not todo:
            return results
        if ray:
            runner = run_ray(todo, out, options, address=None if ray is True else str(ray))
        elif jobs == 0:
            runner = run_serial(todo, out, options)
        else:
            workers = min(jobs or os.cpu_count() or 1, len(todo))
            runner = run_pool(todo, out, options, workers=workers)
        for result in runner:
            record(result)
    return results
