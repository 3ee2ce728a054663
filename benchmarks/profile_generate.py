"""Where the time of one generated token goes: per-step timing and onnxruntime's profiler.

On the opus-mt-fr-en shape (seeded random weights), the float32 file and its int8 quantization,
greedy and 4 beams at batch 1, exactly 32 new tokens, 2 threads: the wall time of ``generate()``,
the time inside ``InferenceSession.run`` per step (first step and cached steps apart), and
onnxruntime's own profile of the same calls: time per operator type and the part of ``run``
spent outside any operator.

Usage: python benchmarks/profile_generate.py [--quick] [--out benchmarks/out/profile.json]
"""

from __future__ import annotations

import collections
import json
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

NEW_TOKENS = 32


def _source(config: dict) -> Any:
    import numpy as np

    rng = np.random.default_rng(_common.SEED)
    ids = rng.integers(2, config["vocab_size"] - 1, size=(1, 32))
    ids[0, -1] = config["eos_token_id"]
    return ids.astype(np.int64)


def _timed_steps(model, ids, beams: int, repeats: int) -> dict[str, Any]:
    """Wall time of generate() and of every run inside it (median over repeats): ``run`` and
    ``run_with_iobinding``, which cached steps writing into the search's buffers take."""
    session = model._session
    originals = {name: getattr(session.session, name) for name in ("run", "run_with_iobinding")}
    calls: list[float] = []

    def timed(original):
        def timed_run(*args, **kwargs):
            start = time.perf_counter()
            result = original(*args, **kwargs)
            calls.append(time.perf_counter() - start)
            return result

        return timed_run

    def generate():
        return model.generate(
            input_ids=ids, num_beams=beams, min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS
        )

    generate()  # warm-up
    for name, original in originals.items():
        setattr(session.session, name, timed(original))
    walls, firsts, cached = [], [], []
    try:
        for _ in range(repeats):
            calls.clear()
            start = time.perf_counter()
            generate()
            walls.append(time.perf_counter() - start)
            firsts.append(calls[0])
            cached.append(sum(calls[1:]) / max(1, len(calls) - 1))
            steps = len(calls)
    finally:
        for name, original in originals.items():
            setattr(session.session, name, original)
    wall = statistics.median(walls)
    first, step = statistics.median(firsts), statistics.median(cached)
    return {
        "wall_s": wall,
        "steps": steps,
        "first_step_s": first,
        "cached_step_s": step,
        "outside_run_s": wall - first - step * (steps - 1),
        "per_token_ms": wall / NEW_TOKENS * 1e3,
    }


def _ort_profile(path: Path, ids, beams: int, threads: int) -> dict[str, Any]:
    """onnxruntime's profile of one generate(): operator time by type, and time outside them."""
    import onnxmerge
    from onnxmerge._ort import session_options

    with tempfile.TemporaryDirectory(prefix="profile-") as tmp:
        options = session_options()
        options.intra_op_num_threads = threads
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "ort")
        model = onnxmerge.Seq2SeqModel(path, session_options=options)
        model.generate(
            input_ids=ids, num_beams=beams, min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS
        )
        events = json.loads(Path(model.session.end_profiling()).read_text())
    by_op: collections.Counter[str] = collections.Counter()
    runs = 0.0
    run_starts: list[int] = []
    operator_starts: list[int] = []
    for event in events:
        if event.get("cat") == "Session" and event.get("name") == "model_run":
            runs += event["dur"]
            run_starts.append(event["ts"])
        elif event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            op = event["args"].get("op_name", "?")
            by_op[op] += event["dur"]
            if op != "If":
                operator_starts.append(event["ts"])
    # Operators that ran after the first step started its successor: the cached steps'.
    second_run = sorted(run_starts)[1] if len(run_starts) > 1 else float("inf")
    cached_operators = sum(ts >= second_run for ts in operator_starts)
    # If nodes contain the branch's nodes; count only leaf operators.
    leaf = sum(v for k, v in by_op.items() if k != "If")
    top = dict(
        sorted(((k, v / 1e3) for k, v in by_op.items() if k != "If"), key=lambda kv: -kv[1])[:12]
    )
    return {
        "model_run_ms": runs / 1e3,
        "operators_ms": leaf / 1e3,
        "outside_operators_ms": (runs - leaf) / 1e3,
        "top_operators_ms": top,
        "operators_per_cached_step": cached_operators / max(1, len(run_starts) - 1),
    }


def profile(merged: Path, config: dict, threads: int, repeats: int) -> dict[str, Any]:
    import onnxmerge
    from onnxmerge._ort import session_options

    options = session_options()
    options.intra_op_num_threads = threads
    model = onnxmerge.Seq2SeqModel(merged, session_options=options)
    ids = _source(config)
    return {
        search: {
            "steps": _timed_steps(model, ids, beams, repeats),
            "onnxruntime_profile": _ort_profile(merged, ids, beams, threads),
        }
        for search, beams in (("greedy", 1), ("beam4", 4))
    }


def merge_without(step_type: type, export_dir: Path, target: Path) -> Path:
    """The merge with one rewrite pass left out, to measure what that pass is worth."""
    from onnxmerge.merge import _orchestrate as orchestrate

    steps = orchestrate.rewrite_steps
    orchestrate.rewrite_steps = lambda *args: tuple(
        s for s in steps(*args) if not isinstance(s, step_type)
    )
    try:
        return orchestrate.merge_seq2seq(export_dir, target)
    finally:
        orchestrate.rewrite_steps = steps


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "profile", "tiny Marian model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    factory = _common.marian_config(args.quick)
    export = _common.export_cached(factory, "tied")
    full = factory()
    config = {k: int(getattr(full, k)) for k in ("vocab_size", "eos_token_id")}
    import onnxmerge

    with tempfile.TemporaryDirectory(prefix="profile-generate-") as tmp:
        report = onnxmerge.merge_seq2seq(export.onnx_dir, Path(tmp) / "model.onnx").report
        merged = report.path
        result = {
            "benchmark": "profile",
            "model": "tiny Marian" if args.quick else "opus-mt-fr-en shape",
            "threads": args.threads,
            "new_tokens": NEW_TOKENS,
            "merge_rewrites": report.rewrites,
            "searches": profile(merged, config, args.threads, args.repeats),
        }
        int8 = onnxmerge.quantize(merged, Path(tmp) / "model_int8.onnx", weights="int8")
        result["searches_int8"] = profile(int8, config, args.threads, args.repeats)
        from onnxmerge.passes.reshape_targets import FoldReshapeTargets

        unfolded = merge_without(FoldReshapeTargets, export.onnx_dir, Path(tmp) / "unfolded.onnx")
        result["without_reshape_folding"] = profile(unfolded, config, args.threads, args.repeats)
    _common.write_results(args.out, result)
    print(json.dumps(result["searches"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
