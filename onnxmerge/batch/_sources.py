"""The models of a batch: sources read, kinds recognised, output names chosen, memory estimated."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from onnxmerge.errors import ExportFolderError

PYTORCH = "pytorch"
EXPORT = "export"
UNKNOWN = "unknown"

CHECKPOINT_SUFFIXES = (".safetensors", ".bin")
ENCODER_FILE = "encoder_model.onnx"

# What one conversion needs beyond the files it reads: interpreter, libraries, onnxruntime
# threads; exporting also imports torch and optimum.
BASE_MEMORY = 1 << 30
EXPORT_BASE_MEMORY = 2 << 30
# Bytes of memory per byte read: merge holds every file once, verify holds the merged model and
# the originals in onnxruntime; an optimum export writes about three checkpoints' worth of files.
MEMORY_PER_EXPORT_BYTE = 4
MEMORY_PER_CHECKPOINT_BYTE = 12


@dataclass(frozen=True)
class Job:
    """One model to convert and what it declares it needs."""

    name: str
    source: Path
    kind: str
    input_bytes: int
    memory_bytes: int


def read_sources(sources: Iterable[str | os.PathLike]) -> list[Path]:
    """Folders named directly or listed in text files (one a line, ``#`` comments)."""
    folders: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_file() and not path.suffix == ".onnx":
            folders += _read_list(path)
        else:
            folders.append(path)
    return folders


def _read_list(path: Path) -> list[Path]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ExportFolderError(
            f"{path} is a file but not a readable list of folders ({e}); pass model folders or a "
            "text file with one folder a line"
        ) from e
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    # Relative entries are relative to the list, so a list travels with its zoo.
    return [path.parent / line for line in lines if line]


def kind_of(folder: Path) -> str:
    from onnxmerge.export_layout import model_folder, part_and_dtype

    models = model_folder(folder)
    if (models / ENCODER_FILE).is_file() or any(
        (part_and_dtype(p) or ("",))[0] == ENCODER_FILE[: -len(".onnx")]
        for p in models.glob("*.onnx")
    ):
        return EXPORT
    if (folder / "config.json").is_file() and _checkpoints(folder):
        return PYTORCH
    return UNKNOWN


def _checkpoints(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.suffix in CHECKPOINT_SUFFIXES and p.is_file()]


def input_bytes(folder: Path, kind: str) -> int:
    if kind == PYTORCH:
        return sum(p.stat().st_size for p in _checkpoints(folder))
    if kind == EXPORT:
        from onnxmerge.export_layout import model_folder

        return sum(
            p.stat().st_size
            for p in model_folder(folder).iterdir()
            if p.is_file() and (p.suffix == ".onnx" or p.name.endswith(("_data", ".data")))
        )
    return 0


def memory_needed(kind: str, nbytes: int) -> int:
    """The memory one conversion declares, estimated from the bytes it reads."""
    if kind == PYTORCH:
        return EXPORT_BASE_MEMORY + MEMORY_PER_CHECKPOINT_BYTE * nbytes
    return BASE_MEMORY + MEMORY_PER_EXPORT_BYTE * nbytes


def plan(sources: Iterable[str | os.PathLike]) -> list[Job]:
    """One job per source folder, each with an output name unique in the batch.

    A folder that is missing or holds neither an export nor a checkpoint still gets a job: its
    conversion fails with a message, and the other models go on.
    """
    folders = list({f.absolute(): f for f in read_sources(sources)}.values())
    names = unique_names(folders)
    jobs = []
    for folder, name in zip(folders, names, strict=True):
        kind = kind_of(folder) if folder.is_dir() else UNKNOWN
        nbytes = input_bytes(folder, kind)
        jobs.append(Job(name, folder.absolute(), kind, nbytes, memory_needed(kind, nbytes)))
    return jobs


def _clean(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", part).strip("._") or "model"


def unique_names(folders: list[Path]) -> list[str]:
    """Folder names; where two collide, parent folders are added until they differ."""
    parts = [[_clean(p) for p in f.absolute().parts[1:]] or ["model"] for f in folders]
    depth = [1] * len(folders)
    while True:
        names = ["-".join(p[-d:]) for p, d in zip(parts, depth, strict=True)]
        seen: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            seen.setdefault(name, []).append(i)
        clashes = [ix for ix in seen.values() if len(ix) > 1]
        grown = False
        for ix in clashes:
            for i in ix:
                if depth[i] < len(parts[i]):
                    depth[i] += 1
                    grown = True
        if not grown:
            break
    # The same folder listed twice, or paths that differ only in cleaned characters.
    counts: dict[str, int] = {}
    unique = []
    for name in names:
        counts[name] = counts.get(name, 0) + 1
        unique.append(name if counts[name] == 1 else f"{name}-{counts[name]}")
    return unique


def fingerprint(folder: Path) -> str:
    """Names, sizes and modification times of a folder's files: changes when the source does."""
    digest = hashlib.sha256()
    if folder.is_dir():
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            stat = path.stat()
            digest.update(
                f"{path.relative_to(folder)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode()
            )
    return digest.hexdigest()
