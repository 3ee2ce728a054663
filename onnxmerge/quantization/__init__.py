"""Orchestration of quantization: load a merged file, store its weights quantized, check, save.

The arithmetic lives in ``_codes``, the graph rewrite in ``_rewrite``; this module only
calls them in order, with the same safety as a merge (inputs untouched, all-or-nothing output).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from onnxmerge import check, contract, inspection, model_io, passes
from onnxmerge.contract import ACTIVATION_SCALES, PRECISIONS, WEIGHT_PRECISIONS
from onnxmerge.errors import (
    InvalidMergedModelError,
    QuantizationError,
)
from onnxmerge.passes import dedup
from onnxmerge.quantization import _rewrite
from onnxmerge.quantization._codes import INT8_PEAK

logger = logging.getLogger(__name__)

# transformers.js's file name suffixes for each precision.
SUFFIXES = {"int8": "_int8", "uint8": "_uint8", "fp16": "_fp16", "int4": "_q4"}


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
    source: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    weights: str = "int8",
    encoder: str | None = None,
    activation_scale: str = "tensor",
    overwrite: bool = False,
    external_data: bool | None = None,
) -> Path:
    """Write a copy of a merged model with its weights stored in ``weights``; return its path.

    See :func:`quantize_with_report` for the arguments.
    """
    return quantize_with_report(
        source,
        output,
        weights=weights,
        encoder=encoder,
        activation_scale=activation_scale,
        overwrite=overwrite,
        external_data=external_data,
    ).path


def quantize_with_report(
    source: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    weights: str = "int8",
    encoder: str | None = None,
    activation_scale: str = "tensor",
    overwrite: bool = False,
    external_data: bool | None = None,
) -> QuantizeResult:
    """Quantize a merged model (or an export folder, merged first) and report the numbers.

    Args:
        source: a file written by :func:`onnxmerge.merge_seq2seq`, or an export folder.
        output: the file to write; by default beside ``source`` with transformers.js's suffix
            (``model_int8.onnx``, ``model_uint8.onnx``, ``model_fp16.onnx``, ``model_q4.onnx``).
        weights: ``"int8"``, ``"uint8"``, ``"fp16"`` or ``"int4"``: the precision of every large
            weight (embedding, LM head, decoders; the encoder too unless ``encoder`` differs).
        encoder: the precision of the weights only the encoder reads: one of ``weights``' values
            or ``"fp32"``; by default ``weights`` (measured to keep quality: docs/quantization.md).
        activation_scale: how the products of int8 and uint8 weights quantize their input:
            ``"tensor"`` (default), one scale over the whole batch, so that a row's result may
            change with the other rows of its batch; ``"row"``, one scale per row (per token),
            so that every input gets what it gets alone, a little slower.
        overwrite: replace an existing output file.
        external_data: ``True`` stores the weights in ``<output>_data`` beside the model, which
            onnxruntime maps instead of parsing and copying: faster to load, and untouched
            embedding rows stay out of memory (docs/runtime.md); ``False`` one file; ``None``
            (default) as the source file is stored, and always past 2 GB.

    Raises:
        OnnxMergeError: or a subclass, saying what is wrong; nothing is written and the source is
            never modified.
    """
    source = Path(source)
    if weights not in WEIGHT_PRECISIONS:
        raise QuantizationError(
            f"weights={weights!r} is not a precision onnxmerge writes; choose one of "
            f"{', '.join(WEIGHT_PRECISIONS)}"
        )
    # By default the encoder gets the weights' precision: on the demo model every precision kept
    # >= 99% of the fp32 translations with a quantized encoder (docs/quantization.md).
    encoder = encoder or weights
    if encoder not in PRECISIONS:
        raise QuantizationError(
            f"encoder={encoder!r} is not a precision; choose one of {', '.join(PRECISIONS)}"
        )
    if activation_scale not in ACTIVATION_SCALES:
        raise QuantizationError(
            f"activation_scale={activation_scale!r} is not a choice; choose one of "
            f"{', '.join(ACTIVATION_SCALES)}"
        )
    if activation_scale != "tensor" and not {weights, encoder} & _rewrite.INTEGER_MATMUL:
        raise QuantizationError(
            f"activation_scale={activation_scale!r} applies to the products of int8 and uint8 "
            f"weights; these weights are {weights} (encoder {encoder}), whose products read float "
            "inputs"
        )
    output = Path(output) if output is not None else default_output(source, weights)
    model_io.check_output(output, _files_read(source), overwrite=overwrite)
    options = _Options(weights, encoder, activation_scale, external_data)
    if source.is_dir():
        return _quantize_export(source, output, options)
    return _quantize_file(source, output, options)


@dataclass(frozen=True)
class _Options:
    weights: str
    encoder: str
    activation_scale: str
    external_data: bool | None


def _files_read(source: Path) -> list[Path]:
    """The model and its data files, or those of every model in the export folder."""
    if source.is_dir():
        from onnxmerge.export_layout import resolve

        models = list(resolve(source).files)
    else:
        models = [source]
    return [f for m in models if m.is_file() for f in (m, *model_io.data_files_of(m))]


def _quantize_export(folder: Path, output: Path, options: _Options) -> QuantizeResult:
    from onnxmerge.merge import merge_seq2seq

    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".onnxmerge-quantize.", dir=output.parent))
    try:
        merged = merge_seq2seq(folder, work / "model.onnx")
        return _quantize_file(merged, output, options)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _quantize_file(source: Path, output: Path, options: _Options) -> QuantizeResult:
    weights, encoder, external_data = options.weights, options.encoder, options.external_data
    model, data_files = model_io.load_model(source)
    tolerated = check.unknown_operators([model])
    if external_data is None and data_files:
        external_data = True
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
    if weights == "int4" or encoder == "int4":
        _rewrite.raise_opset_for_int4(model)
    encoder_nodes = inspection.encoder_nodes(model)

    def precision_of(weight: ir.Value) -> str:
        readers = [node for node, _ in weight.uses()]
        if readers and all(node in encoder_nodes for node in readers):
            return encoder
        return weights

    before = model_io.tensor_bytes(model)
    quantized, *_ = passes.run(
        model,
        (
            _rewrite.QuantizeWeights(precision_of, options.activation_scale),
            # Equal scales or zero points (e.g. of two zero-initialized layers) are stored once.
            dedup.DeduplicateInitializers(),
            dedup.RemoveUnusedInitializers(),
        ),
    )
    done = quantized.records
    precision = {"encoder": encoder, "decoder": weights}
    contract.record_format(meta, quantized=True)  # version 2 for the two-decoder form
    meta[contract.META_PRECISION] = json.dumps(precision, sort_keys=True)
    if {weights, encoder} & _rewrite.INTEGER_MATMUL:
        meta[contract.META_ACTIVATION_SCALE] = options.activation_scale
    inputs_read = frozenset(f.resolve() for f in (source, *data_files))
    model_io.save_model_atomically(
        model,
        output,
        external_data=external_data,
        validate=lambda path: check.check_written_model(
            path, what="quantized model", tolerated=tolerated, sources=[source]
        ),
        protected=inputs_read,
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


__all__ = ["INT8_PEAK", "quantize", "quantize_with_report", "QuantizeResult", "default_output"]
