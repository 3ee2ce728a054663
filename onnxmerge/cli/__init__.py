"""The ``onnxmerge`` command: the only package that talks to a person.

One module per command (``merge``, ``quantize``, ``verify``, ``inspect``, ``generate``,
``translate``, ``export``, ``features``, ``web``, ``batch``, ``demo``), each with its ``HELP``,
``add_arguments(parser)`` and ``run(args)``; ``_shared`` holds the exit codes, the error
mapping, the progress printer and the arguments several commands take; ``_main`` the parser and
``main``.
"""

from __future__ import annotations

from onnxmerge.cli import demo
from onnxmerge.cli._main import build_parser, main
from onnxmerge.cli._shared import ExitCode, Progress, failure, human, table

# The names these were imported by before the command became a package.
_failure = failure
_human = human
_DEMO_SIZE_NOTE = demo.SIZE_NOTE

__all__ = ["ExitCode", "Progress", "build_parser", "main", "table"]
