"""Keep symbolic dimensions of different source graphs apart.

A symbolic dimension (``dim_param``) means one size throughout a model, and onnxruntime plans
buffers on that promise. Each source file keeps it only within itself: tools that infer shapes
(onnxruntime's symbolic shape inference, which ``quantize_dynamic`` and the transformer optimizer
run) name the sizes they cannot express ``unk__0``, ``unk__1``, … anew in every file. The names on
the files' inputs and outputs are optimum's (``batch_size``, ``encoder_sequence_length``, …) and
do mean one size in every file; every other name that two parts use gets the part's role as a
prefix. Names used by one part only stay as they are, so an untouched export merges unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx_ir as ir

from onnxmerge.splice import Part


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


def separate_symbolic_dims(parts: list[Part]) -> int:
    """Prefix interior symbolic dims that more than one part uses; return how many were renamed."""
    shared = {
        name
        for part in parts
        for value in (*part.inputs.values(), *part.outputs.values())
        for name in _names(value)
    }
    interior = {id(part): list(_interior_values(part)) for part in parts}
    users: dict[str, int] = {}
    for part in parts:
        for name in {n for v in interior[id(part)] for n in _names(v)} - shared:
            users[name] = users.get(name, 0) + 1
    clashing = {name for name, count in users.items() if count > 1}
    renamed = set()
    for part in parts:
        for value in interior[id(part)]:
            found = _names(value) & clashing
            if not found:
                continue
            renamed |= found
            value.shape = ir.Shape(
                [
                    f"{part.role.value}/{d.value}"
                    if isinstance(d, ir.SymbolicDim) and d.value in clashing
                    else d
                    for d in value.shape
                ]
            )
    return len(renamed)
