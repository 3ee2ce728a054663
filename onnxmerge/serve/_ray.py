"""The server's app as a Ray Serve deployment: the same routes and per-replica batching, with
Ray Serve spreading requests over ``replicas`` copies on one machine or a cluster."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Mapping
from typing import Any, cast

from onnxmerge._ray_session import QUIET_INIT, SIGNALS, handlers, ray_session, restore
from onnxmerge.errors import InvalidArgumentError, MissingDependencyError
from onnxmerge.serve._app import create_app
from onnxmerge.serve._limits import LIMIT_NAMES, Limits
from onnxmerge.serve._models import check_models

# A replica is healthy once its models are loaded; merging an export folder can take minutes.
_LOAD_TIMEOUT_S = 600.0


def _serve_module() -> Any:
    try:
        from ray import serve
    except ImportError as error:
        raise MissingDependencyError(
            f"serving on Ray needs Ray Serve ({error}): pip install 'onnxmerge[ray,serve]'"
        ) from error
    return serve


def _checked(
    models: Mapping[str, str | os.PathLike], replicas: int, limits: dict[str, Any]
) -> tuple[dict[str, str], Limits]:
    """Absolute model paths (replicas may start in another folder) and the limits."""
    unknown = sorted(set(limits) - set(LIMIT_NAMES))
    if unknown:
        raise InvalidArgumentError(
            f"unknown limits {unknown}; the limits are {', '.join(LIMIT_NAMES)}",
            argument=unknown[0],
        )
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise InvalidArgumentError(
            f"replicas must be a whole number of at least 1, got {replicas!r}",
            argument="replicas",
        )
    paths = {name: os.fspath(path.resolve()) for name, path in check_models(models).items()}
    return paths, Limits(**limits)


def _replica_class(serve: Any) -> Any:
    """The deployment class: each replica builds its own app (its models, its batchers)."""

    @serve.ingress()
    class OnnxMergeServer:
        def __init__(self, models: dict[str, str], limits: dict[str, Any]):
            self.models = models
            self.limits = limits

        def __serve_build_asgi_app__(self) -> Any:
            return create_app(self.models, **self.limits)

        async def check_health(self) -> None:
            """Ready once the models are loaded, so Ray routes nothing to a loading replica."""
            state = cast(Any, self).app.state.serve  # the app Ray Serve's wrapper holds
            while not state.loaded and state.load_error is None:
                await asyncio.sleep(0.05)
            if state.load_error is not None:
                raise RuntimeError(f"loading the models failed: {state.load_error}")

    return OnnxMergeServer


def application(
    models: Mapping[str, str | os.PathLike],
    *,
    replicas: int = 2,
    num_cpus: float = 1.0,
    **limits: Any,
) -> Any:
    """The server as a Ray Serve application, to pass to ``serve.run`` (docs/serve.md).

    Args:
        models: served name -> merged file or export folder, as for :func:`create_app`; every
            node must reach the paths (a shared folder or the same image).
        replicas: copies of the server; each loads every model and batches its own requests.
        num_cpus: CPUs Ray reserves for each replica.
        **limits: :func:`create_app`'s limits, applied per replica.

    Returns:
        A bound ``ray.serve.Application``.

    Raises:
        InvalidArgumentError: a bad model, limit or replica count; nothing is read.
        MissingDependencyError: Ray Serve is not installed.
    """
    paths, checked = _checked(models, replicas, limits)
    serve = _serve_module()
    deployment = serve.deployment(
        _replica_class(serve),
        name="onnxmerge",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": num_cpus},
        # Ours is the queue that answers 429; Ray's own cap must not throttle batching first.
        max_ongoing_requests=checked.max_queue + checked.max_batch_size,
        health_check_timeout_s=_LOAD_TIMEOUT_S,
    )
    # As checked: the session cache's path made absolute, as the models' are.
    return deployment.bind(paths, {name: getattr(checked, name) for name in LIMIT_NAMES})


def build_app(args: dict[str, Any]) -> Any:
    """An application builder for ``serve run``, ``serve deploy`` and KubeRay's ``RayService``
    (``import_path: onnxmerge.serve:build_ray_app``), its ``args`` from the config file.

    Args:
        args: ``models`` (name -> path), and optionally ``replicas``, ``num_cpus`` and any
            limit of :func:`create_app`.

    Returns:
        A bound ``ray.serve.Application``.

    Raises:
        InvalidArgumentError: ``models`` missing, or as :func:`application` raises.
    """
    if not isinstance(args.get("models"), Mapping):
        raise InvalidArgumentError(
            "args.models must map served names to model paths (fr-en: /models/opus-fr-en)",
            argument="models",
        )
    options = {key: value for key, value in args.items() if key != "models"}
    return application(args["models"], **options)


def deploy(
    models: Mapping[str, str | os.PathLike],
    *,
    replicas: int = 2,
    host: str = "127.0.0.1",
    port: int = 8000,
    num_cpus: float = 1.0,
    address: str | None = None,
    name: str = "onnxmerge",
    **limits: Any,
) -> str:
    """Run the server on Ray Serve with ``replicas`` copies and return once every replica
    has loaded its models.

    Uses the Ray session of this process if there is one, else ``ray.init(address)``
    (``None``: ``RAY_ADDRESS``, a cluster started on this machine, or a new local one).

    Args:
        models: served name -> merged file or export folder, as for :func:`create_app`.
        replicas: copies of the server.
        host: the address Ray Serve's HTTP proxy binds.
        port: its port.
        num_cpus: CPUs Ray reserves for each replica.
        address: the Ray cluster to join when this process has no Ray session yet.
        name: the Ray Serve application's name (``serve.delete(name)`` removes it).
        **limits: :func:`create_app`'s limits, per replica.

    Returns:
        The URL the application answers at.

    Raises:
        InvalidArgumentError: a bad model, limit or replica count; nothing is started.
        MissingDependencyError: Ray Serve is not installed.
    """
    app = application(models, replicas=replicas, num_cpus=num_cpus, **limits)
    import ray

    serve = _serve_module()
    if not ray.is_initialized():
        ray.init(address=address, **QUIET_INIT)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=name, route_prefix="/")
    return f"http://{host}:{port}"


def run_on_ray(
    models: Mapping[str, str | os.PathLike], *, replicas: int = 2, **options: Any
) -> int:
    """:func:`deploy`, then wait for SIGTERM or SIGINT, remove the application and return.

    Args:
        models: as for :func:`deploy`.
        replicas: as for :func:`deploy`.
        **options: :func:`deploy`'s other options and the limits.

    Returns:
        The signal that ended it.

    Raises:
        InvalidArgumentError: a bad model, limit or replica count; Ray is not started.
        MissingDependencyError: Ray Serve is not installed.
    """
    _checked(models, replicas, {k: v for k, v in options.items() if k in LIMIT_NAMES})
    _serve_module()
    name = options.get("name", "onnxmerge")
    stopped = threading.Event()
    ended: list[int] = []

    def stop(sig: int, _frame: Any) -> None:
        ended.append(sig)
        stopped.set()

    # Ray first: ray.init installs its own SIGTERM handler, which ours must replace.
    with ray_session(options.get("address"), **QUIET_INIT):
        previous = handlers()
        for sig in SIGNALS:
            signal.signal(sig, stop)
        try:
            deploy(models, replicas=replicas, **options)
            stopped.wait()
            _serve_module().delete(name)
        finally:
            restore(previous)
    return ended[0]


__all__ = ["application", "build_app", "deploy", "run_on_ray"]
