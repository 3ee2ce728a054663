"""Generator benchmark: the decoding loop inside the graph against the Python runtime's loop.

On the opus-mt-fr-en shape (seeded random weights, optimum export with the tied-weight pass):

1. file size of the generator model against the plain merged model (the loop adds structure only);
2. greedy generation, tokens per second: one ``session.run`` of the generator model against
   ``Seq2SeqModel.generate`` on the merged model, same inputs, same thread settings, same
   process, median of ``--repeats`` runs after a warm-up; the token ids are checked to be equal.

Random weights rarely produce eos, so every row runs to ``--new-tokens``: both sides do the same
number of decoder steps. ``--quick`` uses a tiny Marian model so the whole run takes seconds.

Usage: python benchmarks/bench_generator.py [--quick] [--out benchmarks/out/generator.json]
"""

from __future__ import annotations

import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _common  # noqa: E402


def _inputs(config: dict, batch: int, length: int, seed: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    special = {config.get(k) for k in ("pad_token_id", "eos_token_id", "decoder_start_token_id")}
    vocab = int(config["vocab_size"])
    ids = rng.integers(0, vocab, size=(batch, length), dtype=np.int64)
    ids[np.isin(ids, list(special))] = 5
    ids[:, -1] = config["eos_token_id"]
    mask = np.ones_like(ids)
    if batch > 1:
        # One padded row, as in a real batch of sentences of different lengths.
        ids[-1, length // 2 :] = config["pad_token_id"]
        ids[-1, length // 2 - 1] = config["eos_token_id"]
        mask[-1, length // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _alternating(sides: dict[str, Any], repeats: int) -> dict[str, tuple[float, float, Any]]:
    """Each side once to warm up, then the sides in turn, so load on the machine hits both
    alike: per side the median wall seconds, the median CPU seconds of this process (all its
    threads) and the last result."""
    results = {name: fn() for name, fn in sides.items()}
    walls: dict[str, list[float]] = {name: [] for name in sides}
    cpus: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            wall, cpu = time.perf_counter(), time.process_time()
            results[name] = fn()
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    return {
        name: (statistics.median(walls[name]), statistics.median(cpus[name]), results[name])
        for name in sides
    }


def measure(
    export_dir: Path, batch: int, length: int, new_tokens: int, repeats: int, threads: int
) -> dict[str, Any]:
    import numpy as np

    import onnxmerge
    from onnxmerge._ort import open_session, session_options
    from onnxmerge.generator import build_generator

    def options():
        return session_options(threads=threads)

    with tempfile.TemporaryDirectory(prefix="bench-generator-") as tmp:
        merged = onnxmerge.merge_seq2seq(export_dir, Path(tmp) / "model.onnx")
        start = time.perf_counter()
        generator = build_generator(merged, Path(tmp) / "generator.onnx")
        build_s = time.perf_counter() - start
        merged_bytes = merged.stat().st_size
        generator_bytes = generator.stat().st_size

        model = onnxmerge.Seq2SeqModel(merged, session_options=options())
        session = open_session(generator, options())
        inputs = _inputs(model.config, batch, length, seed=0)
        feeds = {**inputs, "max_new_tokens": np.array(new_tokens, np.int64)}
        timed = _alternating(
            {
                "python": lambda: model.generate(**inputs, max_new_tokens=new_tokens),
                "graph": lambda: session.run(None, feeds)[0],
            },
            repeats,
        )
        (python_s, python_cpu_s, python_out), (graph_s, graph_cpu_s, graph_out) = timed.values()
        identical = python_out.shape == graph_out.shape and bool((python_out == graph_out).all())
        generated = int(graph_out.shape[0] * (graph_out.shape[1] - 1))
    return {
        "batch": batch,
        "source_length": length,
        "max_new_tokens": new_tokens,
        "generated_tokens": generated,
        "identical_tokens": identical,
        "python_runtime_s": python_s,
        "in_graph_loop_s": graph_s,
        "python_runtime_tokens_per_s": generated / python_s,
        "in_graph_loop_tokens_per_s": generated / graph_s,
        "speedup": python_s / graph_s,
        "python_runtime_cpu_s": python_cpu_s,
        "in_graph_loop_cpu_s": graph_cpu_s,
        "cpu_ratio": graph_cpu_s / python_cpu_s,
        "build_generator_s": build_s,
        "merged_bytes": merged_bytes,
        "generator_bytes": generator_bytes,
        "generator_extra_bytes": generator_bytes - merged_bytes,
        "generator_size_ratio": generator_bytes / merged_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "generator", "tiny Marian model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--source-length", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=0, help="onnxruntime threads (0: default)")
    args = parser.parse_args(argv)

    factory = _common.marian_config(args.quick)
    export = _common.export_cached(factory, "tied")
    runs = [
        measure(export.onnx_dir, b, args.source_length, args.new_tokens, args.repeats, args.threads)
        for b in args.batches
    ]
    result = {
        "benchmark": "generator",
        "model": "tiny-marian" if args.quick else "opus-mt-fr-en shape",
        "export": str(export.onnx_dir),
        "search": "greedy",
        "repeats": args.repeats,
        "threads": args.threads or "onnxruntime default",
        "runs": runs,
        "platform": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "packages": _common.package_versions(),
        },
    }
    _common.write_results(args.out, result)
    for run in runs:
        print(
            f"batch {run['batch']}: python loop {run['python_runtime_tokens_per_s']:.1f} tok/s, "
            f"in-graph loop {run['in_graph_loop_tokens_per_s']:.1f} tok/s "
            f"(x{run['speedup']:.2f}), identical={run['identical_tokens']}; "
            f"generator {run['generator_bytes']} B vs merged {run['merged_bytes']} B "
            f"(+{run['generator_extra_bytes']} B)"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
