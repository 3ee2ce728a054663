"""The parts of an export: one per role, with the interface it had in its source file (an
optimum merged decoder yields two), and what the symbolic-dims pass needs to know of each."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from onnxmerge import contract
from onnxmerge.errors import ExportFolderError
from onnxmerge.merge._roles import Role
from onnxmerge.passes.base import name_of
from onnxmerge.passes.dims import DimSource

__all__ = ["Part", "dim_sources", "parts_of_file"]

# Short, since a tag is repeated in every shape that uses the name.
TAGS = {
    Role.ENCODER: "encoder",
    Role.DECODER: "decoder",
    Role.DECODER_WITH_PAST: "with_past",
}


@dataclass
class Part:
    """The nodes of one role, with the interface they had in their source file."""

    role: Role
    source: Path
    graph: ir.Graph
    inputs: dict[str, ir.Value]
    outputs: dict[str, ir.Value]
    # Initializers this part brings; parts taken from one merged decoder share theirs.
    initializers: list[ir.Value] = field(default_factory=list)


def parts_of_file(model: ir.Model, role: Role, source: Path) -> list[Part]:
    """The part(s) a loaded file contributes: one, or two for an optimum merged decoder."""
    graph = model.graph
    initializers = list(graph.initializers.values())
    if role != Role.MERGED_DECODER:
        return [
            Part(
                role,
                source,
                graph,
                {name_of(v): v for v in graph.inputs},
                {name_of(v): v for v in graph.outputs},
                initializers,
            )
        ]
    if_nodes = [n for n in graph if n.op_type == "If"]
    if len(if_nodes) != 1 or len(graph) != 1:
        raise ExportFolderError(
            f"{source} takes use_cache_branch but is not one If node over two decoders "
            f"({len(graph)} top-level nodes); re-export it with optimum, or remove it and keep "
            "decoder_model.onnx and decoder_with_past_model.onnx"
        )
    node = if_nodes[0]
    inputs = {name_of(v): v for v in graph.inputs}
    past_inputs = {v for name, v in inputs.items() if contract.is_past_name(name)}
    names = [name_of(v) for v in node.outputs]
    parts: list[Part] = []
    for attr_name in ("then_branch", "else_branch"):
        branch = node.attributes[attr_name].value
        reads_past = any(
            v in past_inputs for n in ir.traversal.RecursiveGraphIterator(branch) for v in n.inputs
        )
        part_role = Role.DECODER_WITH_PAST if reads_past else Role.DECODER
        outputs = dict(zip(names, branch.outputs, strict=True))
        if reads_past:
            # Cached steps return empty encoder presents; the splice makes its own.
            outputs = {k: v for k, v in outputs.items() if not contract.is_encoder_present(k)}
        # Other tools may keep initializers inside the branches; they move out like the rest.
        parts.append(
            Part(part_role, source, branch, inputs, outputs, list(branch.initializers.values()))
        )
    if {p.role for p in parts} != {Role.DECODER, Role.DECODER_WITH_PAST}:
        raise ExportFolderError(
            f"{source}: expected one branch with past and one without, found "
            f"{[p.role.value for p in parts]}"
        )
    parts.sort(key=lambda p: p.role != Role.DECODER)
    parts[0].initializers = initializers + parts[0].initializers
    return parts


def dim_sources(parts: list[Part]) -> list[DimSource]:
    """What ``SeparateSymbolicDims`` keeps apart: each part's tag, interface and interior values.

    Taken before the splice, while each part's nodes are still its own; the splice moves nodes
    and renames values but keeps the value objects, so the pass can run on the spliced model.
    """
    return [
        DimSource(
            TAGS[part.role],
            [*part.inputs.values(), *part.outputs.values()],
            list(_interior_values(part)),
        )
        for part in parts
    ]


def _interior_values(part: Part) -> Iterator[ir.Value]:
    """Values computed inside a part, in its subgraphs too; not its inputs or outputs."""
    interface = set(part.inputs.values()) | set(part.outputs.values())
    for node in ir.traversal.RecursiveGraphIterator(part.graph):
        for attr in node.attributes.values():
            subgraphs: Sequence[ir.Graph] = ()
            if attr.type == ir.AttributeType.GRAPH:
                subgraphs = (attr.value,)
            elif attr.type == ir.AttributeType.GRAPHS:
                subgraphs = attr.value
            for sub in subgraphs:
                yield from sub.inputs
        for value in node.outputs:
            if value not in interface:
                yield value
