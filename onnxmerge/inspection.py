"""What a merged file holds: its interface, metadata, and where its bytes go."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from onnxmerge import contract, model_io

PARTS = ("embedding", "encoder", "decoder", "head", "other")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str
    shape: tuple


@dataclass(frozen=True)
class Inspection:
    path: Path
    file_bytes: int
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    metadata: dict[str, str]
    bytes_by_part: dict[str, int] = field(default_factory=dict)
    initializers: int = 0


def _info(value: ir.Value) -> TensorInfo:
    dims = tuple(d if isinstance(d, int) else str(d) for d in value.shape) if value.shape else ()
    return TensorInfo(value.name or "", str(value.dtype).removeprefix("DataType."), dims)


def _part_of(value: ir.Value, logits_producers: set[ir.Node], encoder_nodes: set[ir.Node]) -> str:
    users = [use.node for use in value.uses()]
    as_stored = {value}
    # Look through nodes that only re-shape or restore a weight (a tied head's Transpose,
    # torch's Identity, the Cast or DequantizeLinear of a quantized weight).
    for node in list(users):
        if node.op_type in ("Transpose", "Identity", "Cast", "DequantizeLinear"):
            users.extend(use.node for out in node.outputs for use in out.uses())
            if node.op_type != "Transpose":
                as_stored.update(node.outputs)
    if any(u.op_type == "Gather" and u.inputs[0] in as_stored for u in users):
        return "embedding"
    if any(u in logits_producers for u in users):
        return "head"
    if any(u in encoder_nodes for u in users):
        return "encoder"
    return "decoder" if users else "other"


def encoder_nodes(model: ir.Model) -> set[ir.Node]:
    """The nodes the encoder's output depends on: the encoder, wherever the splice put it."""
    outputs = [
        out
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        for out in node.outputs
        if out.name == contract.OPTIMUM_ENCODER_OUTPUT
    ]
    found: set[ir.Node] = set()
    stack = [out.producer() for out in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in found:
            continue
        found.add(node)
        stack.extend(v.producer() for v in node.inputs if v is not None)
    return found


def _logits_producers(model: ir.Model) -> set[ir.Node]:
    """The nodes that compute logits from the last hidden state: the head's MatMul and bias Add."""
    producers: set[ir.Node] = set()
    for graph in [model.graph, *model.graph.subgraphs()]:
        for output in [o for o in graph.outputs if (o.name or "").endswith(contract.LOGITS)]:
            node = output.producer()
            for _ in range(4):  # Add(bias) <- MatMul <- ... ; a few hops suffice
                if node is None:
                    break
                producers.add(node)
                if node.op_type in ("MatMul", "Gemm"):
                    break
                node = next(
                    (i.producer() for i in node.inputs if i is not None and i.producer()), None
                )
    return producers


def inspect_model(path: str | os.PathLike) -> Inspection:
    """Describe a model file (merged or not) without loading its weights."""
    path = Path(path)
    model, data_files = model_io.load_model(path)
    producers = _logits_producers(model)
    in_encoder = encoder_nodes(model)
    by_part = dict.fromkeys(PARTS, 0)
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            by_part[_part_of(value, producers, in_encoder)] += value.const_value.nbytes
    return Inspection(
        path=path,
        file_bytes=model_io.file_bytes(path, data_files),
        inputs=tuple(_info(v) for v in model.graph.inputs),
        outputs=tuple(_info(v) for v in model.graph.outputs),
        metadata=dict(model.metadata_props),
        bytes_by_part=by_part,
        initializers=len(model.graph.initializers),
    )


def is_merged(inspection: Inspection) -> bool:
    return contract.is_merged(inspection.metadata)
