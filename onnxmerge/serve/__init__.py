"""Serve merged models over HTTP: LibreTranslate's ``/translate`` and ``/languages``,
``/v1/generate``, ``/health`` and ``/metrics``, with concurrent requests batched together
(docs/serve.md). Needs the ``serve`` extra: ``pip install 'onnxmerge[serve]'``.

``create_app(models, ...)`` is the ASGI app to mount in your own; ``run(models, host, port,
...)`` serves it with uvicorn and drains on SIGTERM.
"""

from __future__ import annotations

from onnxmerge.serve._app import create_app
from onnxmerge.serve._limits import Limits
from onnxmerge.serve._models import models_from_arguments
from onnxmerge.serve._server import Server, run

__all__ = ["Limits", "Server", "create_app", "models_from_arguments", "run"]
