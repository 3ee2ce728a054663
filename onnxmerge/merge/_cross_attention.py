"""Find, in a decoder without past, the nodes that compute its cross-attention keys and values.

Format version 3 runs the decoder with past on every step, the first one included; the first step
only needs what the decoder without past computes from the encoder's hidden states: the
``present.*.encoder.*`` outputs (each layer's key and value projections of those states). This
module finds those nodes and says why, when they cannot be taken apart from the rest of the
decoder.

Exporters often read the batch size for the projections' ``Reshape`` from the decoder's own hidden
states (``Shape(x)[0]``). Such a read is of a shape, not of values, and the batch size is the
encoder's as well; it is taken from the encoder's hidden states instead. Anything else that the
projections take from the decoder's tokens refuses the extraction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import onnx_ir as ir

from onnxmerge.passes.base import NoMatch, constant_array, is_op


@dataclass(frozen=True)
class CrossAttention:
    """The nodes (in graph order) that compute ``outputs`` from the encoder's hidden states.

    ``batch_reads`` are the ``Shape`` nodes that read the decoder's own values for their batch
    size only; the splice makes them read the encoder's hidden states instead.
    """

    nodes: tuple[ir.Node, ...]
    outputs: tuple[ir.Value, ...]
    batch_reads: tuple[ir.Node, ...]


def find_cross_attention(
    graph: ir.Graph,
    outputs: Sequence[ir.Value],
    decoder_inputs: Iterable[ir.Value],
) -> CrossAttention | NoMatch:
    """The nodes of ``graph`` that ``outputs`` need, if none reads ``decoder_inputs``' values.

    ``decoder_inputs`` are the inputs the first step varies by (the decoder's token ids); the
    encoder's hidden states and attention mask are not among them.
    """
    tainted = _depending_on(graph, set(decoder_inputs))
    order = {node: i for i, node in enumerate(graph)}
    needed: set[ir.Node] = set()
    batch_reads: set[ir.Node] = set()
    stack = [v.producer() for v in outputs]
    if any(v in tainted and v.producer() is None for v in outputs):
        return NoMatch("a cross-attention present is one of the decoder's own inputs")
    while stack:
        node = stack.pop()
        if node is None or node in needed or node in batch_reads:
            continue
        if node not in order:
            return NoMatch(f"{node.name or node.op_type} is not a node of the decoder's graph")
        if any(
            attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
            for attr in node.attributes.values()
        ):
            return NoMatch(f"{node.name or node.op_type} holds a subgraph")
        if is_op(node, "Shape") and node.inputs[0] in tainted:
            batch_reads.add(node)
            continue
        tainted_inputs = [v for v in node.inputs if v is not None and v in tainted]
        if tainted_inputs and not is_op(node, "Shape"):
            node = _where_tokens_enter(node, tainted, order)
            tainted_inputs = [v for v in node.inputs if v is not None and v in tainted]
            return NoMatch(
                f"{node.name or node.op_type} ({node.op_type}) computes the cross-attention "
                f"keys or values from {tainted_inputs[0].name!r}, which depends on the decoder's "
                "tokens"
            )
        needed.add(node)
        stack.extend(v.producer() for v in node.inputs if v is not None)
    for node in batch_reads:
        problem = _batch_only(node, needed)
        if problem:
            return NoMatch(
                f"{node.name or 'a Shape node'} reads the decoder's own shape for more than "
                f"the batch size ({problem})"
            )

    def position(node: ir.Node) -> int:
        return order[node]

    nodes = sorted(needed | batch_reads, key=position)
    return CrossAttention(tuple(nodes), tuple(outputs), tuple(sorted(batch_reads, key=position)))


def _where_tokens_enter(
    node: ir.Node, tainted: set[ir.Value], order: dict[ir.Node, int]
) -> ir.Node:
    """The first node, upstream of ``node``, that mixes the decoder's values with others."""
    seen: set[ir.Node] = set()
    stack: list[ir.Node | None] = [node]
    mixing: list[ir.Node] = []
    while stack:
        current = stack.pop()
        if current is None or current in seen or current not in order:
            continue
        seen.add(current)
        inputs = [v for v in current.inputs if v is not None]
        marked = [v in tainted for v in inputs]
        if (
            any(marked)
            and not all(marked)
            and any(
                not m and v.const_value is None and not is_op(v.producer(), "Constant")
                for v, m in zip(inputs, marked, strict=True)
            )
        ):
            mixing.append(current)
        stack.extend(v.producer() for v in inputs if v in tainted)
    return min(mixing, key=lambda n: order[n]) if mixing else node


def _depending_on(graph: ir.Graph, sources: set[ir.Value]) -> set[ir.Value]:
    """Every value of ``graph`` computed from ``sources``' values (the sources included).

    A ``Shape`` reads no values: what it returns is checked where it is read.
    """
    tainted = set(sources)
    for node in graph:  # graphs are topologically sorted
        if is_op(node, "Shape"):
            continue
        inputs = [v for v in node.inputs if v is not None]
        if any(v in tainted for v in inputs) or _reads_outer(node, tainted):
            tainted.update(node.outputs)
    return tainted


def _reads_outer(node: ir.Node, tainted: set[ir.Value]) -> bool:
    for attr in node.attributes.values():
        graphs = (
            [attr.value]
            if attr.type == ir.AttributeType.GRAPH
            else list(attr.value)
            if attr.type == ir.AttributeType.GRAPHS
            else []
        )
        for sub in graphs:
            for inner in ir.traversal.RecursiveGraphIterator(sub):
                if any(v in tainted for v in inner.inputs if v is not None):
                    return True
    return False


def _batch_only(shape: ir.Node, readers: set[ir.Node]) -> str | None:
    """Why ``readers`` use the ``Shape`` node's output for more than its first element."""
    start = shape.attributes.get("start")
    end = shape.attributes.get("end")
    if start is not None and start.value != 0:
        return f"it starts at axis {start.value}"
    if end is not None and end.value == 1:
        return None
    for use in shape.outputs[0].uses():
        reader = use.node
        if reader not in readers:
            continue
        if is_op(reader, "Gather") and use.idx == 0:
            index = constant_array(reader.inputs[1])
            axis = reader.attributes.get("axis")
            if (
                index is not None
                and index.size == 1
                and int(index.reshape(-1)[0]) == 0
                and (axis is None or axis.value == 0)
            ):
                continue
            return "an element other than the first is gathered"
        if is_op(reader, "Slice") and use.idx == 0:
            starts, ends = constant_array(reader.inputs[1]), constant_array(reader.inputs[2])
            if (
                starts is not None
                and ends is not None
                and starts.tolist() == [0]
                and (ends.tolist() == [1])
            ):
                continue
            return "it is sliced beyond the first element"
        return f"{reader.op_type} reads the whole shape"
    return None


__all__ = ["CrossAttention", "find_cross_attention"]
