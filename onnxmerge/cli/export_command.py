"""``onnxmerge export MODEL``: a transformers model exported with optimum, then merged."""

from __future__ import annotations

import argparse
import logging
import shutil
import warnings
from pathlib import Path

from onnxmerge.cli import merge_command
from onnxmerge.cli._shared import ExitCode, Progress, emit, need

HELP = "export a local model folder (or hub id) with optimum, then merge"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="transformers model folder or hub id")
    p.add_argument("-o", "--output", help="export folder (default: ./<model>-onnx)")
    p.add_argument("--task", default="text2text-generation-with-past")
    p.add_argument("--overwrite", action="store_true")


def run(args: argparse.Namespace) -> int:
    from onnxmerge.merge import merge_seq2seq

    output = Path(args.output) if args.output else Path(Path(args.model).name + "-onnx")
    if not args.overwrite:
        _refuse_a_used_folder(output)
    with Progress(quiet=args.json) as progress:
        progress(f"exporting {args.model} with optimum")
        export_with_optimum(args.model, output, args.task)
        copy_tokenizer(Path(args.model), output)
        result = merge_seq2seq(output, overwrite=True, progress=progress).report
        result = merge_command.with_checkpoint(result, Path(args.model))
    emit(args, merge_command.result_json(result), lambda: merge_command.summary_of(result))
    return ExitCode.OK


def _refuse_a_used_folder(output: Path) -> None:
    """optimum would replace the files already in the folder before the merge could refuse:
    each is an output, refused as any existing output is."""
    from onnxmerge import model_io

    for written in sorted(output.iterdir()) if output.is_dir() else [output]:
        model_io.check_output(written, [], overwrite=False)


def export_with_optimum(model: str, output: Path, task: str) -> None:
    """``model`` exported by optimum into ``output``; its warnings shown with -v only."""
    need("optimum.exporters.onnx", "export")
    from optimum.exporters.onnx import main_export

    verbose = logging.getLogger().isEnabledFor(logging.INFO)
    if not verbose:
        for name in ("optimum", "transformers"):
            logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        if not verbose:
            warnings.simplefilter("ignore")  # torch's TracerWarnings say nothing to a user
        main_export(model, output=output, task=task)


def copy_tokenizer(source: Path, export_dir: Path) -> None:
    """The tokenizer files of a model folder, copied beside its export where missing there."""
    if not source.is_dir():
        return
    for path in source.iterdir():
        if (
            path.name.startswith(("tokenizer", "special_tokens", "vocab", "source.", "target."))
            and path.is_file()
            and not (export_dir / path.name).exists()
        ):
            shutil.copy2(path, export_dir / path.name)
