"""Nodes beside a merged decoder's ``If`` moved into the branches that read them."""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["sink_into_branches"]


def sink_into_branches(model: ir.Model) -> int:
    """Move the nodes beside a merged decoder's ``If`` into the branches that read them.

    onnxruntime's ``quantize_dynamic`` (how transformers.js makes its q8 files) quantizes a
    graph input read by both branches once, before the ``If``
    (``DynamicQuantizeLinear(encoder_hidden_states)``); the merge takes the two branches apart,
    so each gets its own copy of such nodes. Returns the number of nodes moved.
    """
    graph = model.graph
    branching = [n for n in graph if n.op_type == "If"]
    if len(branching) != 1 or len(graph) == 1:
        return 0
    node = branching[0]
    beside = [n for n in graph if n is not node]
    produced = {v for n in beside for v in n.outputs}
    if produced & set(graph.outputs) or any(v in produced for v in node.inputs):
        return 0  # not the shape above; the splice says what it expects
    for attr in ("then_branch", "else_branch"):
        branch: ir.Graph = node.attributes[attr].value
        nodes = ir.traversal.RecursiveGraphIterator(branch)
        read = {v for n in nodes for v in n.inputs if v in produced}
        copies: dict[ir.Value, ir.Value] = {}
        made = []
        for original in beside:  # graph order is topological
            if not any(v in read or v in copies for v in original.outputs) and not any(
                v in copies for v in original.inputs
            ):
                continue
            copy = ir.Node(
                original.domain,
                original.op_type,
                [None if v is None else copies.get(v, v) for v in original.inputs],
                [ir.Attr(a.name, a.type, a.value) for a in original.attributes.values()],
                num_outputs=len(original.outputs),
                name=f"{original.name or original.op_type}/{attr}",
            )
            for old, new in zip(original.outputs, copy.outputs, strict=True):
                new.name = f"{old.name}/{attr}"
                new.type, new.shape = old.type, old.shape
                copies[old] = new
            made.append(copy)
        for user in list(ir.traversal.RecursiveGraphIterator(branch)):
            for index, value in enumerate(user.inputs):
                if value in copies:
                    user.replace_input_with(index, copies[value])
        if made:
            branch.insert_before(branch.node(0), made)
    for original in reversed(beside):
        graph.remove(original, safe=True)
    return len(beside)
