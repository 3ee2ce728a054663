"""The ``onnxmerge`` command: the only module that talks to a person."""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from onnxmerge import __version__
from onnxmerge.errors import (
    ExportFolderError,
    MissingDependencyError,
    OnnxMergeError,
    RefusedOutputError,
)


class ExitCode(enum.IntEnum):
    """The exit codes and what they mean: the one source of docs/cli.md's table and of --help."""

    meaning: str

    def __new__(cls, value: int, meaning: str):
        member = int.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member

    OK = 0, "success (verify: every output within the tolerance)"
    MISMATCH = 1, "verify found an output that differs by more than the tolerance"
    USAGE = 2, "usage error: unknown command or option, missing or invalid argument"
    ERROR = 3, "refused input or output: the message says why (not an export, output exists, ...)"
    MISSING_DEPENDENCY = 4, "an optional dependency is missing: the message says what to install"
    INTERNAL = 5, "an unexpected error, a bug: rerun with -v and report the traceback"
    INTERRUPTED = 130, "interrupted (Ctrl-C)"
    TERMINATED = 143, "terminated (SIGTERM), cleaned up as after Ctrl-C"


def _human(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or (cell[0] in "-+." and cell[1:2].isdigit()))


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A plain-text table; columns of numbers are right-aligned."""
    body = [[str(c) for c in row] for row in rows]
    cells = [[str(c) for c in header], *body]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    right = [
        all(_numeric(r[i]) or not r[i] for r in body) and any(r[i] for r in body)
        for i in range(len(header))
    ]

    def line(row: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in body)])


def _jsonable(obj):
    if is_dataclass(obj) and not isinstance(obj, type):
        return {k: _jsonable(v) for k, v in asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return os.fspath(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return obj


class _Steps:
    """One line per step on stderr, with the time each took: progress for long merges."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.current: str | None = None
        self.started = 0.0

    def __call__(self, name: str) -> None:
        self.finish()
        self.current, self.started = name, time.perf_counter()
        if not self.quiet:
            print(f"  {name} ...", end="", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.current is not None and not self.quiet:
            print(f" {time.perf_counter() - self.started:.1f} s", file=sys.stderr, flush=True)
        self.current = None

    def __enter__(self) -> _Steps:
        return self

    def __exit__(self, *exc_info) -> None:
        self.finish()


def _with_checkpoint(result, source: Path):
    """The result, with the checkpoint of the model folder it was exported from when known."""
    import dataclasses

    from onnxmerge.merge import find_checkpoint

    if result.checkpoint_bytes is not None or not source.is_dir():
        return result
    found = find_checkpoint(source)
    if found is None:
        return result
    return dataclasses.replace(result, checkpoint_bytes=found.stat().st_size)


def _relative(path: Path, folder: Path | None) -> str:
    try:
        return path.relative_to(folder).as_posix() if folder else path.name
    except ValueError:
        return path.name


def _merge_summary(result) -> str:
    base = result.config_dir or result.path.parent
    rows = [(_relative(f.path, base), f.role, _human(f.bytes)) for f in result.inputs]
    rows.append(("total read", "", _human(result.input_bytes)))
    rows.append((_relative(result.path, base), "merged", _human(result.output_bytes)))
    lines = [table(rows, ("file", "role", "size"))]
    saved = result.bytes_saved
    lines.append("")
    if _chose_files(result):
        lines.append(_dtype_line(result))
    lines.append(
        f"tensors: {result.tensors_in} in, {result.tensors_out} out; "
        f"{len(result.shared)} stored once instead of twice or more "
        f"({len(result.transposed)} found transposed)"
    )
    lines.append(
        f"saved {_human(saved)} ({saved / max(1, result.input_bytes):.0%} of the files read)"
    )
    if result.checkpoint_ratio is not None:
        lines.append(
            f"merged model / PyTorch checkpoint: {result.checkpoint_ratio:.3f}x "
            f"({_human(result.checkpoint_bytes)} checkpoint)"
        )
    lines.append(f"format version {result.format_version}: {result.format_reason}")
    lines.append(f"wrote {result.path}")
    return "\n".join(lines)


def _chose_files(result) -> bool:
    """Whether the merge picked files from several dtypes or a Hub layout: worth saying which."""
    return (
        result.dtype not in (None, "fp32")
        or any(d != result.dtype for d in result.dtypes_present)
        or (result.config_dir is not None and result.config_dir != result.model_dir)
    )


def _dtype_line(result) -> str:
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


def _result_json(result) -> dict:
    data = _jsonable(result)
    data.update(
        constants_lifted=result.constants_lifted,
        input_bytes=result.input_bytes,
        bytes_saved=result.bytes_saved,
        checkpoint_ratio=result.checkpoint_ratio,
    )
    return data


def cmd_merge(args: argparse.Namespace) -> int:
    from onnxmerge.export_layout import EVERY_DTYPE, output_name
    from onnxmerge.merge import merge_seq2seq_with_report

    if args.dtype == EVERY_DTYPE:
        return _merge_every_dtype(args)
    output = Path(args.output) if args.output else Path(args.dir) / output_name(args.dtype)
    new_output = not output.exists()
    if args.generation:
        _refuse_existing_generator(output, args.overwrite)
    with _Steps(quiet=args.json) as steps:
        result = merge_seq2seq_with_report(
            args.dir,
            args.output,
            overwrite=args.overwrite,
            external_data=True if args.external_data else None,
            force=args.force,
            progress=steps,
            format=args.format,
            dtype=args.dtype,
        )
    data = _result_json(result)
    summary = _merge_summary(result)
    if args.weights:
        with steps:
            steps(f"storing the weights as {args.weights}")
            quantized = _quantize(result.path, None, args)
        data["quantized"] = _jsonable(quantized)
        summary += "\n" + _quantize_summary(quantized)
        result = quantized  # the generator below runs on the quantized file
    if args.generation:
        from onnxmerge.generator import build_generator

        num_beams = args.num_beams or 4
        steps(f"building the {args.generation} decoding loop")
        try:
            generator = build_generator(
                result.path,
                search=args.generation,
                num_beams=num_beams,
                audio=args.audio,
                generation_config=_whisper_prompt(args),
                overwrite=args.overwrite,
            )
        except BaseException:
            if new_output:  # no half-done output: the merged model goes with the generator
                result.path.unlink(missing_ok=True)
            raise
        finally:
            steps.finish()
        data["generator"] = {
            "path": generator,
            "bytes": generator.stat().st_size,
            "search": args.generation,
            "num_beams": num_beams if args.generation == "beam" else 1,
        }
        data["generator"]["audio"] = args.audio
        given = "16 kHz audio in" if args.audio else "token ids in"
        summary += (
            f"\nwrote {generator} ({_human(generator.stat().st_size)}): "
            f"{args.generation} search inside the graph, {given}, token ids out"
        )
    _emit(args, data, lambda: summary)
    return ExitCode.OK


def _merge_every_dtype(args: argparse.Namespace) -> int:
    from onnxmerge.merge import merge_every_dtype

    with _Steps(quiet=args.json) as steps:
        results = merge_every_dtype(
            args.dir,
            overwrite=args.overwrite,
            external_data=True if args.external_data else None,
            force=args.force,
            progress=steps,
        )
    _emit(
        args,
        [_result_json(r) for r in results],
        lambda: "\n\n".join(_merge_summary(r) for r in results),
    )
    return ExitCode.OK


def _refuse_existing_generator(merged: Path, overwrite: bool) -> None:
    """Refuse before merging, so that a refusal writes neither file."""
    from onnxmerge.generator import DEFAULT_OUTPUT_NAME

    generator = merged.parent / DEFAULT_OUTPUT_NAME
    if generator.exists() and not overwrite:
        raise RefusedOutputError(
            f"{generator} exists; pass --overwrite to replace it (and {merged.name}), "
            "or move it away; nothing was written"
        )


def _quantize(source, output, args: argparse.Namespace):
    from onnxmerge.quantization import quantize_with_report

    return quantize_with_report(
        source,
        output,
        weights=args.weights,
        encoder=args.encoder,
        activation_scale=args.activation_scale,
        overwrite=args.overwrite,
        external_data=True if args.external_data else None,
    )


def _quantize_summary(result) -> str:
    parts = ", ".join(f"{part} {p}" for part, p in sorted(result.precision.items()))
    return (
        f"wrote {result.path} ({_human(result.bytes_after)}, "
        f"{result.bytes_after / max(1, result.bytes_before):.2f}x the float file): "
        f"{len(result.weights)} weights stored quantized ({parts}), each once"
    )


def cmd_quantize(args: argparse.Namespace) -> int:
    with _Steps(quiet=args.json) as steps:
        steps(f"storing the weights as {args.weights}")
        result = _quantize(args.file, args.output, args)
    _emit(args, _jsonable(result), lambda: _quantize_summary(result))
    return ExitCode.OK


def cmd_verify(args: argparse.Namespace) -> int:
    from onnxmerge.verify import verify

    _need("onnxruntime", "runtime")
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

    _emit(args, dict(_jsonable(report), ok=report.ok, max_abs_diff=report.max_abs_diff), text)
    return ExitCode.OK if report.ok else ExitCode.MISMATCH


def cmd_inspect(args: argparse.Namespace) -> int:
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
        parts = [(k, _human(v), f"{v / total:.0%}") for k, v in found.bytes_by_part.items()]
        meta = [
            (k, (v[:60] + "...") if len(v) > 63 else v) for k, v in sorted(found.metadata.items())
        ]
        kind = "merged seq2seq model" if is_merged(found) else "ONNX model (not merged)"
        return "\n\n".join(
            [
                f"{found.path}: {kind}, {_human(found.file_bytes)} on disk, "
                f"{found.initializers} initializers",
                table(io_rows, ("", "name", "type", "shape")),
                table(parts, ("part", "bytes", "share")),
                table(meta, ("metadata", "value")) if meta else "no metadata",
            ]
        )

    _emit(args, _jsonable(found), text)
    return ExitCode.OK


def _shape(dims) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"


def cmd_generate(args: argparse.Namespace) -> int:
    import numpy as np

    _need("onnxruntime", "runtime")
    if args.text:
        _need("transformers", "text")
        _tokenizers_only()
    from onnxmerge.runtime import Seq2SeqModel, TextGenerator

    with _Steps(quiet=args.json) as steps:
        steps("loading the model")
        model = Seq2SeqModel(args.file, session_cache=args.session_cache, threads=args.threads)
        if args.text:
            steps("loading the tokenizer")
            tokenizer = TextGenerator.load_tokenizer(model.path.parent)
        steps("generating")
        options = {
            k: v
            for k, v in (("max_new_tokens", args.max_new_tokens), ("num_beams", args.num_beams))
            if v is not None
        }
        if args.text:
            texts = model.translate(args.text, tokenizer, **options)
        else:
            ids = np.array([args.ids], dtype=np.int64)
            sequences = model.generate(input_ids=ids, attention_mask=np.ones_like(ids), **options)
    if args.text:
        _emit(
            args,
            {"inputs": args.text, "outputs": texts},
            lambda: "\n".join(f"{s}\n  -> {t}" for s, t in zip(args.text, texts, strict=True)),
        )
        return ExitCode.OK
    _emit(
        args,
        {"sequences": sequences.tolist()},
        lambda: "\n".join(" ".join(map(str, row)) for row in sequences.tolist()),
    )
    return ExitCode.OK


class _LineProgress:
    """Lines done and generated tokens per second, on stderr, when it is a terminal that the
    translations themselves do not go to."""

    def __init__(self, quiet: bool, to_stdout: bool):
        self.shown = not quiet and sys.stderr.isatty() and not (to_stdout and sys.stdout.isatty())
        self.lines = self.tokens = 0
        self.started = self.drawn = time.perf_counter()

    def __call__(self, tokens: int) -> None:
        self.lines += 1
        self.tokens += tokens
        now = time.perf_counter()
        if self.shown and now - self.drawn >= 0.2:
            self.drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.tokens / max(now - self.started, 1e-9)
        line = f"\r  {self.lines} lines, {self.tokens} tokens, {rate:.1f} tokens/s\033[K"
        print(line, end="", file=sys.stderr, flush=True)

    def clear(self) -> None:
        """Erase the drawn line, before something else goes to stderr; the next draw redraws it."""
        if self.shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.shown and self.lines:
            self._draw(time.perf_counter())
            print(file=sys.stderr)
            self.shown = False


def _source_lines(source: Path | None) -> Iterator[bytes]:
    """The lines of ``source`` (stdin for None) as bytes, without their line ends or the first
    line's UTF-8 byte order mark, which Windows editors write."""
    stream = sys.stdin.buffer if source is None else open(source, "rb")  # noqa: SIM115
    try:
        for number, line in enumerate(stream):
            line = line.rstrip(b"\r\n")
            yield line.removeprefix(b"\xef\xbb\xbf") if number == 0 else line
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def _line_ids(text: str) -> list[int] | None:
    """``--ids``: the line's decimal ids, or None where a word is not one."""
    words = text.split()
    if not all(word.isascii() and word.isdigit() for word in words):
        return None
    return [int(word) for word in words]


def _translate_inputs(args, model, tokenizer, lines: Iterable[bytes], records: deque):
    """The encoder input of each good line, for ``generate_many``; every line's record (its
    number and error, None when good) goes to ``records`` as the line is read."""
    import numpy as np

    from onnxmerge.settings import encoder_positions

    positions = encoder_positions(model.config)
    vocab = model.config.get("vocab_size")
    for number, raw in enumerate(lines, 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            records.append((number, f"not UTF-8 (byte {error.start + 1}); nothing translated"))
            continue
        if not text.strip():
            records.append((number, "empty line"))
            continue
        if args.ids:
            ids = _line_ids(text)
            if ids is None:
                records.append((number, "--ids takes non-negative integers separated by spaces"))
                continue
            outside = [i for i in ids if isinstance(vocab, int) and i >= vocab]
            if outside:
                records.append(
                    (number, f"id {outside[0]} is outside the vocabulary 0..{vocab - 1}")
                )
                continue
        else:
            ids = tokenizer(text)["input_ids"]
        if positions is not None and len(ids) > positions:
            records.append(
                (number, f"{len(ids)} tokens, more than the model's {positions} positions")
            )
            continue
        records.append((number, None))
        yield np.asarray(ids, dtype=np.int64)


def _check_translate_args(args: argparse.Namespace) -> str | None:
    if args.json and not args.output:
        return "--json needs -o OUT: without it stdout carries the translations"
    return None


def _translate_source(name: str) -> Path | None:
    """SOURCE as a path (None for stdin), refused here, before the model loads, where it cannot
    be read: a pipe, ``/dev/stdin`` or ``<(...)`` is a file to read too."""
    if name == "-":
        return None
    source = Path(name)
    if not source.exists():
        raise FileNotFoundError(2, "no such file", name)
    if source.is_dir():
        raise OnnxMergeError(f"{source} is a folder; give a text file, or - for stdin")
    return source


def _one_line(text: str) -> str:
    """A translation on one output line: a line break inside it would shift every later line."""
    return " ".join(text.splitlines()) if "\n" in text or "\r" in text else text


def cmd_translate(args: argparse.Namespace) -> int:
    _need("onnxruntime", "runtime")
    if not args.ids:
        _need("transformers", "text")
        _tokenizers_only()
    from onnxmerge import model_io

    source = _translate_source(args.source)
    output = Path(args.output) if args.output else None
    if output is not None:
        model_io.check_output(output, [source] if source else [], overwrite=args.overwrite)
    with contextlib.ExitStack() as cleanup:
        # The output's temporary file first: an output that cannot be written fails at once.
        sink = (
            cleanup.enter_context(model_io.text_written_atomically(output))
            if output is not None
            else sys.stdout
        )
        model, tokenizer = _translation_model(args)
        progress = _LineProgress(quiet=args.json, to_stdout=output is None)
        cleanup.callback(progress.finish)
        errors = _translate_lines(args, model, tokenizer, source, sink, progress)
    total = progress.lines + len(errors)
    if args.json:
        print(
            json.dumps(
                {
                    "lines": total,
                    "translated": progress.lines,
                    "tokens": progress.tokens,
                    "errors": errors,
                    "output": str(output),
                },
                indent=2,
            )
        )
    if errors:
        listed = ", ".join(str(e["line"]) for e in errors[:10]) + (
            ", ..." if len(errors) > 10 else ""
        )
        print(
            f"onnxmerge: error: {len(errors)} of {total} lines not translated "
            f"(line{'s' if len(errors) > 1 else ''} {listed}); an empty line stands in for each",
            file=sys.stderr,
            flush=True,
        )
        return ExitCode.ERROR
    return ExitCode.OK


def _translation_model(args: argparse.Namespace) -> tuple:
    """The model, opened for ``--parallel-batches``, and its tokenizer (None with ``--ids``)."""
    from onnxmerge.runtime import Seq2SeqModel, TextGenerator

    with _Steps(quiet=args.json or not sys.stderr.isatty()) as steps:
        steps("loading the model")
        threads = args.threads
        if args.parallel_batches > 1:
            from onnxmerge._ort import shared_pool_threads

            threads = shared_pool_threads(args.parallel_batches, threads)
        model = Seq2SeqModel(args.file, session_cache=args.session_cache, threads=threads)
        _refuse_without_ids(model, args.file)
        tokenizer = None
        if not args.ids:
            steps("loading the tokenizer")
            tokenizer = TextGenerator.load_tokenizer(model.path.parent)
    return model, tokenizer


def _refuse_without_ids(model: Any, file: str) -> None:
    """translate feeds token ids: a model whose encoder reads something else is refused."""
    main = model._main_input()
    if main != "input_ids":
        raise OnnxMergeError(
            f"{file} reads {main}, not token ids: translate takes text or ids; "
            "call Seq2SeqModel.generate_many() on its inputs from Python"
        )


def _translate_lines(args, model, tokenizer, source, sink, progress) -> list[dict]:
    """Every line of ``source`` translated to ``sink``, in order, an empty line for each line
    that fails; the failures, as they are reported."""
    options = {
        k: v
        for k, v in (("max_new_tokens", args.max_new_tokens), ("num_beams", args.num_beams))
        if v is not None
    }
    records: deque = deque()
    errors: list[dict] = []

    def flush_errors() -> None:
        while records and records[0][1] is not None:
            number, message = records.popleft()
            errors.append({"line": number, "message": message})
            progress.clear()
            print(f"onnxmerge: line {number}: {message}", file=sys.stderr, flush=True)
            sink.write("\n")

    inputs = _translate_inputs(args, model, tokenizer, _source_lines(source), records)
    results = model.generate_many(
        inputs,
        max_batch_size=args.max_batch_size,
        batch_type=args.batch_type,
        parallel_batches=args.parallel_batches,
        **options,
    )
    try:
        for sequences in results:
            flush_errors()
            records.popleft()
            generated = sequences[0, 1:]
            if tokenizer is None:  # --ids
                sink.write(" ".join(map(str, generated.tolist())) + "\n")
            else:
                text = tokenizer.decode(generated, skip_special_tokens=True)
                sink.write(_one_line(text) + "\n")
            progress(generated.size)
        flush_errors()
        sink.flush()
    finally:  # stops the batches running now (an error, Ctrl-C)
        results.close()
    return errors


def _tokenizers_only() -> None:
    """Keep transformers from importing torch, which only a tokenizer's user would wait for
    (seconds); called where this process needs no model from transformers."""
    if "transformers" not in sys.modules:
        os.environ.setdefault("USE_TORCH", "0")
        if not logging.getLogger().isEnabledFor(logging.INFO):
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # "no PyTorch found"


def _export(model: str, output: Path, task: str) -> None:
    _need("optimum.exporters.onnx", "export")
    from optimum.exporters.onnx import main_export

    verbose = logging.getLogger().isEnabledFor(logging.INFO)
    if not verbose:
        for name in ("optimum", "transformers"):
            logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        if not verbose:
            warnings.simplefilter("ignore")  # torch's TracerWarnings say nothing to a user
        main_export(model, output=output, task=task)


def cmd_export(args: argparse.Namespace) -> int:
    from onnxmerge.merge import merge_seq2seq_with_report

    output = Path(args.output) if args.output else Path(Path(args.model).name + "-onnx")
    if output.exists() and not args.overwrite and (not output.is_dir() or any(output.iterdir())):
        # optimum would replace the files already there before the merge could refuse.
        raise RefusedOutputError(
            f"{output} exists and is not empty; pass --overwrite to export into it again, "
            "or choose another folder with -o"
        )
    with _Steps(quiet=args.json) as steps:
        steps(f"exporting {args.model} with optimum")
        _export(args.model, output, args.task)
        _copy_tokenizer(Path(args.model), output)
        result = merge_seq2seq_with_report(output, overwrite=True, progress=steps)
        result = _with_checkpoint(result, Path(args.model))
    _emit(args, _result_json(result), lambda: _merge_summary(result))
    return ExitCode.OK


def _copy_tokenizer(source: Path, export_dir: Path) -> None:
    import shutil

    if not source.is_dir():
        return
    for path in source.iterdir():
        if (
            path.name.startswith(("tokenizer", "special_tokens", "vocab", "source.", "target."))
            and path.is_file()
            and not (export_dir / path.name).exists()
        ):
            shutil.copy2(path, export_dir / path.name)


_DEMO_SIZE_NOTE = (
    "(The demo model has 0.25 M parameters, so the graph itself is a large share of its size;\n"
    " on opus-mt-fr-en the merged file is 1.002x the checkpoint: docs/benchmarks.md)"
)


def cmd_demo(args: argparse.Namespace) -> int:
    """Export the shipped trained demo model, merge it, show the gain, translate with it."""
    from onnxmerge.demo import DEMO_MODEL_DIR, DEMO_SENTENCES
    from onnxmerge.merge import merge_seq2seq_with_report

    _need("onnxruntime", "runtime")
    from onnxmerge.runtime import Seq2SeqModel

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="onnxmerge-demo-"))
    export_dir = work / "export"
    with _Steps(quiet=args.json) as steps:
        if not (export_dir / "encoder_model.onnx").exists():
            steps("exporting the demo model with optimum")
            _export(os.fspath(DEMO_MODEL_DIR), export_dir, "text2text-generation-with-past")
            _copy_tokenizer(DEMO_MODEL_DIR, export_dir)
        else:
            _tokenizers_only()
        result = merge_seq2seq_with_report(export_dir, overwrite=True, progress=steps)
        result = _with_checkpoint(result, DEMO_MODEL_DIR)
        steps("translating")
        model = Seq2SeqModel(result.path)
        translations = model.translate(list(DEMO_SENTENCES))
    payload = dict(
        merge=_result_json(result),
        translations=[
            {"source": s, "output": t} for s, t in zip(DEMO_SENTENCES, translations, strict=True)
        ],
    )

    def text() -> str:
        rows = list(zip(DEMO_SENTENCES, translations, strict=True))
        return "\n\n".join(
            [
                _merge_summary(result),
                _DEMO_SIZE_NOTE,
                f"Generating with the single file {result.path.name}:",
                table(rows, ("French", "English (generated)")),
            ]
        )

    _emit(args, payload, text)
    return ExitCode.OK


def cmd_features(args: argparse.Namespace) -> int:
    from onnxmerge.generator.audio import DEFAULT_FEATURES_NAME, build_features, spec_for_source

    source = Path(args.source)
    folder = source if source.is_dir() else source.parent
    output = Path(args.output) if args.output else folder / DEFAULT_FEATURES_NAME
    spec = spec_for_source(source)
    path = build_features(source, output, spec=spec, overwrite=args.overwrite)
    data = {"path": path, "bytes": path.stat().st_size, **spec.as_dict()}
    _emit(
        args,
        data,
        lambda: (
            f"wrote {path} ({_human(path.stat().st_size)}): {spec.sampling_rate} Hz audio "
            f"in, {spec.n_mels} mel bins x {spec.frames} frames out"
        ),
    )
    return ExitCode.OK


def cmd_web(args: argparse.Namespace) -> int:
    from onnxmerge.web import build_site

    with _Steps(quiet=args.json) as steps:
        site = build_site(
            args.source,
            args.output,
            weights=args.weights,
            tokenizer=args.tokenizer,
            examples=args.example or (),
            language=args.language,
            task=args.task,
            overwrite=args.overwrite,
            progress=steps,
            dtype=args.dtype,
        )
    files = {p.name: p.stat().st_size for p in sorted(site.iterdir())}

    def text() -> str:
        rows = [(name, _human(size)) for name, size in files.items()]
        return (
            table(rows, ("file", "size"))
            + f"\n\nwrote {site}; preview it with:\n"
            + f"  cd {site} && npm install --ignore-scripts\n"
            + "  python3 -m http.server --bind 127.0.0.1 8000   # then open http://127.0.0.1:8000/"
        )

    _emit(args, {"site": site, "files": files}, text)
    return ExitCode.OK


class _Progress:
    """A progress bar on stderr (a line per model when stderr is not a terminal)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.counts: dict[str, int] = {}

    def __call__(self, result, done: int, total: int) -> None:
        self.counts[result.status] = self.counts.get(result.status, 0) + 1
        if self.quiet:
            return
        counts = ", ".join(f"{n} {status}" for status, n in self.counts.items())
        if self.tty:
            filled = round(30 * done / total)
            bar = "#" * filled + "-" * (30 - filled)
            print(f"\r[{bar}] {done}/{total}  {counts}\033[K", end="", file=sys.stderr, flush=True)
        else:
            print(f"  [{done}/{total}] {result.name}: {result.status}", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.tty and not self.quiet and self.counts:
            print(file=sys.stderr)


def cmd_batch(args: argparse.Namespace) -> int:
    from onnxmerge.batch import FAILED, RESULTS_NAME, convert_many

    progress = _Progress(quiet=args.json)
    started = time.perf_counter()
    try:
        results = convert_many(
            args.sources,
            args.output,
            jobs=args.jobs,
            ray=args.ray or False,
            weights=args.weights,
            generation=args.generation,
            num_beams=args.num_beams,
            web=args.web,
            dtype=args.dtype,
            memory_bytes=int(args.memory * 2**30) if args.memory else None,
            on_result=progress,
        )
    finally:
        progress.finish()
    elapsed = time.perf_counter() - started

    def text() -> str:
        rows = [
            (
                r.name,
                r.status,
                _human(r.input_bytes),
                _human(r.model_bytes),
                f"{r.ratio_to_checkpoint:.3f}x" if r.ratio_to_checkpoint else "-",
                f"{sum(r.seconds.values()):.1f}",
                _human(r.peak_rss_bytes),
                (r.error or "")[:100],
            )
            for r in results
        ]
        header = (
            "model",
            "status",
            "read",
            "model.onnx",
            "vs checkpoint",
            "s",
            "peak RSS",
            "error",
        )
        counts = ", ".join(f"{n} {s}" for s, n in progress.counts.items()) or "no models"
        return (
            table(rows, header)
            + f"\n\n{counts} in {elapsed:.1f} s; one line per model in "
            + os.path.join(args.output, RESULTS_NAME)
        )

    _emit(args, [r.to_json() for r in results], text)
    return ExitCode.ERROR if any(r.status == FAILED for r in results) else ExitCode.OK


def _need(module: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise MissingDependencyError(
            f"this command needs {module}: pip install 'onnxmerge[{extra}]'"
        )


def _emit(args: argparse.Namespace, data, text: Callable[[], str]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text())


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _whisper_prompt_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--language",
        metavar="CODE",
        help="Whisper: the language of the audio (en, fr, ...); a multilingual model needs one",
    )
    p.add_argument(
        "--task", choices=("transcribe", "translate"), help="Whisper: the task (default transcribe)"
    )


def _whisper_prompt(args: argparse.Namespace) -> dict[str, str] | None:
    chosen = {k: getattr(args, k) for k in ("language", "task") if getattr(args, k) is not None}
    return chosen or None


def _check_merge_args(args: argparse.Namespace) -> str | None:
    if args.num_beams is not None and args.generation != "beam":
        return "--num-beams applies only with --generation beam"
    if args.audio and not args.generation:
        return "--audio applies only with --generation"
    if (args.language or args.task) and not args.generation:
        return "--language and --task apply only with --generation"
    if (args.encoder or args.activation_scale != "tensor") and not args.weights:
        return "--encoder and --activation-scale apply only with --weights"
    if args.dtype == "all" and (args.output or args.weights or args.generation):
        return (
            "--dtype all writes DIR/model{suffix}.onnx for each dtype; it takes no -o, "
            "--weights or --generation"
        )
    return None


def _dtype_argument(p: argparse.ArgumentParser, *, every: bool) -> None:
    from onnxmerge.export_layout import DTYPE_SUFFIXES, EVERY_DTYPE

    names = (*DTYPE_SUFFIXES, EVERY_DTYPE) if every else tuple(DTYPE_SUFFIXES)
    p.add_argument(
        "--dtype",
        choices=names,
        metavar="NAME",
        help="which files of a folder with several dtypes (transformers.js's suffixes: fp32 "
        "none, fp16 _fp16, q8 _quantized, int8 _int8, uint8 _uint8, q4 _q4, q4f16 _q4f16, "
        "bnb4 _bnb4); default fp32"
        + ("; all: each present, into DIR/model{suffix}.onnx" if every else ""),
    )


def _external_data_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--external-data",
        action="store_true",
        help="store weights in OUTPUT_data beside the model: faster to load, less memory "
        "(automatic past 2 GB)",
    )


def _precision_arguments(p: argparse.ArgumentParser, *, required: bool) -> None:
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
        "--activation-scale",
        choices=ACTIVATION_SCALES,
        default="tensor",
        help="how int8 and uint8 products scale their input: one scale for the batch (default), "
        "or one per row, so that each input gets what it gets alone",
    )


def _merge_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `onnxmerge merge`."""
    p.add_argument(
        "dir",
        help="folder written by optimum-cli export onnx, or a Hub repository with its models "
        "under onnx/ (transformers.js's layout)",
    )
    p.add_argument(
        "-o", "--output", help="output file (default: DIR/model.onnx, DIR/model{suffix}.onnx)"
    )
    _dtype_argument(p, every=True)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    _external_data_argument(p)
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
    p.add_argument("--num-beams", type=_at_least(2), help="beams for --generation beam (default 4)")
    p.add_argument(
        "--audio",
        action="store_true",
        help="Whisper: the generator reads 16 kHz audio and computes the log-mel features itself",
    )
    _whisper_prompt_arguments(p)
    p.set_defaults(check=_check_merge_args)
    _precision_arguments(p, required=False)


def _quantize_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `onnxmerge quantize`."""
    p.add_argument("file", help="merged model (or an export folder, merged first)")
    p.add_argument("-o", "--output", help="output file (default: model_int8.onnx etc. beside FILE)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    _external_data_argument(p)
    _precision_arguments(p, required=True)


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `onnxmerge verify`."""
    p.add_argument("file", help="merged model")
    p.add_argument("--against", help="export folder (default: the model's folder)")
    _dtype_argument(p, every=False)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tolerance",
        type=float,
        help="max |diff| (default: 1e-4; for quantized files a share of each output's largest "
        "value that fits the precision)",
    )


def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `onnxmerge inspect`."""
    p.add_argument("file")
    p.add_argument("--all", action="store_true", help="list every cache input and output")


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `onnxmerge generate`."""
    p.add_argument("file", help="merged model")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--ids", type=int, nargs="+", help="source token ids")
    group.add_argument(
        "--text", nargs="+", help="source texts (needs a tokenizer beside the model)"
    )
    p.add_argument(
        "--threads",
        type=_at_least(1),
        metavar="N",
        help="onnxruntime's threads (default: onnxruntime's choice)",
    )
    _generation_arguments(p)


def _generation_arguments(p: argparse.ArgumentParser) -> None:
    """What `generate` and `translate` both take: the search and the session cache."""
    p.add_argument("--max-new-tokens", type=_at_least(1))
    p.add_argument("--num-beams", type=_at_least(1))
    p.add_argument(
        "--session-cache",
        metavar="DIR",
        help="keep onnxruntime's optimized graph in DIR, so that later runs load faster",
    )


def _translate_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `onnxmerge translate`."""
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
        type=_at_least(1),
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
        type=_at_least(1),
        default=1,
        metavar="N",
        help="batches translated at once, sharing --threads (default 1)",
    )
    p.add_argument(
        "--threads",
        type=_at_least(1),
        metavar="N",
        help="onnxruntime's threads in all (default: every core with --parallel-batches, "
        "else onnxruntime's choice)",
    )
    _generation_arguments(p)
    p.set_defaults(check=_check_translate_args)


def _export_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `onnxmerge export`."""
    p.add_argument("model", help="transformers model folder or hub id")
    p.add_argument("-o", "--output", help="export folder (default: ./<model>-onnx)")
    p.add_argument("--task", default="text2text-generation-with-past")
    p.add_argument("--overwrite", action="store_true")


def _features_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `onnxmerge features`."""
    p.add_argument("source", help="Whisper export folder, merged model or generator model")
    p.add_argument("-o", "--output", help="output file (default: features.onnx beside SOURCE)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")


def _web_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `onnxmerge web`."""
    p.add_argument("source", help="export folder, merged model or generator model")
    p.add_argument("-o", "--output", required=True, help="site folder to write")
    p.add_argument(
        "--weights",
        choices=("int8", "uint8", "fp16", "int4"),
        help="quantize the weights first (default: as they are)",
    )
    p.add_argument("--tokenizer", help="folder with tokenizer.json (default: beside the source)")
    _dtype_argument(p, every=False)
    p.add_argument("--example", action="append", help="a sentence the text box starts with")
    _whisper_prompt_arguments(p)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty site folder")


def _batch_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `onnxmerge batch`."""
    p.add_argument(
        "sources", nargs="+", help="PyTorch or optimum export folders, or text files listing them"
    )
    p.add_argument("-o", "--output", required=True, help="output folder, one subfolder per model")
    p.add_argument("-j", "--jobs", type=int, help="worker processes (default: one per CPU)")
    p.add_argument(
        "--ray",
        nargs="?",
        const=True,
        metavar="ADDRESS",
        help="run each model as a Ray task, on the cluster at ADDRESS (default: the one started "
        "on this machine, else a new local one)",
    )
    p.add_argument("--weights", help="also quantize the weights to this type")
    p.add_argument("--generation", choices=("greedy", "beam"), help="also write generator.onnx")
    p.add_argument("--num-beams", type=int, default=4, help="beams for --generation beam")
    p.add_argument("--web", action="store_true", help="also build a web page running the model")
    _dtype_argument(p, every=False)
    p.add_argument(
        "--memory",
        type=float,
        metavar="GIB",
        help="memory each model declares and is held to (default: estimated from its files)",
    )


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `onnxmerge demo`."""
    p.add_argument("--dir", help="work folder to keep (default: a new temporary folder)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnxmerge",
        description="Merge an optimum seq2seq ONNX export into one file with every tensor stored "
        "once, check it, inspect it and generate with it.",
        epilog="Exit codes: " + "; ".join(f"{c.value} {c.meaning}" for c in ExitCode) + ".",
    )
    parser.add_argument("--version", action="version", version=f"onnxmerge {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details; show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # SUPPRESS: a -v given before the command is not reset by the command's own default.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log details; show tracebacks",
    )

    def add(name: str, handler, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, parents=[common])
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        p.set_defaults(handler=handler, command_parser=p)
        return p

    _merge_arguments(add("merge", cmd_merge, "merge an export folder into one model"))
    _quantize_arguments(
        add("quantize", cmd_quantize, "store a merged model's weights as int8, uint8, fp16 or int4")
    )
    _verify_arguments(
        add("verify", cmd_verify, "compare a merged model with the files it came from")
    )
    _inspect_arguments(
        add("inspect", cmd_inspect, "show a model's inputs, outputs, metadata and size by part")
    )
    _generate_arguments(add("generate", cmd_generate, "generate with a merged model"))
    _translate_arguments(
        add("translate", cmd_translate, "translate a file line by line with a merged model")
    )
    _export_arguments(
        add(
            "export", cmd_export, "export a local model folder (or hub id) with optimum, then merge"
        )
    )
    _features_arguments(
        add("features", cmd_features, "write Whisper's log-mel features as a model of their own")
    )
    _web_arguments(
        add(
            "web",
            cmd_web,
            "write a static site that translates (Whisper: transcribes) in the browser "
            "with one model",
        )
    )
    _batch_arguments(
        add("batch", cmd_batch, "convert many models: export, merge, verify and more; resumable")
    )
    _demo_arguments(
        add("demo", cmd_demo, "export, merge and run the bundled demo translation model")
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = args.check(args) if hasattr(args, "check") else None
    if problem:
        args.command_parser.error(problem)  # exits with the usage code
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    previous = _raise_on_sigterm()
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("onnxmerge: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except _Terminated:
        print("onnxmerge: terminated", file=sys.stderr)
        return ExitCode.TERMINATED
    except BrokenPipeError:
        # The reader left early (`onnxmerge inspect m.onnx --json | head`): not a failure.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK
    except Exception as e:
        code, message = _failure(e)
        if args.verbose:
            traceback.print_exc()
        print(f"onnxmerge: error: {message}", file=sys.stderr, flush=True)
        if args.json:  # a reader of stdout gets the failure as JSON too
            print(json.dumps({"error": {"exit_code": int(code), "message": message}}, indent=2))
        return code
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(BaseException):
    """SIGTERM, raised on the main thread as Ctrl-C is, so that every cleanup runs: temporary
    outputs are removed and running batches stop. Not an Exception: nothing may handle it."""


def _raise_on_sigterm() -> Any:
    """Have SIGTERM raise ``_Terminated``; the handler it replaces, or None where only the main
    thread may set one."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    return signal.signal(signal.SIGTERM, terminated)


def _failure(e: Exception) -> tuple[int, str]:
    """The exit code and the one-line message for an exception that ends a command."""
    if isinstance(e, MissingDependencyError):
        return ExitCode.MISSING_DEPENDENCY, str(e)
    if isinstance(e, OnnxMergeError):
        return ExitCode.ERROR, str(e)
    if isinstance(e, FileNotFoundError):
        return ExitCode.ERROR, f"{e.filename or e}: no such file"
    # Anything else is a bug; it must not exit 1, which means "verify found a mismatch".
    return (
        ExitCode.INTERNAL,
        f"{type(e).__name__}: {e} (rerun with -v for the traceback and report it)",
    )


if __name__ == "__main__":
    sys.exit(main())
