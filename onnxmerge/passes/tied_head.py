"""Read a tied LM head straight from the embedding, with no transposed copy in memory.

After deduplication a tied head is ``MatMul(hidden, Transpose(embedding))``. onnxruntime folds the
Transpose into a second, transposed copy of the embedding at load time (122 MB for opus-mt-fr-en),
which stays where weights are not pre-packed (``session.disable_prepacking``, runtimes without
pre-packing); with pre-packing on, the head's packed copy replaces it in either form.
``Gemm(transB=1)`` reads the embedding as it is stored, so this pass rewrites each such MatMul into
Reshape -> Gemm(transB=1) -> Reshape, which computes the same numbers.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from onnxmerge.passes import base as passes_base
from onnxmerge.passes.base import (
    StepResult,
    free_name,
    graph_of,
    initializer,
    is_op,
    replace_result,
)

logger = logging.getLogger(__name__)


def _producer(value: ir.Value | None) -> ir.Node:
    """The node computing ``value``, which the search found to be one."""
    node = value.producer() if value is not None else None
    if node is None:
        raise ValueError(f"{value} has no producer")
    return node


def _transposed_initializer(value: ir.Value | None, main: ir.Graph) -> ir.Value | None:
    """The 2-D main-graph initializer that ``value`` is the plain transpose of, if any."""
    if value is None:
        return None
    node = value.producer()
    if not is_op(node, "Transpose"):
        return None
    source = node.inputs[0]
    if source is None or not source.is_initializer() or source.graph is not main:
        return None
    if source.shape is None or len(source.shape) != 2:
        return None
    perm = node.attributes.get("perm")
    if perm is not None and list(perm.value) != [1, 0]:
        return None
    return source


def _node(op: str, inputs: list, name: str, output: str | ir.Value, **ints: int) -> ir.Node:
    """One node named ``name`` with one output (a new value named ``output``)."""
    value = output if isinstance(output, ir.Value) else ir.Value(name=output)
    return passes_base.node(op, inputs, [value], name=name, **ints)


# onnxruntime's float16 Gemm and MatMul round differently; float and double agree exactly.
_EXACT_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE})
# Slice with inputs, which the rewrite uses, arrived in opset 10.
_MIN_OPSET = 10


class GemmForTransposedWeights(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> StepResult:
        rewritten = gemm_for_transposed_weights(model)
        return StepResult.counted(model, "matmuls_to_gemm", rewritten)


def gemm_for_transposed_weights(model: ir.Model) -> int:
    """Rewrite ``MatMul(x, Transpose(W))`` with a main-graph initializer W; return how many."""
    main = model.graph
    if model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0)) < _MIN_OPSET:
        return 0
    rewritten = 0
    prefixes: set[str] = set()
    for node in list(ir.traversal.RecursiveGraphIterator(main)):
        operands = _hidden_and_weight(node, main)
        if operands is None:
            continue
        # Node names need not be unique; the names of the values made here must be.
        prefix = free_name(f"{node.name or node.outputs[0].name}/gemm", prefixes)
        prefixes.add(prefix)
        new_nodes = _gemm_nodes(main, *operands, prefix)
        transpose = _producer(node.inputs[1])
        replace_result(node, new_nodes, new_nodes[-1].outputs[0])
        graph = graph_of(transpose)
        if not transpose.outputs[0].uses() and transpose.outputs[0] not in graph.outputs:
            graph.remove(transpose, safe=True)
        rewritten += 1
    if rewritten:
        logger.debug("read %d transposed weights through Gemm(transB=1)", rewritten)
    return rewritten


def _hidden_and_weight(node: ir.Node, main: ir.Graph) -> tuple[ir.Value, ir.Value] | None:
    """``x`` and ``W`` of a ``MatMul(x, Transpose(W))`` that Gemm computes exactly, if any."""
    if not is_op(node, "MatMul"):
        return None
    weight = _transposed_initializer(node.inputs[1], main)
    hidden = node.inputs[0]
    if weight is None or hidden is None or weight.shape is None:
        return None
    return (hidden, weight) if weight.dtype in _EXACT_DTYPES else None


def _gemm_nodes(main: ir.Graph, hidden: ir.Value, weight: ir.Value, prefix: str) -> list[ir.Node]:
    """Reshape -> Gemm(transB=1) -> Reshape computing ``hidden @ weight.T``; the last node's
    output is the product, in ``hidden``'s leading dims."""
    assert weight.shape is not None  # _hidden_and_weight checked
    out_features, in_features = weight.shape
    flat_shape = initializer(
        main, f"onnxmerge.flatten_to_2d_{in_features}", np.array([-1, in_features], np.int64)
    )
    reshape_in = _node("Reshape", [hidden, flat_shape], f"{prefix}/reshape_in", f"{prefix}/rows")
    gemm = _node(
        "Gemm", [reshape_in.outputs[0], weight], f"{prefix}/gemm", f"{prefix}/product", transB=1
    )
    shape = _node("Shape", [hidden], f"{prefix}/shape", f"{prefix}/full_shape")
    # Slice rather than Shape(end=-1), which needs opset 15.
    leading = _node(
        "Slice",
        [
            shape.outputs[0],
            initializer(main, "onnxmerge.zero", np.array([0], np.int64)),
            initializer(main, "onnxmerge.minus_one", np.array([-1], np.int64)),
        ],
        f"{prefix}/leading_dims",
        f"{prefix}/hidden_shape",
    )
    columns = initializer(
        main, f"onnxmerge.columns_{out_features}", np.array([out_features], np.int64)
    )
    concat = _node(
        "Concat", [leading.outputs[0], columns], f"{prefix}/concat", f"{prefix}/out_shape", axis=0
    )
    reshape_out = _node(
        "Reshape",
        [gemm.outputs[0], concat.outputs[0]],
        f"{prefix}/reshape_out",
        f"{prefix}/out",
    )
    return [reshape_in, gemm, shape, leading, concat, reshape_out]
