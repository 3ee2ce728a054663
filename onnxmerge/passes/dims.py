"""Keep symbolic dimensions of different source graphs apart.

A symbolic dimension (``dim_param``) means one size throughout a model, and onnxruntime plans
buffers on that promise. Each source file keeps it only within itself: tools that infer shapes
(onnxruntime's symbolic shape inference, which ``quantize_dynamic`` and the transformer optimizer
run) name the sizes they cannot express ``unk__0``, ``unk__1``, … anew in every file. The names on
the files' inputs and outputs are optimum's (``batch_size``, ``encoder_sequence_length``, …) and
do mean one size in every file; any other name that an earlier part already uses gets the later
part's tag as a prefix. Names used by one part only stay as they are, so an untouched export
merges unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx_ir as ir

from onnxmerge.merge.roles import Role
from onnxmerge.merge.splice import Part
from onnxmerge.passes import StepResult, free_name

# Short, since a tag is repeated in every shape that uses the name.
TAGS = {
    Role.ENCODER: "encoder",
    Role.DECODER: "decoder",
    Role.DECODER_WITH_PAST: "with_past",
}


def _interior_values(part: Part) -> Iterator[ir.Value]:
    """Values computed inside a part, in its subgraphs too; not its inputs or outputs."""
    interface = set(part.inputs.values()) | set(part.outputs.values())
    for node in ir.traversal.RecursiveGraphIterator(part.graph):
        for attr in node.attributes.values():
            subgraphs = ()
            if attr.type == ir.AttributeType.GRAPH:
                subgraphs = (attr.value,)
            elif attr.type == ir.AttributeType.GRAPHS:
                subgraphs = attr.value
            for sub in subgraphs:
                yield from sub.inputs
        for value in node.outputs:
            if value not in interface:
                yield value


def _names(value: ir.Value) -> set[str]:
    if value.shape is None:
        return set()
    return {d.value for d in value.shape if isinstance(d, ir.SymbolicDim) and d.value}


class SeparateSymbolicDims(ir.passes.InPlacePass):
    """Rename interior symbolic dims that an earlier part uses too; count the names renamed.

    As with value names, the first part to use a name keeps it; later ones get their role's tag.
    Made from the parts before the splice, while each part's nodes are still its own; run on the
    spliced model, which holds the same values (the splice moves nodes, it does not copy values).
    """

    def __init__(self, parts: list[Part]):
        super().__init__()
        self._interface_names = {
            name
            for part in parts
            for value in (*part.inputs.values(), *part.outputs.values())
            for name in _names(value)
        }
        self._parts = [(part.role, list(_interior_values(part))) for part in parts]

    def call(self, model: ir.Model) -> StepResult:
        taken: set[str] = set()
        renamed = 0
        for role, values in self._parts:
            own = {n for v in values for n in _names(v)} - self._interface_names
            clashing = own & taken
            new_names = {name: free_name(f"{TAGS[role]}/{name}", taken | own) for name in clashing}
            taken |= (own - clashing) | set(new_names.values())
            renamed += len(clashing)
            for value in values:
                if _names(value) & clashing:
                    value.shape = ir.Shape(
                        [
                            new_names[d.value]
                            if isinstance(d, ir.SymbolicDim) and d.value in clashing
                            else d
                            for d in value.shape
                        ]
                    )
        return StepResult.counted(model, "symbolic_dims_renamed", renamed)
