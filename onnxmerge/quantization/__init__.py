"""Orchestration of quantization: load a merged file, store its weights quantized, check, save.

The arithmetic lives in ``_codes``, the graph rewrite in ``_rewrite``; this module only
calls them in order, with the same safety as a merge (inputs untouched, all-or-nothing output).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_ir as ir

from onnxmerge import check, contract, inspection, model_io, passes
from onnxmerge.contract import ACTIVATION_SCALES, PRECISIONS, WEIGHT_PRECISIONS
from onnxmerge.errors import (
    InvalidArgumentError,
    InvalidMergedModelError,
    QuantizationError,
)
from onnxmerge.merge import Source, merged_model, resolve_source
from onnxmerge.passes import dedup
from onnxmerge.quantization import _rewrite
from onnxmerge.quantization._codes import INT8_PEAK

logger = logging.getLogger(__name__)

# transformers.js's file name suffixes for each precision.
SUFFIXES = {"int8": "_int8", "uint8": "_uint8", "fp16": "_fp16", "int4": "_q4"}
DEFAULT_WEIGHTS = "int8"


@dataclass(frozen=True)
class QuantizeResult:
    path: Path
    precision: dict[str, str]
    bytes_before: int
    bytes_after: int
    weights: tuple[_rewrite.QuantizedWeight, ...]


def default_output(source: Path, weights: str) -> Path:
    """``model_int8.onnx`` and so on, beside the source file (or inside the source folder)."""
    if source.is_dir():
        return source / f"model{SUFFIXES[weights]}.onnx"
    return source.with_name(f"{source.stem}{SUFFIXES[weights]}{source.suffix or '.onnx'}")


def quantize(
    source: str | os.PathLike | Source,
    output: str | os.PathLike | None = None,
    *,
    weights: str = DEFAULT_WEIGHTS,
    encoder: str | None = None,
    activation_scale: str = "tensor",
    embedding: str | None = None,
    overwrite: bool = False,
    external_data: bool | None = None,
    progress: Callable[[str], None] | None = None,
    dtype: str | None = None,
) -> model_io.WrittenPath[QuantizeResult]:
    """Write a copy of a merged model with its weights stored in ``weights``; return its path.

    Args:
        source: a file written by :func:`onnxmerge.merge_seq2seq`, or an export folder or Hub
            repository (merged first, unless it holds the merge of its files already).
        output: the file to write; by default beside ``source`` with transformers.js's suffix
            (``model_int8.onnx``, ``model_uint8.onnx``, ``model_fp16.onnx``, ``model_q4.onnx``).
        weights: ``"int8"``, ``"uint8"``, ``"fp16"`` or ``"int4"``: the precision of every large
            weight (embedding, LM head, decoders; the encoder too unless ``encoder`` differs).
            The same values as every writer's ``weights``; where quantizing is optional, ``None``
            there keeps the weights as they are.
        encoder: the precision of the weights only the encoder reads: one of ``weights``' values
            or ``"fp32"``; by default ``weights`` (measured to keep quality: docs/quantization.md).
        activation_scale: how the products of int8 and uint8 weights quantize their input:
            ``"tensor"`` (default), one scale over the whole batch, so that a row's result may
            change with the other rows of its batch; ``"row"``, one scale per row (per token),
            so that every input gets what it gets alone, a little slower.
        embedding: the precision of the weights whose rows are gathered (the embedding, a
            tied head); by default int8 under int4 ``weights`` (int4 rows cannot be gathered,
            docs/quantization.md), else ``weights``. ``"int4"``: the smallest file, slower.
        overwrite: replace an existing output file.
        external_data: ``True`` stores the weights in ``<output>_data`` beside the model, which
            onnxruntime maps instead of parsing and copying: faster to load, and untouched
            embedding rows stay out of memory (docs/runtime.md); ``False`` one file; ``None``
            (default) as the source file is stored, and always past 2 GB.
        progress: called with the name of each step as it starts.
        dtype: which files of a folder with several dtypes (transformers.js's names).

    Returns:
        The written file's path; its ``report`` is the :class:`QuantizeResult`.

    Raises:
        InvalidArgumentError: ``weights``, ``encoder``, ``activation_scale`` or ``embedding``
            is not a choice.
        OnnxMergeError: or a subclass, saying what is wrong; nothing is written and the source is
            never modified.
    """
    options = _options(weights, encoder, activation_scale, external_data, embedding)
    found = resolve_source(source, dtype)
    output = Path(output) if output is not None else default_output(found.path, weights)
    model_io.check_output(output, found.files(), overwrite=overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    step = progress or (lambda _name: None)
    with merged_model(found, work_dir=output.parent, progress=step) as merged:
        step(f"storing the weights as {weights}")
        result = _quantize_file(merged, output, options)
    return model_io.WrittenPath.of(result.path, result)


def quantize_with_report(
    source: str | os.PathLike | Source, output: str | os.PathLike | None = None, **options: Any
) -> QuantizeResult:
    """Deprecated: ``quantize(...).report``, which this returns.

    Takes :func:`quantize`'s arguments.
    """
    warnings.warn(
        "quantize_with_report is deprecated; quantize returns the path, whose `report` is the "
        "QuantizeResult",
        DeprecationWarning,
        stacklevel=2,
    )
    return quantize(source, output, **options).report


def check_weights(
    weights: str | None, *, argument: str = "weights", required: bool = False
) -> None:
    """Refuse a precision onnxmerge does not write; ``None`` (the weights stay as they are) is
    refused only where a precision is ``required``.

    Raises:
        InvalidArgumentError: naming ``argument``.
    """
    if weights is None and not required:
        return
    if weights not in WEIGHT_PRECISIONS:
        raise InvalidArgumentError(
            f"{argument}={weights!r} is not a precision onnxmerge writes; choose one of "
            f"{', '.join(WEIGHT_PRECISIONS)}",
            argument=argument,
        )


@dataclass(frozen=True)
class _Options:
    weights: str
    encoder: str
    activation_scale: str
    external_data: bool | None
    embedding: str | None


def _options(
    weights: str,
    encoder: str | None,
    activation_scale: str,
    external_data: bool | None,
    embedding: str | None = None,
) -> _Options:
    """The arguments checked, before anything is read."""
    check_weights(weights, required=True)
    # By default the encoder gets the weights' precision: on the demo model every precision kept
    # >= 99% of the fp32 translations with a quantized encoder (docs/quantization.md).
    encoder = encoder or weights
    if encoder not in PRECISIONS:
        raise InvalidArgumentError(
            f"encoder={encoder!r} is not a precision; choose one of {', '.join(PRECISIONS)}",
            argument="encoder",
        )
    if embedding is not None and embedding not in PRECISIONS:
        raise InvalidArgumentError(
            f"embedding={embedding!r} is not a precision; choose one of {', '.join(PRECISIONS)}",
            argument="embedding",
        )
    if activation_scale not in ACTIVATION_SCALES:
        raise InvalidArgumentError(
            f"activation_scale={activation_scale!r} is not a choice; choose one of "
            f"{', '.join(ACTIVATION_SCALES)}",
            argument="activation_scale",
        )
    if activation_scale != "tensor" and not {weights, encoder} & _rewrite.INTEGER_MATMUL:
        raise InvalidArgumentError(
            f"activation_scale={activation_scale!r} applies to the products of int8 and uint8 "
            f"weights; these weights are {weights} (encoder {encoder}), whose products read float "
            "inputs",
            argument="activation_scale",
        )
    return _Options(weights, encoder, activation_scale, external_data, embedding)


def _quantize_file(source: Path, output: Path, options: _Options) -> QuantizeResult:
    model, data_files = _load_float_merged(source)
    tolerated = check.unknown_operators([model])
    external_data = options.external_data
    if external_data is None and data_files:
        external_data = True
    before = model_io.tensor_bytes(model)
    done = _store_quantized(model, options)
    precision = _record_precision(model, options)
    model_io.save_model_atomically(
        model,
        output,
        external_data=external_data,
        validate=lambda path: check.check_written_model(
            path, what="quantized model", tolerated=tolerated, sources=[source]
        ),
        protected=frozenset(f.resolve() for f in (source, *data_files)),
    )
    result = QuantizeResult(
        path=output,
        precision=precision,
        bytes_before=model_io.file_bytes(source, data_files),
        bytes_after=model_io.file_bytes(output, model_io.data_files_of(output)),
        weights=done,
    )
    logger.info(
        "quantized %d weights of %s (%d tensor bytes) into %s (%d bytes)",
        len(done),
        source,
        before,
        output,
        result.bytes_after,
    )
    return result


def _load_float_merged(source: Path) -> tuple[ir.Model, set[Path]]:
    """A merged model onnxmerge wrote, its weights not yet quantized."""
    model, data_files = model_io.load_model(source)
    meta = model.metadata_props
    if not contract.is_merged(meta):
        raise InvalidMergedModelError(
            f"{source} was not written by onnxmerge; merge its export folder first "
            "(onnxmerge.merge_seq2seq, or pass the folder to quantize)"
        )
    if contract.META_PRECISION in meta:
        raise QuantizationError(
            f"{source} is already quantized ({meta[contract.META_PRECISION]}); quantize the "
            "float32 file it came from"
        )
    return model, data_files


def _store_quantized(model: ir.Model, options: _Options) -> tuple[_rewrite.QuantizedWeight, ...]:
    """Rewrite the weights quantized, each precision where its readers are; what was stored."""
    weights, encoder, embedding = options.weights, options.encoder, options.embedding
    if "int4" in (weights, encoder, embedding):
        _rewrite.raise_opset_for_int4(model)
    encoder_nodes = inspection.encoder_nodes(model)

    def precision_of(weight: ir.Value) -> str:
        readers = [node for node, _ in weight.uses()]
        part = encoder if readers and all(n in encoder_nodes for n in readers) else weights
        if part == "fp32" or not _rewrite.rows_gathered(weight):
            return part
        if embedding is not None:
            return embedding
        # int4 rows cannot be gathered (ai.onnx's Gather takes no 4-bit type): an int4 embedding
        # is dequantized whole at every step, about 8x the int8 file's greedy time (opus shape).
        return "int8" if part == "int4" else part

    quantized, *_ = passes.run(
        model,
        (
            _rewrite.QuantizeWeights(precision_of, options.activation_scale),
            # Equal scales or zero points (e.g. of two zero-initialized layers) are stored once.
            dedup.DeduplicateInitializers(),
            dedup.RemoveUnusedInitializers(),
        ),
    )
    return quantized.records


def _record_precision(model: ir.Model, options: _Options) -> dict[str, str]:
    """Write what the quantizer did into the metadata; the precision of each part."""
    meta = model.metadata_props
    precision = {"encoder": options.encoder, "decoder": options.weights}
    contract.record_format(meta, quantized=True)  # version 2 for the two-decoder form
    meta[contract.META_PRECISION] = json.dumps(precision, sort_keys=True)
    if {options.weights, options.encoder} & _rewrite.INTEGER_MATMUL:
        meta[contract.META_ACTIVATION_SCALE] = options.activation_scale
    return precision


__all__ = [
    "DEFAULT_WEIGHTS",
    "INT8_PEAK",
    "QuantizeResult",
    "check_weights",
    "default_output",
    "quantize",
    "quantize_with_report",
]
