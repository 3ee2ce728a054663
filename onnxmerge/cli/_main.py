"""The parser of every command, and ``main``: run one, map its failure to an exit code."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from onnxmerge import __version__
from onnxmerge.cli import (
    batch_command,
    demo_command,
    export_command,
    features_command,
    generate_command,
    inspect_command,
    merge_command,
    quantize_command,
    serve_command,
    transcribe_command,
    translate_command,
    verify_command,
    web_command,
)
from onnxmerge.cli._shared import ExitCode, failure

# Each command's module: its HELP, add_arguments(parser) and run(args) -> exit code.
COMMANDS: dict[str, ModuleType] = {
    "merge": merge_command,
    "quantize": quantize_command,
    "verify": verify_command,
    "inspect": inspect_command,
    "generate": generate_command,
    "translate": translate_command,
    "transcribe": transcribe_command,
    "export": export_command,
    "features": features_command,
    "web": web_command,
    "batch": batch_command,
    "serve": serve_command,
    "demo": demo_command,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``onnxmerge`` parser, with a subcommand per module of ``COMMANDS``."""
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
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.HELP, description=command.HELP, parents=[common])
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        p.set_defaults(handler=command.run, command_parser=p)
        command.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``onnxmerge`` command line ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code (``ExitCode``); usage errors exit from argparse with 2.
    """
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
        code, message = failure(e)
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
