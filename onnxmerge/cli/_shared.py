"""What every command shares: exit codes and the error mapping, the progress printer, tables,
``--json`` output, the dependency check and the arguments several commands take."""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from onnxmerge.errors import (
    MissingDependencyError,
    OnnxMergeError,
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


def failure(e: Exception) -> tuple[int, str]:
    """The exit code and the one-line message for an exception that ends a command."""
    if isinstance(e, MissingDependencyError):
        return ExitCode.MISSING_DEPENDENCY, str(e)
    # A value the library refuses once the command runs (an InvalidArgumentError among them) is
    # refused input, as it always exited; 2 stays argparse's, found before anything runs.
    if isinstance(e, OnnxMergeError):
        return ExitCode.ERROR, str(e)
    if isinstance(e, FileNotFoundError):
        return ExitCode.ERROR, f"{e.filename or e}: no such file"
    if isinstance(e, IsADirectoryError):  # a folder given where a file is read
        return ExitCode.ERROR, f"{e.filename} {e.strerror}" if e.filename else str(e)
    # Anything else is a bug; it must not exit 1, which means "verify found a mismatch".
    return (
        ExitCode.INTERNAL,
        f"{type(e).__name__}: {e} (rerun with -v for the traceback and report it)",
    )


class Progress:
    """Everything a long command shows on stderr while it works: each step with the time it
    took (``progress("loading the model")``, the callable the library's ``progress=`` takes),
    and a status line redrawn in place on a terminal (``show``).

    Args:
        quiet: show nothing (``--json``, or a command that shows steps on a terminal only).
        live: whether a status line may be drawn: never off a terminal, nor where it would mix
            with output on the same terminal.
    """

    def __init__(self, quiet: bool, *, live: bool = True):
        self.quiet = quiet
        self.live = live and not quiet and sys.stderr.isatty()
        self.current: str | None = None
        self.started = self.drawn = time.perf_counter()
        self.status: str | None = None

    def __call__(self, name: str) -> None:
        self.finish()
        self.current, self.started = name, time.perf_counter()
        self._write(f"  {name} ...", end="")

    def show(self, status: str, *, every: float = 0.0) -> None:
        """Draw ``status`` in place of the last one, at most once per ``every`` seconds."""
        now = time.perf_counter()
        if self.live and now - self.drawn >= every:
            self.drawn, self.status = now, status
            self._write(f"\r{status}\033[K", end="")

    def line(self, text: str) -> None:
        """A line of its own, below the status line, which is drawn again by the next show."""
        self.clear()
        self._write(text)

    def clear(self) -> None:
        """Erase the status line, before something else goes to stderr."""
        if self.live and self.status is not None:
            self._write("\r\033[K", end="")

    def finish(self) -> None:
        """End the current step with its time, and leave the last status line on screen."""
        if self.current is not None:
            self._write(f" {time.perf_counter() - self.started:.1f} s")
            self.current = None
        if self.live and self.status is not None:
            self._write("")
            self.status = None

    def _write(self, text: str, end: str = "\n") -> None:
        if not self.quiet:
            print(text, end=end, file=sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()


def human(n: int | float | None) -> str:
    """A byte count as people read it: 1.2 MB."""
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


def jsonable(obj: Any) -> Any:
    """``obj`` with dataclasses, paths and arrays turned into what ``json.dumps`` writes."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {k: jsonable(v) for k, v in asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return os.fspath(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return obj


def emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    """The command's result on stdout: ``data`` as JSON with ``--json``, else ``text()``."""
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text())


def need(module: str, extra: str) -> None:
    """Refuse, with what to install, where ``module`` is not installed."""
    import importlib.util

    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise MissingDependencyError(
            f"this command needs {module}: pip install 'onnxmerge[{extra}]'"
        )


def tokenizers_only() -> None:
    """Keep transformers from importing torch, which only a tokenizer's user would wait for
    (seconds); called where this process needs no model from transformers."""
    if "transformers" not in sys.modules:
        os.environ.setdefault("USE_TORCH", "0")
        if not logging.getLogger().isEnabledFor(logging.INFO):
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # "no PyTorch found"


def generation_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--max-new-tokens`` and ``--num-beams`` where given, as ``generate`` takes them."""
    given = (("max_new_tokens", args.max_new_tokens), ("num_beams", args.num_beams))
    return {k: v for k, v in given if v is not None}


# -- arguments several commands take ------------------------------------------------------------


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def whisper_prompt_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--language",
        metavar="CODE",
        help="Whisper: the language of the audio (en, fr, ...); a multilingual model needs one",
    )
    p.add_argument(
        "--task", choices=("transcribe", "translate"), help="Whisper: the task (default transcribe)"
    )


def whisper_prompt(args: argparse.Namespace) -> dict[str, str] | None:
    chosen = {k: getattr(args, k) for k in ("language", "task") if getattr(args, k) is not None}
    return chosen or None


def dtype_argument(p: argparse.ArgumentParser, *, every: bool) -> None:
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


def external_data_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--external-data",
        action="store_true",
        help="store weights in OUTPUT_data beside the model: faster to load, less memory "
        "(automatic past 2 GB)",
    )


def generation_arguments(p: argparse.ArgumentParser) -> None:
    """What `generate` and `translate` both take: the search and the session cache."""
    p.add_argument("--max-new-tokens", type=at_least(1))
    p.add_argument("--num-beams", type=at_least(1))
    p.add_argument(
        "--session-cache",
        metavar="DIR",
        help="keep onnxruntime's optimized graph in DIR, so that later runs load faster",
    )
