"""The ``onnxmerge`` command: the only package that talks to a person.

One module per command (``merge_command``, ``quantize_command``, ... ``serve_command``: named
apart from the library's stages they call), each with its ``HELP``,
``add_arguments(parser)`` and ``run(args)``; ``_shared`` holds the exit codes, the error
mapping, the progress printer and the arguments several commands take; ``_main`` the parser and
``main``.
"""

from __future__ import annotations

from onnxmerge.cli._main import build_parser, main
from onnxmerge.cli._shared import ExitCode, Progress, failure, human, table

__all__ = ["ExitCode", "Progress", "build_parser", "failure", "human", "main", "table"]
