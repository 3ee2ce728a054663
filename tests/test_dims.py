"""Symbolic dims of different source graphs stay apart after the merge."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from onnxmerge import dims, splice
from onnxmerge.roles import Role
from tests import textmodels as tm

# Both graphs name a size they computed ``unk__0``, as onnxruntime's shape inference does in
# every file it processes; here it means 2*N in one and N+1 in the other.
ENCODER = """
<ir_version: 8, opset_import: ["" : 17]>
encoder (float[batch_size, seq] x) => (float[batch_size, seq_twice] y, float[batch_size, own] z)
<float[batch_size, unk__0] t, float[batch_size, only_encoder] u>
{
    t = Concat <axis = 1> (x, x)
    u = Identity (t)
    y = Identity (u)
    z = Identity (t)
}
"""
DECODER = """
<ir_version: 8, opset_import: ["" : 17]>
decoder (float[batch_size, seq] x) => (float[batch_size, unk__1] y)
<float[batch_size, unk__0] t, float[batch_size, seq] s>
{
    one = Constant <value = float[1, 1] {1.0}> ()
    s = Identity (x)
    t = Concat <axis = 1> (s, one)
    y = Identity (t)
}
"""


def _part(text: str, role: Role) -> splice.Part:
    model = ir.from_proto(tm.proto_from_text(text))
    return splice.parts_of_file(model, role, Path(f"{role.value}.onnx"))[0]


def _interior_dims(part: splice.Part) -> dict[str, list]:
    return {
        v.name: [d if isinstance(d, int) else d.value for d in v.shape]
        for n in part.graph
        for v in n.outputs
        if v.shape is not None and v not in part.outputs.values()
    }


def test_interior_dims_an_earlier_part_uses_get_the_part_tag():
    encoder, decoder = _part(ENCODER, Role.ENCODER), _part(DECODER, Role.DECODER)
    assert dims.separate_symbolic_dims([encoder, decoder]) == 1
    assert _interior_dims(encoder) == {
        "t": ["batch_size", "unk__0"],  # the first part keeps its names
        "u": ["batch_size", "only_encoder"],  # one part only: already unique
    }
    assert _interior_dims(decoder) == {
        "t": ["batch_size", "decoder/unk__0"],
        "s": ["batch_size", "seq"],  # an interface name means one size everywhere
    }
    # Interfaces keep the names other files and the merged model's contract use.
    assert [d.value for d in encoder.outputs["y"].shape] == ["batch_size", "seq_twice"]
    assert [d.value for d in decoder.outputs["y"].shape] == ["batch_size", "unk__1"]


def test_parts_without_clashes_are_left_alone():
    encoder = _part(ENCODER, Role.ENCODER)
    before = _interior_dims(encoder)
    assert dims.separate_symbolic_dims([encoder]) == 0
    assert _interior_dims(encoder) == before


def test_an_untouched_export_keeps_every_name(tiny_export):
    """Optimum's own files name only interface sizes: the merged bytes stay what they were."""
    from onnxmerge.merge import load_export

    folder = tiny_export("t5").onnx_dir
    chosen, models, _ = load_export(folder, folder / "model.onnx")
    parts = [
        p for role, path in chosen.items() for p in splice.parts_of_file(models[path], role, path)
    ]
    assert dims.separate_symbolic_dims(parts) == 0
