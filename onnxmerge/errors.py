"""The exceptions onnxmerge raises. Catch :class:`OnnxMergeError` to catch them all."""

from __future__ import annotations

__all__ = [
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
    "AudioInputError",
    "WireFormatError",
    "QuantizationError",
]


class OnnxMergeError(Exception):
    """Base class of every error raised on purpose by onnxmerge."""


class InvalidArgumentError(OnnxMergeError, ValueError):
    """An argument has a value the call cannot take; nothing was read or written.

    Raised before any file is opened. ``argument`` names the parameter (or the CLI option) at
    fault, and the message says which values it takes.

    Example:
        >>> from onnxmerge.errors import InvalidArgumentError
        >>> try:
        ...     raise InvalidArgumentError("threads must be at least 1, got 0", argument="threads")
        ... except ValueError as error:
        ...     print(error.argument)
        threads
    """

    def __init__(self, message: str, *, argument: str | None = None):
        self.argument = argument
        super().__init__(message)


class ExportFolderError(OnnxMergeError):
    """The export folder is missing files or holds files whose role cannot be recognised."""


class IncompatibleModelsError(OnnxMergeError):
    """The files of an export folder cannot be merged into one model.

    ``problems`` lists every problem found, one line each.
    """

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = list(problems or [])
        if self.problems:
            message = message + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class ModelNotFoundError(OnnxMergeError, FileNotFoundError):
    """A model file that was asked for does not exist."""


class UnsafeExternalDataError(OnnxMergeError):
    """A model refers to external data outside its folder, or to data that does not fit."""


class RefusedOutputError(OnnxMergeError):
    """The output path cannot be written: it exists, is an input, or there is no room."""


class InvalidMergedModelError(OnnxMergeError):
    """A file is not a merged seq2seq model, or a produced model failed validation."""


class MergedModelRunError(OnnxMergeError):
    """onnxruntime cannot run a model that onnxmerge wrote; nothing was published.

    ``step`` says where it failed: ``"load"``, ``"first"`` (``use_cache_branch = false``: encoder
    and decoder without past), ``"cached"`` (``use_cache_branch = true``: decoder with past) or
    ``"generate"`` (a generator's run).
    """

    STEPS = {
        "load": "loading it",
        "first": "the first step (use_cache_branch = false: encoder and decoder without past)",
        "cached": "a cached step (use_cache_branch = true: decoder with past)",
        # Format version 3 runs the decoder with past on every step.
        "first-one-decoder": "the first step (use_cache_branch = false: encoder, its "
        "cross-attention keys and values, and the decoder with past)",
        "cached-one-decoder": "a cached step (use_cache_branch = true: decoder with past)",
        "generate": "a generation of two tokens (the generator's loop)",
    }

    def __init__(self, step: str, reason: str):
        self.step = step.removesuffix("-one-decoder")
        self.reason = reason
        super().__init__(
            f"onnxruntime failed on the written model in {self.STEPS[step]}: {reason}. Nothing "
            "was written. Check that the source files run in onnxruntime; if they do, please "
            "report this with the export folder's config.json"
        )


class MissingDependencyError(OnnxMergeError, ImportError):
    """An optional dependency is not installed, or its import fails; the message says what to
    install (the CLI exits 4)."""


class GenerationError(InvalidArgumentError):
    """Inputs or settings of a generation are invalid (wrong dtype, rank, missing inputs, bad
    settings, a source past the model's positions)."""


class WireFormatError(OnnxMergeError, ValueError):
    """The bytes of a model file are not a well-formed protobuf message."""


class QuantizationError(OnnxMergeError, ValueError):
    """A model cannot be quantized as asked (unknown precision, already quantized, old opset)."""


class AudioInputError(OnnxMergeError, ValueError):
    """PCM the audio generator cannot take: not mono, empty, not finite, not float, another rate."""
