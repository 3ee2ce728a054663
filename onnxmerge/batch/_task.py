"""One model's conversion: the task a pool worker or a Ray worker runs.

Everything is written into a staging folder beside the output (``OUT/.<name>.staging-*``); the
manifest is written last, then the folder is renamed into place. A failure of any kind is returned
as a failed result, and the staging folder is removed: the output folder either holds a complete,
checked conversion or what an earlier run left there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import resource
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onnxmerge.batch import _manifest as manifest
from onnxmerge.batch._sources import EXPORT, PYTORCH, Job, fingerprint
from onnxmerge.errors import (
    ExportFolderError,
    InvalidArgumentError,
    InvalidMergedModelError,
    MissingDependencyError,
)

logger = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
GENERATOR_FILE = "generator.onnx"
SITE_DIR = "web"
STAGING_MARK = ".staging-"
# Small files beside the weights that tokenizers, transformers.js and Seq2SeqModel.translate read.
SIDE_FILE_PREFIXES = (
    "tokenizer",
    "special_tokens",
    "vocab",
    "source.",
    "target.",
    "merges",
    "added_tokens",
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
)

CONVERTED = "converted"
SKIPPED = "skipped"
FAILED = "failed"


@dataclass(frozen=True)
class Options:
    """What to produce for each model, beyond the merged, verified ``model.onnx``."""

    weights: str | None = None
    generation: str | None = None
    num_beams: int = 4
    web: bool = False
    tolerance: float = 1e-4
    limit_memory: bool = True
    dtype: str | None = None  # which files of a folder with several (transformers.js's names)

    def key(self) -> dict[str, Any]:
        """The options that shape the outputs (a change means the model is converted again)."""
        key = {
            "weights": self.weights,
            "generation": self.generation,
            "num_beams": self.num_beams if self.generation == "beam" else None,
            "web": self.web,
        }
        if self.dtype not in (None, "fp32"):  # keys written before dtypes existed stay valid
            key["dtype"] = self.dtype
        return key


@dataclass(frozen=True)
class ModelResult:
    """The outcome of one model: one line of ``results.jsonl``."""

    name: str
    source: str
    status: str
    output: str | None = None
    kind: str | None = None
    input_bytes: int = 0
    model_bytes: int | None = None
    output_bytes: int | None = None
    checkpoint_bytes: int | None = None
    export_bytes: int | None = None
    ratio_to_export: float | None = None
    ratio_to_checkpoint: float | None = None
    max_abs_diff: float | None = None
    files: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    memory_declared_bytes: int | None = None
    peak_rss_bytes: int | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The result as the manifest and ``--json`` write it."""
        return asdict(self)


def output_key(job: Job, options: Options) -> dict[str, Any]:
    return {"source": fingerprint(job.source), "options": options.key()}


def finished(job: Job, out_dir: Path, options: Options) -> ModelResult | None:
    """The recorded result of an earlier run whose outputs are complete and intact, if any."""
    folder = out_dir / job.name
    found = manifest.read_valid(folder, output_key(job, options))
    if found is None or MODEL_FILE not in found["files"]:
        return None
    files = {name: entry["bytes"] for name, entry in found["files"].items()}
    recorded = dict(found["result"], status=SKIPPED, output=str(folder), error=None, files=files)
    fields = ModelResult.__dataclass_fields__
    return ModelResult(**{k: v for k, v in recorded.items() if k in fields})


def failed(job: Job, error: str, **numbers: Any) -> ModelResult:
    return ModelResult(
        name=job.name,
        source=str(job.source),
        status=FAILED,
        kind=job.kind,
        input_bytes=job.input_bytes,
        memory_declared_bytes=job.memory_bytes,
        error=error,
        **numbers,
    )


def remove_stale_staging(out_dir: Path, name: str) -> None:
    """Staging folders a killed run left for ``name``."""
    for path in out_dir.glob(f".{name}{STAGING_MARK}*"):
        shutil.rmtree(path, ignore_errors=True)


def convert_one(job: Job, out_dir: str | os.PathLike, options: Options) -> ModelResult:
    """Convert one model into ``out_dir/<job.name>``; never raises for a problem of the model."""
    out_dir = Path(out_dir)
    seconds: dict[str, float] = {}
    _reset_peak_rss()
    staging = None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{job.name}{STAGING_MARK}", dir=out_dir))
        with _address_space_limit(job.memory_bytes if options.limit_memory else None):
            numbers = _convert(job, staging, options, seconds)
        numbers.update(seconds=seconds, peak_rss_bytes=_peak_rss())
        result = ModelResult(
            name=job.name,
            source=str(job.source),
            status=CONVERTED,
            output=str(out_dir / job.name),
            kind=job.kind,
            input_bytes=job.input_bytes,
            memory_declared_bytes=job.memory_bytes,
            **numbers,
        )
        start = time.perf_counter()
        files = manifest.write(staging, key=output_key(job, options), result=result.to_json())
        _publish(staging, out_dir / job.name)
        seconds["publish"] = time.perf_counter() - start
        return ModelResult(**dict(result.to_json(), files=files, seconds=seconds))
    except Exception as e:  # any failure of one model must not end the batch
        logger.debug("conversion of %s failed:\n%s", job.name, traceback.format_exc())
        error = f"{type(e).__name__}: {e}"
        if _out_of_memory(e, error):
            error = (
                f"out of memory within the {job.memory_bytes / 2**20:.0f} MiB declared for this "
                f"model; declare more (--memory) or run fewer at once ({error})"
            )
        return failed(job, error, seconds=seconds, peak_rss_bytes=_peak_rss())
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


# How native code reports an allocation past the cap: C++ (bad_alloc), the dynamic loader mapping
# a library that a step imports lazily, and mmap/malloc failing with ENOMEM.
_NATIVE_OUT_OF_MEMORY = ("bad_alloc", "failed to map segment", "cannot allocate memory")


def _out_of_memory(error: Exception, text: str) -> bool:
    return isinstance(error, MemoryError) or any(s in text.lower() for s in _NATIVE_OUT_OF_MEMORY)


@contextlib.contextmanager
def _timed(seconds: dict[str, float], stage: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[stage] = time.perf_counter() - start


def _convert(job: Job, staging: Path, options: Options, seconds: dict[str, float]) -> dict:
    from onnxmerge.merge import find_checkpoint, merge_seq2seq
    from onnxmerge.verify import verify

    check_features(options)
    export_dir = _export_of(job, staging, seconds)
    model = staging / MODEL_FILE
    with _timed(seconds, "merge"):
        merged = merge_seq2seq(export_dir, model, dtype=options.dtype).report
    with _timed(seconds, "verify"):
        report = verify(model, export_dir, tolerance=options.tolerance, dtype=options.dtype)
    if not report.ok:
        raise InvalidMergedModelError(
            f"{model.name} differs from the export in {export_dir}: max |diff| "
            f"{report.max_abs_diff:.3g} > tolerance {options.tolerance:g}"
        )
    checkpoint = find_checkpoint(job.source if job.kind == PYTORCH else export_dir)
    _write_extras(model, staging, options, seconds)
    if job.kind == PYTORCH:
        shutil.rmtree(export_dir)
    checkpoint_bytes = checkpoint.stat().st_size if checkpoint else None
    output_bytes = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
    return dict(
        model_bytes=merged.output_bytes,
        output_bytes=output_bytes,
        checkpoint_bytes=checkpoint_bytes,
        export_bytes=merged.input_bytes,
        ratio_to_export=merged.output_bytes / merged.input_bytes if merged.input_bytes else None,
        ratio_to_checkpoint=merged.output_bytes / checkpoint_bytes if checkpoint_bytes else None,
        max_abs_diff=report.max_abs_diff,
    )


def _export_of(job: Job, staging: Path, seconds: dict[str, float]) -> Path:
    """The export folder of the job (a checkpoint is exported into the staging folder first),
    its tokenizer and configs copied beside the model."""
    from onnxmerge.export_layout import config_folder

    if job.kind == PYTORCH:
        export_dir = staging / ".export"
        with _timed(seconds, "export"):
            export_checkpoint(job.source, export_dir)
    elif job.kind == EXPORT:
        export_dir = job.source
    else:
        raise ExportFolderError(
            f"{job.source} holds neither an optimum export (encoder_model.onnx, here or in onnx/) "
            "nor a PyTorch checkpoint (config.json with *.safetensors or *.bin); pass a model "
            "folder"
        )
    copy_side_files(config_folder(export_dir), staging)
    if job.kind == PYTORCH:
        copy_side_files(job.source, staging)
    return export_dir


def _write_extras(model: Path, staging: Path, options: Options, seconds: dict[str, float]) -> None:
    """The quantized model, the generator and the web page the options ask for."""
    site_source = model
    if options.weights:
        from onnxmerge.quantization import quantize

        with _timed(seconds, "quantize"):
            site_source = quantize(model, weights=options.weights)
    if options.generation:
        from onnxmerge.generator import build_generator

        with _timed(seconds, "generator"):
            build_generator(
                model,
                staging / GENERATOR_FILE,
                search=options.generation,
                num_beams=options.num_beams,
            )
    if options.web:
        from onnxmerge.web import build_site

        with _timed(seconds, "web"):
            build_site(site_source, staging / SITE_DIR, tokenizer=staging)


def check_features(options: Options) -> None:
    """Refuse options that would fail every model, before any work starts.

    Raises:
        InvalidArgumentError: naming the argument (``weights``, ``search``, ``num_beams``).
    """
    from onnxmerge.generator import SEARCHES
    from onnxmerge.quantization import check_weights

    check_weights(options.weights)
    if options.generation is not None and options.generation not in SEARCHES:
        raise InvalidArgumentError(
            f"search must be one of {', '.join(SEARCHES)}, got {options.generation!r}",
            argument="search",
        )
    if options.generation == "beam" and options.num_beams < 2:
        raise InvalidArgumentError(
            f"beam search needs num_beams >= 2, got {options.num_beams}", argument="num_beams"
        )


def export_checkpoint(model_dir: Path, export_dir: Path) -> None:
    """Export a PyTorch checkpoint folder with optimum, with past key values."""
    if importlib.util.find_spec("optimum") is None:
        raise MissingDependencyError(
            f"{model_dir} is a PyTorch checkpoint; exporting it needs optimum: "
            "pip install 'onnxmerge[export]'"
        )
    from optimum.exporters.onnx import main_export

    for name in ("optimum", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's tracer warnings say nothing to a user
        task = export_task(model_dir)
        try:
            main_export(os.fspath(model_dir), output=export_dir, task=task)
        except (ValueError, KeyError) as e:
            raise ExportFolderError(f"optimum cannot export {model_dir}: {e}") from e


def export_task(model_dir: Path) -> str:
    """optimum's task for the model class named in config.json, with past key values if it can.

    optimum infers tasks of hub models only; a local folder names its class in ``architectures``.
    """
    import transformers
    from optimum.exporters.tasks import TasksManager

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    names = config.get("architectures") or []
    model_class = getattr(transformers, names[0], None) if names else None
    if model_class is None:
        raise ExportFolderError(
            f"{model_dir / 'config.json'} names no model class transformers knows "
            f"(architectures: {names}); save the model with save_pretrained"
        )
    try:
        task = TasksManager.infer_task_from_model(model_class)
        supported = TasksManager.get_supported_tasks_for_model_type(
            config["model_type"], "onnx", library_name="transformers"
        )
    except (ValueError, KeyError) as e:
        raise ExportFolderError(f"optimum cannot export {model_dir}: {e}") from e
    return f"{task}-with-past" if f"{task}-with-past" in supported else task


def copy_side_files(source: Path, target: Path) -> None:
    for path in source.iterdir():
        if (
            path.name.startswith(SIDE_FILE_PREFIXES)
            and path.is_file()
            and not (target / path.name).exists()
        ):
            shutil.copy2(path, target / path.name)


def _publish(staging: Path, final: Path) -> None:
    """Put the staged folder in place of ``final``; an old folder is removed only after."""
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}{STAGING_MARK}old-", dir=final.parent))
        os.replace(final, old / final.name)
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp made it private
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------ memory of this process


def proc_bytes(path: str, key: str) -> int | None:
    """The value of ``key`` (given in kB) in a /proc file such as /proc/self/status, in bytes."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def _address_space_limit(extra_bytes: int | None) -> Iterator[None]:
    """Cap this process's address space at what it uses now plus ``extra_bytes``, then restore.

    Past the cap allocations fail (``MemoryError`` in Python), so one model cannot take the
    memory of the machine's other workers.
    """
    current = proc_bytes("/proc/self/status", "VmSize")
    if extra_bytes is None or current is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = current + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")


def _peak_rss() -> int | None:
    return proc_bytes("/proc/self/status", "VmHWM")
