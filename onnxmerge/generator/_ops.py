"""A small node builder over onnx-ir: each call appends one standard (ai.onnx) node.

Constants become ``Constant`` nodes, never initializers, so the generator's initializers stay
exactly those of the merged model. Every value and node gets a unique name under one prefix.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from onnxmerge.passes.base import node

PREFIX = "generator"


class Names:
    """Unique names for everything the generator adds, shared by all builders of one model."""

    def __init__(self, prefix: str = PREFIX):
        self.prefix = prefix
        self._counter: Iterator[int] = itertools.count()

    def __call__(self, hint: str) -> str:
        return f"{self.prefix}/{hint}_{next(self._counter)}"


class Ops:
    """Appends nodes to ``self.nodes``; the caller places them in a graph."""

    def __init__(self, names: Names, opset: int = 18):
        self.names = names
        self.opset = opset  # the model's ai.onnx version: some operators changed form
        self.nodes: list[ir.Node] = []

    def op(self, op_type: str, *inputs: ir.Value | None, **attributes: Any) -> ir.Value:
        return self.op_multi(op_type, inputs, 1, **attributes)[0]

    def op_multi(
        self, op_type: str, inputs: Sequence[ir.Value | None], num_outputs: int, **attributes: Any
    ) -> list[ir.Value]:
        hint = op_type.lower()
        outputs = [ir.Value(name=self.names(hint)) for _ in range(num_outputs)]
        self.nodes.append(node(op_type, inputs, outputs, name=self.names(op_type), **attributes))
        return outputs

    # -- constants ----------------------------------------------------------------------------

    def const(self, value: Any, dtype: Any = None) -> ir.Value:
        array = np.asarray(value, dtype=dtype)
        out = self.op("Constant", value=ir.tensor(array))
        out.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
        out.shape = ir.Shape(array.shape)
        return out

    def i64(self, value: Any) -> ir.Value:
        return self.const(value, np.int64)

    def f32(self, value: Any) -> ir.Value:
        return self.const(value, np.float32)

    # -- shorthands -----------------------------------------------------------------------------

    def dim(self, value: ir.Value, axis: int) -> ir.Value:
        """``value.shape[axis]`` as an int64 scalar."""
        bounds = {"start": axis} if axis == -1 else {"start": axis, "end": axis + 1}
        shape = self.op("Shape", value, **bounds)
        out = self.op("Squeeze", shape, self.i64([0]))
        out.type = ir.TensorType(ir.DataType.INT64)
        out.shape = ir.Shape([])
        return out

    def unsqueeze(self, value: ir.Value, *axes: int) -> ir.Value:
        return self.op("Unsqueeze", value, self.i64(list(axes)))

    def squeeze(self, value: ir.Value, *axes: int) -> ir.Value:
        return self.op("Squeeze", value, self.i64(list(axes)))

    def vector(self, *scalars: ir.Value) -> ir.Value:
        """A 1-D int64 tensor from int64 scalars (or 1-D pieces)."""
        parts = [s if _is_vector(s) else self.unsqueeze(s, 0) for s in scalars]
        return parts[0] if len(parts) == 1 else self.op("Concat", *parts, axis=0)

    def slice(self, value: ir.Value, start: Any, end: Any, axis: int) -> ir.Value:
        return self.op("Slice", value, self._index(start), self._index(end), self.i64([axis]))

    def _index(self, value: Any) -> ir.Value:
        if isinstance(value, ir.Value):
            return value if _is_vector(value) else self.unsqueeze(value, 0)
        return self.i64([value])

    def reduce(
        self, op_type: str, value: ir.Value, axis: int | None = None, keepdims: bool = False
    ) -> ir.Value:
        """``ReduceMax``/``ReduceMin`` over ``axis`` (all axes when None), in the model's opset:
        the axes are an input from opset 18 on and an attribute before."""
        if axis is None:
            return self.op(op_type, value, keepdims=int(keepdims))
        if self.opset >= 18:
            return self.op(op_type, value, self.i64([axis]), keepdims=int(keepdims))
        return self.op(op_type, value, axes=[axis], keepdims=int(keepdims))

    def any(self, flags: ir.Value, axis: int | None = None, keepdims: bool = False) -> ir.Value:
        """Logical OR over ``axis`` (all axes when None) of a bool tensor."""
        return self._reduce_flags("ReduceMax", flags, axis, keepdims)

    def all(self, flags: ir.Value, axis: int | None = None, keepdims: bool = False) -> ir.Value:
        """Logical AND over ``axis`` (all axes when None) of a bool tensor."""
        return self._reduce_flags("ReduceMin", flags, axis, keepdims)

    def _reduce_flags(
        self, op_type: str, flags: ir.Value, axis: int | None, keepdims: bool
    ) -> ir.Value:
        # Reduce* take no bool input: reduce 0/1 as int64.
        as_int = self.op("Cast", flags, to=ir.DataType.INT64)
        reduced = self.reduce(op_type, as_int, axis, keepdims)
        return self.op("Cast", reduced, to=ir.DataType.BOOL)

    def isin(self, tokens: ir.Value, choices: Sequence[int]) -> ir.Value:
        """Elementwise ``tokens in choices`` (bool, the shape of ``tokens``)."""
        found = self.op("Equal", self.unsqueeze(tokens, -1), self.i64(list(choices)))
        return self.any(found, axis=-1)

    def bool_to_float(self, flags: ir.Value) -> ir.Value:
        return self.op("Cast", flags, to=ir.DataType.FLOAT)


def _is_vector(value: ir.Value) -> bool:
    return value.shape is not None and len(value.shape) == 1


def typed_input(names: Names, hint: str, dtype: ir.DataType, rank: int | None) -> ir.Value:
    """A graph input with an element type and a rank but no fixed dims."""
    shape = None if rank is None else ir.Shape([None] * rank)
    return ir.Value(name=names(hint), type=ir.TensorType(dtype), shape=shape)
