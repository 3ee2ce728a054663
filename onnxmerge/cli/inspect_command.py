"""``onnxmerge inspect FILE``: a model's inputs, outputs, metadata and bytes by part."""

from __future__ import annotations

import argparse

from onnxmerge.cli._shared import ExitCode, emit, human, jsonable, table

HELP = "show a model's inputs, outputs, metadata and size by part"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file")
    p.add_argument("--all", action="store_true", help="list every cache input and output")


def run(args: argparse.Namespace) -> int:
    from onnxmerge import contract
    from onnxmerge.inspection import inspect_model, is_merged

    found = inspect_model(args.file)

    def text() -> str:
        io_rows = [("input", t.name, t.type, _shape(t.shape)) for t in found.inputs]
        io_rows += [("output", t.name, t.type, _shape(t.shape)) for t in found.outputs]
        if len(io_rows) > 16 and not args.all:
            # Layer 0 shows what the cache tensors look like; later layers fold into one line.
            hidden = [r for r in io_rows if contract.cache_layer(r[1]) not in (None, 0)]
            io_rows = [r for r in io_rows if r not in hidden]
            io_rows.append(("", f"... {len(hidden)} more cache tensors (--all shows them)", "", ""))
        total = sum(found.bytes_by_part.values()) or 1
        parts = [(k, human(v), f"{v / total:.0%}") for k, v in found.bytes_by_part.items()]
        meta = [
            (k, (v[:60] + "...") if len(v) > 63 else v) for k, v in sorted(found.metadata.items())
        ]
        kind = "merged seq2seq model" if is_merged(found) else "ONNX model (not merged)"
        return "\n\n".join(
            [
                f"{found.path}: {kind}, {human(found.file_bytes)} on disk, "
                f"{found.initializers} initializers",
                table(io_rows, ("", "name", "type", "shape")),
                table(parts, ("part", "bytes", "share")),
                table(meta, ("metadata", "value")) if meta else "no metadata",
            ]
        )

    emit(args, jsonable(found), text)
    return ExitCode.OK


def _shape(dims) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"
