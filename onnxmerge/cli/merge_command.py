"""``onnxmerge merge DIR``: an export folder into one model, and optionally its quantized copy
and its generator."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from onnxmerge.cli import quantize_command
from onnxmerge.cli._shared import (
    ExitCode,
    Progress,
    at_least,
    dtype_argument,
    emit,
    external_data_argument,
    human,
    jsonable,
    table,
    whisper_prompt,
    whisper_prompt_arguments,
)

HELP = "merge an export folder into one model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dir",
        help="folder written by optimum-cli export onnx, or a Hub repository with its models "
        "under onnx/ (transformers.js's layout)",
    )
    p.add_argument(
        "-o", "--output", help="output file (default: DIR/model.onnx, DIR/model{suffix}.onnx)"
    )
    dtype_argument(p, every=True)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    external_data_argument(p)
    p.add_argument(
        "--force",
        action="store_true",
        help="merge even if the files look like they come from different checkpoints",
    )
    p.add_argument(
        "--format",
        type=int,
        choices=(2, 3, 4),
        help="4: one decoder for every step, its cross-attention cache once per input; 3: "
        "the same with that cache once per row; 2: the two decoders of versions 1 and 2 "
        "(default: 4, else 3, where the merge proves it, else 2)",
    )
    p.add_argument(
        "--generation",
        choices=("greedy", "beam"),
        help="also write generator.onnx: the whole decoding loop inside one graph",
    )
    p.add_argument("--num-beams", type=at_least(2), help="beams for --generation beam (default 4)")
    p.add_argument(
        "--audio",
        action="store_true",
        help="Whisper: the generator reads 16 kHz audio and computes the log-mel features itself",
    )
    whisper_prompt_arguments(p)
    p.set_defaults(check=check)
    quantize_command.precision_arguments(p, required=False)


def check(args: argparse.Namespace) -> str | None:
    """What the options say wrong together, found before anything runs."""
    if args.num_beams is not None and args.generation != "beam":
        return "--num-beams applies only with --generation beam"
    if args.audio and not args.generation:
        return "--audio applies only with --generation"
    if (args.language or args.task) and not args.generation:
        return "--language and --task apply only with --generation"
    if (args.encoder or args.embedding or args.activation_scale != "tensor") and not args.weights:
        return "--encoder, --embedding and --activation-scale apply only with --weights"
    if args.dtype == "all" and (args.output or args.weights or args.generation):
        return (
            "--dtype all writes DIR/model{suffix}.onnx for each dtype; it takes no -o, "
            "--weights or --generation"
        )
    return None


def run(args: argparse.Namespace) -> int:
    from onnxmerge import model_io
    from onnxmerge.export_layout import EVERY_DTYPE, output_name
    from onnxmerge.merge import merge_seq2seq

    if args.dtype == EVERY_DTYPE:
        return _merge_every_dtype(args)
    output = Path(args.output) if args.output else Path(args.dir) / output_name(args.dtype)
    new_output = not output.exists()
    if args.generation:  # refused before merging, so that a refusal writes neither file
        from onnxmerge.generator import DEFAULT_OUTPUT_NAME

        model_io.check_output(output.parent / DEFAULT_OUTPUT_NAME, [], overwrite=args.overwrite)
    with Progress(quiet=args.json) as progress:
        result = merge_seq2seq(
            args.dir,
            args.output,
            overwrite=args.overwrite,
            external_data=True if args.external_data else None,
            force=args.force,
            progress=progress,
            format_version=args.format,
            dtype=args.dtype,
        ).report
        data, summary = result_json(result), summary_of(result)
        if args.weights:
            progress(f"storing the weights as {args.weights}")
            result = quantize_command.quantize_file(result.path, None, args)
            data["quantized"] = jsonable(result)
            summary += "\n" + quantize_command.summary_of(result)  # the generator runs on this file
        if args.generation:
            progress(f"building the {args.generation} decoding loop")
            data["generator"], said = _build_generator(args, result.path, new_output)
            summary += "\n" + said
    emit(args, data, lambda: summary)
    return ExitCode.OK


def _build_generator(args: argparse.Namespace, model: Path, new_output: bool) -> tuple[dict, str]:
    """The generator of ``model``: its JSON record and its summary line."""
    from onnxmerge.generator import build_generator

    num_beams = args.num_beams or 4
    try:
        generator = build_generator(
            model,
            search=args.generation,
            num_beams=num_beams,
            audio=args.audio,
            generation_config=whisper_prompt(args),
            overwrite=args.overwrite,
        )
    except BaseException:
        if new_output:  # no half-done output: the merged model goes with the generator
            model.unlink(missing_ok=True)
        raise
    size = generator.stat().st_size
    record = {
        "path": generator,
        "bytes": size,
        "search": args.generation,
        "num_beams": num_beams if args.generation == "beam" else 1,
        "audio": args.audio,
    }
    given = "16 kHz audio in" if args.audio else "token ids in"
    said = (
        f"wrote {generator} ({human(size)}): "
        f"{args.generation} search inside the graph, {given}, token ids out"
    )
    return record, said


def _merge_every_dtype(args: argparse.Namespace) -> int:
    from onnxmerge.merge import merge_every_dtype

    with Progress(quiet=args.json) as progress:
        results = merge_every_dtype(
            args.dir,
            overwrite=args.overwrite,
            external_data=True if args.external_data else None,
            force=args.force,
            progress=progress,
        )
    emit(
        args,
        [result_json(r) for r in results],
        lambda: "\n\n".join(summary_of(r) for r in results),
    )
    return ExitCode.OK


# -- the merge's report, which export and demo print too ---------------------------------------


def with_checkpoint(result: Any, source: Path) -> Any:
    """The result, with the checkpoint of the model folder it was exported from when known."""
    from onnxmerge.merge import find_checkpoint

    if result.checkpoint_bytes is not None or not source.is_dir():
        return result
    found = find_checkpoint(source)
    if found is None:
        return result
    return dataclasses.replace(result, checkpoint_bytes=found.stat().st_size)


def result_json(result: Any) -> dict:
    """A merge's report as ``--json`` prints it."""
    data = jsonable(result)
    data.update(
        constants_lifted=result.constants_lifted,
        input_bytes=result.input_bytes,
        bytes_saved=result.bytes_saved,
        checkpoint_ratio=result.checkpoint_ratio,
    )
    return data


def _relative(path: Path, folder: Path | None) -> str:
    try:
        return path.relative_to(folder).as_posix() if folder else path.name
    except ValueError:
        return path.name


def summary_of(result: Any) -> str:
    """A merge's report as a table of the files read and written, then what it saved."""
    base = result.config_dir or result.path.parent
    rows = [(_relative(f.path, base), f.role, human(f.bytes)) for f in result.inputs]
    rows.append(("total read", "", human(result.input_bytes)))
    rows.append((_relative(result.path, base), "merged", human(result.output_bytes)))
    lines = [table(rows, ("file", "role", "size")), ""]
    if _chose_files(result):
        lines.append(_dtype_line(result))
    saved = result.bytes_saved
    lines.append(
        f"tensors: {result.tensors_in} in, {result.tensors_out} out; "
        f"{len(result.shared)} stored once instead of twice or more "
        f"({len(result.transposed)} found transposed)"
    )
    lines.append(
        f"saved {human(saved)} ({saved / max(1, result.input_bytes):.0%} of the files read)"
    )
    if result.checkpoint_ratio is not None:
        lines.append(
            f"merged model / PyTorch checkpoint: {result.checkpoint_ratio:.3f}x "
            f"({human(result.checkpoint_bytes)} checkpoint)"
        )
    lines.append(f"format version {result.format_version}: {result.format_reason}")
    lines.append(f"wrote {result.path}")
    return "\n".join(lines)


def _chose_files(result: Any) -> bool:
    """Whether the merge picked files from several dtypes or a Hub layout: worth saying which."""
    return (
        result.dtype not in (None, "fp32")
        or any(d != result.dtype for d in result.dtypes_present)
        or (result.config_dir is not None and result.config_dir != result.model_dir)
    )


def _dtype_line(result: Any) -> str:
    """Which dtype's files were merged, from where, and which others the folder holds."""
    where = os.fspath(result.model_dir or result.path.parent)
    if result.dtype is None:
        text = f"merged the .onnx files of {where}"
    else:
        from onnxmerge.export_layout import DTYPE_SUFFIXES

        suffix = DTYPE_SUFFIXES[result.dtype]
        named = f"suffix {suffix}" if suffix else "no suffix"
        text = f"dtype {result.dtype} ({named}) from {where}"
    if result.config_dir is not None and result.config_dir != result.model_dir:
        text += f"; configs from {result.config_dir}"
    others = [d for d in result.dtypes_present if d != result.dtype]
    if others:
        text += f"\nalso present: {', '.join(others)} (--dtype NAME merges one, --dtype all each)"
    return text
