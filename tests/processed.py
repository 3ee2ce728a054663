"""Tiny exports after another tool processed each file, cached on disk like the exports.

Users rarely merge a pristine export: they quantize each file, run onnxruntime's transformer
optimizer or shape inference on it, or slim it. Each tool here runs on ``encoder_model.onnx``,
``decoder_model.onnx`` and ``decoder_with_past_model.onnx`` one by one, as users run them (the
merge takes the separate decoders over ``decoder_model_merged.onnx``, which is left out). A tool
that cannot process an architecture, or whose files onnxruntime cannot run on CPU, leaves the
reason instead of files, so the test of that cell says why it is skipped.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

from tests import zoo as models
from tests.zoo import TinyExport

# Bump to invalidate every cached processed export after a change in how tools are run.
PROCESSED_VERSION = "1"

SOURCE_FILES = (models.ENCODER_FILE, models.DECODER_FILE, models.DECODER_WITH_PAST_FILE)
# version_converter's target: newer than the exports' opset (18), run by onnxruntime.
NEWER_OPSET = 21
SKIPPED = "skipped.txt"


def _quantize(weight_type: str) -> Callable[[Path, Path, TinyExport], None]:
    def run(source: Path, target: Path, export: TinyExport) -> None:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(source, target, weight_type=getattr(QuantType, weight_type))

    return run


def _symbolic_shapes(source: Path, target: Path, export: TinyExport) -> None:
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    inferred = SymbolicShapeInference.infer_shapes(onnx.load(source), auto_merge=True)
    onnx.save(inferred, target)


def optimizer_model_type(export: TinyExport, file: str) -> str:
    """onnxruntime's model type for the optimizer, as optimum's ORTOptimizer maps it.

    A vision-encoder-decoder's files take the types of its encoder and decoder; BlenderbotSmall,
    which optimum does not map, takes its BART family's.
    """
    from optimum.onnxruntime.utils import ORTConfigManager

    config = json.loads((export.onnx_dir / "config.json").read_text())
    if config["model_type"] == "vision-encoder-decoder":
        config = config["encoder" if file == models.ENCODER_FILE else "decoder"]
    model_type = {"blenderbot-small": "bart"}.get(config["model_type"], config["model_type"])
    try:
        return ORTConfigManager.get_model_ort_type(model_type)
    except KeyError as e:
        raise ToolCannotProcess(f"optimum maps no onnxruntime model type for {model_type}") from e


def _optimize(source: Path, target: Path, export: TinyExport) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    optimized = optimize_model(
        os.fspath(source),
        model_type=optimizer_model_type(export, source.name),
        num_heads=models.HEADS,
        hidden_size=models.D_MODEL,
    )
    optimized.save_model_to_file(os.fspath(target))


def _slim(source: Path, target: Path, export: TinyExport) -> None:
    import onnxslim

    onnxslim.slim(os.fspath(source), os.fspath(target))


def _onnx_shapes(source: Path, target: Path, export: TinyExport) -> None:
    import onnx

    onnx.save(onnx.shape_inference.infer_shapes(onnx.load(source)), target)


def _newer_opset(source: Path, target: Path, export: TinyExport) -> None:
    import onnx
    import onnx.version_converter

    onnx.save(onnx.version_converter.convert_version(onnx.load(source), NEWER_OPSET), target)


TOOLS: dict[str, Callable[[Path, Path, TinyExport], None]] = {
    "quantize_dynamic QInt8": _quantize("QInt8"),
    "quantize_dynamic QUInt8": _quantize("QUInt8"),
    "SymbolicShapeInference": _symbolic_shapes,
    "optimize_model": _optimize,
    "onnxslim": _slim,
    "onnx infer_shapes": _onnx_shapes,
    f"version_converter {NEWER_OPSET}": _newer_opset,
}


class ToolCannotProcess(Exception):
    """The tool refuses this architecture; the message says why."""


def _versions() -> dict[str, str]:
    found = {}
    for name in ("onnx", "onnxruntime", "onnxslim", "optimum-onnx"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


def _entry(export: TinyExport, tool: str) -> Path:
    payload = json.dumps(
        {"version": PROCESSED_VERSION, "tool": tool, "versions": _versions()}, sort_keys=True
    )
    digest = hashlib.sha256(payload.encode()).hexdigest()[:12]
    slug = tool.replace(" ", "-").lower()
    return models.cache_root() / "processed" / f"{export.onnx_dir.parent.name}--{slug}--{digest}"


def _runs_on_cpu(path: Path) -> str | None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own types
        return f"onnxruntime cannot load its {path.name} on CPU: {str(e).splitlines()[0]}"
    return None


def processed_export(export: TinyExport, tool: str) -> Path | str:
    """The folder of ``export`` after ``tool``, or the reason the tool cannot process it."""
    entry = _entry(export, tool)
    if not entry.is_dir():
        with models.staging(entry) as staging:
            _process(export, tool, staging)
    if (entry / SKIPPED).is_file():
        return (entry / SKIPPED).read_text()
    return entry / "onnx"


def _process(export: TinyExport, tool: str, staging: Path) -> None:
    folder = staging / "onnx"
    folder.mkdir()
    for path in export.onnx_dir.iterdir():
        if path.suffix != ".onnx" and path.is_file():
            shutil.copy2(path, folder / path.name)
    reason = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in SOURCE_FILES:
                if (export.onnx_dir / name).is_file():
                    TOOLS[tool](export.onnx_dir / name, folder / name, export)
                    reason = reason or _runs_on_cpu(folder / name)
    except ToolCannotProcess as e:
        reason = str(e)
    except Exception as e:  # each tool fails in its own way
        reason = f"{tool} fails on {export.arch}: {type(e).__name__}: {str(e).splitlines()[0]}"
    if reason is not None:
        shutil.rmtree(folder)
        (staging / SKIPPED).write_text(reason)
