"""Symbolic dims of different source graphs stay apart after the merge."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from onnxmerge.merge import _parts as parts
from onnxmerge.merge import _splice as splice
from onnxmerge.merge._roles import Role
from onnxmerge.passes import dims

# Both graphs name a size they computed ``unk__0``, as onnxruntime's shape inference does in
# every file it processes; here it means 2*N in one and N+1 in the other.
ENCODER = """
<ir_version: 8, opset_import: ["" : 17]>
encoder (float[batch_size, seq] input_ids) => (float[batch_size, seq_twice] last_hidden_state)
<float[batch_size, unk__0] t, float[batch_size, only_encoder] u>
{
    t = Concat <axis = 1> (input_ids, input_ids)
    u = Identity (t)
    last_hidden_state = Identity (u)
}
"""
DECODER = """
<ir_version: 8, opset_import: ["" : 17]>
decoder (float[batch_size, seq] input_ids, float[batch_size, seq_twice] encoder_hidden_states)
    => (float[batch_size, unk__1] logits)
<float[batch_size, unk__0] t, float[batch_size, seq] s>
{
    one = Constant <value = float[1, 1] {1.0}> ()
    s = Identity (input_ids)
    t = Concat <axis = 1> (s, one)
    logits = Concat <axis = 1> (t, encoder_hidden_states)
}
"""


def _file(text: str, role: Role) -> tuple[Path, ir.Model, parts.Part]:
    path = Path(f"{role.value}.onnx")
    model = ir.from_onnx_text(text)
    return path, model, parts.parts_of_file(model, role, path)[0]


def _dims(values) -> dict[str, list]:
    return {
        v.name: [d if isinstance(d, int) else d.value for d in v.shape]
        for v in values
        if v.shape is not None
    }


def test_interior_dims_an_earlier_part_uses_get_the_part_tag():
    encoder_path, encoder_model, encoder = _file(ENCODER, Role.ENCODER)
    decoder_path, decoder_model, decoder = _file(DECODER, Role.DECODER)
    separate = dims.SeparateSymbolicDims(parts.dim_sources([encoder, decoder]))
    model = splice.splice(
        [encoder, decoder], {encoder_path: encoder_model, decoder_path: decoder_model}
    )

    result = separate(model)

    assert (result.name, result.count, result.modified) == ("symbolic_dims_renamed", 1, True)
    assert _dims(v for n in model.graph for v in n.outputs) == {
        "t": ["batch_size", "unk__0"],  # the first part keeps its names
        "u": ["batch_size", "only_encoder"],  # one part only: already unique
        "last_hidden_state": ["batch_size", "seq_twice"],
        "s": ["batch_size", "seq"],  # an interface name means one size everywhere
        "decoder/t": ["batch_size", "decoder/unk__0"],
        # Interfaces keep the names other files and the merged model's contract use.
        "logits": ["batch_size", "unk__1"],
    }


def test_parts_without_clashes_are_left_alone():
    _, model, encoder = _file(ENCODER, Role.ENCODER)
    before = _dims(v for n in model.graph for v in n.outputs)

    result = dims.SeparateSymbolicDims(parts.dim_sources([encoder]))(model)

    assert (result.count, result.modified) == (0, False)
    assert _dims(v for n in model.graph for v in n.outputs) == before


def test_an_untouched_export_keeps_every_name(tiny_export):
    """Optimum's own files name only interface sizes: the merged bytes stay what they were."""
    from onnxmerge.merge._load import load_export

    folder = tiny_export("t5").onnx_dir
    chosen, models, _ = load_export(folder, folder / "model.onnx")
    found = [
        p for role, path in chosen.items() for p in parts.parts_of_file(models[path], role, path)
    ]
    separate = dims.SeparateSymbolicDims(parts.dim_sources(found))
    assert separate(splice.splice(found, models)).count == 0


def test_the_if_branches_declare_no_dim_names(tiny_export, tmp_path):
    """Regression: tract binds names inside a branch apart from the outer graph's and refused
    the step's sizes there; the graph's own inputs and outputs keep their names."""
    import onnx

    from onnxmerge import merge_seq2seq

    model = onnx.load(merge_seq2seq(tiny_export("marian").onnx_dir, tmp_path / "model.onnx"))
    (if_node,) = [n for n in model.graph.node if n.op_type == "If"]
    declared = [
        value for branch in if_node.attribute for value in [*branch.g.output, *branch.g.value_info]
    ]
    assert declared
    assert not [
        (v.name, d.dim_param) for v in declared for d in v.type.tensor_type.shape.dim if d.dim_param
    ]
    named = {
        d.dim_param for v in model.graph.input for d in v.type.tensor_type.shape.dim if d.dim_param
    }
    assert {"batch_size", "encoder_sequence_length"} <= named
