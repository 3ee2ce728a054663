"""Fold the shape arithmetic that exporters write in front of ``Reshape`` into constants.

torch's exporter computes each attention reshape's target at run time: ``Shape`` of the hidden
states, ``Gather`` of one axis, ``Unsqueeze``, ``Concat`` with the head sizes. onnxruntime runs
those nodes at every decoding step, and on the opus-mt shape they are a fifth of a cached step's
nodes. Where shape inference proves an element of the target equal to the same axis of the tensor
being reshaped, it becomes ``0`` (``Reshape`` copies that axis); where it proves a fixed size, that
size. A target whose every element is proven becomes a constant, and the arithmetic that only fed
it is removed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common

from onnxmerge.passes.base import NoMatch, StepResult, graph_of, is_op, name_of, tensor_of

logger = logging.getLogger(__name__)

# Initializers above this size leave the copy that shape inference reads; only their type and
# shape matter to it.
_INFERENCE_TENSOR_LIMIT = 1024

Dim = int | str | None


@dataclass(frozen=True)
class _AxisOf:
    """One element of a target: axis ``axis`` of ``value``'s shape."""

    value: ir.Value
    axis: int


class FoldReshapeTargets(ir.passes.InPlacePass):
    """Constant ``Reshape`` targets where shape inference proves them; reports how many."""

    def call(self, model: ir.Model) -> StepResult:
        shapes = inferred_shapes(model)
        folded = 0
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            target = folded_target(node, shapes)
            if isinstance(target, NoMatch):
                if node.op_type == "Reshape":
                    logger.debug("%s: target not folded: %s", node.name, target)
                continue
            _replace_target(node, target)
            folded += 1
        if folded:
            onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
        return StepResult.counted(model, "reshape_targets_folded", folded)


def inferred_shapes(model: ir.Model) -> dict[str, tuple[Dim, ...]]:
    """The shape onnx's inference gives each value name (one shape per name, or none).

    The model is serialized without its large initializers' data, so this costs little memory;
    it is left as it was, initializer order included. A name that two graphs give different
    shapes is left out, as is everything when inference fails (nothing is folded then).
    """
    main = model.graph
    initializers = list(main.initializers.values())
    inputs_before = len(main.inputs)
    large = [
        v
        for v in initializers
        if v.const_value is not None and v.const_value.nbytes > _INFERENCE_TENSOR_LIMIT
    ]
    saved = {name_of(v): (v.const_value, v.shape, v.dtype) for v in large}
    try:
        for value in large:
            tensor = tensor_of(value)
            value.shape = value.shape or cast(ir.Shape, tensor.shape)
            value.dtype = value.dtype or tensor.dtype
            main.initializers.pop(name_of(value))
            value.const_value = None
            main.inputs.append(value)
        proto = ir.serde.serialize_model(model)
    finally:
        del main.inputs[inputs_before:]
        for value in large:
            value.const_value, value.shape, dtype = saved[name_of(value)]
            if dtype is None:
                value.type = None  # it had no type: the loop above gave it one
            else:
                value.dtype = dtype
        main.initializers.clear()
        for value in initializers:
            main.initializers[name_of(value)] = value
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception as error:  # onnx raises its own error types for models it cannot infer
        logger.debug("shape inference failed, no reshape target folded: %s", error)
        return {}
    shapes: dict[str, tuple[Dim, ...]] = {}
    ambiguous: set[str] = set()
    for graph in _proto_graphs(inferred.graph):
        for info in (*graph.input, *graph.value_info, *graph.output):
            shape = _dims(info)
            if shape is None or info.name in ambiguous:
                continue
            if shapes.setdefault(info.name, shape) != shape:
                ambiguous.add(info.name)
                del shapes[info.name]
    return shapes


def folded_target(node: ir.Node, shapes: dict[str, tuple[Dim, ...]]) -> list[int] | NoMatch:
    """The constant target of a ``Reshape`` node, or why it cannot be folded."""
    if not is_op(node, "Reshape"):
        return NoMatch("not a Reshape")
    allowzero = node.attributes.get("allowzero")
    if allowzero is not None and allowzero.value:
        return NoMatch("allowzero=1: 0 would not copy an axis")
    data, target = node.inputs[0], node.inputs[1]
    if target is None or target.const_value is not None:
        return NoMatch("the target is already constant")
    concat = target.producer()
    if not is_op(concat, "Concat"):
        return NoMatch("the target is not a Concat")
    elements: list[int | _AxisOf] = []
    for part in concat.inputs:
        read = _constant_ints(part)
        if read is not None:
            elements.extend(read)
            continue
        axis = _axis_of(part)
        if axis is None:
            name = part.name if part is not None else None
            return NoMatch(f"{name} is neither constant nor one axis of a Shape")
        elements.append(axis)
    data_shape = shapes.get(data.name or "") if data is not None else None
    folded = []
    for position, element in enumerate(elements):
        if isinstance(element, int):
            folded.append(element)
            continue
        source = shapes.get(element.value.name or "")
        if source is None or not -len(source) <= element.axis < len(source):
            return NoMatch(f"the shape of {element.value.name} is not known")
        size = source[element.axis]
        if isinstance(size, int) and size > 0:
            folded.append(size)
        elif (
            isinstance(size, str)
            and data_shape is not None
            and position < len(data_shape)
            and data_shape[position] == size
        ):
            folded.append(0)  # Reshape copies the axis, which inference proved the same size
        else:
            return NoMatch(
                f"element {position} ({size}) is not proven equal to axis {position} of the data"
            )
    if folded.count(-1) > 1:
        return NoMatch("more than one -1")
    return folded


def _replace_target(node: ir.Node, target: list[int]) -> None:
    name = f"{node.name or node.outputs[0].name}/folded_target"
    constant = ir.node(
        "Constant",
        [],
        attributes={"value": ir.tensor(np.array(target, dtype=np.int64), name=name)},
        outputs=[ir.Value(name=name)],
    )
    graph_of(node).insert_before(node, constant)
    node.replace_input_with(1, constant.outputs[0])


def _constant(value: ir.Value | None) -> ir.TensorProtocol | None:
    # Not ir.convenience.get_const_tensor: it renames a Constant's tensor after its output, which
    # would change the bytes of every merged file whose targets stay unfolded.
    if value is None:
        return None
    producer = value.producer()
    if value.const_value is None and producer is not None and producer.op_type == "Constant":
        attribute = producer.attributes.get("value")
        return attribute.value if attribute is not None else None
    return value.const_value


def _constant_ints(value: ir.Value | None) -> list[int] | None:
    tensor = _constant(value)
    if tensor is None or tensor.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None
    return [int(v) for v in tensor.numpy().reshape(-1)]


def _axis_of(value: ir.Value | None) -> _AxisOf | None:
    """``Unsqueeze(Gather(Shape(x), i), [0])`` as axis ``i`` of ``x``."""
    unsqueeze = value.producer() if value is not None else None
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or len(unsqueeze.inputs) != 2:
        return None
    if _constant_ints(unsqueeze.inputs[1]) != [0]:
        return None
    gather = unsqueeze.inputs[0].producer() if unsqueeze.inputs[0] is not None else None
    if gather is None or gather.op_type != "Gather" or gather.attributes.get_int("axis", 0) != 0:
        return None
    index = _constant(gather.inputs[1])
    indices = _constant_ints(gather.inputs[1])
    if indices is None or index is None or index.shape.rank() != 0:  # a scalar: one element
        return None
    shape = gather.inputs[0].producer() if gather.inputs[0] is not None else None
    if shape is None or shape.op_type != "Shape" or shape.attributes:  # start/end: not axis i
        return None
    data = shape.inputs[0]
    return _AxisOf(data, indices[0]) if data is not None else None


def _proto_graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _proto_graphs(attribute.g)
            for subgraph in attribute.graphs:
                yield from _proto_graphs(subgraph)


def _dims(info: onnx.ValueInfoProto) -> tuple[Dim, ...] | None:
    tensor = info.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
    )
