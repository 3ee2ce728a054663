"""A corpus whose outputs end at different lengths, against CTranslate2: what running ended rows
costs, and what dropping them (``generate()``'s default, as CTranslate2 does) gives.

``bench_corpus.py`` forces exactly 24 new tokens per input, so every row of a batch ends on the
same step. Translations end where they end: in a batch run to its longest output, the rows that
ended run on, on padding. Here the model is the opus-mt-fr-en shape with an untied head and a
raised eos logit (``_common.opus_mt_ends_config``; seeded random weights tied to the head only
repeat their first token), so outputs end where the model puts eos: at least ``MIN_NEW`` and at
most ``MAX_NEW`` new tokens. Their lengths do not follow the source's, as translations' do, so
length-sorted batches mix short and long outputs more than a real corpus would: this is the
case where dropping rows matters most.

The same 1,000 inputs as ``bench_corpus.py``, greedy and 4 beams, float32 and int8, 2 threads, two
batches at once on each side (its best in ``bench_corpus.py``) at each of ``SETTINGS``, and past
them where a side's fastest is the smallest or largest tried (``bench_corpus.widen``), each run
in a process of its own, the sides alternated. Sides: CTranslate2's ``translate_batch``; our
``generate_many``; and ours with ended rows kept to the batch's end (transformers' way, and ours
before). Tokens are counted without eos on every side (CTranslate2 returns none), so an output
that reaches ``MAX_NEW`` counts one token less on ours, whose last is then a forced eos.

Usage: python benchmarks/bench_corpus_ends.py [--quick] [--inputs 1000]
    [--out benchmarks/out/corpus_ends.json]
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _anchor, _common  # noqa: E402
from benchmarks.bench_corpus import (  # noqa: E402
    CASES,
    anchor_checks,
    partial_path,
    probed_group,
    setting_name,
    side_worker,
    widen,
    widened_note,
)
from benchmarks.bench_ctranslate2 import convert_ctranslate2, quantize_ours  # noqa: E402

MIN_NEW, MAX_NEW = 12, 48
SETTINGS = (("examples", 32, 2), ("examples", 64, 2), ("examples", 128, 2))
QUICK_SETTINGS = (("examples", 16, 2),)
SIDES = ("ctranslate2", "ours", "ours, rows kept")


def _translated(side, path, config, count, threads, cache, case, batching) -> dict:
    """``bench_corpus``'s worker over the corpus, its tokens without eos (ours ends each output
    with one, CTranslate2 returns none) and its speed counted so."""
    worker = "ctranslate2" if side == "ctranslate2" else "ours"
    result = side_worker(
        worker,
        path,
        config,
        count,
        threads,
        cache,
        case,
        batching,
        new_tokens=(MIN_NEW, MAX_NEW),
        keep_rows=side == "ours, rows kept",
    )
    eos = config["eos_token_id"]
    tokens = [t[:-1] if t and t[-1] == eos else t for t in result["tokens"]]
    return {**result, "tokens": tokens, "tokens_per_s": sum(map(len, tokens)) / result["s"]}


def _run_side(ct2_path, our_path, cache, config, count, threads, case, side, batching) -> dict:
    """``_translated`` for ``side`` with that side's file (and our session cache)."""
    if side == "ctranslate2":
        return _translated(side, ct2_path, config, count, threads, None, case, batching)
    return _translated(side, our_path, config, count, threads, cache, case, batching)


# -- the comparison -------------------------------------------------------------------------------


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of outputs that are the same on both sides."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def lengths(tokens: list[list[int]]) -> dict:
    n = sorted(map(len, tokens))
    return {
        "mean": sum(n) / len(n),
        "median": n[len(n) // 2],
        "max": n[-1],
        "at_max": sum(x >= MAX_NEW - 1 for x in n) / len(n),  # ours: the last is eos
    }


def summarize(tried: dict[str, dict[str, dict]]) -> dict:
    """Per side its fastest setting; ours against CTranslate2 and against ours with rows kept
    (at our fastest setting), and how often the outputs are the same."""
    best = {side: max(runs, key=lambda k: runs[k]["tokens_per_s"]) for side, runs in tried.items()}
    pick = {side: tried[side][best[side]] for side in tried}
    kept_there = tried["ours, rows kept"][best["ours"]]
    return {
        "best": {
            side: {k: v for k, v in pick[side].items() if k != "tokens"} | {"batching": best[side]}
            for side in tried
        },
        "settings": {
            side: {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in runs.items()}
            for side, runs in tried.items()
        },
        "vs_ctranslate2": pick["ours"]["tokens_per_s"] / pick["ctranslate2"]["tokens_per_s"],
        "rows_kept_vs_ctranslate2": pick["ours, rows kept"]["tokens_per_s"]
        / pick["ctranslate2"]["tokens_per_s"],
        "vs_rows_kept": pick["ours"]["tokens_per_s"] / kept_there["tokens_per_s"],
        "same_as_rows_kept": agreement(pick["ours"]["tokens"], kept_there["tokens"]),
        "same_as_ctranslate2": agreement(pick["ours"]["tokens"], pick["ctranslate2"]["tokens"]),
        "lengths": lengths(pick["ours"]["tokens"]),
    }


def markdown(data: dict) -> list[str]:
    """The section of docs/benchmarks.md."""
    from benchmarks.run_all import _load_averages

    s = data["setting"]
    lines = [
        "## A corpus whose outputs end at different lengths (`generate_many`)",
        "",
        f"{data['model']} with an untied head and a raised eos logit, so that outputs end where "
        f"the model puts eos, {s['min_new_tokens']} to {s['max_new_tokens']} new tokens; the "
        f"same {s['inputs']} inputs as above, {s['threads']} threads, two batches at once on "
        f"each side at {', '.join(s['settings'])}{widened_note(s.get('widened'))} "
        "(`benchmarks/bench_corpus_ends.py`). Output "
        "lengths here do not follow the source's, so length-sorted batches mix short and long "
        "outputs more than a real corpus would. *Rows kept*: ours with ended rows run to the "
        "batch's end, as transformers runs them. Tokens/s counts tokens without eos on every "
        "side; *same* is the share of outputs equal on both sides. Load average of this run: "
        f"{_load_averages(data['environment'])}; "
        f"processor: {_common.processor_words(data['environment'])}." + _anchor.sentence(data),
        "",
        "| precision | search | output tokens: mean / median / max | CTranslate2 tokens/s "
        "| onnxmerge tokens/s | ratio | rows kept tokens/s | dropping / keeping "
        "| peak MB: CTranslate2 / onnxmerge / kept | same: kept / CTranslate2 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for precision, cases in data["precisions"].items():
        for case, c in cases.items():
            b, n = c["best"], c["lengths"]
            kept = c["settings"]["ours, rows kept"][b["ours"]["batching"]]
            lines.append(
                f"| {precision} | {case} | {n['mean']:.1f} / {n['median']} / {n['max']} "
                f"| {b['ctranslate2']['tokens_per_s']:.1f} ({b['ctranslate2']['batching']}) "
                f"| {b['ours']['tokens_per_s']:.1f} ({b['ours']['batching']}) "
                f"| **{c['vs_ctranslate2']:.2f}x** | {kept['tokens_per_s']:.1f} "
                f"| **{c['vs_rows_kept']:.2f}x** | {b['ctranslate2']['peak_rss_mb']:.0f} / "
                f"{b['ours']['peak_rss_mb']:.0f} / {kept['peak_rss_mb']:.0f} "
                f"| {c['same_as_rows_kept']:.2f} / {c['same_as_ctranslate2']:.2f} |"
            )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "corpus_ends", "tiny Marian model, 48 inputs")
    parser.add_argument("--inputs", type=int, default=1000, help="inputs in the corpus")
    # The workers are bench_corpus.py's: the options they share.
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=_common.DEFAULT_CACHE_DIR)
    _anchor.add_argument(parser)
    args = parser.parse_args(argv)
    _common.compile_bytecode()
    settings = QUICK_SETTINGS if args.quick else SETTINGS
    if args.quick:
        args.inputs = min(args.inputs, 48)
    load_at_start = os.getloadavg()
    machine = _anchor.MachineUse()
    started = time.perf_counter()
    factory = _common.tiny_marian_ends_config if args.quick else _common.opus_mt_ends_config
    export = _common.export_cached(factory, "tied", args.cache_dir)
    config = {k: int(getattr(factory(), k)) for k in ("vocab_size", "pad_token_id", "eos_token_id")}
    import onnxmerge

    scratch = Path(tempfile.mkdtemp(prefix="bench-corpus-ends-"))
    try:
        float_path = onnxmerge.merge_seq2seq(export.onnx_dir, scratch / "float32" / "model.onnx")
        int8_path = scratch / "int8" / "model.onnx"
        int8_path.parent.mkdir()
        quantize_ours(float_path, int8_path)
        ours = {"float32": float_path, "int8": int8_path}
        caches = {}
        for precision, path in ours.items():  # entries written before the timed runs
            caches[precision] = scratch / f"session-cache-{precision}"
            onnxmerge.Seq2SeqModel(path, session_cache=caches[precision])
        ct2 = convert_ctranslate2(export.pytorch_dir, scratch, config)
        precisions: dict[str, dict] = {}
        probed: dict[str, list[dict]] = {}
        widened: dict[str, dict[str, list[str]]] = {"float32": {}, "int8": {}}
        for precision in ("float32", "int8"):
            precisions[precision] = {}
            for case, _ in CASES:
                run = functools.partial(
                    _run_side, ct2[precision], ours[precision], caches[precision], config,
                    args.inputs, args.threads, case,
                )  # fmt: skip
                tried: dict[str, dict[str, dict]] = {side: {} for side in SIDES}
                for setting in settings:
                    name = setting_name(*setting)
                    for side in SIDES:
                        tried[side][name] = run(side, name)
                if not args.quick:  # the quick run checks the pipeline, not the grid
                    widened[precision][case] = widen(
                        tried, run, ("ctranslate2", "ours"), args.inputs
                    )
                for name, result in tried["ctranslate2"].items():
                    group = probed_group(precision, name, args.threads)
                    probed.setdefault(group, []).append(result)
                precisions[precision][case] = summarize(tried)
            _common.write_results(partial_path(args.out), {"precisions": precisions})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    import ctranslate2
    import onnxruntime

    results = {
        "benchmark": "corpus_ends",
        "model": "tiny Marian" if args.quick else "opus-mt-fr-en shape",
        "setting": {
            "inputs": args.inputs,
            "min_new_tokens": MIN_NEW,
            "max_new_tokens": MAX_NEW,
            "threads": args.threads,
            "settings": [setting_name(*s) for s in settings],
            "widened": None if args.quick else widened,
            "ours": "generate_many(max_batch_size, batch_type, parallel_batches=2) through a "
            "session cache written beforehand, as in bench_corpus.py",
            "rows kept": "the same with ended rows run to the batch's end",
            "ctranslate2": "translate_batch(max_batch_size, batch_type), as in bench_corpus.py",
        },
        "precisions": precisions,
        "seconds": time.perf_counter() - started,
        "environment": _common.environment(
            load_at_start, onnxruntime=onnxruntime.__version__, ctranslate2=ctranslate2.__version__
        ),
    }
    status = _anchor.finish(args.out, results, anchor_checks(probed), machine, args.anchor_check)
    if status:
        return status
    for precision, cases in precisions.items():
        for case, c in cases.items():
            print(
                f"{precision} {case}: ours/ctranslate2 {c['vs_ctranslate2']:.2f}x, dropping/"
                f"keeping ended rows {c['vs_rows_kept']:.2f}x, mean length "
                f"{c['lengths']['mean']:.1f}"
            )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
