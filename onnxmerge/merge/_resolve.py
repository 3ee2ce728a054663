"""From what a writer is given to a merged model: one place for every writer.

A source is a merged model file, an optimum export folder (flat) or a Hub repository laid out for
transformers.js (configs at the root, models under ``onnx/``). A folder is merged into a temporary
file, unless it already holds the merge of the very files there now.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from onnxmerge import contract, export_layout, model_io
from onnxmerge.errors import ModelNotFoundError


@dataclass(frozen=True)
class Source:
    """What a writer reads: a model file (``layout`` None) or one dtype's files of an export."""

    path: Path
    layout: export_layout.ExportLayout | None = None

    @property
    def config_dir(self) -> Path:
        """Where the configs (and tokenizer, preprocessor config) are."""
        return self.layout.config_dir if self.layout else self.path.parent

    def files(self) -> list[Path]:
        """Every model file the source reads, with its external data files: what an output must
        not replace."""
        models = self.layout.files if self.layout else (self.path,)
        return [f for m in models if m.is_file() for f in (m, *model_io.data_files_of(m))]


def resolve_source(
    source: str | os.PathLike | export_layout.ExportLayout | Source, dtype: str | None = None
) -> Source:
    """Say what ``source`` is, reading folder listings only (no model is loaded).

    Args:
        source: a merged model file, an export folder or a Hub repository (or its ``onnx/``
            folder), or a layout already resolved.
        dtype: which files of a folder with several dtypes (transformers.js's names).

    Raises:
        ModelNotFoundError: ``source`` does not exist.
        ExportFolderError: the folder holds no model of ``dtype``.
    """
    if isinstance(source, Source):
        return source
    if isinstance(source, export_layout.ExportLayout):
        return Source(source.source, source)
    path = Path(source)
    if path.is_dir():
        return Source(path, export_layout.resolve(path, dtype))
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} does not exist: give an export folder or a merged model file"
        )
    return Source(path)


@contextlib.contextmanager
def merged_model(
    source: Source,
    *,
    work_dir: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
) -> Iterator[Path]:
    """The merged model of ``source``; a merge made here is removed when the block ends.

    Args:
        source: from :func:`resolve_source`.
        work_dir: where a temporary merge goes (default: the system's temporary folder).
        progress: called with each step's name.
    """
    step = progress or (lambda _name: None)
    if source.layout is None:
        yield source.path
        return
    earlier, stale = _earlier_merge(source.layout)
    if earlier is not None:
        step(f"using {earlier}, the merge of these files")
        yield earlier
        return
    step(
        f"merging the export folder (in a temporary folder: {stale[0].name} there is not the "
        "merge of these files)"
        if stale
        else "merging the export folder"
    )
    layout = dataclasses.replace(
        source.layout, files=tuple(p for p in source.layout.files if p not in stale)
    )
    from onnxmerge.merge._orchestrate import merge_seq2seq

    with tempfile.TemporaryDirectory(prefix="onnxmerge-merge-", dir=work_dir) as work:
        yield Path(merge_seq2seq(layout, Path(work) / "model.onnx"))


def _earlier_merge(layout: export_layout.ExportLayout) -> tuple[Path | None, tuple[Path, ...]]:
    """The folder's own merged model (``onnxmerge merge`` wrote it) when it is the merge of the
    files there now; else None and the merged files there that are not."""
    earlier = [
        folder / export_layout.output_name(layout.dtype)
        for folder in dict.fromkeys((layout.source, layout.model_dir, layout.config_dir))
    ]
    for path in earlier:
        if path.is_file():
            recorded = model_io.read_metadata(path).get(contract.META_SOURCES)
            if export_layout.is_merge_of(recorded, layout):
                return path, ()
    return None, tuple(p for p in earlier if p.is_file())
