"""Generation speed and memory: onnxmerge's Seq2SeqModel against optimum's ORTModelForSeq2SeqLM.

The model has the shape of opus-mt-fr-en (Marian, 6+6 layers, d_model 512, vocabulary 59514) with
seeded random weights, exported once with optimum into the benchmarks' shared cache
(``_common.export_cached``) and merged afresh by the onnxmerge under test. Each side then runs in a
fresh process, on the same input (batch 1, 32 source tokens, exactly 32 new tokens): load time,
resident memory after load, greedy and 4-beam generation time (best of several runs), and the
tokens, which must be the same. ``--quick`` uses a tiny Marian model, one process per side.

Usage::

    python benchmarks/bench_generate.py results.json [--cache-dir DIR] [--repeats 5] [--rounds 2]
        [--quick]

Writes the measurements and the ratios ours/optimum as JSON to ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import _common  # noqa: E402

SOURCE_TOKENS = 32
NEW_TOKENS = 32
TARGETS = {"greedy_time": 0.6, "beam4_time": 0.8, "rss_after_load_mb": 0.5}


# -- helpers shared by the processes ---------------------------------------------------------------


def resident_mb() -> float:
    """This process's resident set size in MiB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def source_ids(config) -> list[int]:
    """Seeded source tokens ending in eos, avoiding the special ids at both ends of the vocab."""
    import numpy as np

    rng = np.random.default_rng(_common.SEED)
    ids = rng.integers(1, config.vocab_size - 1, size=SOURCE_TOKENS - 1).tolist()
    return [*ids, config.eos_token_id]


def _as_arrays(ids: list[int]):
    import numpy as np

    array = np.array([ids], dtype=np.int64)
    return array, np.ones_like(array)


def _time_best(generate, repeats: int) -> tuple[float, list[float], list[int]]:
    times, tokens = _common.timed_runs(generate, repeats)
    return min(times), times, [int(t) for t in tokens[0]]


# -- the child processes ---------------------------------------------------------------------------


def worker_ours(model_path: Path, repeats: int, source: list[int]) -> dict:
    baseline = resident_mb()
    start = time.perf_counter()
    from onnxmerge import Seq2SeqModel

    model = Seq2SeqModel(model_path)
    load = time.perf_counter() - start
    rss = resident_mb()
    ids, mask = _as_arrays(source)

    def run(beams):
        return lambda: _common.generate_exactly(model, ids, mask, beams, NEW_TOKENS)

    return _measure(load, baseline, rss, run, repeats)


def worker_optimum(export_dir: Path, repeats: int, source: list[int]) -> dict:
    baseline = resident_mb()
    start = time.perf_counter()
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    model = ORTModelForSeq2SeqLM.from_pretrained(export_dir, use_merged=True, use_cache=True)
    load = time.perf_counter() - start
    rss = resident_mb()
    ids, mask = (torch.from_numpy(a) for a in _as_arrays(source))

    def run(beams):
        def generate():
            with torch.no_grad():
                return _common.generate_exactly(model, ids, mask, beams, NEW_TOKENS).numpy()

        return generate

    return _measure(load, baseline, rss, run, repeats)


def _measure(load, baseline, rss, run, repeats) -> dict:
    greedy, greedy_all, greedy_tokens = _time_best(run(1), repeats)
    beam, beam_all, beam_tokens = _time_best(run(4), repeats)
    return {
        "load_time": load,
        "rss_before_load_mb": baseline,
        "rss_after_load_mb": rss,
        "rss_after_generate_mb": resident_mb(),
        "greedy_time": greedy,
        "greedy_times": greedy_all,
        "beam4_time": beam,
        "beam4_times": beam_all,
        "greedy_tokens": greedy_tokens,
        "beam4_tokens": beam_tokens,
    }


# -- the parent -----------------------------------------------------------------------------------


def _child(args: list[str]) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, *args], check=True, capture_output=True, text=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def _best(runs: list[dict]) -> dict:
    best = dict(runs[0])
    for key in ("load_time", "rss_after_load_mb", "greedy_time", "beam4_time"):
        best[key] = min(r[key] for r in runs)
    best["runs"] = runs
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", type=Path, help="where to write the JSON results")
    parser.add_argument("--cache-dir", type=Path, default=_common.DEFAULT_CACHE_DIR)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per process")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per side")
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, one process per side, two timed runs"
    )
    parser.add_argument("--worker", choices=("ours", "optimum"), help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _common.compile_bytecode()

    if args.worker:
        work = worker_ours if args.worker == "ours" else worker_optimum
        source = [int(t) for t in args.source.split(",")]
        print(json.dumps(work(args.path, args.repeats, source)))
        return 0
    if args.output is None:
        parser.error("give the path of the JSON file to write")
    if args.quick:
        args.repeats, args.rounds = min(args.repeats, 2), 1

    factory = _common.marian_config(args.quick)
    export = _common.export_cached(factory, "tied", args.cache_dir)
    export_dir, config = export.onnx_dir, factory()
    source = ",".join(map(str, source_ids(config)))
    scratch = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    try:
        from onnxmerge import merge_seq2seq

        # Merged by the onnxmerge under test, never taken from a cache.
        merged = merge_seq2seq(export_dir, scratch / "model.onnx")
        runs: dict[str, list[dict]] = {"ours": [], "optimum": []}
        for _ in range(args.rounds):  # alternate, so load on the machine hits both sides alike
            for side, path in (("ours", merged), ("optimum", export_dir)):
                runs[side].append(
                    _child(
                        [
                            "--worker",
                            side,
                            "--path",
                            str(path),
                            "--repeats",
                            str(args.repeats),
                            "--source",
                            source,
                        ]
                    )
                )
        merged_mb = merged.stat().st_size / 2**20
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    ours, theirs = _best(runs["ours"]), _best(runs["optimum"])
    ratios = {
        key: ours[key] / theirs[key]
        for key in ("greedy_time", "beam4_time", "rss_after_load_mb", "load_time")
    }
    import onnxruntime

    results = {
        "model": {
            "shape": "tiny Marian" if args.quick else "opus-mt-fr-en",
            "config": config.to_diff_dict(),
            "random_weights_seed": _common.SEED,
        },
        "setting": {
            "batch": 1,
            "source_tokens": SOURCE_TOKENS,
            "new_tokens": NEW_TOKENS,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "statistic": "best",
            "load_time": "importing the library and creating the model, in a fresh process",
            "rss": "VmRSS after loading, before generating",
        },
        "environment": {
            "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__,
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
        },
        "files_mb": {
            "merged": merged_mb,
            "optimum_encoder_plus_merged_decoder": sum(
                (export_dir / n).stat().st_size
                for n in ("encoder_model.onnx", "decoder_model_merged.onnx")
            )
            / 2**20,
        },
        "ours": ours,
        "optimum": theirs,
        "ratios": ratios,
        "targets": TARGETS,
        "targets_met": {k: ratios[k] <= v for k, v in TARGETS.items()},
        "same_tokens": {
            "greedy": ours["greedy_tokens"] == theirs["greedy_tokens"],
            "beam4": ours["beam4_tokens"] == theirs["beam4_tokens"],
        },
    }
    _common.write_results(args.output, results)
    summary = {k: round(v, 3) for k, v in ratios.items()}
    print(f"ratios ours/optimum: {summary}; same tokens: {results['same_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
