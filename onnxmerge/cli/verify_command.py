"""``onnxmerge verify FILE``: a merged model against the files it was merged from."""

from __future__ import annotations

import argparse
from pathlib import Path

from onnxmerge.cli._shared import ExitCode, dtype_argument, emit, jsonable, need, table
from onnxmerge.errors import ExportFolderError

HELP = "compare a merged model with the files it came from"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="merged model")
    p.add_argument("--against", help="export folder (default: the model's folder)")
    dtype_argument(p, every=False)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tolerance",
        type=float,
        help="max |diff| (default: 1e-4; for quantized files a share of each output's largest "
        "value that fits the precision)",
    )


def run(args: argparse.Namespace) -> int:
    from onnxmerge.verify import verify

    need("onnxruntime", "runtime")
    against = Path(args.against) if args.against else Path(args.file).parent
    try:
        report = verify(
            args.file, against, seed=args.seed, tolerance=args.tolerance, dtype=args.dtype
        )
    except ExportFolderError as e:
        if args.against:
            raise
        raise ExportFolderError(
            f"{e}. verify compares the model with the export folder it was merged from, by "
            f"default the folder the model is in ({against}); name it with --against DIR"
        ) from e
    rows = [
        (d.step, d.name, "x".join(map(str, d.shape)), f"{d.max_abs_diff:.3g}") for d in report.diffs
    ]

    def text() -> str:
        verdict = "OK" if report.ok else "MISMATCH"
        return (
            table(rows, ("step", "output", "shape", "max |diff|"))
            + f"\n\n{verdict}: max |diff| {report.max_abs_diff:.3g} "
            f"(tolerance {report.tolerance:g}{' of each largest value' if report.relative else ''})"
            f" against {against}"
        )

    emit(args, dict(jsonable(report), ok=report.ok, max_abs_diff=report.max_abs_diff), text)
    return ExitCode.OK if report.ok else ExitCode.MISMATCH
