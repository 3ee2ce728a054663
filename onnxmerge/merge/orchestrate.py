"""Orchestration of a merge: load, identify roles, splice, store once, check, save.

Each step lives in its own module; this one only calls them in order and gathers their numbers.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from onnxmerge import check, contract, model_io, passes
from onnxmerge.errors import (
    ExportFolderError,
    IncompatibleModelsError,
)
from onnxmerge.merge import compat, splice
from onnxmerge.merge.load import find_checkpoint, load_export
from onnxmerge.merge.parts import dim_sources, parts_of_file
from onnxmerge.merge.roles import Role
from onnxmerge.passes import dedup, dims, reshape_targets, tied_head

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_NAME = "model.onnx"


@dataclass(frozen=True)
class InputFile:
    path: Path
    role: str
    bytes: int


@dataclass(frozen=True)
class MergeResult:
    """The merged file and the numbers of the merge."""

    path: Path
    layout: str
    inputs: tuple[InputFile, ...]
    output_bytes: int
    tensors_in: int
    tensors_out: int
    shared: tuple[dedup.SharedTensor, ...]
    checkpoint_bytes: int | None
    # What every rewrite pass did, by its result name (see :mod:`onnxmerge.passes`).
    rewrites: dict[str, int] = field(default_factory=dict)

    @property
    def constants_lifted(self) -> int:
        return self.rewrites.get("constants_lifted", 0)

    @property
    def input_bytes(self) -> int:
        return sum(f.bytes for f in self.inputs)

    @property
    def bytes_saved(self) -> int:
        return self.input_bytes - self.output_bytes

    @property
    def transposed(self) -> tuple[dedup.SharedTensor, ...]:
        return tuple(s for s in self.shared if s.transposed)

    @property
    def checkpoint_ratio(self) -> float | None:
        return self.output_bytes / self.checkpoint_bytes if self.checkpoint_bytes else None


def merge_seq2seq(
    export_dir: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    external_data: bool | None = None,
    force: bool = False,
) -> Path:
    """Merge an optimum seq2seq export folder into one ONNX model; return its path.

    See :func:`merge_seq2seq_with_report` for the arguments.
    """
    return merge_seq2seq_with_report(
        export_dir, output, overwrite=overwrite, external_data=external_data, force=force
    ).path


def merge_seq2seq_with_report(
    export_dir: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    external_data: bool | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> MergeResult:
    """Merge an optimum seq2seq export folder into one ONNX model and report the numbers.

    Args:
        export_dir: the folder ``optimum-cli export onnx`` wrote.
        output: the file to write; ``<export_dir>/model.onnx`` by default.
        overwrite: replace an existing output file.
        external_data: ``None`` writes weights to ``<output>_data`` only past 2 GB; ``True`` always;
            ``False`` never (a model past 2 GB is then refused).
        force: merge even when the compatibility checks find the files do not belong together.
        progress: called with the name of each step as it starts (for progress displays).

    Raises:
        OnnxMergeError: or one of its subclasses, with what is wrong and what to do. Nothing is
            written and the inputs are never modified.
    """
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise ExportFolderError(
            f"{export_dir} is not a folder; pass the folder optimum exported to"
        )
    output = Path(output) if output is not None else export_dir / DEFAULT_OUTPUT_NAME
    step = progress or (lambda _: None)
    step("loading")
    chosen, models, data_files = load_export(export_dir, output)
    files_read = [f for p in chosen.values() for f in (p, *data_files[p])]
    model_io.check_output(output, files_read, overwrite=overwrite)

    parts = [
        part
        for role in (Role.ENCODER, Role.MERGED_DECODER, Role.DECODER, Role.DECODER_WITH_PAST)
        if role in chosen
        for part in parts_of_file(models[chosen[role]], role, chosen[role])
    ]
    origins = compat.origins(parts)
    tensors_in = len(origins)
    # Operators the checker does not know, which the merged model may hold too.
    tolerated = check.unknown_operators(models.values())
    step("splicing")
    # Made before the splice, which moves the parts' nodes into one graph.
    separate_dims = dims.SeparateSymbolicDims(dim_sources(parts))
    model = splice.splice(parts, models)
    step("deduplicating")
    rewrites = passes.run(model, (separate_dims, *rewrite_steps()))
    shared = passes.records(rewrites)
    configs = {
        contract.META_CONFIG: _read_json(export_dir / "config.json"),
        contract.META_GENERATION_CONFIG: _read_json(export_dir / "generation_config.json"),
    }
    config = configs[contract.META_CONFIG]
    problems = compat.checkpoint_problems(
        parts, origins, list(shared), json.loads(config) if config else None
    )
    if problems and not force:
        raise IncompatibleModelsError(
            "the files do not come from one model (pass force=True / --force to merge anyway):",
            problems,
        )
    for problem in problems:
        logger.warning("merging anyway: %s", problem)
    model.metadata_props.update({key: text for key, text in configs.items() if text is not None})
    step("saving and checking")
    model_io.save_model_atomically(
        model,
        output,
        external_data=external_data,
        validate=lambda path: check.check_written_model(
            path, tolerated=tolerated, sources=list(chosen.values())
        ),
        protected=frozenset(f.resolve() for f in files_read),
    )
    output_bytes = model_io.file_bytes(output, model_io.data_files_of(output))
    inputs = tuple(
        InputFile(path, role.value, model_io.file_bytes(path, data_files[path]))
        for role, path in chosen.items()
    )
    checkpoint = find_checkpoint(export_dir)
    result = MergeResult(
        path=output,
        layout=model.metadata_props[contract.META_LAYOUT],
        inputs=inputs,
        output_bytes=output_bytes,
        tensors_in=tensors_in,
        tensors_out=len(model.graph.initializers),
        shared=shared,
        checkpoint_bytes=checkpoint.stat().st_size if checkpoint else None,
        rewrites=passes.counts(rewrites),
    )
    logger.info(
        "merged %d files (%d bytes) into %s (%d bytes); %d tensors shared, %d transposed",
        len(inputs),
        result.input_bytes,
        output,
        output_bytes,
        len(result.shared),
        len(result.transposed),
    )
    return result


def rewrite_steps() -> tuple[ir.passes.InPlacePass, ...]:
    """The rewrite passes of a merge after the splice, in the order they run."""
    return (
        reshape_targets.FoldReshapeTargets(),
        *dedup.store_once_steps(),
        tied_head.GemmForTransposedWeights(),
    )


def _read_json(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        # Normalised so the file bytes do not depend on the JSON's formatting.
        return json.dumps(json.loads(path.read_text(encoding="utf-8")), sort_keys=True)
    except (OSError, ValueError) as e:
        raise ExportFolderError(f"{path} is not valid JSON: {e}") from e


__all__ = ["merge_seq2seq", "merge_seq2seq_with_report", "MergeResult", "InputFile"]
