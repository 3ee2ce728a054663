"""Merge benchmark: bytes on disk per layout, merge time and peak memory against optimum.

On the opus-mt-fr-en shape (seeded random weights), exported twice with optimum: with its tied-
weight pass (``tied``: needs accelerate) and without it (``untied``: what users without accelerate
get). For each export it measures:

1. bytes on disk of each layout and their ratio to ``model.safetensors``;
2. onnxmerge's ``merge_seq2seq`` against optimum's ``merge_decoders`` on the same folder, each in a
   fresh interpreter, median of ``--repeats`` runs: time and peak memory;
3. the merge report (tensors in/out, shared, transposed) and an onnxruntime check of the merged
   file: one first step and one cached step, compared with the separate export files.

``--profile`` also breaks onnxmerge's merge down by phase (time, peak RSS) and by function
(cProfile). ``--quick`` uses a tiny Marian model so the whole run takes seconds.

Usage: python benchmarks/bench_merge.py [--quick] [--out benchmarks/out/merge.json] [--profile]
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _common  # noqa: E402
from benchmarks._common import (  # noqa: E402
    DECODER_FILE,
    DECODER_MERGED_FILE,
    DECODER_WITH_PAST_FILE,
    ENCODER_FILE,
)

TARGET_CHECKPOINT_RATIO = 1.01
TARGET_TIME_RATIO = 1.0
TARGET_RSS_RATIO = 0.5

LAYOUTS: dict[str, tuple[str, ...]] = {
    "encoder+decoder+decoder_with_past": _common.SEPARATE_FILES,
    "all four files": (*_common.SEPARATE_FILES, DECODER_MERGED_FILE),
    "encoder+decoder_model_merged": (ENCODER_FILE, DECODER_MERGED_FILE),
}
OURS_LAYOUT = "onnxmerge model.onnx"


# ---------------------------------------------------------------- run in child processes


def merge_ours(export_dir: str, output: str, format: int | None = None) -> dict[str, Any]:
    """onnxmerge's merge of the export folder (the default form, or ``format``); the report's
    numbers."""
    from onnxmerge.merge import merge_seq2seq

    result = merge_seq2seq(export_dir, output, overwrite=True, format_version=format).report
    return {
        "path": str(result.path),
        "format_version": result.format_version,
        "format_reason": result.format_reason,
        "layout": result.layout,
        "inputs": [{"path": str(f.path), "role": f.role, "bytes": f.bytes} for f in result.inputs],
        "input_bytes": result.input_bytes,
        "output_bytes": result.output_bytes,
        "tensors_in": result.tensors_in,
        "tensors_out": result.tensors_out,
        "constants_lifted": result.constants_lifted,
        "shared": len(result.shared),
        "shared_bytes_removed": sum(s.nbytes for s in result.shared),
        "transposed": len(result.transposed),
        "transposed_tensors": [
            {"kept": s.kept, "removed": s.removed, "nbytes": s.nbytes} for s in result.transposed
        ],
    }


def merge_optimum(export_dir: str, output: str) -> dict[str, Any]:
    """optimum's merge of the two decoders of the folder, called as main_export calls it.

    ``strict=False`` because the decoder with past does not output the cross-attention cache.
    """
    from optimum.onnx import merge_decoders

    folder = Path(export_dir)
    merge_decoders(
        folder / DECODER_FILE, folder / DECODER_WITH_PAST_FILE, save_path=output, strict=False
    )
    out = Path(output)
    return {"output_bytes": _common.files_bytes(out.parent, [out.name])}


class _PhaseRecorder:
    """Wraps functions to record each call's time and peak RSS, nested calls included."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._peaks: list[int] = []
        self.missing: list[str] = []
        self.t0 = __import__("time").perf_counter()

    def wrap(self, owner: Any, attr: str, label: str | None = None) -> None:
        import functools
        import time

        original = getattr(owner, attr, None)
        name = label or attr
        if original is None:  # the library moved on; profile what is still there
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            return

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            hwm = _common.self_rss_bytes()["peak_rss_bytes"]
            if self._peaks:
                self._peaks[-1] = max(self._peaks[-1], hwm)
            _common.reset_peak_rss()
            rss_before = _common.self_rss_bytes()["rss_bytes"]
            self._peaks.append(0)
            depth = len(self._peaks) - 1
            detail = next((Path(a).name for a in args if isinstance(a, (str, os.PathLike))), "")
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                now = _common.self_rss_bytes()
                peak = max(self._peaks.pop(), now["peak_rss_bytes"])
                if self._peaks:
                    self._peaks[-1] = max(self._peaks[-1], peak)
                self.records.append(
                    {
                        "phase": name,
                        "detail": detail,
                        "depth": depth,
                        "start": start - self.t0,
                        "seconds": seconds,
                        "rss_before_bytes": rss_before,
                        "rss_after_bytes": now["rss_bytes"],
                        "peak_rss_bytes": peak,
                    }
                )

        setattr(owner, attr, timed)


def profile_ours(export_dir: str, output: str, top: int = 25) -> dict[str, Any]:
    """onnxmerge's merge, broken down by phase, then once more under cProfile."""
    import cProfile
    import io as text_io
    import pstats
    import time

    import onnx
    import onnx_ir as ir

    from onnxmerge import model_io, passes
    from onnxmerge.merge import _compat as compat
    from onnxmerge.merge import _orchestrate as merge
    from onnxmerge.merge import _roles as roles
    from onnxmerge.merge import _splice as splice

    # Each phase as module.function; a few carry a note, or share the name of the public one.
    phases = {
        merge: "load_export _references validate_merged_file",
        model_io: "load_model check_external_data save_model_atomically _fsync file_bytes",
        onnx: "load",
        ir.serde: "deserialize_model",
        ir: "save",
        roles: "judge",
        splice: "parts_of_file splice",
        compat: "origins checkpoint_problems",
        passes: "run",
    }
    labels = {
        "merge._references": "merge._references (onnx.load of output)",
        "merge.validate_merged_file": "validate_merged_file (checker full_check)",
        "passes.run": "passes.run (store once, tied head)",
    }
    recorder = _PhaseRecorder()
    recorder.wrap(merge, "_load_export", "merge.load_export")
    for owner, names in phases.items():
        for name in names.split():
            label = f"{owner.__name__.removeprefix('onnxmerge.').removeprefix('onnx_')}.{name}"
            recorder.wrap(owner, name, labels.get(label, label))

    _common.reset_peak_rss()
    baseline = _common.self_rss_bytes()["rss_bytes"]
    start = time.perf_counter()
    merge.merge_seq2seq(export_dir, output, overwrite=True)
    total_s = time.perf_counter() - start
    peak = _common.self_rss_bytes()["peak_rss_bytes"]
    # Records are appended when a call ends; order them by start for reading.
    phases = sorted(recorder.records, key=lambda r: r["start"])

    profiler = cProfile.Profile()
    profiler.enable()
    merge.merge_seq2seq(export_dir, output, overwrite=True)
    profiler.disable()
    stream = text_io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return {
        "total_s": total_s,
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": peak,
        "phases": phases,
        "not_found": recorder.missing,
        "cprofile": stream.getvalue(),
    }


# ---------------------------------------------------------------- onnxruntime check


def _run(session, feeds: dict[str, Any]) -> dict[str, Any]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))


def ort_check(export_dir: Path, merged: Path) -> dict[str, Any]:
    """Run the merged file for one first step and one cached step; compare with the export files."""
    import numpy as np

    from onnxmerge._ort import open_session

    model = open_session(merged)
    encoder = open_session(export_dir / ENCODER_FILE)
    decoder = open_session(export_dir / DECODER_FILE)
    with_past = open_session(export_dir / DECODER_WITH_PAST_FILE)
    config = json.loads((export_dir / "config.json").read_text(encoding="utf-8"))
    start_token = config["decoder_start_token_id"]
    rng = np.random.default_rng(0)
    input_ids = rng.integers(1, config["vocab_size"] - 1, size=(2, 7), dtype=np.int64)
    attention_mask = np.ones_like(input_ids)
    attention_mask[1, 5:] = 0
    decoder_ids = np.full((2, 1), start_token, dtype=np.int64)

    past_inputs = [i for i in model.get_inputs() if i.name.startswith("past_key_values.")]
    heads = config["decoder_attention_heads"]
    head_dim = config["d_model"] // heads
    empty = np.zeros((2, heads, 0, head_dim), dtype=np.float32)
    feed = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "decoder_input_ids": decoder_ids,
        "use_cache_branch": np.array([False]),
        **{i.name: empty for i in past_inputs},
    }
    first = _run(model, feed)
    (hidden,) = encoder.run(None, {"input_ids": input_ids, "attention_mask": attention_mask})
    reference = _run(
        decoder,
        {
            "input_ids": decoder_ids,
            "encoder_attention_mask": attention_mask,
            "encoder_hidden_states": hidden,
        },
    )

    next_ids = first["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
    past = {
        name.replace("present.", "past_key_values."): value
        for name, value in first.items()
        if name.startswith("present.")
    }
    cached = _run(
        model,
        {**feed, "decoder_input_ids": next_ids, "use_cache_branch": np.array([True]), **past},
    )
    past_feed = {i.name: past[i.name] for i in with_past.get_inputs() if i.name in past}
    reference_cached = _run(
        with_past, {"input_ids": next_ids, "encoder_attention_mask": attention_mask, **past_feed}
    )
    first_diff, cached_diff = (
        max(float(np.abs(got[name] - want[name]).max()) for name in want if name in got)
        for got, want in ((first, reference), (cached, reference_cached))
    )
    return {
        "loads": True,
        "first_step_logits_shape": list(first["logits"].shape),
        "first_step_max_abs_diff": first_diff,
        "cached_step_max_abs_diff": cached_diff,
        "ok": bool(np.isfinite(first["logits"]).all()) and first_diff < 1e-3 and cached_diff < 1e-3,
    }


# ---------------------------------------------------------------- the benchmark


def layout_bytes(export: _common.Export, ours_bytes: int) -> dict[str, dict[str, Any]]:
    checkpoint = export.checkpoint.stat().st_size
    sizes = {name: _common.files_bytes(export.onnx_dir, files) for name, files in LAYOUTS.items()}
    sizes[OURS_LAYOUT] = ours_bytes
    return {
        name: {"bytes": size, "ratio_to_safetensors": size / checkpoint}
        for name, size in sizes.items()
    }


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def bench_export(export: _common.Export, repeats: int, scratch: Path, profile: bool) -> dict:
    export_dir = str(export.onnx_dir)
    ours_out = scratch / f"{export.variant}-ours" / "model.onnx"
    format_2_out = scratch / f"{export.variant}-ours-format-2" / "model.onnx"
    optimum_out = scratch / f"{export.variant}-optimum" / "decoder_model_merged.onnx"
    for folder in (ours_out.parent, format_2_out.parent, optimum_out.parent):
        folder.mkdir(parents=True, exist_ok=True)

    def measured(merge: str, out: Path, preload: str, *args: Any) -> dict[str, Any]:
        return _common.repeat_in_subprocess(
            f"benchmarks.bench_merge:{merge}",
            (export_dir, str(out), *args),
            repeats=repeats,
            preload=(preload,),
            before_each=lambda: [p.unlink() for p in out.parent.iterdir() if p.is_file()],
        )

    ours = measured("merge_ours", ours_out, "onnxmerge.merge")
    # The two-decoder form, today's before format 3: the one-decoder merge is held to it.
    two_decoders = measured("merge_ours", format_2_out, "onnxmerge.merge", 2)
    optimum = measured("merge_optimum", optimum_out, "optimum.onnx")
    report = ours["runs"][-1]["result"]
    for runs in (ours, two_decoders, optimum):
        for run in runs["runs"]:
            run.pop("result", None)
    result = {
        "variant": export.variant,
        "export_dir": export_dir,
        "checkpoint_bytes": export.checkpoint.stat().st_size,
        "layouts": layout_bytes(export, report["output_bytes"]),
        "merge_report": report,
        "ort_check": ort_check(export.onnx_dir, ours_out),
        "merge_time_memory": {
            "onnxmerge": ours,
            "onnxmerge_format_2": two_decoders,
            "optimum_merge_decoders": optimum,
            "ratios_ours_over_optimum": {
                key: _ratio(ours["median"][key], optimum["median"][key])
                for key in (
                    "call_s",
                    "wall_s",
                    "peak_rss_bytes",
                    "peak_call_rss_bytes",
                    "peak_private_bytes",
                )
            },
            "ratios_ours_over_format_2": {
                key: _ratio(ours["median"][key], two_decoders["median"][key])
                for key in ("call_s", "wall_s", "peak_rss_bytes", "peak_call_rss_bytes")
            },
        },
    }
    if profile:
        result["profile"] = _common.run_in_subprocess(
            "benchmarks.bench_merge:profile_ours",
            (export_dir, str(ours_out)),
            preload=("onnxmerge.merge",),
        )
    return result


def markdown(results: dict[str, Any]) -> str:
    lines = ["### Bytes on disk (ratio to model.safetensors)", ""]
    variants = results["variants"]
    names = list(next(iter(variants.values()))["layouts"])
    lines.append("| layout | " + " | ".join(variants) + " |")
    lines.append("|---|" + "---|" * len(variants))
    for name in names:
        cells = [
            f"{_common.mb(v['layouts'][name]['bytes'])} MB "
            f"({v['layouts'][name]['ratio_to_safetensors']:.3f}x)"
            for v in variants.values()
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        "| model.safetensors | "
        + " | ".join(f"{_common.mb(v['checkpoint_bytes'])} MB" for v in variants.values())
        + " |"
    )
    lines += ["", f"### Merge, median of {results['repeats']} fresh processes (ours / optimum)", ""]
    lines.append(
        "| export | tool | merge s | process s | peak RSS MB | RSS above imports MB "
        "| peak private MB |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for variant, v in variants.items():
        tm = v["merge_time_memory"]
        for tool in ("onnxmerge", "onnxmerge_format_2", "optimum_merge_decoders"):
            m = tm[tool]["median"]
            lines.append(
                f"| {variant} | {tool} | {m['call_s']:.2f} | {m['wall_s']:.2f} | "
                f"{_common.mb(m['peak_rss_bytes'])} | {_common.mb(m['peak_call_rss_bytes'])} | "
                f"{_common.mb(m['peak_private_bytes'])} |"
            )
        r = tm["ratios_ours_over_optimum"]
        fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        lines.append(
            f"| {variant} | ratio | {fmt(r['call_s'])} | {fmt(r['wall_s'])} | "
            f"{fmt(r['peak_rss_bytes'])} | {fmt(r['peak_call_rss_bytes'])} | "
            f"{fmt(r['peak_private_bytes'])} |"
        )
        r = tm["ratios_ours_over_format_2"]
        lines.append(
            f"| {variant} | format 3 / format 2 | {fmt(r['call_s'])} | {fmt(r['wall_s'])} | "
            f"{fmt(r['peak_rss_bytes'])} | {fmt(r['peak_call_rss_bytes'])} | - |"
        )
    lines += ["", "### Merge report and onnxruntime check", ""]
    lines.append(
        "| export | initializers in | out | shared | transposed | ORT first / cached step "
        "max abs diff | ok |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for variant, v in variants.items():
        rep, chk = v["merge_report"], v["ort_check"]
        lines.append(
            f"| {variant} | {rep['tensors_in']} | {rep['tensors_out']} | {rep['shared']} | "
            f"{rep['transposed']} | {chk['first_step_max_abs_diff']:.2e} / "
            f"{chk['cached_step_max_abs_diff']:.2e} | {chk['ok']} |"
        )
    lines += ["", "### Targets", ""]
    if results["quick"]:
        lines.append(
            "(set for the opus-mt shape; in the tiny model the graph, not the weights, "
            "dominates the bytes)"
        )
    for variant, t in results["targets"].items():
        lines.append(
            f"- {variant}: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in t.items())
        )
    return "\n".join(lines)


def profile_markdown(variant: str, profile: dict[str, Any]) -> str:
    lines = [
        f"### Profile of onnxmerge's merge ({variant})",
        "",
        f"total {profile['result']['total_s']:.2f} s, peak RSS "
        f"{_common.mb(profile['result']['peak_rss_bytes'])} MB (baseline "
        f"{_common.mb(profile['result']['baseline_rss_bytes'])} MB)",
        "",
        "| phase | detail | s | RSS before MB | RSS after MB | peak RSS MB |",
        "|---|---|---|---|---|---|",
    ]
    for r in profile["result"]["phases"]:
        lines.append(
            f"| {'  ' * r['depth']}{r['phase']} | {r['detail']} | {r['seconds']:.3f} | "
            f"{_common.mb(r['rss_before_bytes'])} | {_common.mb(r['rss_after_bytes'])} | "
            f"{_common.mb(r['peak_rss_bytes'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "merge", "tiny model, one run each")
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs per tool (default 3; 1 with --quick)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(_common.EXPORT_VARIANTS),
        choices=_common.EXPORT_VARIANTS,
    )
    parser.add_argument("--cache-dir", type=Path, default=_common.DEFAULT_CACHE_DIR)
    parser.add_argument("--profile", action="store_true", help="also profile onnxmerge's merge")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    factory = _common.marian_config(args.quick)

    results: dict[str, Any] = {
        "benchmark": "merge",
        "model": "tiny-marian" if args.quick else "opus-mt-fr-en shape (seeded random weights)",
        "repeats": repeats,
        "quick": args.quick,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "versions": _common.package_versions(),
        "variants": {},
    }
    scratch = Path(tempfile.mkdtemp(prefix="bench-merge-"))
    try:
        for variant in args.variants:
            export = _common.export_cached(factory, variant, args.cache_dir)
            results["variants"][variant] = bench_export(export, repeats, scratch, args.profile)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    results["targets"] = {
        variant: {
            f"onnxmerge/safetensors <= {TARGET_CHECKPOINT_RATIO}": v["layouts"][OURS_LAYOUT][
                "ratio_to_safetensors"
            ]
            <= TARGET_CHECKPOINT_RATIO,
            f"time <= {TARGET_TIME_RATIO}x optimum": (
                v["merge_time_memory"]["ratios_ours_over_optimum"]["call_s"] or 0
            )
            <= TARGET_TIME_RATIO,
            f"peak RSS <= {TARGET_RSS_RATIO}x optimum": (
                v["merge_time_memory"]["ratios_ours_over_optimum"]["peak_rss_bytes"] or 0
            )
            <= TARGET_RSS_RATIO,
            # A few percent either way is the machine's noise across processes.
            "peak RSS <= 1.05x format 2": (
                v["merge_time_memory"]["ratios_ours_over_format_2"]["peak_rss_bytes"] or 0
            )
            <= 1.05,
            "ORT check": v["ort_check"]["ok"],
        }
        for variant, v in results["variants"].items()
    }
    _common.write_results(args.out, results)
    print(markdown(results))
    for variant, v in results["variants"].items():
        if "profile" in v:
            print()
            print(profile_markdown(variant, v["profile"]))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
