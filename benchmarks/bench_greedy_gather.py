"""What the greedy head's ``greedy_gather_below`` weighs, at batch 1: a cached step through the
float head against one through the int8 head (what screening saves), gathering the float rows
of ``k`` tokens from cold pages (what a screened step pays for the tokens its bounds leave), and
one row's product over the whole mapped head (what a step pays that gives up gathering). And
what ``gathered_pages_kept`` weighs: a long-form ``generate`` (``bench_pipeline``'s two minutes
of audio) with the mapped pages of gathered rows dropped once the process's resident file pages
grew by each of ``KEPT`` bytes, 4,096 being about every step.

The model is the whisper-tiny shape (seeded random weights; ``bench_whisper``'s cached export,
merged afresh) opened through a session cache, whose entry holds the int8 head
(``docs/runtime.md``, "Greedy search through the session cache"); the opus-mt-fr-en shape with
``--model marian``. Cold pages: the head's rows are dropped from the process before each
gather, as a step's page release leaves them. A diagnosis for one setting, run by
``run_all.py --only greedy_gather``; its figures are medians of ``--repeats`` each.

Usage: python benchmarks/bench_greedy_gather.py [--quick] [--model whisper|marian]
    [--repeats 50] [--threads 2] [--out benchmarks/out/greedy_gather.json]
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _anchor, _common  # noqa: E402

GATHERED = (256, 512, 1024, 2048, 4096, 8192)
KEPT = (4096, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20)


def _median_ms(
    fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None
) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _model(args, scratch: Path) -> tuple[Any, dict[str, Any], str]:
    """The model through a session cache, its first step's encoder inputs and prompt, a name."""
    import numpy as np

    import onnxmerge

    if args.model == "marian":
        export, _ = _common.marian_export(args.quick)
        onnx_dir, name = export.onnx_dir, "tiny Marian" if args.quick else "opus-mt-fr-en shape"
    else:
        from benchmarks import bench_whisper

        onnx_dir = bench_whisper.export_whisper(quick=args.quick)
        name = "tiny Whisper" if args.quick else "whisper-tiny shape"
    merged = onnxmerge.merge_seq2seq(onnx_dir, scratch / "model.onnx")
    model = onnxmerge.Seq2SeqModel(merged, threads=args.threads, session_cache=scratch / "cache")
    rng = np.random.default_rng(_common.SEED)
    if args.model == "marian":
        inputs = {"input_ids": rng.integers(2, 1000, (1, 30), dtype=np.int64)}
    else:
        bins, frames = model.config["num_mel_bins"], 2 * model.config["max_source_positions"]
        inputs = {"input_features": rng.uniform(-1, 1, (1, bins, frames)).astype(np.float32)}
    start = int(model.generation_config.get("decoder_start_token_id") or 0)
    return model, {"inputs": inputs, "prompt": np.array([[start]], dtype=np.int64)}, name


def measure(args) -> dict[str, Any]:
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="bench-gather-") as tmp:
        model, first, name = _model(args, Path(tmp))
        session = model._session
        head = session.greedy_head
        if head is None:
            raise RuntimeError("the session-cache entry holds no int8 head")
        out = model.first_step(first["inputs"], first["prompt"])
        token = np.array([[int(np.argmax(out.logits[0, -1]))]], dtype=np.int64)

        def step(greedy: bool) -> Callable[[], Any]:
            return lambda: session.next_step(token, out.cache, greedy=greedy)

        vocab, width = head.weight.shape
        rng = np.random.default_rng(_common.SEED)
        hidden = rng.standard_normal((1, width)).astype(np.float32)
        # The runtime's own code: LogitBounds gathering the rows of the tokens a mask holds
        # (with shares that never send them to a product), and its product over a whole row.
        gathering = dataclasses.replace(
            model.accelerations, greedy_most_of_row=1.0, greedy_most_of_step=1.0
        )
        bounds = head.bounds(np.zeros((1, vocab), np.float32), hidden, accelerations=gathering)
        gathers = {}
        for count in GATHERED:
            reaching = np.zeros((1, vocab), bool)
            reaching[0, rng.choice(vocab, min(count, vocab), replace=False)] = True
            unbounded = np.zeros(1, bool)
            gathers[str(count)] = _median_ms(
                lambda reaching=reaching, unbounded=unbounded: bounds._candidates(
                    reaching, unbounded
                ),
                args.repeats,
                before=head.drop_pages,
            )
        logits = np.zeros((1, vocab), np.float32)

        def whole_row() -> None:
            bounds._write_whole_rows(logits, np.ones(1, bool))

        float_ms = _median_ms(step(False), args.repeats)
        int8_ms = _median_ms(step(True), args.repeats)
        return {
            "model": name,
            "vocab": vocab,
            "width": width,
            "float_step_ms": float_ms,
            "int8_step_ms": int8_ms,
            "saved_ms": float_ms - int8_ms,
            "gather_ms": gathers,
            "whole_row_ms": _median_ms(whole_row, max(3, args.repeats // 10), head.drop_pages),
            "greedy_gather_below": model.accelerations.greedy_gather_below,
        }


def measure_page_release(args) -> dict[str, Any]:
    """A long-form call's time and the resident file pages it leaves, by ``gathered_pages_kept``:
    the fastest of ``--calls`` calls after one untimed, each setting in turn, twice over."""
    import gc
    import json

    import onnxmerge
    from benchmarks import bench_pipeline
    from onnxmerge.runtime import Accelerations
    from onnxmerge.runtime._memory import resident_file_bytes

    onnx_dir, _, fields, features, mask = bench_pipeline._whisper(args)
    with tempfile.TemporaryDirectory(prefix="bench-kept-") as tmp:
        merged = onnxmerge.merge_seq2seq(onnx_dir, Path(tmp) / "model.onnx")
        cache = Path(tmp) / "cache"
        onnxmerge.Seq2SeqModel(merged, session_cache=cache)  # the entry, written once
        times: dict[int, list[float]] = {kept: [] for kept in KEPT}
        kept_mb: dict[int, float] = {}
        sequences = set()
        for _ in range(2):
            for kept in KEPT:
                model = onnxmerge.Seq2SeqModel(
                    merged,
                    threads=args.threads,
                    session_cache=cache,
                    accelerations=Accelerations(gathered_pages_kept=kept),
                )
                model.generation_config.update(fields)

                def call(model=model) -> Any:
                    return model.generate(
                        input_features=features, attention_mask=mask, return_timestamps=True
                    )

                before = resident_file_bytes() or 0
                sequences.add(json.dumps(call().tolist()))
                for _ in range(args.calls):
                    start = time.perf_counter()
                    call()
                    times[kept].append(time.perf_counter() - start)
                kept_mb[kept] = max(
                    kept_mb.get(kept, 0.0), ((resident_file_bytes() or 0) - before) / 1e6
                )
                del model, call
                gc.collect()
        if len(sequences) != 1:
            raise RuntimeError("the settings gave different ids")
        return {
            "audio_s": None if args.quick else bench_pipeline.AUDIO_SECONDS,
            "call_s": {str(kept): min(times[kept]) for kept in KEPT},
            "resident_file_growth_mb": {str(kept): kept_mb[kept] for kept in KEPT},
            "gathered_pages_kept": Accelerations().gathered_pages_kept,
        }


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "greedy_gather", "the tiny model, fewer repeats")
    parser.add_argument("--model", choices=("whisper", "marian"), default="whisper")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2, help="timed long-form calls a setting")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.calls = 5, 1
    load_at_start = os.getloadavg()
    machine = _anchor.MachineUse()
    results = {
        "quick": args.quick,
        "setting": {"threads": args.threads, "repeats": args.repeats, "statistic": "median"},
        "environment": _common.environment(load_at_start, **_common.package_versions()),
        "batch_1": measure(args),
        "page_release": measure_page_release(args),
        "machine_use": machine.record(),
    }
    _common.write_results(args.out, results)
    return 0


def markdown(data: dict[str, Any]) -> list[str]:
    """The section of docs/benchmarks.md (``run_all.py`` renders it from greedy_gather.json)."""
    m = data["batch_1"]
    cpu = _common.processor_words(data["environment"])
    gathers = ", ".join(f"{k}: {v:.2f} ms" for k, v in m["gather_ms"].items())
    return [
        "## What a screened greedy step pays for the tokens its bounds leave",
        "",
        f"{m['model']} ({m['vocab']:,} tokens, {m['width']} wide), batch 1, "
        f"{data['setting']['threads']} threads, {cpu} (`benchmarks/bench_greedy_gather.py`, "
        f"medians). A cached step through the float head takes {m['float_step_ms']:.2f} ms, "
        f"through the int8 head {m['int8_step_ms']:.2f} ms: screening saves "
        f"{m['saved_ms']:.2f} ms a step. Gathering the float rows of k tokens from cold pages, "
        f"by k: {gathers}; one row's product over the whole mapped head "
        f"{m['whole_row_ms']:.2f} ms. A step that takes fewer than `greedy_gather_below` "
        f"({m['greedy_gather_below']:,}) tokens in float gathers them and counts as cheap. "
        f"Other processes used {data['machine_use']['other_cores']:.2f} cores on average.",
        "",
        *_page_release_lines(data),
    ]


def _page_release_lines(data: dict[str, Any]) -> list[str]:
    r = data.get("page_release")
    if r is None:
        return []
    every = str(KEPT[0])
    cells = ", ".join(
        f"{int(k) / 2**20:g} MiB: {s:.2f} s ({s / r['call_s'][every]:.2f}x), "
        f"+{r['resident_file_growth_mb'][k]:.1f} MB"
        for k, s in r["call_s"].items()
        if k != every
    )
    audio = f"{r['audio_s']:.0f} s of audio" if r["audio_s"] else "the tiny model's features"
    return [
        "Long-form `generate(..., return_timestamps=True)` on the same model through its "
        f"session cache ({audio}), by `gathered_pages_kept`: the fastest call of each, and how "
        "much the process's resident file pages grew over its calls. Dropping the gathered "
        f"rows' pages about every step (4 KiB): {r['call_s'][every]:.2f} s, "
        f"+{r['resident_file_growth_mb'][every]:.1f} MB; {cells}. The default keeps "
        f"{r['gathered_pages_kept'] / 2**20:g} MiB.",
        "",
    ]


if __name__ == "__main__":
    sys.exit(main())
