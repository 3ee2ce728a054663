"""Loading an export folder: every model file read safely, each judged by its role, the ones a
merge needs kept; and finding the PyTorch checkpoint beside them."""

from __future__ import annotations

import logging
from pathlib import Path

import onnx_ir as ir

from onnxmerge import export_layout, model_io
from onnxmerge.errors import ExportFolderError, InvalidMergedModelError
from onnxmerge.merge import _roles as roles
from onnxmerge.merge._roles import Role
from onnxmerge.passes.branches import sink_into_branches

__all__ = ["CHECKPOINT_NAMES", "find_checkpoint", "load_export"]

logger = logging.getLogger(__name__)

CHECKPOINT_NAMES = ("model.safetensors", "pytorch_model.bin")


def find_checkpoint(folder: Path) -> Path | None:
    """The PyTorch checkpoint file in ``folder``, if there is one."""
    return next((folder / n for n in CHECKPOINT_NAMES if (folder / n).is_file()), None)


def load_export(
    export_dir: Path,
    output: Path,
    *,
    ignore_merged: bool = False,
    files: tuple[Path, ...] | None = None,
) -> tuple[dict[Role, Path], dict[Path, ir.Model], dict[Path, set[Path]]]:
    """Load every model of the folder (or ``files``, one dtype's: see
    :func:`onnxmerge.export_layout.resolve`), judge its role, keep the ones the merge needs.

    ``ignore_merged`` skips merged models found in the folder instead of refusing them (for
    ``verify``, which only reads the originals).
    """
    if files is None:
        files = export_layout.resolve(export_dir).files
    candidates = sorted(files)
    if not candidates:
        raise ExportFolderError(
            f"{export_dir} holds no .onnx file; export the model first, e.g. `optimum-cli export "
            f"onnx --model MODEL --task text2text-generation-with-past {export_dir}`"
        )
    models, data_files, judged = _read_and_judge(candidates, output, ignore_merged)
    chosen = _choose_roles(judged, export_dir)
    kept = set(chosen.values())
    return (
        chosen,
        {p: m for p, m in models.items() if p in kept},
        {p: d for p, d in data_files.items() if p in kept},
    )


def _read_and_judge(
    candidates: list[Path], output: Path, ignore_merged: bool
) -> tuple[dict[Path, ir.Model], dict[Path, set[Path]], dict[Path, roles.Judgement]]:
    """Every candidate's model, external data files and role, skipping merged models that are
    ignored or the output itself."""
    models: dict[Path, ir.Model] = {}
    data_files: dict[Path, set[Path]] = {}
    judged: dict[Path, roles.Judgement] = {}
    for path in candidates:
        model, model_data = model_io.load_model(path)
        judgement = roles.judge(model)
        if judgement.role == Role.MERGED_DECODER:
            sink_into_branches(model)
        if judgement.role == Role.MERGED_MODEL and (
            ignore_merged or (output.exists() and path.samefile(output))
        ):
            continue  # the previous result of this merge, about to be replaced
        models[path], data_files[path], judged[path] = model, model_data, judgement
        logger.debug("%s: %s (%s)", path.name, judgement.role, judgement.reason)
    return models, data_files, judged


def _choose_roles(judged: dict[Path, roles.Judgement], export_dir: Path) -> dict[Role, Path]:
    """The file the merge takes for each role, or why the folder cannot be merged."""
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
        and Role.DECODER_WITH_PAST in chosen
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
    return chosen
