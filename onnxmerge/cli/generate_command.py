"""``onnxmerge generate FILE``: token ids or texts given on the command line, generated on."""

from __future__ import annotations

import argparse

from onnxmerge.cli._shared import (
    ExitCode,
    Progress,
    at_least,
    emit,
    generation_arguments,
    generation_options,
    need,
    tokenizers_only,
)

HELP = "generate with a merged model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="merged model")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--ids", type=int, nargs="+", help="source token ids")
    group.add_argument(
        "--text", nargs="+", help="source texts (needs a tokenizer beside the model)"
    )
    p.add_argument(
        "--threads",
        type=at_least(1),
        metavar="N",
        help="onnxruntime's threads (default: onnxruntime's choice)",
    )
    generation_arguments(p)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    need("onnxruntime", "runtime")
    if args.text:
        need("transformers", "text")
        tokenizers_only()
    from onnxmerge.runtime import Seq2SeqModel, TextGenerator

    with Progress(quiet=args.json) as progress:
        progress("loading the model")
        model = Seq2SeqModel(args.file, session_cache=args.session_cache, threads=args.threads)
        if args.text:
            progress("loading the tokenizer")
            tokenizer = TextGenerator.load_tokenizer(model.path.parent)
        progress("generating")
        options = generation_options(args)
        if args.text:
            texts = model.translate(args.text, tokenizer, **options)
        else:
            ids = np.array([args.ids], dtype=np.int64)
            sequences = model.generate(input_ids=ids, attention_mask=np.ones_like(ids), **options)
    if args.text:
        emit(
            args,
            {"inputs": args.text, "outputs": texts},
            lambda: "\n".join(f"{s}\n  -> {t}" for s, t in zip(args.text, texts, strict=True)),
        )
        return ExitCode.OK
    emit(
        args,
        {"sequences": sequences.tolist()},
        lambda: "\n".join(" ".join(map(str, row)) for row in sequences.tolist()),
    )
    return ExitCode.OK
