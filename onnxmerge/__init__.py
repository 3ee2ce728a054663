"""onnxmerge: one ONNX file for a seq2seq export, every tensor stored once."""

from __future__ import annotations

from onnxmerge._version import __version__
from onnxmerge.errors import (
    AudioInputError,
    ExportFolderError,
    GenerationError,
    IncompatibleModelsError,
    InvalidArgumentError,
    InvalidMergedModelError,
    MergedModelRunError,
    MissingDependencyError,
    ModelNotFoundError,
    OnnxMergeError,
    QuantizationError,
    RefusedOutputError,
    UnsafeExternalDataError,
    WireFormatError,
)

__all__ = [
    "__version__",
    "merge_seq2seq",
    "merge_seq2seq_with_report",
    "MergeResult",
    "merge_every_dtype",
    "quantize",
    "Seq2SeqModel",
    "OnnxMergeError",
    "InvalidArgumentError",
    "ExportFolderError",
    "ModelNotFoundError",
    "IncompatibleModelsError",
    "UnsafeExternalDataError",
    "RefusedOutputError",
    "InvalidMergedModelError",
    "MergedModelRunError",
    "GenerationError",
    "MissingDependencyError",
    "QuantizationError",
    "AudioInputError",
    "WireFormatError",
    "build_generator",
]


def __getattr__(name: str):
    # The merge needs only onnx and onnx-ir; the runtime needs onnxruntime. Import lazily so that
    # each works without the other's dependencies.
    if name in ("merge_seq2seq", "merge_seq2seq_with_report", "MergeResult", "merge_every_dtype"):
        from onnxmerge import merge

        return getattr(merge, name)
    if name == "quantize":
        from onnxmerge.quantization import quantize

        return quantize
    if name == "Seq2SeqModel":
        from onnxmerge.runtime import Seq2SeqModel

        return Seq2SeqModel
    if name == "build_generator":
        from onnxmerge.generator import build_generator

        return build_generator
    raise AttributeError(f"module 'onnxmerge' has no attribute {name!r}")
