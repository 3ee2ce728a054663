"""``onnxmerge translate FILE [SOURCE]``: a text file, line by line, through
:func:`onnxmerge.translate.translate_lines`; one output line per input line, in order."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import sys
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import IO, Any

from onnxmerge.cli._shared import (
    ExitCode,
    Progress,
    at_least,
    generation_arguments,
    generation_options,
    need,
    tokenizers_only,
)

HELP = "translate a file line by line with a merged model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="merged model")
    p.add_argument(
        "source", nargs="?", default="-", help="text file, one input per line (default: stdin)"
    )
    p.add_argument("-o", "--output", help="output file (default: stdout)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument(
        "--ids", action="store_true", help="lines are token ids separated by spaces, in and out"
    )
    p.add_argument(
        "--max-batch-size",
        type=at_least(1),
        default=32,
        help="inputs per batch, or source tokens with --batch-type tokens (default 32)",
    )
    p.add_argument(
        "--batch-type",
        choices=("examples", "tokens"),
        default="examples",
        help="what --max-batch-size counts (default: examples)",
    )
    p.add_argument(
        "--parallel-batches",
        type=at_least(1),
        default=1,
        metavar="N",
        help="batches translated at once, sharing --threads (default 1)",
    )
    p.add_argument(
        "--threads",
        type=at_least(1),
        metavar="N",
        help="onnxruntime's threads in all (default: every core with --parallel-batches, "
        "else onnxruntime's choice)",
    )
    generation_arguments(p)
    p.set_defaults(check=check)


def check(args: argparse.Namespace) -> str | None:
    if args.json and not args.output:
        return "--json needs -o OUT: without it stdout carries the translations"
    return None


def run(args: argparse.Namespace) -> int:
    need("onnxruntime", "runtime")
    if not args.ids:
        need("transformers", "text")
        tokenizers_only()
    from onnxmerge import model_io

    source = _source(args.source)
    output = Path(args.output) if args.output else None
    if output is not None:
        model_io.check_output(output, [source] if source else [], overwrite=args.overwrite)
    # Steps show on a terminal only; the status line not where the translations go to it too.
    progress = Progress(
        quiet=args.json or not sys.stderr.isatty(),
        live=not (output is None and sys.stdout.isatty()),
    )
    with contextlib.ExitStack() as cleanup:
        # The output's temporary file first: an output that cannot be written fails at once.
        sink = (
            cleanup.enter_context(model_io.text_written_atomically(output))
            if output is not None
            else sys.stdout
        )
        cleanup.callback(progress.finish)
        lines = cleanup.enter_context(_lines_of(source))
        results = cleanup.enter_context(contextlib.closing(_start(args, lines, progress)))
        done = _write(results, sink, progress)
    return _report(args, output, done)


def _source(name: str) -> Path | None:
    """SOURCE as a path (None for stdin), refused here, before the model loads, where it cannot
    be read: a pipe, ``/dev/stdin`` or ``<(...)`` is a file to read too."""
    if name == "-":
        return None
    source = Path(name)
    if not source.exists():
        raise FileNotFoundError(errno.ENOENT, "no such file", name)
    if source.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder; give a text file, or - for stdin", name)
    return source


@contextlib.contextmanager
def _lines_of(source: Path | None) -> Iterator[IO[bytes]]:
    if source is None:
        yield sys.stdin.buffer
    else:
        with open(source, "rb") as stream:
            yield stream


def _start(
    args: argparse.Namespace, lines: IO[bytes], progress: Progress
) -> Generator[Any, None, None]:
    """The model and its tokenizer loaded, each a step; the results of every line, to come."""
    from onnxmerge.translate import open_model, translate_lines

    progress("loading the model")
    model = open_model(
        args.file,
        parallel_batches=args.parallel_batches,
        threads=args.threads,
        session_cache=args.session_cache,
    )
    if not args.ids:
        progress("loading the tokenizer")
    results = translate_lines(
        model,
        lines,
        ids=args.ids,
        max_batch_size=args.max_batch_size,
        batch_type=args.batch_type,
        parallel_batches=args.parallel_batches,
        **generation_options(args),
    )
    progress.finish()
    return results


def _write(results: Iterator[Any], sink: IO[str], progress: Progress) -> dict[str, Any]:
    """Each result on its line of ``sink``, each failure on stderr as it comes; the counts."""
    translated = tokens = 0
    errors: list[dict[str, Any]] = []
    started = time.perf_counter()

    def status() -> str:
        rate = tokens / max(time.perf_counter() - started, 1e-9)
        return f"  {translated} lines, {tokens} tokens, {rate:.1f} tokens/s"

    for result in results:
        if result.ok:
            translated += 1
            tokens += result.tokens
            progress.show(status(), every=0.2)
        else:
            errors.append({"line": result.number, "message": result.error})
            progress.clear()
            print(f"onnxmerge: line {result.number}: {result.error}", file=sys.stderr, flush=True)
        sink.write(result.text + "\n")
    sink.flush()
    if translated:
        progress.show(status())  # the final counts stay on the screen
    return {"translated": translated, "tokens": tokens, "errors": errors}


def _report(args: argparse.Namespace, output: Path | None, done: dict[str, Any]) -> int:
    """The counts as JSON with ``--json``; the failed lines, if any, in one error line."""
    errors = done["errors"]
    total = done["translated"] + len(errors)
    if args.json:
        report = {"lines": total, **done, "output": str(output)}
        print(json.dumps(report, indent=2))
    if not errors:
        return ExitCode.OK
    listed = ", ".join(str(e["line"]) for e in errors[:10]) + (", ..." if len(errors) > 10 else "")
    print(
        f"onnxmerge: error: {len(errors)} of {total} lines not translated "
        f"(line{'s' if len(errors) > 1 else ''} {listed}); an empty line stands in for each",
        file=sys.stderr,
        flush=True,
    )
    return ExitCode.ERROR
