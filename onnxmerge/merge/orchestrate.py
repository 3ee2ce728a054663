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
    InvalidMergedModelError,
)
from onnxmerge.merge import compat, roles, splice
from onnxmerge.merge.roles import Role
from onnxmerge.passes import dedup, dims, reshape_targets, tied_head

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_NAME = "model.onnx"
CHECKPOINT_NAMES = ("model.safetensors", "pytorch_model.bin")


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
    constants_lifted: int
    checkpoint_bytes: int | None
    # What every rewrite pass did, by its result name (see :mod:`onnxmerge.passes`).
    rewrites: dict[str, int] = field(default_factory=dict)

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
        for part in splice.parts_of_file(models[chosen[role]], role, chosen[role])
    ]
    origins = compat.origins(parts)
    tensors_in = len(origins)
    # Operators the checker does not know, which the merged model may hold too.
    tolerated = check.unknown_operators(models.values())
    step("splicing")
    # Made before the splice, which moves the parts' nodes into one graph.
    separate_dims = dims.SeparateSymbolicDims(parts)
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
        validate=lambda path: check.check_merged_model(path, tolerated, list(chosen.values())),
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
        constants_lifted=passes.counts(rewrites)["constants_lifted"],
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


def find_checkpoint(folder: Path) -> Path | None:
    """The PyTorch checkpoint file in ``folder``, if there is one."""
    return next((folder / n for n in CHECKPOINT_NAMES if (folder / n).is_file()), None)


def load_export(
    export_dir: Path, output: Path, *, ignore_merged: bool = False
) -> tuple[dict[Role, Path], dict[Path, ir.Model], dict[Path, set[Path]]]:
    """Load every model of the folder, judge its role, keep the ones the merge needs.

    ``ignore_merged`` skips merged models found in the folder instead of refusing them (for
    ``verify``, which only reads the originals).
    """
    candidates = sorted(p for p in export_dir.glob("*.onnx") if p.is_file())
    if not candidates:
        raise ExportFolderError(
            f"{export_dir} holds no .onnx file; export the model first, e.g. `optimum-cli export "
            f"onnx --model MODEL --task text2text-generation-with-past {export_dir}`"
        )
    models: dict[Path, ir.Model] = {}
    data_files: dict[Path, set[Path]] = {}
    judged: dict[Path, roles.Judgement] = {}
    for path in candidates:
        model, files = model_io.load_model(path)
        judgement = roles.judge(model)
        if judgement.role == Role.MERGED_MODEL and (
            ignore_merged or (output.exists() and path.samefile(output))
        ):
            continue  # the previous result of this merge, about to be replaced
        models[path], data_files[path], judged[path] = model, files, judgement
        logger.debug("%s: %s (%s)", path.name, judgement.role, judgement.reason)
    chosen = roles.assign_roles(judged)
    if Role.MERGED_MODEL in chosen:
        raise InvalidMergedModelError(
            f"{chosen[Role.MERGED_MODEL]} is already a merged model; move it out of "
            f"{export_dir} or write over it (-o {chosen[Role.MERGED_MODEL]} --overwrite)"
        )
    missing = []
    if Role.ENCODER not in chosen:
        missing.append(roles.CONVENTIONAL_NAMES[Role.ENCODER])
    if Role.DECODER not in chosen and Role.MERGED_DECODER not in chosen:
        missing.append(roles.CONVENTIONAL_NAMES[Role.DECODER])
    if missing:
        found = ", ".join(
            f"{p.name} ({j.role.value if j.role else j.reason})" for p, j in judged.items()
        )
        raise ExportFolderError(
            f"{export_dir} lacks {' and '.join(missing)} (found: {found}); export with "
            "--task text2text-generation-with-past"
        )
    if (
        Role.DECODER in chosen
        and Role.MERGED_DECODER in chosen
        and (Role.DECODER_WITH_PAST in chosen)
    ):
        # The separate decoders hold the same graphs; the merged one adds nothing.
        del chosen[Role.MERGED_DECODER]
    elif Role.MERGED_DECODER in chosen:
        chosen.pop(Role.DECODER, None)
        chosen.pop(Role.DECODER_WITH_PAST, None)
    if Role.DECODER_WITH_PAST in chosen and Role.DECODER not in chosen:
        raise ExportFolderError(
            f"{export_dir} has {chosen[Role.DECODER_WITH_PAST].name} but no decoder without past "
            "for the first step; export again or add decoder_model.onnx"
        )
    kept = set(chosen.values())
    return (
        chosen,
        {p: m for p, m in models.items() if p in kept},
        {p: d for p, d in data_files.items() if p in kept},
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
