"""What a busy machine does to CTranslate2 and to onnxmerge: each alone, then beside busy processes.

The figures against CTranslate2 once published (an Intel Xeon, 2 cores) had CTranslate2 running
2.5-3x slower than its own one-liner runs on a quiet machine, while our side reproduced. This
measures the likely cause on the machine at hand: for ``--busy 0 1 2`` processes spinning on the
processor (each a Python loop, the load a test suite or a second benchmark puts there), fresh
processes run, one after another, CTranslate2's documented one-liner in a clean environment
(``_anchor.reference``), ``bench_ctranslate2``'s CTranslate2 worker and our worker, greedy at
batch 1 on the opus-mt-fr-en shape (``bench_ctranslate2``'s models and inputs), float32 and int8,
2 threads each. Reported per condition: each side's best time, its slowdown against the quiet
machine, and ours / CTranslate2.

It loads the machine on purpose, so ``run_all.py`` runs it only when asked (``--only
contention``); no anchor check applies.

Usage: python benchmarks/bench_contention.py [--quick] [--busy 0 1 2]
    [--out benchmarks/out/contention.json]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _common  # noqa: E402
from benchmarks import bench_ctranslate2 as ct2_bench  # noqa: E402

SIDES = ("ctranslate2 one-liner", "ctranslate2 worker", "ours")


def _spinners(count: int) -> list[subprocess.Popen]:
    """``count`` processes that keep one processor busy each until killed."""
    code = "while True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def _best_greedy(side: str, path: Path, config: dict, repeats: int, threads: int) -> float:
    """One fresh process of ``side`` on ``path``: its best greedy batch-1 time."""
    if side == "ctranslate2 one-liner":
        return min(ct2_bench.reference_run(path, config, repeats, threads)["times"])
    worker = "ctranslate2" if side == "ctranslate2 worker" else "ours"
    result = ct2_bench.worker_process(worker, path, config, repeats, threads, None)
    case = result["cases"]["greedy_b1"]
    return min(case.get("times") or [case["s"]])


def measure(models: dict, config: dict, busy: list[int], repeats: int, threads: int) -> dict:
    """Per number of busy processes, per precision, each side's best greedy batch-1 time."""
    conditions: dict[str, Any] = {}
    for count in busy:
        spinners = _spinners(count)
        time.sleep(0.5 if count else 0)  # let them take their processors
        try:
            conditions[str(count)] = {
                precision: {
                    side: _best_greedy(side, paths[side], config, repeats, threads)
                    for side in SIDES
                }
                for precision, paths in models.items()
            }
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
    return conditions


def summarise(conditions: dict) -> dict:
    """Slowdowns against the quiet machine and ours / CTranslate2's worker, per condition."""
    quiet = conditions.get("0")
    out: dict[str, Any] = {}
    for count, precisions in conditions.items():
        out[count] = {}
        for precision, times in precisions.items():
            row: dict[str, Any] = {
                "ours_over_ctranslate2": times["ours"] / times["ctranslate2 worker"],
                "ours_over_one_liner": times["ours"] / times["ctranslate2 one-liner"],
            }
            if quiet is not None:
                row["slowdown"] = {s: times[s] / quiet[precision][s] for s in SIDES}
            out[count][precision] = row
    return out


def markdown(data: dict) -> list[str]:
    lines = [
        "## CTranslate2 and onnxmerge on a busy machine",
        "",
        f"{data['model']}, greedy, batch 1, {data['setting']['threads']} threads, best of "
        f"{data['setting']['repeats']} in a fresh process per side, beside 0, 1 or 2 processes "
        "spinning on the processor (`benchmarks/bench_contention.py`); processor: "
        f"{data['environment']['cpu']['model'] if data['environment'].get('cpu') else '?'}. "
        "Slowdown is the time over the same side's on the quiet machine.",
        "",
        "| busy processes | precision | CTranslate2 one-liner | CTranslate2 worker | onnxmerge "
        "| ours / CTranslate2 | slowdown: CTranslate2 | slowdown: onnxmerge |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for count, precisions in data["conditions"].items():
        for precision, times in precisions.items():
            summary = data["summary"][count][precision]
            slow = summary.get("slowdown", {})
            lines.append(
                f"| {count} | {precision} | {times['ctranslate2 one-liner']:.3f} s | "
                f"{times['ctranslate2 worker']:.3f} s | {times['ours']:.3f} s | "
                f"**{summary['ours_over_ctranslate2']:.2f}x** | "
                f"{slow.get('ctranslate2 worker', float('nan')):.2f}x | "
                f"{slow.get('ours', float('nan')):.2f}x |"
            )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "contention", "tiny Marian model")
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=_common.DEFAULT_CACHE_DIR)
    args = parser.parse_args(argv)
    load_at_start = os.getloadavg()
    export, config = _common.marian_export(args.quick, args.cache_dir)
    import onnxmerge

    scratch = Path(tempfile.mkdtemp(prefix="bench-contention-"))
    try:
        merged = onnxmerge.merge_seq2seq(export.onnx_dir, scratch / "float32" / "model.onnx")
        int8 = scratch / "int8" / "model.onnx"
        int8.parent.mkdir()
        ct2_bench.quantize_ours(merged, int8)
        ct2 = ct2_bench.convert_ctranslate2(export.pytorch_dir, scratch, config)
        ours = {"float32": merged, "int8": int8}
        models = {
            p: {
                "ctranslate2 one-liner": ct2[p],
                "ctranslate2 worker": ct2[p],
                "ours": ours[p],
            }
            for p in ("float32", "int8")
        }
        conditions = measure(models, config, args.busy, args.repeats, args.threads)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    import ctranslate2
    import onnxruntime

    results = {
        "benchmark": "contention",
        "model": "tiny Marian" if args.quick else "opus-mt-fr-en shape",
        "setting": {"threads": args.threads, "repeats": args.repeats, "busy": args.busy},
        "conditions": conditions,
        "summary": summarise(conditions),
        "environment": _common.environment(
            load_at_start, onnxruntime=onnxruntime.__version__, ctranslate2=ctranslate2.__version__
        ),
    }
    print("\n".join(markdown(results)))
    if args.out:
        _common.write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
