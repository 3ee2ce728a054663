"""One result shape for every rewrite pass, running passes in order, and what passes share.

A pass is an onnx-ir in-place pass; its result says, besides ``modified``, what it counted
(docs/architecture.md lists them). The helpers at the end are the graph edits several passes make.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import onnx_ir as ir


@dataclass
class StepResult(ir.passes.PassResult):
    """``count`` things changed, reported under ``name``.

    ``records`` describes each change where callers need more than the count: the tensors
    deduplication stored once, the weights quantization stored quantized.
    """

    name: str = ""
    count: int = 0
    records: tuple = ()

    @classmethod
    def counted(cls, model: ir.Model, name: str, count: int) -> StepResult:
        return cls(model, count > 0, name, count)


@dataclass(frozen=True)
class NoMatch:
    """What a search for something to rewrite returns where it finds nothing: the reason."""

    reason: str

    def __str__(self) -> str:
        return self.reason


def run(model: ir.Model, steps: Iterable[ir.passes.PassBase]) -> tuple[StepResult, ...]:
    """Run ``steps`` in order on ``model``, in place, and return each one's result.

    Raises:
        TypeError: a step returned a plain ``PassResult``: every pass here says what it did.
    """
    results = []
    for step in steps:
        result = step(model)
        if not isinstance(result, StepResult):
            raise TypeError(
                f"{type(step).__name__} returned {type(result).__name__}, not a StepResult"
            )
        results.append(result)
    return tuple(results)


def counts(results: Iterable[StepResult]) -> dict[str, int]:
    """What every step did, by name, without the model (results keep it alive)."""
    return {r.name: r.count for r in results}


def records(results: Iterable[StepResult]) -> tuple:
    """Every step's records, in the order the steps ran."""
    return tuple(record for r in results for record in r.records)


def replace_result(old: ir.Node, new_nodes: list[ir.Node], result: ir.Value) -> None:
    """Put ``new_nodes`` where ``old`` was; ``result`` (new, or a value already in the graph)
    takes the place of its one output, keeping the type and shape it has.

    A graph output keeps its name, so the graph's interface does not change.
    """
    graph = graph_of(old)
    if new_nodes:
        graph.insert_before(old, new_nodes)
    output = old.outputs[0]
    result.type, result.shape = result.type or output.type, result.shape or output.shape
    is_output = output in graph.outputs
    if is_output:
        graph.outputs[graph.outputs.index(output)] = result
    ir.convenience.replace_all_uses_with(output, result)
    graph.remove(old, safe=True)
    if is_output:
        name, output.name = output.name, None
        result.name = name


def initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """The initializer ``name`` of ``graph``, registered with ``array``'s value if absent."""
    if name not in graph.initializers:
        graph.register_initializer(
            ir.Value(
                name=name,
                type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                shape=ir.Shape(array.shape),
                const_value=ir.tensor(array, name=name),
            )
        )
    return graph.initializers[name]


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or of a standard ``Constant`` node's ``value``, else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and is_op(producer, "Constant") and "value" in producer.attributes:
        return producer.attributes["value"].as_tensor().numpy()
    return None


def tensor_of(value: ir.Value) -> ir.TensorProtocol:
    """The tensor of an initializer that holds one (the passes read no other)."""
    if value.const_value is None:
        raise ValueError(f"{value.name} holds no tensor")
    return value.const_value


def name_of(value: ir.Value) -> str:
    """The name of a value that has one: initializers and graph inputs and outputs do."""
    if value.name is None:
        raise ValueError(f"a value without a name: {value!r}")
    return value.name


def graph_of(node: ir.Node) -> ir.Graph:
    """The graph or function body ``node`` is in; the passes visit no detached node."""
    if node.graph is None:
        raise ValueError(f"{node.name} is in no graph")
    return node.graph


def is_op(node: ir.Node | None, op_type: str) -> TypeGuard[ir.Node]:
    """Whether ``node`` is the standard (``ai.onnx``) operator ``op_type``."""
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def free_name(name: str, used: set[str], *, separator: str = ".", first: int = 2) -> str:
    """``name``, or ``name.2``, ``name.3``, … : the first that is not in ``used``.

    The merge's scheme. Quantized files name their additions ``name_1``, ``name_2``, …
    (``separator="_", first=1``): their names are part of files already written, so they stay.
    """
    candidate, counter = name, first
    while candidate in used:
        candidate = f"{name}{separator}{counter}"
        counter += 1
    return candidate


def node(
    op: str,
    inputs: Sequence[ir.Value | None],
    outputs: Sequence[ir.Value] | int = 1,
    *,
    name: str | None = None,
    **attributes: Any,
) -> ir.Node:
    """A default-domain node writing ``outputs`` (values, or how many new ones); attributes as
    keywords: ints, lists of ints, floats, strings, tensors, graphs (``ir.node`` converts them)."""
    if isinstance(outputs, int):
        return ir.node(op, inputs, attributes, num_outputs=outputs, name=name)
    return ir.node(op, inputs, attributes, outputs=outputs, name=name)
