"""Large-model benchmark: a model past 2 GB, merged with external data, against optimum.

On the shape of facebook/mbart-large-50 (about 611 M parameters, 2.4 GB of float32; seeded random
weights), exported with optimum's ``main_export`` (``text2text-generation-with-past``). Past 2 GB
optimum's own post-processing (merging the two decoders into ``decoder_model_merged.onnx``) may
fail; the failure is recorded and the three files it wrote before (encoder, decoder, decoder with
past) are kept. Then, each in a fresh interpreter:

1. onnxmerge's merge of the folder: wall time, peak RSS, peak private memory and peak anonymous
   memory (target: peak anonymous memory <= 1.5 GiB); the output must be ``model.onnx`` +
   ``model.onnx_data``. Private memory counts the file pages the merge alone maps: the weights
   its output check reads when it runs the written file, and the data file as it is written;
   the kernel can drop or write back those, not the anonymous ones;
2. the same merge in a memory cgroup limited to 1.5 GiB, page cache included, with the export's
   files dropped from the page cache first (target: it completes), where this machine lets the
   benchmark make a cgroup (cgroup v1's memory controller or v2's, as root);
3. ``onnx.checker.check_model(path, full_check=True)`` on the merged file;
4. ``onnxmerge.verify.verify`` of both branches against the export's files with onnxruntime;
5. optimum's ``merge_decoders(decoder, decoder_with_past, strict=False)`` on the same folder:
   time, peak memory, and whether it fails (protobuf cannot serialise a message past 2 GB).

The export is cached under ``.cache/bench/``; ``--export-only`` builds it and stops.

Usage: python benchmarks/bench_large.py [--out benchmarks/out/large.json] [--export-only]
       [--skip-optimum] [--skip-verify] [--skip-limited]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _common  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "out" / "large.json"
TARGET_PEAK_ANONYMOUS_BYTES = int(1.5 * 2**30)
# The limited merge's cgroup: the same 1.5 GiB, the page cache charged to it included.
MEMORY_LIMIT_BYTES = TARGET_PEAK_ANONYMOUS_BYTES
REQUIRED_FILES = _common.SEPARATE_FILES
EXPORT_RECORD = "export_record.json"
GIB = 2**30


def mbart_large_50_config() -> Any:
    """The shape of facebook/mbart-large-50 (about 611 M parameters)."""
    from transformers import MBartConfig

    return MBartConfig(
        vocab_size=250054,
        d_model=1024,
        encoder_layers=12,
        decoder_layers=12,
        encoder_attention_heads=16,
        decoder_attention_heads=16,
        encoder_ffn_dim=4096,
        decoder_ffn_dim=4096,
        max_position_embeddings=1024,
        scale_embedding=True,
        activation_function="gelu",
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
    )


# ---------------------------------------------------------------- export (cached)


def export_folders(cache_dir: Path) -> tuple[Path, Path, Path]:
    """The checkpoint folder, the export folder and the export record of the large model."""
    config = mbart_large_50_config()
    model_key = _common.cache_key(config, "pytorch")
    root = cache_dir / f"mbart_large_50-{model_key}"
    key = _common.cache_key(config, "default:text2text-generation-with-past")
    return root / "pytorch", root / f"onnx-{key}", root / f"onnx-{key}.{EXPORT_RECORD}"


def export_large(cache_dir: Path) -> dict[str, Any]:
    """Build, save and export the large model once; return the export record.

    The export runs as a user runs it (optimum's defaults: its tied-weight pass runs when
    accelerate is installed). An exception raised after the three model files are written (in the
    post-processing that merges the decoders) is recorded and the files kept; a partial
    ``decoder_model_merged.onnx`` left by such a failure is removed so the folder is coherent.
    """
    pytorch_dir, onnx_dir, record_path = export_folders(cache_dir)
    if record_path.exists() and all((onnx_dir / f).exists() for f in REQUIRED_FILES):
        return json.loads(record_path.read_text(encoding="utf-8"))
    record: dict[str, Any] = {"pytorch_dir": str(pytorch_dir), "onnx_dir": str(onnx_dir)}
    if not (pytorch_dir / _common.CHECKPOINT_FILE).exists():
        start = time.perf_counter()
        with _common.staging(pytorch_dir) as staging:
            _common.build_pytorch(mbart_large_50_config(), staging)
        record["build_s"] = time.perf_counter() - start
    onnx_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{onnx_dir.name}-", dir=onnx_dir.parent))
    try:
        from optimum.exporters.onnx import main_export

        start = time.perf_counter()
        try:
            main_export(
                str(pytorch_dir),
                output=staging,
                task="text2text-generation-with-past",
                do_validation=False,
            )
            record["export_error"] = None
        except Exception as e:  # optimum's post-processing past 2 GB; the files may be there
            record["export_error"] = f"{type(e).__name__}: {e}"[:2000]
            record["export_traceback"] = traceback.format_exc()[-6000:]
        record["export_s"] = time.perf_counter() - start
        missing = [f for f in REQUIRED_FILES if not (staging / f).exists()]
        if missing:
            raise RuntimeError(f"the export did not write {missing}: {record.get('export_error')}")
        merged = staging / _common.DECODER_MERGED_FILE
        record["optimum_wrote_decoder_model_merged"] = merged.exists()
        if merged.exists() and record["export_error"]:
            merged.unlink()
            for leftover in staging.glob(_common.DECODER_MERGED_FILE + "*"):
                leftover.unlink()
        record["files"] = {
            p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()
        }
        if onnx_dir.exists():
            shutil.rmtree(onnx_dir)
        staging.rename(onnx_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    record["versions"] = _common.package_versions()
    record_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


# ---------------------------------------------------------------- run in child processes


def merge_ours(export_dir: str, output: str) -> dict[str, Any]:
    """onnxmerge's merge of the folder; the report's numbers and the files written."""
    from onnxmerge.merge import merge_seq2seq

    result = merge_seq2seq(export_dir, output, overwrite=True).report
    out = Path(output)
    return {
        "path": str(result.path),
        "layout": result.layout,
        "input_bytes": result.input_bytes,
        "output_bytes": result.output_bytes,
        "checkpoint_ratio": result.checkpoint_ratio,
        "tensors_in": result.tensors_in,
        "tensors_out": result.tensors_out,
        "shared": len(result.shared),
        "shared_bytes_removed": sum(s.nbytes for s in result.shared),
        "transposed": len(result.transposed),
        "files": {p.name: p.stat().st_size for p in sorted(out.parent.iterdir()) if p.is_file()},
    }


def check_merged(path: str) -> dict[str, Any]:
    """The ONNX checker with full shape inference, on the file (it reads the external data)."""
    import onnx

    try:
        onnx.checker.check_model(path, full_check=True)
        return {"ok": True, "error": None}
    except Exception as e:  # the checker raises several types
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}


def verify_merged(path: str, export_dir: str, tolerance: float) -> dict[str, Any]:
    """Both branches of the merged file against the export's own files, with onnxruntime."""
    from onnxmerge.verify import verify

    report = verify(path, export_dir, tolerance=tolerance)
    return {
        "ok": report.ok,
        "tolerance": tolerance,
        "max_abs_diff": report.max_abs_diff,
        "outputs_compared": len(report.diffs),
        "by_step": {
            step: max((d.max_abs_diff for d in report.diffs if d.step == step), default=None)
            for step in ("first", "cached")
        },
    }


def merge_optimum(export_dir: str, output: str) -> dict[str, Any]:
    """optimum's merge of the two decoders, as its post-processing calls it; failures recorded."""
    import traceback as tb

    from optimum.onnx import merge_decoders

    folder = Path(export_dir)
    try:
        merge_decoders(
            folder / _common.DECODER_FILE,
            folder / _common.DECODER_WITH_PAST_FILE,
            save_path=output,
            strict=False,
        )
    except Exception as e:  # recorded, not raised: the failure is the measurement
        return {
            "failed": True,
            "error": f"{type(e).__name__}: {e}"[:1000],
            "traceback": tb.format_exc()[-3000:],
        }
    out = Path(output)
    return {"failed": False, "output_bytes": _common.files_bytes(out.parent, [out.name])}


# ---------------------------------------------------------------- the benchmark


def _in_child(
    fn: str, args: tuple, preload: tuple[str, ...], preexec_fn: Any = None
) -> dict[str, Any]:
    """One measured child process; a crash is recorded rather than raised."""
    try:
        run = _common.run_in_subprocess(fn, args, preload=preload, preexec_fn=preexec_fn)
    except RuntimeError as e:
        return {"crashed": True, "error": str(e)[-3000:]}
    measured = {k: run.get(k) for k in _common.MEASURED_KEYS}
    return {"crashed": False, **measured, "result": run["result"]}


class MemoryCgroup:
    """A memory cgroup of its own with ``limit`` bytes, page cache included (v1's
    ``memory.limit_in_bytes`` or v2's ``memory.max``); ``reason`` says why there is none."""

    def __init__(self, limit: int) -> None:
        self.path: Path | None = None
        self.version = 0
        self.reason = ""
        name = f"onnxmerge-bench-{os.getpid()}"
        v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
        try:
            if (v1 / "memory.limit_in_bytes").exists():
                self.path, self.version = v1 / name, 1
                self.path.mkdir()
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
            elif "memory" in (v2 / "cgroup.subtree_control").read_text().split():
                self.path, self.version = v2 / name, 2
                self.path.mkdir()
                (self.path / "memory.max").write_text(str(limit))
                (self.path / "memory.swap.max").write_text("0")
            else:
                self.reason = "no cgroup memory controller this process may use"
        except OSError as e:
            self.reason = f"cannot make a memory cgroup here ({e})"
            self.remove()
            self.path = None

    def join(self) -> None:
        """Move the calling process into the cgroup (a child's ``preexec_fn``)."""
        assert self.path is not None
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> dict[str, int | None]:
        """The cgroup's peak charge and how often the limit made it reclaim or kill."""
        folder = self.path
        assert folder is not None

        def read(name: str) -> str | None:
            try:
                return (folder / name).read_text()
            except OSError:
                return None

        if self.version == 1:
            peak, failcnt = read("memory.max_usage_in_bytes"), read("memory.failcnt")
            oom = read("memory.oom_control") or ""
            kills = dict(line.split() for line in oom.splitlines() if line).get("oom_kill")
            return {
                "peak_charged_bytes": int(peak) if peak else None,
                "limit_hits": int(failcnt) if failcnt else None,
                "oom_kills": int(kills) if kills else 0,
            }
        peak = read("memory.peak")
        events = dict(line.split() for line in (read("memory.events") or "").splitlines())
        return {
            "peak_charged_bytes": int(peak) if peak else None,
            "limit_hits": int(events.get("max", 0)),
            "oom_kills": int(events.get("oom_kill", 0)),
        }

    def remove(self) -> None:
        if self.path is not None and self.path.exists():
            try:
                self.path.rmdir()
            except OSError:
                pass


def drop_from_page_cache(folder: Path) -> None:
    """Written-back pages of ``folder``'s files out of the page cache, so that a run reads them
    from disk and is charged for them."""
    os.sync()
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def limited_merge(export_dir: Path, scratch: Path) -> dict[str, Any]:
    """The merge in a memory cgroup of ``MEMORY_LIMIT_BYTES``, from a cold page cache."""
    cgroup = MemoryCgroup(MEMORY_LIMIT_BYTES)
    if cgroup.path is None:
        return {"measured": False, "reason": cgroup.reason}
    out = scratch / "limited" / "model.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        drop_from_page_cache(export_dir)
        run = _in_child(
            "benchmarks.bench_large:merge_ours",
            (str(export_dir), str(out)),
            ("onnxmerge.merge",),
            preexec_fn=cgroup.join,
        )
        usage = cgroup.usage()
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
        cgroup.remove()
    return {
        "measured": True,
        "cgroup_version": cgroup.version,
        "limit_bytes": MEMORY_LIMIT_BYTES,
        **usage,
        **run,
    }


def run_benchmark(
    cache_dir: Path,
    scratch: Path,
    *,
    skip_verify: bool,
    skip_optimum: bool,
    tolerance: float,
    skip_limited: bool = False,
) -> dict[str, Any]:
    record = export_large(cache_dir)
    export_dir = Path(record["onnx_dir"])
    checkpoint = Path(record["pytorch_dir"]) / _common.CHECKPOINT_FILE
    results: dict[str, Any] = {
        "benchmark": "large",
        "model": "facebook/mbart-large-50 shape (seeded random weights)",
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "cpu": _common.cpu_description(),
        },
        "versions": _common.package_versions(),
        "checkpoint_bytes": checkpoint.stat().st_size,
        "export": {k: v for k, v in record.items() if k != "export_traceback"},
        "export_root_cause": _root_cause(record.get("export_traceback", "")),
        "export_input_bytes": _common.files_bytes(export_dir, list(REQUIRED_FILES)),
    }
    ours_out = scratch / "ours" / "model.onnx"
    ours_out.parent.mkdir(parents=True, exist_ok=True)
    ours = _in_child(
        "benchmarks.bench_large:merge_ours", (str(export_dir), str(ours_out)), ("onnxmerge.merge",)
    )
    results["onnxmerge"] = ours
    if not ours["crashed"]:
        files = ours["result"]["files"]
        results["onnxmerge"]["external_data"] = sorted(files) == ["model.onnx", "model.onnx_data"]
        results["checker"] = _in_child(
            "benchmarks.bench_large:check_merged", (str(ours_out),), ("onnx",)
        )
        if not skip_verify:
            results["verify"] = _in_child(
                "benchmarks.bench_large:verify_merged",
                (str(ours_out), str(export_dir), tolerance),
                ("onnxmerge.verify", "onnxruntime"),
            )
    shutil.rmtree(ours_out.parent, ignore_errors=True)  # room for optimum's attempt
    if not skip_limited:
        results["limited_merge"] = limited_merge(export_dir, scratch)
    if not skip_optimum:
        optimum_out = scratch / "optimum" / _common.DECODER_MERGED_FILE
        optimum_out.parent.mkdir(parents=True, exist_ok=True)
        results["optimum_merge_decoders"] = _in_child(
            "benchmarks.bench_large:merge_optimum",
            (str(export_dir), str(optimum_out)),
            ("optimum.onnx",),
        )
        shutil.rmtree(optimum_out.parent, ignore_errors=True)
    results["targets"] = targets(results)
    return results


def _root_cause(traceback_text: str) -> str | None:
    """The first exception line of a chained traceback: what failed before optimum wrapped it."""
    for line in traceback_text.splitlines():
        head = line.split(":", 1)[0]
        if (
            line
            and not line.startswith(" ")
            and head.replace(".", "").isidentifier()
            and (head.endswith(("Error", "Exception")))
        ):
            return line.strip()[:300]
    return None


def targets(results: dict[str, Any]) -> dict[str, bool | None]:
    ours = results.get("onnxmerge", {})
    peak = ours.get("peak_anonymous_bytes")
    verify = results.get("verify")
    limited = results.get("limited_merge") or {}
    return {
        "onnxmerge peak anonymous memory <= 1.5 GiB": None
        if peak is None
        else peak <= TARGET_PEAK_ANONYMOUS_BYTES,
        "onnxmerge merges within a 1.5 GiB memory limit, page cache included": (
            not limited["crashed"] if limited.get("measured") else None
        ),
        "output is model.onnx + model.onnx_data": ours.get("external_data"),
        "check_model(full_check=True)": results.get("checker", {}).get("result", {}).get("ok"),
        "both branches match the export": None
        if verify is None
        else bool(verify.get("result", {}).get("ok")),
    }


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < GIB / 10 else f"{n / GIB:.2f} GiB"


def _secs(n: float | None) -> str:
    return "-" if n is None else f"{n:.1f}"


def markdown(results: dict[str, Any]) -> str:
    export = results["export"]
    lines = [
        f"### {results['model']}",
        "",
        f"- checkpoint: {_gib(results['checkpoint_bytes'])} GiB; export (encoder + decoder + "
        f"decoder with past, with data files): {_gib(results['export_input_bytes'])} GiB",
        f"- optimum export: {_secs(export.get('export_s'))} s; post-processing error: "
        f"{export.get('export_error') or 'none'}"
        + (
            f" (cause: {results['export_root_cause']}; the three model files were kept)"
            if results.get("export_root_cause")
            else ""
        ),
        "",
        "| step | outcome | wall s | peak RSS GiB | peak private GiB | peak anonymous GiB |",
        "|---|---|---|---|---|---|",
    ]
    steps = [
        ("onnxmerge merge", results.get("onnxmerge")),
        (
            f"onnxmerge merge within {_gib(MEMORY_LIMIT_BYTES)} GiB, cold page cache",
            (results.get("limited_merge") or {}).get("measured") and results["limited_merge"],
        ),
        ("check_model(full_check=True)", results.get("checker")),
        ("verify (ORT, both branches)", results.get("verify")),
        ("optimum merge_decoders", results.get("optimum_merge_decoders")),
    ]
    for label, run in steps:
        if not run:
            continue
        outcome = _outcome(label, run)
        lines.append(
            f"| {label} | {outcome} | {_secs(run.get('wall_s'))} | "
            f"{_gib(run.get('peak_rss_bytes'))} | {_gib(run.get('peak_private_bytes'))} | "
            f"{_gib(run.get('peak_anonymous_bytes'))} |"
        )
    limited = results.get("limited_merge") or {}
    if limited and not limited.get("measured"):
        lines += ["", f"The merge within a memory limit was not run: {limited['reason']}."]
    lines += ["", "### Targets", ""]
    for name, ok in results["targets"].items():
        lines.append(f"- {name}: {'not measured' if ok is None else 'met' if ok else 'MISSED'}")
    return "\n".join(lines)


def _outcome(label: str, run: dict[str, Any]) -> str:
    if run.get("crashed"):
        return "crashed: " + run["error"].strip().splitlines()[-1][:120]
    result = run.get("result") or {}
    if label.startswith("onnxmerge merge within"):
        return (
            f"completes; the cgroup's peak charge {_gib(run.get('peak_charged_bytes'))} GiB, "
            f"{run.get('oom_kills')} processes killed"
        )
    if label == "onnxmerge merge":
        files = ", ".join(f"{n} {_size(s)}" for n, s in result.get("files", {}).items())
        return f"{files}; {result.get('shared')} shared ({result.get('transposed')} transposed)"
    if label.startswith("check_model"):
        return "passes" if result.get("ok") else f"fails: {result.get('error', '')[:120]}"
    if label.startswith("verify"):
        return (
            f"{'ok' if result.get('ok') else 'MISMATCH'}: max abs diff "
            f"{result.get('max_abs_diff', float('nan')):.2e} over "
            f"{result.get('outputs_compared')} outputs"
        )
    if result.get("failed"):
        return "fails: " + result["error"].splitlines()[0][:120]
    return f"writes {_gib(result.get('output_bytes'))} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--cache-dir", type=Path, default=_common.DEFAULT_CACHE_DIR)
    parser.add_argument(
        "--scratch",
        type=Path,
        default=None,
        help="folder for the merged files (default: a temporary folder beside "
        "the cache, on the same disk)",
    )
    parser.add_argument("--export-only", action="store_true", help="build the export and stop")
    parser.add_argument("--skip-verify", action="store_true")
    parser.add_argument("--skip-optimum", action="store_true")
    parser.add_argument(
        "--skip-limited", action="store_true", help="leave out the merge within a memory limit"
    )
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args(argv)
    _common.compile_bytecode()
    if args.export_only:
        record = export_large(args.cache_dir)
        print(json.dumps({k: v for k, v in record.items() if k != "export_traceback"}, indent=2))
        return 0
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="bench-large-", dir=args.cache_dir))
    try:
        results = run_benchmark(
            args.cache_dir,
            scratch,
            skip_verify=args.skip_verify,
            skip_optimum=args.skip_optimum,
            skip_limited=args.skip_limited,
            tolerance=args.tolerance,
        )
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    _common.write_results(args.out, results)
    print(markdown(results))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
