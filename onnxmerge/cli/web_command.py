"""``onnxmerge web SOURCE -o SITE``: a static site that runs the model in the browser."""

from __future__ import annotations

import argparse

from onnxmerge.cli._shared import (
    ExitCode,
    Progress,
    dtype_argument,
    emit,
    human,
    table,
    whisper_prompt_arguments,
)

HELP = "write a static site that translates (Whisper: transcribes) in the browser with one model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="export folder, merged model or generator model")
    p.add_argument("-o", "--output", required=True, help="site folder to write")
    p.add_argument(
        "--weights",
        choices=("int8", "uint8", "fp16", "int4"),
        help="quantize the weights first (default: as they are)",
    )
    p.add_argument("--tokenizer", help="folder with tokenizer.json (default: beside the source)")
    dtype_argument(p, every=False)
    p.add_argument("--example", action="append", help="a sentence the text box starts with")
    whisper_prompt_arguments(p)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty site folder")


def run(args: argparse.Namespace) -> int:
    from onnxmerge.web import build_site

    with Progress(quiet=args.json) as progress:
        site = build_site(
            args.source,
            args.output,
            weights=args.weights,
            tokenizer=args.tokenizer,
            examples=args.example or (),
            language=args.language,
            task=args.task,
            overwrite=args.overwrite,
            progress=progress,
            dtype=args.dtype,
        )
    files = {p.name: p.stat().st_size for p in sorted(site.iterdir())}

    def text() -> str:
        rows = [(name, human(size)) for name, size in files.items()]
        return (
            table(rows, ("file", "size"))
            + f"\n\nwrote {site}; preview it with:\n"
            + f"  cd {site} && npm install --ignore-scripts\n"
            + "  python3 -m http.server --bind 127.0.0.1 8000   # then open http://127.0.0.1:8000/"
        )

    emit(args, {"site": site, "files": files}, text)
    return ExitCode.OK
