"""Checks the tests hold outputs to: tensors stored twice, and the float weight that quantized codes
stand for. They hold whole arrays in memory, so they are meant for tests and small models."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxmerge.passes.base import name_of, tensor_of
from onnxmerge.passes.dedup import MIN_SHARED_BYTES, SharedTensor
from onnxmerge.passes.dedup import array_digest as _digest
from onnxmerge.passes.dedup import contiguous_array as _array
from onnxmerge.quantization._codes import Quantized

__all__ = ["dequantize", "expand", "find_duplicates"]


def find_duplicates(graph: ir.Graph, min_bytes: int = MIN_SHARED_BYTES) -> list[SharedTensor]:
    """Pairs of initializers of at least ``min_bytes`` that hold the same data, or transposed data.

    Reads only; a merged model should have none. It keys on plain sha256 of each tensor and of its
    transpose, independent of the keys ``dedup.deduplicate_initializers`` uses: it checks them.
    """
    large = [
        v
        for v in graph.initializers.values()
        if v.const_value is not None
        and v.const_value.nbytes >= min_bytes
        and v.const_value.dtype != ir.DataType.STRING
    ]
    seen: dict[tuple, ir.Value] = {}
    found: list[SharedTensor] = []
    for value in large:
        tensor = tensor_of(value)
        array = _array(tensor)
        if array is None:  # strings are left out above
            continue
        keys = [((tensor.dtype, array.shape, _digest(array)), False)]
        if array.ndim == 2:
            keys.append(((tensor.dtype, array.shape[::-1], _digest(array, transposed=True)), True))
        for key, transposed in keys:
            other = seen.get(key)
            if other is not None and other is not value:
                found.append(
                    SharedTensor(name_of(other), name_of(value), tensor.nbytes, transposed)
                )
        seen.setdefault(keys[0][0], value)
    return found


def dequantize(q: Quantized) -> np.ndarray:
    """The float32 weight the codes stand for (what ``DequantizeLinear`` computes)."""
    codes = q.codes.astype(np.float32)
    if q.zero_point is not None:
        codes = codes - expand(q.zero_point.astype(np.float32), q, codes.shape)
    return codes * expand(q.scale, q, codes.shape)


def expand(values: np.ndarray, q: Quantized, shape: tuple[int, ...]) -> np.ndarray:
    """Per-axis or per-block ``values`` (scales, zero points) spread to the weight's ``shape``."""
    if q.axis is None:
        return values
    if q.block_size is not None:
        repeated = np.repeat(values, q.block_size, axis=q.axis)
        return np.take(repeated, np.arange(shape[q.axis]), axis=q.axis)
    view = [1] * len(shape)
    view[q.axis] = -1
    return values.reshape(view)
