"""Batch conversion benchmark: a zoo serially, on the process pool and on local Ray.

1. The tiny architectures of the test zoo (their optimum exports), converted (merge + verify) by
   ``onnxmerge.batch.convert_many`` in this process one after another, on a pool of spawned
   workers, and as Ray tasks on a local Ray started with as many CPUs: models per minute, peak
   memory per worker (each task's own peak RSS) and the time a rerun takes to skip them all.
2. One opus-mt-fr-en-shaped PyTorch checkpoint (seeded random weights) converted from the
   checkpoint folder with ``--generation greedy``: the cost of each stage, and from it the
   projected time of 1,000 such models on N nodes shaped like this machine.

Each mode runs in a fresh interpreter. ``--quick`` takes two architectures, no Ray, and a tiny
Marian in place of the opus-mt shape, to check the pipeline.

Usage: python benchmarks/bench_batch.py [--quick] [--out benchmarks/out/batch.json]
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _common  # noqa: E402

QUICK_ARCHS = ("marian", "t5")
# With past, a vision-encoder-decoder export is refused (README, "What it handles").
VARIANTS = {"vision-encoder-decoder": "no-past"}
MODES = ("serial", "pool", "ray")
# --quick checks the pipeline; the Ray path of convert_many is tested in tests/test_batch.py.
QUICK_MODES = ("serial", "pool")
ZOO_SIZE = 1000
NODE_COUNTS = (1, 4, 16, 64)


def convert_zoo(mode: str, sources: list[str], out: str, workers: int) -> dict:
    """Run in a child process: one batch over ``sources`` into the empty folder ``out``."""
    from onnxmerge.batch import convert_many

    startup_s = 0.0
    if mode == "ray":
        import ray

        start = time.perf_counter()
        ray.init(
            num_cpus=workers,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        startup_s = time.perf_counter() - start
    try:
        start = time.perf_counter()
        results = convert_many(
            sources, out, jobs=0 if mode == "serial" else workers, ray=mode == "ray"
        )
        convert_s = time.perf_counter() - start
        start = time.perf_counter()
        rerun = convert_many(
            sources, out, jobs=0 if mode == "serial" else workers, ray=mode == "ray"
        )
        rerun_s = time.perf_counter() - start
    finally:
        if mode == "ray":
            ray.shutdown()
    return {
        "startup_s": startup_s,
        "convert_s": convert_s,
        "rerun_s": rerun_s,
        "rerun_statuses": sorted({r.status for r in rerun}),
        "results": [r.to_json() for r in results],
    }


def convert_checkpoint(pytorch_dir: str, out: str) -> dict:
    """Run in a child process: one checkpoint folder through every stage, in this process."""
    from onnxmerge.batch import convert_many

    (result,) = convert_many([pytorch_dir], out, jobs=0, generation="greedy")
    return result.to_json()


def pytorch_folder(config_factory, cache_dir: Path) -> Path:
    """A saved seeded random model of ``config_factory()``, cached like the benchmark exports."""
    config = config_factory()
    name = config_factory.__name__.removesuffix("_config")
    folder = cache_dir / f"{name}-{_common.cache_key(config, 'pytorch')}" / "pytorch"
    if not (folder / _common.CHECKPOINT_FILE).exists():
        with _common.staging(folder) as staging:
            _common.build_pytorch(config, staging)
    return folder


def memory_total() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def summarise(mode: str, run: dict, models: int) -> dict:
    results = run["results"]
    peaks = [r["peak_rss_bytes"] for r in results if r.get("peak_rss_bytes")]
    return {
        "mode": mode,
        "models": models,
        "converted": sum(r["status"] == "converted" for r in results),
        "startup_s": run["startup_s"],
        "convert_s": run["convert_s"],
        "models_per_minute": 60 * models / run["convert_s"],
        "peak_rss_per_worker_max_bytes": max(peaks) if peaks else None,
        "peak_rss_per_worker_median_bytes": statistics.median(peaks) if peaks else None,
        "rerun_s": run["rerun_s"],
        "rerun_statuses": run["rerun_statuses"],
        "errors": {r["name"]: r["error"] for r in results if r["error"]},
    }


def project(stage: dict, cores: int, memory: int) -> dict:
    """1,000 models of the measured cost on N nodes of this machine's shape (ideal scaling)."""
    seconds = stage["seconds"]
    peak = stage["peak_rss_bytes"]
    workers = max(1, min(cores, memory // peak))
    pipelines = {
        "export + merge + verify": sum(v for k, v in seconds.items() if k != "generator"),
        "+ generator": sum(seconds.values()),
    }
    return {
        "workers_per_node": workers,
        "node_cores": cores,
        "node_memory_bytes": memory,
        "hours": {
            name: {str(n): ZOO_SIZE * per_model / (n * workers) / 3600 for n in NODE_COUNTS}
            for name, per_model in pipelines.items()
        },
        "per_model_s": pipelines,
    }


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "batch", "two tiny models; a tiny Marian")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    _common.compile_bytecode()

    from tests.zoo import ARCHITECTURES, tiny_export

    load_before = os.getloadavg()[0]
    archs = QUICK_ARCHS if args.quick else ARCHITECTURES
    sources = [str(tiny_export(arch, VARIANTS.get(arch, "default")).onnx_dir) for arch in archs]
    modes = {}
    for mode in QUICK_MODES if args.quick else MODES:
        with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
            print(f"{mode}: {len(sources)} models", flush=True)
            measured = _common.run_in_subprocess(
                "benchmarks.bench_batch:convert_zoo",
                [mode, sources, str(Path(tmp) / "out"), args.workers],
                timeout_s=1800,
            )
            modes[mode] = summarise(mode, measured["result"], len(sources))
            print(f"  {modes[mode]['models_per_minute']:.1f} models/min", flush=True)
    serial = modes["serial"]["convert_s"]
    for data in modes.values():
        data["speedup_over_serial"] = serial / data["convert_s"]

    factory = _common.marian_config(args.quick)
    folder = pytorch_folder(factory, _common.DEFAULT_CACHE_DIR)
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        print(f"stages: {factory.__name__}", flush=True)
        measured = _common.run_in_subprocess(
            "benchmarks.bench_batch:convert_checkpoint",
            [str(folder), str(Path(tmp) / "out")],
            timeout_s=3600,
        )
    stage = measured["result"]
    if stage["status"] != "converted":
        raise RuntimeError(f"the {factory.__name__} model failed: {stage['error']}")
    cores = os.cpu_count() or 1
    result = {
        "setting": {
            "quick": args.quick,
            "workers": args.workers,
            "architectures": list(archs),
            "machine": f"{platform.machine()}, {cores} CPUs, {memory_total() / 2**30:.0f} GiB",
            # Other work on the machine slows every mode; absolute seconds depend on it.
            "load_average": [load_before, os.getloadavg()[0]],
        },
        "modes": modes,
        "stages": {
            "model": factory.__name__.removesuffix("_config"),
            "checkpoint_bytes": stage["checkpoint_bytes"],
            "model_bytes": stage["model_bytes"],
            "seconds": stage["seconds"],
            "peak_rss_bytes": stage["peak_rss_bytes"],
            "memory_declared_bytes": stage["memory_declared_bytes"],
        },
        "projection": project(stage, cores, memory_total()),
    }
    _common.write_results(args.out, result)
    print(f"wrote {args.out}")
    return 0


def markdown(data: dict) -> list[str]:
    """The docs/benchmarks.md section."""
    setting, stages, projection = data["setting"], data["stages"], data["projection"]
    lines = [
        f"{len(setting['architectures'])} tiny architectures of the test zoo (merge + verify from "
        f"their optimum exports), {setting['workers']} workers, on {setting['machine']}. "
        "Peak RSS is each task's own; a rerun finds every model complete and skips it."
        + (
            " Load average {:.1f} at the start, {:.1f} at the end: compare the ratios.".format(
                *setting["load_average"]
            )
            if "load_average" in setting
            else ""
        ),
        "",
        "| mode | models/min | vs serial | start-up s | peak RSS per worker MB (max) | rerun s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, m in data["modes"].items():
        lines.append(
            f"| {mode} | {m['models_per_minute']:.1f} | {m['speedup_over_serial']:.2f}x | "
            f"{m['startup_s']:.1f} | {_common.mb(m['peak_rss_per_worker_max_bytes'])} | "
            f"{m['rerun_s']:.2f} |"
        )
    lines += [
        "",
        f"One {stages['model']}-shaped model from its PyTorch folder "
        f"({_common.mb(stages['checkpoint_bytes'])} MB checkpoint, "
        f"{_common.mb(stages['model_bytes'])} MB model.onnx), one worker; peak RSS "
        f"{_common.mb(stages['peak_rss_bytes'])} MB against "
        f"{_common.mb(stages['memory_declared_bytes'])} MB declared:",
        "",
        "| stage | s |",
        "|---|---:|",
        *(f"| {name} | {s:.1f} |" for name, s in stages["seconds"].items()),
        "",
        f"Projected hours for {ZOO_SIZE:,} such models on N nodes like this one "
        f"({projection['workers_per_node']} workers each, bounded by cores and by the peak RSS), "
        "assuming ideal scaling (see the pool's measured speedup above):",
        "",
        "| pipeline | s per model | " + " | ".join(f"N={n}" for n in NODE_COUNTS) + " |",
        "|---|---:|" + "---:|" * len(NODE_COUNTS),
    ]
    for name, hours in projection["hours"].items():
        cells = " | ".join(f"{hours[str(n)]:.1f}" for n in NODE_COUNTS)
        lines.append(f"| {name} | {projection['per_model_s'][name]:.0f} | {cells} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
