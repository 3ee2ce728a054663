"""What the graph a session runs reads, by structure alone: which memory the runtime may write
over (a step's presents over pasts read already) or hand back between runs (weights whose
readers run from packed copies).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence

from onnxmerge import contract as c
from onnxmerge._wire import Graph, Initializer, Node


def pasts_read_only_into_presents(graph: Graph, pasts: Sequence[str]) -> bool:
    """Whether every node of ``graph`` (and of its subgraphs) that reads one of ``pasts`` either
    reads only its shape or computes that past's own present."""
    names = set(pasts)
    for node in _nodes(graph):
        for name in names.intersection(node.input):
            if node.op_type != "Shape" and c.present_name_of(name) not in node.output:
                return False
    return True


def presents_follow_layers(graph: Graph, presents: Sequence[str]) -> bool:
    """Whether the node that computes each present of layer ``i`` (``presents``: key, value per
    layer, in order) needs, through the graph's data flow, the nodes that compute both presents
    of layer ``i - 1``: then no order onnxruntime may run the nodes in writes a present of
    layer ``i`` before those of layer ``i - 1`` are written. A node with subgraphs needs every
    name they read from outside."""
    producer: dict[str, int] = {}
    needs: list[Collection[str]] = []
    for index, node in enumerate(graph.node):
        for name in node.output:
            producer[name] = index
        within = {name for inner in _nodes_within(node) for name in inner.input}
        needs.append(within | set(node.input) if within else node.input)
    kinds = len(c.CACHE_KINDS)
    if any(name not in producer for name in presents):
        return False
    for layer in range(1, len(presents) // kinds):
        before = {producer[n] for n in presents[(layer - 1) * kinds : layer * kinds]}
        for name in presents[layer * kinds : (layer + 1) * kinds]:
            if not before <= _upstream(producer[name], needs, producer):
                return False
    return True


def _upstream(start: int, needs: list[Collection[str]], producer: Mapping[str, int]) -> set[int]:
    """The nodes that node ``start`` needs, directly or not."""
    seen: set[int] = set()
    todo = [start]
    while todo:
        for name in needs[todo.pop()]:
            index = producer.get(name)
            if index is not None and index not in seen:
                seen.add(index)
                todo.append(index)
    return seen


def _nodes_within(node: Node) -> Iterator[Node]:
    """Every node of the graphs inside ``node``, at any depth."""
    for sub in node.subgraphs:
        yield from _nodes(sub)


# (op_type, input index) of the readers whose weight onnxruntime's CPU kernels pre-pack.
_PACKED_READS = {("MatMul", 1), ("Gemm", 1)}


def gathered_only(graph: Graph) -> list[Initializer]:
    """The initializers of ``graph`` that a ``Gather`` reads rows of (its data input) and that
    nothing else reads but as a weight that onnxruntime pre-packs (``_PACKED_READS``)."""
    initializers = {t.name: t for t in graph.initializer}
    reads: dict[str, set[tuple[str, int]]] = {}
    for node in _nodes(graph):
        for index, name in enumerate(node.input):
            if name in initializers:
                op = (
                    node.op_type
                    if node.domain in ("", "ai.onnx")
                    else f"{node.domain}.{node.op_type}"
                )
                reads.setdefault(name, set()).add((op, index))
    return [
        initializers[name]
        for name, how in reads.items()
        if ("Gather", 0) in how and how <= {("Gather", 0), *_PACKED_READS}
    ]


def _nodes(graph: Graph) -> Iterator[Node]:
    """Every node of ``graph`` and of the graphs inside its nodes."""
    for inner in graph.graphs():
        yield from inner.node
