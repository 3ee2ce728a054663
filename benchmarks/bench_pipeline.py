"""transformers' pipeline() and long-form Whisper: onnxmerge against optimum and PyTorch.

Two comparisons, each side in fresh processes, sides taking turns in rounds (their order rotated
each round), each side's best kept:

1. ``pipeline("translation", model=..., tokenizer=...)``, one batch of 8 sentences
   (``batch_size=8``; 32, 9, 27, 14, 31, 5, 20 and 24 ids with eos), exactly 32 new tokens
   (``min_new_tokens`` = ``max_new_tokens``), over three models of the same seeded opus-mt-fr-en
   shaped checkpoint (``_common.marian_export``): onnxmerge's adapter
   (``MergedModelForSeq2SeqLM.from_pretrained`` on the file ``merge_seq2seq`` writes), optimum's
   ``ORTModelForSeq2SeqLM.from_pretrained`` on the export folder, and PyTorch's
   ``AutoModelForSeq2SeqLM.from_pretrained`` on the checkpoint. The model has random weights and
   no tokenizer, so every side gets the same synthetic word-level one (token ``i`` is ``t{i}``,
   eos appended), and the sentences are words of it: the same ids on every side. Every side has
   2 threads (``torch.set_num_threads``; onnxruntime's intra-op threads). Measured: the time of
   one batch (best of the repeats of each process, then of the processes), memory after load
   (resident memory once model, tokenizer and pipeline are loaded, less that before importing
   torch, transformers and the side's runtime), and whether the ids and texts equal ours.
2. Long-form Whisper on the whisper-tiny shape (seeded random weights; ``bench_whisper``'s
   cached export, merged afresh): 120 s of seeded synthetic audio through
   ``WhisperFeatureExtractor`` (12,000 frames, several 30 s windows), then the runtime's
   ``Seq2SeqModel.generate(input_features=..., attention_mask=..., return_timestamps=True,
   return_segments=True)`` against transformers' ``WhisperForConditionalGeneration.generate``
   with the same arguments on the same features, whisper-tiny's generation settings set on both
   (``WHISPER_TINY_FIELDS``; the language detected from the first window). Ours runs twice: with
   a session cache (``session_cache=``, built once before the rounds, not timed), whose int8
   head screens greedy steps, and without one. Random weights put
   most of the probability on the timestamp tokens, so each window is decoded with timestamps
   and moved by its last pair, as with speech; once the timestamps reach the window's end, the
   text goes on to the 448-position limit (random weights rarely give eos), so a window holds
   more tokens than speech would. Measured: the time of one call (best), the windows decoded,
   and whether ids and segments are equal.

``--quick`` runs the pipeline on the tiny models: the tiny Marian, and the test zoo's tiny
Whisper on 300 frames of seeded features (about five of its 64-frame windows), one process per
side. Records the processor and environment (``_common.environment``) and how much of the
processor other processes used during the run (``_anchor.MachineUse``): PyTorch's threads slow
down many times over on a busy machine, onnxruntime's far less, so only a quiet run's ratios
are results.

Usage: python benchmarks/bench_pipeline.py [--quick] [--out benchmarks/out/pipeline.json]
    [--rounds 3] [--repeats 5] [--longform-repeats 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _anchor, _common  # noqa: E402

BATCH_LENGTHS = (32, 9, 27, 14, 31, 5, 20, 24)  # ids per sentence, eos included
NEW_TOKENS = 32
QUICK_NEW_TOKENS = 8
TRANSLATION_SIDES = ("ours", "optimum", "pytorch")
LONGFORM_SIDES = ("ours", "ours_without_cache", "pytorch")
AUDIO_SECONDS = 120.0
RATE = 16_000
QUICK_FRAMES = 300
# Fields of whisper-tiny's generation config that bench_whisper's export leaves out, set on both
# sides: its 448 positions (the export keeps GenerationConfig's 20), the previous-text token, and
# the latest first timestamp (1 s).
WHISPER_TINY_FIELDS = {
    "max_length": 448,
    "prev_sot_token_id": 50361,
    "max_initial_timestamp_index": 50,
}
# The tiny Whisper's timestamp and language fields (128 ids: 94 is <|notimestamps|>, 95.. the
# timestamps), as tests/test_runtime_longform.py sets them, and its 64 positions as the length
# limit: the settings of the full run at the tiny model's size.
TINY_WHISPER_FIELDS = {
    "max_length": 64,
    "no_timestamps_token_id": 94,
    "prev_sot_token_id": 90,
    "begin_suppress_tokens": [2],
    "suppress_tokens": [1],
    "lang_to_id": {"<|en|>": 80, "<|fr|>": 81, "<|de|>": 82},
    "task_to_id": {"transcribe": 85, "translate": 84},
    "is_multilingual": True,
}
TARGETS = {
    "translation": {"batch_s": 0.7, "memory_after_load_mb": 0.5},  # ours / optimum
    "longform": {"call_s": 0.5},  # ours / PyTorch
}
TRANSLATION_MEASURES = ("batch_s", "memory_after_load_mb", "memory_added_by_load_mb", "load_s")


def resident_mb() -> float:
    """This process's resident set size in MB (10^6 bytes)."""
    return (_common.self_rss_bytes()["rss_bytes"] or 0) / 1e6


# -- the translation workers -----------------------------------------------------------------------


def _import_side(side: str, threads: int) -> None:
    """What each side imports before it loads: torch and transformers, and its runtime."""
    import torch
    import transformers  # noqa: F401

    torch.set_num_threads(threads)
    if side == "ours":
        import onnxmerge.transformers  # noqa: F401
    elif side == "optimum":
        import optimum.onnxruntime  # noqa: F401


def _load_model(side: str, path: str, threads: int) -> Any:
    if side == "ours":
        from onnxmerge.transformers import MergedModelForSeq2SeqLM

        return MergedModelForSeq2SeqLM.from_pretrained(path, threads=threads)
    if side == "optimum":
        import onnxruntime
        from optimum.onnxruntime import ORTModelForSeq2SeqLM

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        return ORTModelForSeq2SeqLM.from_pretrained(path, session_options=options)
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(path).eval()


def translation_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One process of one side: load, then time ``pipeline(sentences, batch_size=8)``."""
    before = resident_mb()
    start = time.perf_counter()
    _import_side(spec["side"], spec["threads"])
    imported = resident_mb()
    from transformers import AutoTokenizer, pipeline

    model = _load_model(spec["side"], spec["path"], spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    load_s = time.perf_counter() - start
    loaded = resident_mb()
    sentences = spec["sentences"]
    new_tokens = spec["new_tokens"]
    settings = {
        "batch_size": len(sentences),
        "min_new_tokens": new_tokens,
        "max_new_tokens": new_tokens,
    }

    def batch() -> list[str]:
        return [found["translation_text"] for found in translator(sentences, **settings)]

    times, texts = _common.timed_runs(batch, spec["repeats"])
    found = translator(sentences, return_tensors=True, **settings)
    return {
        "load_s": load_s,
        "rss_before_import_mb": before,
        "rss_after_import_mb": imported,
        "rss_after_load_mb": loaded,
        "memory_after_load_mb": loaded - before,
        "memory_added_by_load_mb": loaded - imported,
        "batch_s": min(times),
        "batch_times": times,
        "texts": texts,
        "ids": [f["translation_token_ids"].tolist() for f in found],
    }


# -- the long-form workers -------------------------------------------------------------------------


def _plain_segments(rows: Any) -> list[list[dict[str, Any]]]:
    """Segments as JSON: start and end in seconds, tokens as a list (numpy or torch alike)."""
    return [
        [
            {
                "start": round(float(s["start"]), 6),
                "end": round(float(s["end"]), 6),
                "tokens": [int(t) for t in s["tokens"]],
            }
            for s in row
        ]
        for row in rows
    ]


def _longform_ours(spec: dict[str, Any], features: Any, mask: Any, windows: list) -> Any:
    from onnxmerge import Seq2SeqModel

    cache = {"session_cache": spec["session_cache"]} if spec.get("session_cache") else {}
    model = Seq2SeqModel(spec["path"], threads=spec["threads"], **cache)
    model.generation_config.update(spec["fields"])

    def call() -> tuple[list, list]:
        out = model.generate(
            input_features=features,
            attention_mask=mask,
            return_timestamps=True,
            return_segments=True,
            monitor_progress=windows.append,
        )
        return out["sequences"].tolist(), _plain_segments(out["segments"])

    return call


def _longform_pytorch(spec: dict[str, Any], features: Any, mask: Any, windows: list) -> Any:
    import torch
    from transformers import WhisperForConditionalGeneration

    torch.set_num_threads(spec["threads"])
    model = WhisperForConditionalGeneration.from_pretrained(spec["path"]).eval()
    for key, value in spec["fields"].items():
        setattr(model.generation_config, key, value)
    inputs = {
        "input_features": torch.from_numpy(features),
        "attention_mask": torch.from_numpy(mask),
    }

    def call() -> tuple[list, list]:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(
                **inputs,
                return_timestamps=True,
                return_segments=True,
                monitor_progress=windows.append,
            )
        return out["sequences"].tolist(), _plain_segments(out["segments"])

    return call


def longform_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One process of one side: load, then time one long-form ``generate``."""
    import numpy as np

    saved = np.load(spec["features"])
    features, mask = saved["features"], saved["mask"]
    windows: list = []
    start = time.perf_counter()
    load = _longform_pytorch if spec["side"] == "pytorch" else _longform_ours
    call = load(spec, features, mask, windows)
    load_s = time.perf_counter() - start
    times, (sequences, segments) = _common.timed_runs(call, spec["repeats"])
    return {
        "load_s": load_s,
        "call_s": min(times),
        "call_times": times,
        "windows_per_call": len(windows) // (spec["repeats"] + 1),
        "sequences": sequences,
        "segments": segments,
    }


WORKERS = {"translation": translation_worker, "longform": longform_worker}


# -- the parent ------------------------------------------------------------------------------------


def _child(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A worker in a fresh interpreter; its result is the last line it prints."""
    done = subprocess.run(
        [sys.executable, __file__, "--worker", kind, "--spec", json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} worker of {spec['side']} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rounds(kind: str, specs: dict[str, dict], rounds: int) -> dict[str, list[dict]]:
    """Each side's processes, the sides taking turns, their order rotated each round."""
    sides = list(specs)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for number in range(rounds):
        shift = number % len(sides)
        for side in sides[shift:] + sides[:shift]:
            runs[side].append(_child(kind, specs[side]))
    return runs


# Kept for every process besides the best measures.
_PER_PROCESS = ("batch_times", "call_times", "rss_before_import_mb", "rss_after_load_mb")


def _best(runs: list[dict], keys: tuple[str, ...]) -> dict[str, Any]:
    """The first process's outputs, each measure the best (lowest) over the processes."""
    best = dict(runs[0])
    for key in keys:
        best[key] = min(r[key] for r in runs)
    best["processes"] = [{k: r[k] for k in (*keys, *_PER_PROCESS) if k in r} for r in runs]
    return best


def sentences(config: dict[str, int]) -> list[str]:
    """The batch: seeded words of the synthetic vocabulary, avoiding the special ids (eos is
    appended by the tokenizer)."""
    import numpy as np

    rng = np.random.default_rng(_common.SEED)
    low, high = 2, config["vocab_size"] - 1
    return [" ".join(f"t{i}" for i in rng.integers(low, high, size=n - 1)) for n in BATCH_LENGTHS]


def write_tokenizer(folder: Path, config: dict[str, int]) -> None:
    """A word-level tokenizer whose token ``i`` is ``t{i}`` (special ids keep their names),
    appending eos as Marian's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from benchmarks.bench_ctranslate2 import token_name

    vocab = {token_name(i, config): i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", config["eos_token_id"])]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(folder)


def _ratios(ours: dict, theirs: dict, keys: tuple[str, ...]) -> dict[str, float]:
    return {key: ours[key] / theirs[key] for key in keys}


def run_translation(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    import onnxmerge

    export, config = _common.marian_export(args.quick, args.cache_dir)
    merged = onnxmerge.merge_seq2seq(export.onnx_dir, scratch / "marian" / "model.onnx")
    write_tokenizer(scratch / "tokenizer", config)
    batch = sentences(config)
    new_tokens = QUICK_NEW_TOKENS if args.quick else NEW_TOKENS
    paths = {"ours": merged, "optimum": export.onnx_dir, "pytorch": export.pytorch_dir}
    specs = {
        side: {
            "side": side,
            "path": str(paths[side]),
            "tokenizer": str(scratch / "tokenizer"),
            "sentences": batch,
            "new_tokens": new_tokens,
            "repeats": args.repeats,
            "threads": args.threads,
        }
        for side in TRANSLATION_SIDES
    }
    runs = _rounds("translation", specs, args.rounds)
    sides = {side: _best(r, TRANSLATION_MEASURES) for side, r in runs.items()}
    ours = sides["ours"]
    ratios = {
        f"ours_over_{other}": _ratios(ours, sides[other], TRANSLATION_MEASURES)
        for other in ("optimum", "pytorch")
    }
    targets = TARGETS["translation"]
    return {
        "model": "tiny Marian" if args.quick else "opus-mt-fr-en shape",
        "random_weights_seed": _common.SEED,
        "batch": len(batch),
        "source_lengths": list(BATCH_LENGTHS),
        "new_tokens": new_tokens,
        "merged_bytes": merged.stat().st_size,
        "sides": sides,
        "ratios": ratios,
        "targets": {f"ours_over_optimum.{k}": v for k, v in targets.items()},
        "targets_met": {k: ratios["ours_over_optimum"][k] <= v for k, v in targets.items()},
        "same_ids": {o: sides[o]["ids"] == ours["ids"] for o in ("optimum", "pytorch")},
        "same_text": {o: sides[o]["texts"] == ours["texts"] for o in ("optimum", "pytorch")},
    }


def synthetic_audio(seconds: float) -> Any:
    """Seeded tones that rise and fall in pitch and loudness, over noise."""
    import numpy as np

    rng = np.random.default_rng(_common.SEED)
    t = np.arange(int(seconds * RATE)) / RATE
    pitch = 180 + 60 * np.sin(2 * np.pi * 0.13 * t)
    loudness = 0.5 + 0.5 * np.sin(2 * np.pi * 0.4 * t) ** 2
    voice = 0.3 * loudness * np.sin(2 * np.pi * np.cumsum(pitch) / RATE)
    return (voice + 0.03 * rng.standard_normal(t.size)).astype(np.float32)


def _whisper(args: argparse.Namespace) -> tuple[Path, Path, dict[str, Any], Any, Any]:
    """The export and checkpoint folders, the generation fields to set, features and mask."""
    import numpy as np

    if args.quick:
        from tests import zoo

        export = zoo.tiny_export("whisper")
        rng = np.random.default_rng(_common.SEED)
        features = rng.uniform(-1.0, 1.0, size=(1, zoo.WHISPER_MEL_BINS, QUICK_FRAMES))
        mask = np.ones((1, QUICK_FRAMES), dtype=np.int64)
        fields = TINY_WHISPER_FIELDS
        return export.onnx_dir, export.pytorch_dir, fields, features.astype(np.float32), mask
    from transformers import WhisperFeatureExtractor

    from benchmarks import bench_whisper

    onnx_dir = bench_whisper.export_whisper(quick=False)
    extractor = WhisperFeatureExtractor(feature_size=80)
    found = extractor(
        synthetic_audio(AUDIO_SECONDS),
        sampling_rate=RATE,
        truncation=False,
        padding="longest",
        return_attention_mask=True,
        return_tensors="np",
    )
    mask = found["attention_mask"].astype(np.int64)
    return onnx_dir, onnx_dir.parent / "pytorch", WHISPER_TINY_FIELDS, found.input_features, mask


def run_longform(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    import numpy as np

    import onnxmerge

    onnx_dir, pytorch_dir, fields, features, mask = _whisper(args)
    merged = onnxmerge.merge_seq2seq(onnx_dir, scratch / "whisper" / "model.onnx")
    np.savez(scratch / "features.npz", features=features, mask=mask)
    cache = scratch / "session-cache"
    onnxmerge.Seq2SeqModel(merged, session_cache=cache)  # the entry the timed processes open
    paths = {"ours": merged, "ours_without_cache": merged, "pytorch": pytorch_dir}
    specs = {
        side: {
            "side": side,
            "path": str(paths[side]),
            "session_cache": str(cache) if side == "ours" else None,
            "features": str(scratch / "features.npz"),
            "fields": fields,
            "repeats": args.longform_repeats,
            "threads": args.threads,
        }
        for side in LONGFORM_SIDES
    }
    runs = _rounds("longform", specs, args.rounds)
    sides = {side: _best(r, ("call_s", "load_s")) for side, r in runs.items()}
    ours, plain, theirs = sides["ours"], sides["ours_without_cache"], sides["pytorch"]
    ratio = ours["call_s"] / theirs["call_s"]
    return {
        "model": "tiny-whisper" if args.quick else "whisper-tiny shape",
        "random_weights_seed": _common.SEED,
        "audio_s": None if args.quick else AUDIO_SECONDS,
        "frames": int(features.shape[-1]),
        "generation_fields": fields,
        "call": "generate(input_features=..., attention_mask=..., return_timestamps=True, "
        "return_segments=True)",
        "sides": sides,
        "ratios": {
            "ours_over_pytorch": {"call_s": ratio},
            "ours_without_cache_over_pytorch": {"call_s": plain["call_s"] / theirs["call_s"]},
        },
        "targets": {f"ours_over_pytorch.{k}": v for k, v in TARGETS["longform"].items()},
        "targets_met": {"call_s": ratio <= TARGETS["longform"]["call_s"]},
        "same_ids": ours["sequences"] == theirs["sequences"] == plain["sequences"],
        "same_segments": ours["segments"] == theirs["segments"] == plain["segments"],
        "segments": sum(len(row) for row in ours["segments"]),
        "generated_ids": sum(len(row) for row in ours["sequences"]),
        "windows": ours["windows_per_call"],
    }


def _versions() -> dict[str, str]:
    found = _common.package_versions()
    try:
        found["onnxruntime"] = metadata.version("onnxruntime")
    except metadata.PackageNotFoundError:
        found["onnxruntime"] = "absent"
    return found


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = _common.arguments(
        __doc__, "pipeline", "tiny models, one process per side, fewer repeats"
    )
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per side")
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per process")
    parser.add_argument(
        "--longform-repeats", type=int, default=2, help="timed long-form calls per process"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=_common.DEFAULT_CACHE_DIR)
    parser.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.repeats, args.longform_repeats = 1, 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    _common.compile_bytecode()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](json.loads(args.spec))))
        return 0
    load_at_start = os.getloadavg()
    machine = _anchor.MachineUse()
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        translation = run_translation(args, Path(tmp))
        longform = run_longform(args, Path(tmp))
    results = {
        "quick": args.quick,
        "setting": {
            "threads": args.threads,
            "rounds": args.rounds,
            "repeats": args.repeats,
            "longform_repeats": args.longform_repeats,
            "statistic": "best of the repeats of each process, then of the processes",
            "memory_after_load": "resident memory after loading model, tokenizer and pipeline, "
            "less that before importing torch, transformers and the side's runtime",
        },
        "environment": _common.environment(load_at_start, **_versions()),
        "translation": translation,
        "longform": longform,
        "machine_use": machine.record(),
    }
    _common.write_results(args.out, results)
    print(
        json.dumps(
            {
                "translation": {k: translation[k] for k in ("ratios", "same_ids", "same_text")},
                "longform": {
                    k: longform[k] for k in ("ratios", "same_ids", "same_segments", "windows")
                },
            },
            indent=1,
        )
    )
    return 0


# -- the docs --------------------------------------------------------------------------------------


def _cell(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def _translation_rows(t: dict[str, Any]) -> list[str]:
    sides, ratios = t["sides"], t["ratios"]
    rows = [
        ("time per batch, s", "batch_s", 3),
        ("memory after load, MB", "memory_after_load_mb", 0),
        ("of which loading the model, MB", "memory_added_by_load_mb", 0),
        ("load (import included), s", "load_s", 2),
    ]
    lines = []
    for name, key, digits in rows:
        target = t["targets"].get(f"ours_over_optimum.{key}")
        cells = [_cell(sides[side][key], digits) for side in ("pytorch", "optimum", "ours")]
        lines.append(
            f"| {name} | {' | '.join(cells)} | **{ratios['ours_over_optimum'][key]:.2f}x** | "
            f"{ratios['ours_over_pytorch'][key]:.2f}x | "
            f"{'' if target is None else f'<= {target}x'} |"
        )
    return lines


def markdown(data: dict[str, Any]) -> list[str]:
    """The section of docs/benchmarks.md (``run_all.py`` renders it from pipeline.json)."""
    t, w, s = data["translation"], data["longform"], data["setting"]
    cpu = _common.processor_words(data["environment"])
    lengths = ", ".join(map(str, t["source_lengths"]))
    audio = f"{w['audio_s']:.0f} s of audio, " if w["audio_s"] else ""
    return [
        "## `pipeline()` and long-form Whisper against optimum and PyTorch",
        "",
        f'{t["model"]} (random weights), `pipeline("translation", model=..., tokenizer=...)` '
        f"on one batch of {t['batch']} sentences ({lengths} ids), exactly {t['new_tokens']} new "
        f"tokens, {s['threads']} threads on every side, {cpu} (`benchmarks/bench_pipeline.py`). "
        'onnxmerge is `MergedModelForSeq2SeqLM.from_pretrained("model.onnx")`, optimum '
        "`ORTModelForSeq2SeqLM.from_pretrained(export)`, PyTorch "
        "`AutoModelForSeq2SeqLM.from_pretrained(checkpoint)`. Times are the best of "
        f"{s['repeats']} batches in each of {s['rounds']} fresh processes per side; memory "
        "after load is the process's resident memory once model, tokenizer and pipeline are "
        "loaded, less that before importing torch, transformers and the side's runtime.",
        "",
        "| measure | PyTorch | optimum | onnxmerge | ours / optimum | ours / PyTorch | target |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *_translation_rows(t),
        "",
        f"Same ids as onnxmerge: optimum {t['same_ids']['optimum']}, PyTorch "
        f"{t['same_ids']['pytorch']}; same text: optimum {t['same_text']['optimum']}, PyTorch "
        f"{t['same_text']['pytorch']}.",
        "",
        f"Long-form: {w['model']} (random weights), {audio}{w['frames']} frames of features, "
        f"`{w['call']}` on the same features: the runtime's `Seq2SeqModel.generate` against "
        "transformers' `WhisperForConditionalGeneration.generate` in PyTorch; onnxmerge with a "
        "session cache (`session_cache=`, built before the rounds), whose int8 head screens "
        "the greedy steps, and without one. "
        f"{w['windows']} windows, {w['segments']} segments, {w['generated_ids']} ids "
        f"({w['generated_ids'] / max(1, w['windows']):.0f} a window); best of "
        f"{s['longform_repeats']} calls in each of {s['rounds']} processes per side.",
        "",
        "| measure | transformers (PyTorch) | onnxmerge | ratio | onnxmerge, no session "
        "cache | ratio | target |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| time per call, s | {w['sides']['pytorch']['call_s']:.2f} | "
        f"{w['sides']['ours']['call_s']:.2f} | "
        f"**{w['ratios']['ours_over_pytorch']['call_s']:.2f}x** | "
        f"{w['sides']['ours_without_cache']['call_s']:.2f} | "
        f"{w['ratios']['ours_without_cache_over_pytorch']['call_s']:.2f}x | "
        f"<= {w['targets']['ours_over_pytorch.call_s']}x |",
        "",
        f"Same ids: {w['same_ids']}; same segments (tokens, start and end): "
        f"{w['same_segments']}. Other processes used "
        f"{data['machine_use']['other_cores']:.2f} cores on average during the run.",
        "",
    ]


if __name__ == "__main__":
    sys.exit(main())
