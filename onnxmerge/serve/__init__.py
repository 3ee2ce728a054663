"""Serve merged models over HTTP: LibreTranslate's ``/translate`` and ``/languages``,
``/v1/generate``, OpenAI's ``/v1/audio/transcriptions`` for Whisper models, ``/health`` and
``/metrics``, with concurrent requests batched together (docs/serve.md). Needs the ``serve``
extra: ``pip install 'onnxmerge[serve]'``.

``create_app(models, ...)`` is the ASGI app to mount in your own; ``run(models, host, port,
...)`` serves it with uvicorn and drains on SIGTERM; ``deploy_on_ray(models, replicas=2, ...)``
runs it as a Ray Serve deployment (the ``ray`` extra).
"""

from __future__ import annotations

from onnxmerge.errors import MissingDependencyError

try:
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import python_multipart  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as error:
    raise MissingDependencyError(
        f"serving needs FastAPI, uvicorn, prometheus-client and python-multipart ({error}): "
        "pip install 'onnxmerge[serve]'"
    ) from error

from onnxmerge.serve._app import create_app  # noqa: E402
from onnxmerge.serve._limits import Limits  # noqa: E402
from onnxmerge.serve._models import models_from_arguments  # noqa: E402
from onnxmerge.serve._ray import application as ray_application  # noqa: E402
from onnxmerge.serve._ray import build_app as build_ray_app  # noqa: E402
from onnxmerge.serve._ray import deploy as deploy_on_ray  # noqa: E402
from onnxmerge.serve._ray import run_on_ray  # noqa: E402
from onnxmerge.serve._server import Server, run  # noqa: E402

__all__ = [
    "Limits",
    "Server",
    "build_ray_app",
    "create_app",
    "deploy_on_ray",
    "models_from_arguments",
    "ray_application",
    "run",
    "run_on_ray",
]
