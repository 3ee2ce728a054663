"""Weight quantization arithmetic: float arrays to integer codes with scales and zero points.

Nothing here knows about graphs. Every scheme rounds to nearest; integer codes dequantize as
``(code - zero_point) * scale``, the formula of ONNX's ``DequantizeLinear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

INTEGER_PRECISIONS = frozenset({"int8", "uint8", "int4"})
# Block length of int4 weights along their input dimension. 64 keeps the scales at 1/16 of the
# codes' bytes; it is a power of two, as onnxruntime's 4-bit MatMul kernels want.
INT4_BLOCK = 64


@dataclass(frozen=True)
class Quantized:
    """Integer codes of one weight and what restores them.

    ``axis`` is None for one scale per tensor; with ``block_size`` the scales hold one value per
    block of that many elements along ``axis``, else one per index of ``axis``.
    """

    codes: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    axis: int | None
    block_size: int | None = None


def _keep_dims(array: np.ndarray, axis: int | None) -> tuple[int, ...] | None:
    """The axes to reduce over so that one statistic remains per index of ``axis``."""
    if axis is None:
        return None
    return tuple(a for a in range(array.ndim) if a != axis)


def _safe(scale: np.ndarray) -> np.ndarray:
    # An all-zero channel gets scale 1: its codes are zero either way, and nothing divides by 0.
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


# int8 codes stay within -63..63: onnxruntime multiplies uint8 activations by int8 weights with
# 16-bit pair sums on AVX2, which saturate with full-range weights (255 * 127 * 2 > 32767) and
# then cost much of the quality (cosine to fp32 logits down to 0.75 on the tiny models).
INT8_PEAK = 63


def quantize_symmetric_int8(weight: np.ndarray, axis: int | None) -> Quantized:
    """int8 codes in -63..63, zero point 0 (left out), one scale per index of ``axis``."""
    reduce = _keep_dims(weight, axis)
    peak = np.max(np.abs(weight), axis=reduce, keepdims=True)
    scale = _safe(peak / INT8_PEAK)
    codes = np.clip(np.rint(weight / scale), -INT8_PEAK, INT8_PEAK).astype(np.int8)
    return Quantized(
        codes, scale.reshape(-1) if axis is not None else scale.reshape(()), None, axis
    )


def quantize_asymmetric_uint8(weight: np.ndarray, axis: int | None) -> Quantized:
    """uint8 codes over each channel's [min, max] (zero included), with a zero point per channel."""
    reduce = _keep_dims(weight, axis)
    low = np.minimum(np.min(weight, axis=reduce, keepdims=True), 0.0)
    high = np.maximum(np.max(weight, axis=reduce, keepdims=True), 0.0)
    scale = _safe((high - low) / 255.0)
    zero = np.clip(np.rint(-low / scale), 0, 255)
    codes = np.clip(np.rint(weight / scale) + zero, 0, 255).astype(np.uint8)
    shape = (-1,) if axis is not None else ()
    return Quantized(codes, scale.reshape(shape), zero.astype(np.uint8).reshape(shape), axis)


def quantize_blocked_int4(weight: np.ndarray, axis: int, block: int = INT4_BLOCK) -> Quantized:
    """int4 codes in -7..7, one scale per ``block`` elements along ``axis`` (ONNX opset 21)."""
    moved = np.moveaxis(weight, axis, 0)
    length = moved.shape[0]
    blocks = -(-length // block)
    padded = np.zeros((blocks * block, *moved.shape[1:]), np.float32)
    padded[:length] = moved
    grouped = padded.reshape(blocks, block, *moved.shape[1:])
    scale = _safe(np.max(np.abs(grouped), axis=1) / 7.0)  # [blocks, *rest]
    codes = np.clip(np.rint(grouped / scale[:, None]), -7, 7).reshape(padded.shape)[:length]
    return Quantized(
        np.moveaxis(codes, 0, axis).astype(ml_dtypes.int4),
        np.moveaxis(scale, 0, axis),
        None,
        axis,
        block,
    )


def quantize(weight: np.ndarray, precision: str, axis: int | None) -> Quantized:
    """Quantize ``weight`` (float32) to an integer ``precision``, per index of ``axis``.

    For int4, ``axis`` is the axis the blocks run along (the weight's input dimension).
    """
    weight = np.asarray(weight, np.float32)
    if precision == "int8":
        return quantize_symmetric_int8(weight, axis)
    if precision == "uint8":
        return quantize_asymmetric_uint8(weight, axis)
    if precision == "int4":
        return quantize_blocked_int4(weight, 0 if axis is None else axis)
    raise ValueError(f"{precision!r} is not an integer precision")
