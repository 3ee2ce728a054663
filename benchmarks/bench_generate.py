"""Generation speed and memory: onnxmerge's Seq2SeqModel against optimum's ORTModelForSeq2SeqLM.

The model has the shape of opus-mt-fr-en (Marian, 6+6 layers, d_model 512, vocabulary 59514) with
seeded random weights. It is exported once with optimum into a cache folder and merged with
onnxmerge. Each side then runs in a fresh process, on the same input (batch 1, 32 source tokens,
exactly 32 new tokens): load time, resident memory after load, greedy and 4-beam generation time
(best of several runs), and the tokens, which must be the same.

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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = REPO / ".cache" / "bench" / "opus-mt-fr-en-shape"
SOURCE_TOKENS = 32
NEW_TOKENS = 32
SEED = 0
TARGETS = {"greedy_time": 0.6, "beam4_time": 0.8, "rss_after_load_mb": 0.5}

MARIAN_CONFIG = {
    "vocab_size": 59514,
    "decoder_vocab_size": 59514,
    "d_model": 512,
    "encoder_layers": 6,
    "decoder_layers": 6,
    "encoder_attention_heads": 8,
    "decoder_attention_heads": 8,
    "encoder_ffn_dim": 2048,
    "decoder_ffn_dim": 2048,
    "max_position_embeddings": 512,
    "pad_token_id": 59513,
    "decoder_start_token_id": 59513,
    "eos_token_id": 0,
    "forced_eos_token_id": 0,
    "activation_function": "swish",
    "scale_embedding": True,
    "static_position_embeddings": True,
    "share_encoder_decoder_embeddings": True,
}


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


def source_ids():
    import numpy as np

    rng = np.random.default_rng(SEED)
    ids = rng.integers(1, MARIAN_CONFIG["vocab_size"] - 1, size=(1, SOURCE_TOKENS - 1))
    ids = np.concatenate([ids, [[MARIAN_CONFIG["eos_token_id"]]]], axis=1).astype(np.int64)
    return ids, np.ones_like(ids)


def _time_best(generate, repeats: int) -> tuple[float, list[float], list[int]]:
    tokens = generate()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = generate()
        times.append(time.perf_counter() - start)
    return min(times), times, [int(t) for t in tokens[0]]


# -- the child processes ---------------------------------------------------------------------------


def export_model(cache_dir: Path) -> None:
    """Build the random-weight Marian model and export it with optimum (runs in a child)."""
    import torch
    from optimum.exporters.onnx import main_export
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(SEED)
    model = MarianMTModel(MarianConfig(**MARIAN_CONFIG)).eval()
    model.save_pretrained(cache_dir / "pytorch")
    main_export(
        str(cache_dir / "pytorch"),
        output=str(cache_dir / "onnx"),
        task="text2text-generation-with-past",
    )


def worker_ours(model_path: Path, repeats: int) -> dict:
    baseline = resident_mb()
    start = time.perf_counter()
    from onnxmerge import Seq2SeqModel

    model = Seq2SeqModel(model_path)
    load = time.perf_counter() - start
    rss = resident_mb()
    ids, mask = source_ids()

    def run(beams):
        return lambda: model.generate(
            input_ids=ids,
            attention_mask=mask,
            num_beams=beams,
            min_new_tokens=NEW_TOKENS,
            max_new_tokens=NEW_TOKENS,
        )

    return _measure(load, baseline, rss, run, repeats)


def worker_optimum(export_dir: Path, repeats: int) -> dict:
    baseline = resident_mb()
    start = time.perf_counter()
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    model = ORTModelForSeq2SeqLM.from_pretrained(export_dir, use_merged=True, use_cache=True)
    load = time.perf_counter() - start
    rss = resident_mb()
    ids, mask = source_ids()
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)

    def run(beams):
        def generate():
            with torch.no_grad():
                return model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    num_beams=beams,
                    min_new_tokens=NEW_TOKENS,
                    max_new_tokens=NEW_TOKENS,
                ).numpy()

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


def prepare(cache_dir: Path) -> tuple[Path, Path]:
    export_dir = cache_dir / "onnx"
    if not (export_dir / "decoder_model_merged.onnx").exists():
        print(f"exporting the model to {export_dir} (about a minute)", file=sys.stderr)
        subprocess.run([sys.executable, __file__, "--export", str(cache_dir)], check=True)
    merged = cache_dir / "merged" / "model.onnx"
    if not merged.exists():
        from onnxmerge import merge_seq2seq

        merged.parent.mkdir(parents=True, exist_ok=True)
        merge_seq2seq(export_dir, merged)
    return export_dir, merged


def _best(runs: list[dict]) -> dict:
    best = dict(runs[0])
    for key in ("load_time", "rss_after_load_mb", "greedy_time", "beam4_time"):
        best[key] = min(r[key] for r in runs)
    best["runs"] = runs
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", type=Path, help="where to write the JSON results")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per process")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per side")
    parser.add_argument(
        "--quick", action="store_true", help="one process per side, two timed runs (noisier)"
    )
    parser.add_argument("--export", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=("ours", "optimum"), help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.export:
        export_model(args.export)
        return 0
    if args.worker:
        work = worker_ours if args.worker == "ours" else worker_optimum
        print(json.dumps(work(args.path, args.repeats)))
        return 0
    if args.output is None:
        parser.error("give the path of the JSON file to write")
    if args.quick:
        args.repeats, args.rounds = min(args.repeats, 2), 1

    export_dir, merged = prepare(args.cache_dir)
    runs: dict[str, list[dict]] = {"ours": [], "optimum": []}
    for _ in range(args.rounds):  # alternate, so load on the machine hits both sides alike
        runs["ours"].append(
            _child(["--worker", "ours", "--path", str(merged), "--repeats", str(args.repeats)])
        )
        runs["optimum"].append(
            _child(
                ["--worker", "optimum", "--path", str(export_dir), "--repeats", str(args.repeats)]
            )
        )
    ours, theirs = _best(runs["ours"]), _best(runs["optimum"])
    ratios = {
        key: ours[key] / theirs[key]
        for key in ("greedy_time", "beam4_time", "rss_after_load_mb", "load_time")
    }
    import onnxruntime

    results = {
        "model": {"shape": "opus-mt-fr-en", "config": MARIAN_CONFIG, "random_weights_seed": SEED},
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
            "merged": merged.stat().st_size / 2**20,
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
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    summary = {k: round(v, 3) for k, v in ratios.items()}
    print(f"ratios ours/optimum: {summary}; same tokens: {results['same_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
