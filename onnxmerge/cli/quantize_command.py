"""``onnxmerge quantize FILE``: a copy of a merged model with its weights stored quantized."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from onnxmerge.cli._shared import ExitCode, Progress, emit, external_data_argument, human, jsonable

HELP = "store a merged model's weights as int8, uint8, fp16 or int4"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="merged model (or an export folder, merged first)")
    p.add_argument("-o", "--output", help="output file (default: model_int8.onnx etc. beside FILE)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    external_data_argument(p)
    precision_arguments(p, required=True)


def precision_arguments(p: argparse.ArgumentParser, *, required: bool) -> None:
    """``--weights``, ``--encoder``, ``--embedding`` and ``--activation-scale``, which merge
    takes too."""
    from onnxmerge.contract import ACTIVATION_SCALES, PRECISIONS, WEIGHT_PRECISIONS

    p.add_argument(
        "--weights",
        choices=WEIGHT_PRECISIONS,
        required=required,
        help="also write MODEL_<precision>.onnx with the weights stored in this precision"
        if not required
        else "precision of the stored weights",
    )
    p.add_argument(
        "--encoder",
        choices=PRECISIONS,
        help="precision of the encoder's own weights (default: docs/quantization.md)",
    )
    p.add_argument(
        "--embedding",
        choices=PRECISIONS,
        help="precision of the weights whose rows are gathered (the embedding, a tied head); "
        "by default int8 under int4 weights, else --weights",
    )
    p.add_argument(
        "--activation-scale",
        choices=ACTIVATION_SCALES,
        default="tensor",
        help="how int8 and uint8 products scale their input: one scale for the batch (default), "
        "or one per row, so that each input gets what it gets alone",
    )


def run(args: argparse.Namespace) -> int:
    with Progress(quiet=args.json) as progress:
        progress(f"storing the weights as {args.weights}")
        result = quantize_file(args.file, args.output, args)
    emit(args, jsonable(result), lambda: summary_of(result))
    return ExitCode.OK


def quantize_file(source: str | Path, output: str | None, args: argparse.Namespace) -> Any:
    """``source`` quantized as the options say; the quantization's report."""
    from onnxmerge.quantization import quantize

    return quantize(
        source,
        output,
        weights=args.weights,
        encoder=args.encoder,
        activation_scale=args.activation_scale,
        embedding=args.embedding,
        overwrite=args.overwrite,
        external_data=True if args.external_data else None,
    ).report


def summary_of(result: Any) -> str:
    """What the quantization wrote, in one line."""
    parts = ", ".join(f"{part} {p}" for part, p in sorted(result.precision.items()))
    return (
        f"wrote {result.path} ({human(result.bytes_after)}, "
        f"{result.bytes_after / max(1, result.bytes_before):.2f}x the float file): "
        f"{len(result.weights)} weights stored quantized ({parts}), each once"
    )
