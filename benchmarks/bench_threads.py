"""Under load: one Seq2SeqModel shared by 1, 2 and 8 Python threads, and memory over many calls.

Both on a tiny Marian model (many calls in little time). Throughput: greedy, batch 1, 32 source
ids, 16 new tokens, onnxruntime with 2 intra-op threads; each caller thread runs the same number
of calls, and the tokens of every call are checked against a serial call. Memory: a tiny Marian
model called ``--calls`` times (10,000 by default) in one process; resident memory is sampled
every tenth of the way, and the growth after the first tenth is reported.

Usage: python benchmarks/bench_threads.py [--quick] [--out benchmarks/out/threads.json]
"""

from __future__ import annotations

import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _common  # noqa: E402

NEW_TOKENS = 16
CALLER_THREADS = (1, 2, 8)


def _model(export_dir: Path, folder: Path):
    import onnxmerge
    from onnxmerge._ort import session_options

    folder.mkdir()
    merged = onnxmerge.merge_seq2seq(export_dir, folder / "model.onnx")
    options = session_options()
    options.intra_op_num_threads = 2
    return onnxmerge.Seq2SeqModel(merged, session_options=options)


def _ids(model, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(2, model.config["vocab_size"] - 1, size=(1, 32))
    ids[0, -1] = model.config["eos_token_id"]
    return ids.astype(np.int64)


def throughput(model, calls_per_thread: int) -> list[dict[str, Any]]:
    inputs = [_ids(model, seed) for seed in range(8)]

    def call(i: int):
        return model.generate(input_ids=inputs[i % 8], max_new_tokens=NEW_TOKENS)

    expected = [call(i) for i in range(8)]
    rows = []
    for threads in CALLER_THREADS:
        total = threads * calls_per_thread
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(call, range(total)))
        elapsed = time.perf_counter() - start
        same = all((r == expected[i % 8]).all() for i, r in enumerate(results))
        tokens = sum(r.shape[0] * (r.shape[1] - 1) for r in results)
        rows.append(
            {
                "caller_threads": threads,
                "calls": total,
                "seconds": elapsed,
                "calls_per_s": total / elapsed,
                "tokens_per_s": tokens / elapsed,
                "same_tokens_as_serial": bool(same),
            }
        )
    return rows


def memory_over_calls(model, calls: int) -> dict[str, Any]:
    ids = _ids(model, 0)
    samples = []
    for i in range(calls):
        model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, num_beams=1 + (i % 2))
        if (i + 1) % max(1, calls // 10) == 0:
            samples.append({"calls": i + 1, "rss_mb": _common.self_rss_bytes()["rss_bytes"] / 1e6})
    first = samples[0]["rss_mb"]
    return {
        "calls": calls,
        "samples": samples,
        "growth_after_first_tenth_mb": samples[-1]["rss_mb"] - first,
    }


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "threads", "tiny model, fewer calls")
    parser.add_argument("--calls", type=int, default=10_000, help="calls for the memory run")
    parser.add_argument("--calls-per-thread", type=int, default=50)
    args = parser.parse_args(argv)
    _common.compile_bytecode()
    if args.quick:
        args.calls, args.calls_per_thread = min(args.calls, 50), 1
    tiny = _common.export_cached(_common.tiny_marian_config, "tied")
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        rows = throughput(_model(tiny.onnx_dir, Path(tmp) / "throughput"), args.calls_per_thread)
        memory = memory_over_calls(_model(tiny.onnx_dir, Path(tmp) / "memory"), args.calls)
    result = {
        "benchmark": "threads",
        "model": "tiny Marian",
        "onnxruntime_threads": 2,
        "new_tokens": NEW_TOKENS,
        "throughput": rows,
        "memory": memory,
    }
    _common.write_results(args.out, result)
    for row in rows:
        print(
            f"{row['caller_threads']} caller threads: {row['tokens_per_s']:.1f} tok/s, "
            f"same tokens {row['same_tokens_as_serial']}"
        )
    print(
        f"RSS growth over {memory['calls']} calls: {memory['growth_after_first_tenth_mb']:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
