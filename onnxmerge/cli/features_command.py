"""``onnxmerge features SOURCE``: Whisper's log-mel features as a model of their own."""

from __future__ import annotations

import argparse
from pathlib import Path

from onnxmerge.cli._shared import ExitCode, emit, human

HELP = "write Whisper's log-mel features as a model of their own"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="Whisper export folder, merged model or generator model")
    p.add_argument("-o", "--output", help="output file (default: features.onnx beside SOURCE)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")


def run(args: argparse.Namespace) -> int:
    from onnxmerge.generator.audio import DEFAULT_FEATURES_NAME, build_features, spec_for_source

    source = Path(args.source)
    folder = source if source.is_dir() else source.parent
    output = Path(args.output) if args.output else folder / DEFAULT_FEATURES_NAME
    spec = spec_for_source(source)
    path = build_features(source, output, spec=spec, overwrite=args.overwrite)
    data = {"path": path, "bytes": path.stat().st_size, **spec.as_dict()}
    emit(
        args,
        data,
        lambda: (
            f"wrote {path} ({human(path.stat().st_size)}): {spec.sampling_rate} Hz audio "
            f"in, {spec.n_mels} mel bins x {spec.frames} frames out"
        ),
    )
    return ExitCode.OK
