"""``onnxmerge serve [NAME=]MODEL ...``: the models behind an HTTP server until it is stopped."""

from __future__ import annotations

import argparse
import signal

from onnxmerge.cli._shared import ExitCode, at_least

HELP = (
    "serve merged models over HTTP (LibreTranslate's /translate, /v1/generate, OpenAI's "
    "/v1/audio/transcriptions, /metrics)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "models",
        nargs="+",
        metavar="[NAME=]MODEL",
        help="a merged .onnx file or an export folder (merged first); NAME=SRC-TGT (fr-en) is "
        "the pair /translate serves; a bare path is named after its folder",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=32, help="inputs per batch at most")
    p.add_argument(
        "--batch-wait-ms", type=float, default=5.0, help="how long a batch waits for company"
    )
    p.add_argument("--max-queue", type=int, default=256, help="queued requests before 429")
    p.add_argument("--max-body-bytes", type=int, default=1_000_000, help="larger bodies: 413")
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="past it: 504")
    p.add_argument("--api-key", default=None, help="required of every request when given")
    p.add_argument(
        "--threads",
        type=at_least(1),
        metavar="N",
        help="onnxruntime's threads of each model (default: onnxruntime's choice)",
    )
    p.add_argument(
        "--session-cache",
        metavar="DIR",
        help="keep onnxruntime's optimized graph of each merged file in DIR: later starts load "
        "faster, and greedy steps of a float32 model with a tied head take its int8 head",
    )
    p.add_argument(
        "--drain-s", type=float, default=30.0, help="on SIGTERM, time for requests in flight"
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="run on Ray Serve (RAY_ADDRESS, a cluster on this machine, or a new local one)",
    )
    p.add_argument("--replicas", type=int, default=2, help="with --ray: copies of the server")
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )


def run(args: argparse.Namespace) -> int:
    from onnxmerge.serve import models_from_arguments, run, run_on_ray

    limits = dict(
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout_s,
        api_key=args.api_key,
        threads=args.threads,
        session_cache=args.session_cache,
    )
    models = models_from_arguments(args.models)
    if args.ray:
        ended: int | None = run_on_ray(
            models, replicas=args.replicas, host=args.host, port=args.port, **limits
        )
    else:
        ended = run(
            models,
            args.host,
            args.port,
            drain_s=args.drain_s,
            log_level=args.log_level,
            **limits,
        )
    if ended == signal.SIGTERM:
        return ExitCode.TERMINATED
    if ended == signal.SIGINT:
        return ExitCode.INTERRUPTED
    return ExitCode.OK
