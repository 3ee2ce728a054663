"""Where an export's model files and configs are: optimum's flat folder or a Hub repository.

optimum writes every file into one folder. Repositories laid out for transformers.js keep
``config.json``, ``generation_config.json`` and ``tokenizer.json`` at the root and the models
under ``onnx/``, one set of files per dtype told apart by a suffix
(``onnx/encoder_model_quantized.onnx`` is the q8 encoder). :func:`resolve` finds the folder, picks
one dtype's files and says where the configs are; the merge then judges those files by role.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from onnxmerge.errors import ExportFolderError

# transformers.js's dtype names and file suffixes (its ``dtype`` option), fp32 first.
DTYPE_SUFFIXES: dict[str, str] = {
    "fp32": "",
    "fp16": "_fp16",
    "q8": "_quantized",
    "int8": "_int8",
    "uint8": "_uint8",
    "q4": "_q4",
    "q4f16": "_q4f16",
    "bnb4": "_bnb4",
    "q2": "_q2",
    "q1": "_q1",
}
DEFAULT_DTYPE = "fp32"
EVERY_DTYPE = "all"
MODELS_FOLDER = "onnx"
CONFIG_FILES = ("config.json", "generation_config.json")
# The file names optimum and transformers.js give each part, longest first: "decoder_model" is a
# prefix of "decoder_model_merged".
_PART_STEMS = ("decoder_model_merged", "decoder_with_past_model", "decoder_model", "encoder_model")
_SUFFIX_DTYPES = {suffix: dtype for dtype, suffix in DTYPE_SUFFIXES.items()}


@dataclass(frozen=True)
class ExportLayout:
    """One dtype's model files of an export and the folder its configs come from.

    ``dtype`` is None for a folder whose files carry none of the usual names (they are all
    judged by role). ``present`` lists every dtype the folder holds files of.
    """

    source: Path
    model_dir: Path
    config_dir: Path
    dtype: str | None
    files: tuple[Path, ...]
    present: tuple[str, ...]


def output_name(dtype: str | None) -> str:
    """``model.onnx`` for fp32, ``model{suffix}.onnx`` for another dtype."""
    return f"model{DTYPE_SUFFIXES.get(dtype or DEFAULT_DTYPE, '')}.onnx"


def part_and_dtype(path: Path) -> tuple[str, str] | None:
    """``("encoder_model", "q8")`` for ``encoder_model_quantized.onnx``; None for other names."""
    if path.suffix != ".onnx":
        return None
    for stem in _PART_STEMS:
        if path.stem.startswith(stem):
            dtype = _SUFFIX_DTYPES.get(path.stem[len(stem) :])
            return None if dtype is None else (stem, dtype)
    return None


def _onnx_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.onnx") if p.is_file())


def model_folder(source: Path) -> Path:
    """``source``, or its ``onnx/`` folder when the models are there (a Hub repository)."""
    inner = source / MODELS_FOLDER
    if inner.is_dir() and not any(part_and_dtype(p) for p in _onnx_files(source)):
        return inner
    return source


def config_folder(source: Path) -> Path:
    """The folder of ``config.json``: the source, or the repository root when the source is the
    ``onnx/`` folder of a Hub repository."""
    if not (source / CONFIG_FILES[0]).is_file() and source.name == MODELS_FOLDER:
        if (source.parent / CONFIG_FILES[0]).is_file():
            return source.parent
    return source


def dtypes_present(model_dir: Path) -> dict[str, list[Path]]:
    """The files of each dtype the folder holds, in :data:`DTYPE_SUFFIXES` order."""
    found: dict[str, list[Path]] = {}
    for path in _onnx_files(model_dir):
        named = part_and_dtype(path)
        if named is not None:
            found.setdefault(named[1], []).append(path)
    return {d: found[d] for d in DTYPE_SUFFIXES if d in found}


def resolve(source: str | os.PathLike, dtype: str | None = None) -> ExportLayout:
    """The model files of one dtype of ``source`` (an optimum export folder or a Hub repository
    root, or its ``onnx/`` folder) and the folder to read the configs from.

    ``dtype``: a transformers.js dtype name (:data:`DTYPE_SUFFIXES`), fp32 by default. The fp32
    files are the folder's ``.onnx`` files but those of other dtypes (so that a folder with other
    names still merges, judged by role); another dtype is its suffixed files only.

    Raises:
        ExportFolderError: ``source`` is not a folder, the dtype is unknown, or the folder holds
            no file of it (the message lists the dtypes present).
    """
    source = Path(source)
    if not source.is_dir():
        raise ExportFolderError(f"{source} is not a folder; pass the folder optimum exported to")
    if dtype == EVERY_DTYPE:
        raise ExportFolderError(
            "dtype 'all' names several merges; call onnxmerge.merge_every_dtype (CLI: --dtype all)"
        )
    if dtype is not None and dtype not in DTYPE_SUFFIXES:
        raise ExportFolderError(
            f"unknown dtype {dtype!r}; transformers.js's dtypes are {', '.join(DTYPE_SUFFIXES)}"
        )
    model_dir = model_folder(source)
    present = dtypes_present(model_dir)
    wanted = dtype or DEFAULT_DTYPE
    if present and wanted not in present:
        listed = ", ".join(f"{d} ({', '.join(p.name for p in present[d])})" for d in present)
        raise ExportFolderError(
            f"{model_dir} holds no {wanted} model files ({_file_names(wanted)}); it holds: "
            f"{listed}. Pass --dtype (dtype=) with one of {', '.join(present)}, or all"
        )
    if wanted == DEFAULT_DTYPE or not present:
        other = {p for d, paths in present.items() if d != DEFAULT_DTYPE for p in paths}
        files = [p for p in _onnx_files(model_dir) if p not in other]
    else:
        files = list(present[wanted])
    return ExportLayout(
        source=source,
        model_dir=model_dir,
        config_dir=config_folder(source),
        dtype=wanted if present else None,
        files=tuple(files),
        present=tuple(present),
    )


def _file_names(dtype: str) -> str:
    suffix = DTYPE_SUFFIXES[dtype]
    return f"encoder_model{suffix}.onnx, decoder_model_merged{suffix}.onnx"


# ---------------------------------------------------------------- what a merge was made of


def _digest(path: Path) -> str:
    # hashlib.file_digest is Python 3.11's; this reads the same way on 3.10.
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _config_files(layout: ExportLayout) -> list[Path]:
    return [layout.config_dir / n for n in CONFIG_FILES if (layout.config_dir / n).is_file()]


def sources_record(layout: ExportLayout, files: list[Path]) -> str:
    """JSON with the dtype and the sha256 of each file a merge read (models, their data files,
    the configs). Names are left out, so that the merged file's bytes depend on the contents
    only."""
    digests = sorted({_digest(p) for p in (*files, *_config_files(layout))})
    return json.dumps({"dtype": layout.dtype or DEFAULT_DTYPE, "sha256": digests}, sort_keys=True)


def is_merge_of(recorded: str | None, layout: ExportLayout) -> bool:
    """Whether a merged file's record (:func:`sources_record`) is of this dtype, every file it
    read is still among the layout's files unchanged, and it read the configs there now."""
    try:
        record = json.loads(recorded or "")
        digests = set(record["sha256"])
    except (ValueError, KeyError, TypeError):
        return False
    if record.get("dtype") != (layout.dtype or DEFAULT_DTYPE):
        return False
    from onnxmerge import model_io

    configs = {_digest(p) for p in _config_files(layout)}
    models = {
        _digest(f)
        for path in layout.files
        for f in (path, *model_io.data_files_of(path))
        if f.is_file()
    }
    return configs <= digests and digests <= models | configs


def recorded_dtype(recorded: str | None) -> str | None:
    """The dtype a merged file was made from, when it recorded its sources."""
    try:
        dtype = json.loads(recorded or "{}").get("dtype")
    except (ValueError, AttributeError):
        return None
    return dtype if dtype in DTYPE_SUFFIXES else None
