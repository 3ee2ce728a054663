"""``onnxmerge batch SOURCES... -o OUT``: many models converted on a process pool or Ray."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from onnxmerge.cli._shared import ExitCode, Progress, dtype_argument, emit, human, need, table

HELP = "convert many models: export, merge, verify and more; resumable"


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    dtype_argument(p, every=False)
    p.add_argument(
        "--memory",
        type=float,
        metavar="GIB",
        help="memory each model declares and is held to (default: estimated from its files)",
    )


def run(args: argparse.Namespace) -> int:
    from onnxmerge.batch import FAILED, RESULTS_NAME, convert_many

    if args.ray:
        need("ray", "ray")
    counts: dict[str, int] = {}
    started = time.perf_counter()
    with Progress(quiet=args.json) as progress:

        def on_result(result: Any, done: int, total: int) -> None:
            counts[result.status] = counts.get(result.status, 0) + 1
            if progress.live:  # a bar redrawn in place, else a line per model
                filled = round(30 * done / total)
                bar = "#" * filled + "-" * (30 - filled)
                said = ", ".join(f"{n} {status}" for status, n in counts.items())
                progress.show(f"[{bar}] {done}/{total}  {said}")
            else:
                progress.line(f"  [{done}/{total}] {result.name}: {result.status}")

        results = convert_many(
            args.sources,
            args.output,
            jobs=args.jobs,
            runner="ray" if args.ray else "processes",
            ray_address=args.ray if isinstance(args.ray, str) else None,
            weights=args.weights,
            search=args.generation,
            num_beams=args.num_beams,
            web=args.web,
            dtype=args.dtype,
            memory_bytes=int(args.memory * 2**30) if args.memory else None,
            on_result=on_result,
        )
    elapsed = time.perf_counter() - started
    said = ", ".join(f"{n} {s}" for s, n in counts.items()) or "no models"
    emit(
        args,
        [r.to_json() for r in results],
        lambda: (
            table([_row(r) for r in results], _HEADER)
            + f"\n\n{said} in {elapsed:.1f} s; one line per model in "
            + os.path.join(args.output, RESULTS_NAME)
        ),
    )
    return ExitCode.ERROR if any(r.status == FAILED for r in results) else ExitCode.OK


_HEADER = ("model", "status", "read", "model.onnx", "vs checkpoint", "s", "peak RSS", "error")


def _row(r: Any) -> tuple[str, ...]:
    return (
        r.name,
        r.status,
        human(r.input_bytes),
        human(r.model_bytes),
        f"{r.ratio_to_checkpoint:.3f}x" if r.ratio_to_checkpoint else "-",
        f"{sum(r.seconds.values()):.1f}",
        human(r.peak_rss_bytes),
        (r.error or "")[:100],
    )
