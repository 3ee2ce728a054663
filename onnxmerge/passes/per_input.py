"""Cross-attention over keys and values held once per input rather than once per decoder row.

In version 3 decoder row ``r`` reads row ``r`` of every ``past_key_values.*.encoder.*``, so beam
search holds each input's cross-attention keys and values once per beam: on the opus-mt shape at
64 source tokens, 1.5 MB a row, most of a 4-beam batch's memory. This pass makes the decoder read
row ``r // k`` of them, ``k = rows / their rows``: each product ``MatMul(x, c)`` whose second
operand ``c`` comes from one of them (through ``Transpose`` and scalings that keep the batch first)
takes ``x`` ``[rows, heads, t, d]`` as ``[rows / k, heads, k * t, d]`` and gives its result back in
rows. Only data moves, in tensors of one row's queries. Fed one row per decoder row, as version 3
is, ``k`` is 1: the same products.

The rewrite holds only where nothing else reads those tensors' batch size; otherwise nothing is
changed and the result says why (``per_input``'s debug log).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxmerge import contract
from onnxmerge.passes.base import NoMatch, StepResult, constant_array, initializer, is_op, node

logger = logging.getLogger(__name__)

RESULT_NAME = "cross_attention_per_input"
# Transpose permutations keep the batch first, scalings are by one number: the rows stay rows.
_ROW_PRESERVING = ("Transpose", "Mul", "Div")


@dataclass(frozen=True)
class _Product:
    """A cross-attention ``MatMul`` and the cache tensor its second operand comes from."""

    matmul: ir.Node
    source: ir.Value


class CrossAttentionPerInput(ir.passes.InPlacePass):
    """Rewrite every cross-attention product of a version-3 graph, or none (see the module)."""

    def call(self, model: ir.Model) -> StepResult:
        found = find_products(model.graph)
        if isinstance(found, NoMatch):
            logger.debug("cross-attention keys and values stay one row per decoder row: %s", found)
            return StepResult(model, False, RESULT_NAME, 0, (found,))
        batches: dict[ir.Value, ir.Value] = {}
        for index, product in enumerate(found):
            _fold(model.graph, product, index, batches)
        return StepResult.counted(model, RESULT_NAME, len(found))


def find_products(graph: ir.Graph) -> list[_Product] | NoMatch:
    """Every product that reads a ``present.*.encoder.*`` output of ``graph``, or why not all
    of them can read it once per input."""
    sources = [v for v in graph.outputs if contract.is_encoder_present(v.name or "")]
    if not sources:
        return NoMatch("the graph returns no cross-attention keys and values")
    products: list[_Product] = []
    for source in sources:
        if source.shape is not None and len(source.shape) != 4:
            return NoMatch(f"{source.name} is not of rank 4")
        found = _products_of(graph, source)
        if isinstance(found, NoMatch):
            return found
        if not found:
            return NoMatch(f"no product reads {source.name}")
        products.extend(found)
    return products


def _products_of(graph: ir.Graph, source: ir.Value) -> list[_Product] | NoMatch:
    products = []
    stack = [source]
    while stack:
        value = stack.pop()
        for use in value.uses():
            user = use.node
            what = f"{user.name or user.op_type} ({user.op_type}), reading {source.name},"
            if user.graph is not graph:
                return NoMatch(f"{what} is in a subgraph")
            if is_op(user, "Shape"):
                reason = _batch_read(user)
                if reason is not None:
                    return NoMatch(f"{what} {reason}")
            elif is_op(user, "MatMul") and use.idx == 1:
                query = user.inputs[0]
                if query is None or (query.shape is not None and len(query.shape) != 4):
                    return NoMatch(f"{what} multiplies a value that is not of rank 4")
                products.append(_Product(user, source))
            elif user.op_type in _ROW_PRESERVING and is_op(user, user.op_type):
                reason = _keeps_rows(user, use.idx)
                if reason is not None:
                    return NoMatch(f"{what} {reason}")
                stack.append(user.outputs[0])
            else:
                return NoMatch(f"{what} is not a product with it as second operand")
    return products


def _batch_read(shape: ir.Node) -> str | None:
    """Why a ``Shape`` of a cache tensor may read its batch size, or None where it cannot."""
    start = shape.attributes.get("start")
    if start is not None and start.value % 4 != 0:
        return None  # the shape from the second dimension on
    for use in shape.outputs[0].uses():
        gather = use.node
        if not is_op(gather, "Gather") or use.idx != 0:
            return f"gives its shape to {gather.op_type}"
        indices = constant_array(gather.inputs[1])
        if indices is None:
            return "gives its shape to a Gather of indices that are not constant"
        if (indices % 4 == 0).any():
            return "reads its batch size"
    return None


def _keeps_rows(user: ir.Node, idx: int) -> str | None:
    if is_op(user, "Transpose"):
        perm = user.attributes.get("perm")
        return None if perm is not None and list(perm.value)[0] == 0 else "moves the batch"
    constant = constant_array(user.inputs[1 - idx]) if len(user.inputs) == 2 else None
    if constant is None or constant.size != 1:
        return "scales it by more than one number"
    if user.op_type == "Div" and idx == 1:
        return "divides by it"
    return None


def _fold(
    graph: ir.Graph, product: _Product, index: int, batches: dict[ir.Value, ir.Value]
) -> None:
    """``MatMul(x, c)`` becomes ``unfold(MatMul(fold(x), c))``."""
    matmul = product.matmul
    name = f"per_input.{index}"  # node names must be unique
    query = matmul.inputs[0]
    assert query is not None  # find_products checked
    ints = _small_ints(graph)
    new: list[ir.Node] = []
    count = [0]

    def add(op: str, *inputs: ir.Value, **attributes) -> ir.Value:
        count[0] += 1
        created = node(op, inputs, name=f"{name}.{op}{count[0]}", **attributes)
        new.append(created)
        return created.outputs[0]

    if product.source not in batches:
        rows = add("Shape", product.source)
        batches[product.source] = add("Slice", rows, ints["0"], ints["1"])
    inputs = batches[product.source]
    shape = add("Shape", query)
    heads = add("Slice", shape, ints["1"], ints["2"])
    length = add("Slice", shape, ints["2"], ints["3"])
    width = add("Slice", shape, ints["3"], ints["4"])
    # [rows, heads, t, d] -> [inputs, k, heads, t, d] -> [inputs, heads, k, t, d] -> [inputs,
    # heads, k * t, d]
    split = add(
        "Reshape", query, add("Concat", inputs, ints["minus_one"], heads, length, width, axis=0)
    )
    moved = add("Transpose", split, perm=[0, 2, 1, 3, 4])
    folded = add("Reshape", moved, add("Concat", inputs, heads, ints["minus_one"], width, axis=0))
    graph.insert_before(matmul, new)
    matmul.replace_input_with(0, folded)

    result = matmul.outputs[0]
    uses = [(u.node, u.idx) for u in result.uses()]
    new.clear()
    out_width = add("Slice", add("Shape", result), ints["3"], ints["4"])
    target = add("Concat", inputs, heads, ints["minus_one"], length, out_width, axis=0)
    back = add("Transpose", add("Reshape", result, target), perm=[0, 2, 1, 3, 4])
    unfolded = add(
        "Reshape", back, add("Concat", ints["minus_one"], heads, length, out_width, axis=0)
    )
    graph.insert_after(matmul, new)
    for user, idx in uses:
        user.replace_input_with(idx, unfolded)
    unfolded.type, unfolded.shape = result.type, result.shape
    result.shape = None
    if result in graph.outputs:  # the interface keeps its name
        graph.outputs[graph.outputs.index(result)] = unfolded
        unfolded.name, result.name = result.name, f"{name}.product"


def _small_ints(graph: ir.Graph) -> dict[str, ir.Value]:
    """The one-element int64 initializers that the rewrite slices and reshapes with."""
    values = {"minus_one": -1, **{str(i): i for i in range(5)}}
    return {
        key: initializer(graph, f"onnxmerge.per_input.{key}", np.array([value], np.int64))
        for key, value in values.items()
    }
