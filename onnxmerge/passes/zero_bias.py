"""Drop the addition of a bias that is all zeros after a weight product.

Marian, BART, mBART and Pegasus add ``final_logits_bias`` to the LM head's output; their
checkpoints hold it as zeros. onnxruntime still adds it on every step, one pass over
``[rows, vocab]`` floats (8% of an int8 beam step on the opus-mt shape). ``x + 0`` is ``x``
exactly, so the pass makes the product's result the addition's. It runs before the tied head
becomes a ``Gemm``: the width of the product is read from the weight of a ``MatMul``.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from onnxmerge.passes.base import NoMatch, StepResult, is_op, replace_result

logger = logging.getLogger(__name__)


class DropZeroBias(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> StepResult:
        return StepResult.counted(model, "zero_biases_dropped", drop_zero_bias(model))


def drop_zero_bias(model: ir.Model) -> int:
    """Remove every ``Add(MatMul(h, W), zeros)`` that cannot change the product's shape."""
    dropped = 0
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        found = _product_plus_zeros(node)
        if isinstance(found, NoMatch):
            if is_op(node, "Add"):
                logger.debug("%s stays: %s", node.name, found)
            continue
        replace_result(node, [], found)
        dropped += 1
    return dropped


def _product_plus_zeros(node: ir.Node) -> ir.Value | NoMatch:
    """The product ``node`` adds zeros to, or why it is not one."""
    if not is_op(node, "Add") or len(node.inputs) != 2:
        return NoMatch("not a two-input Add")
    for product, bias in (node.inputs, node.inputs[::-1]):
        if product is None or bias is None or not is_op(product.producer(), "MatMul"):
            continue
        if bias.const_value is None or bias.shape is None:
            return NoMatch("the other operand is not a constant")
        if product.graph is not None and product in product.graph.outputs:
            return NoMatch("the product is also a graph output")
        width = _product_width(product)
        dims = list(bias.shape)
        if width is None or not dims or dims[-1] != width or any(d != 1 for d in dims[:-1]):
            return NoMatch(f"a bias of shape {dims} may broadcast the product (width {width})")
        rank = _rank(node.outputs[0])
        if len(dims) > 1 and (rank is None or rank < len(dims)):
            return NoMatch(f"a bias of rank {len(dims)} may add dimensions")
        if np.any(bias.const_value.numpy()):
            return NoMatch("the bias is not all zeros")
        return product
    return NoMatch("neither operand is a MatMul's result")


def _product_width(product: ir.Value) -> int | None:
    """The last dimension of ``MatMul(h, W)`` from W, a 2-D constant or its plain transpose."""
    matmul = product.producer()
    weight = matmul.inputs[1] if matmul is not None else None
    if weight is None:
        return None
    transpose = weight.producer()
    if is_op(transpose, "Transpose") and transpose.inputs[0] is not None:
        perm = transpose.attributes.get("perm")
        source = transpose.inputs[0]
        if (perm is None or list(perm.value) == [1, 0]) and _is_matrix_constant(source):
            return _int(source.shape[0])  # type: ignore[index]
        return None
    return _int(weight.shape[1]) if _is_matrix_constant(weight) else None  # type: ignore[index]


def _is_matrix_constant(value: ir.Value) -> bool:
    return value.const_value is not None and value.shape is not None and len(value.shape) == 2


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def _int(dim: object) -> int | None:
    return dim if isinstance(dim, int) else None
