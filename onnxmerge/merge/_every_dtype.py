"""Merging every dtype a Hub repository holds, each into its own file beside the others."""

from __future__ import annotations

import os
from pathlib import Path

from onnxmerge import model_io
from onnxmerge.errors import ExportFolderError
from onnxmerge.export_layout import output_name, resolve
from onnxmerge.merge._orchestrate import MergeResult, merge_seq2seq

__all__ = ["merge_every_dtype"]


def merge_every_dtype(
    source: str | os.PathLike,
    *,
    overwrite: bool = False,
    external_data: bool | None = None,
    force: bool = False,
    progress=None,
) -> list[MergeResult]:
    """Merge each dtype ``source`` holds into ``<source>/model{suffix}.onnx``; return the
    :class:`onnxmerge.merge.MergeResult` of each, fp32 first.

    All or nothing: when one merge fails, the files this call wrote are removed again.
    """
    source = Path(source)
    first = resolve(source)  # checks the folder; its present dtypes are the ones to merge
    if not first.present:
        raise ExportFolderError(
            f"{first.model_dir} holds no file with transformers.js's names "
            "(encoder_model{suffix}.onnx, ...); merge it without --dtype"
        )
    written: list[Path] = []
    results: list[MergeResult] = []
    try:
        for dtype in first.present:
            output = source / output_name(dtype)
            existed = output.exists()
            step = progress or (lambda _name: None)
            step(f"merging {dtype}")
            results.append(
                merge_seq2seq(
                    resolve(source, dtype),
                    output,
                    overwrite=overwrite,
                    external_data=external_data,
                    force=force,
                    progress=progress,
                ).report
            )
            if not existed:
                written.append(output)
    except BaseException:
        for path in written:
            for data in model_io.data_files_of(path):
                data.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        raise
    return results
