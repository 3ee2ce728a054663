"""``onnxmerge demo``: the bundled demo model exported, merged and translated with."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from onnxmerge.cli import export_command, merge_command
from onnxmerge.cli._shared import ExitCode, Progress, emit, need, table, tokenizers_only

HELP = "export, merge and run the bundled demo translation model"

SIZE_NOTE = (
    "(The demo model has 0.25 M parameters, so the graph itself is a large share of its size;\n"
    " on opus-mt-fr-en the merged file is 1.002x the checkpoint: docs/benchmarks.md)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="work folder to keep (default: a new temporary folder)")


def run(args: argparse.Namespace) -> int:
    """Export the shipped trained demo model, merge it, show the gain, translate with it."""
    from onnxmerge.demo import DEMO_MODEL_DIR, DEMO_SENTENCES
    from onnxmerge.merge import merge_seq2seq

    need("onnxruntime", "runtime")
    from onnxmerge.runtime import Seq2SeqModel

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="onnxmerge-demo-"))
    export_dir = work / "export"
    with Progress(quiet=args.json) as progress:
        if not (export_dir / "encoder_model.onnx").exists():
            progress("exporting the demo model with optimum")
            demo_source = os.fspath(DEMO_MODEL_DIR)
            export_command.export_with_optimum(
                demo_source, export_dir, "text2text-generation-with-past"
            )
            export_command.copy_tokenizer(DEMO_MODEL_DIR, export_dir)
        else:
            tokenizers_only()
        result = merge_seq2seq(export_dir, overwrite=True, progress=progress).report
        result = merge_command.with_checkpoint(result, DEMO_MODEL_DIR)
        progress("translating")
        model = Seq2SeqModel(result.path)
        translations = model.translate(list(DEMO_SENTENCES))
    rows = list(zip(DEMO_SENTENCES, translations, strict=True))
    payload = dict(
        merge=merge_command.result_json(result),
        translations=[{"source": s, "output": t} for s, t in rows],
    )
    said = [
        merge_command.summary_of(result),
        SIZE_NOTE,
        f"Generating with the single file {result.path.name}:",
        table(rows, ("French", "English (generated)")),
    ]
    emit(args, payload, lambda: "\n\n".join(said))
    return ExitCode.OK
