"""Folding exporter shape arithmetic into constant Reshape targets, on small text graphs."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnxmerge.passes import NoMatch
from onnxmerge.passes.reshape_targets import FoldReshapeTargets, folded_target, inferred_shapes
from tests import textmodels as tm

RNG = np.random.default_rng(5)
HEADER = '<ir_version: 8, opset_import: ["" : 17]>'
# The exporter's attention reshape: [batch, seq, 16] -> [batch, seq, heads, 8], the batch and
# sequence sizes read from the hidden states' shape at run time.
SPLIT_HEADS = """
  zero = Constant <value = int64 {0}> ()
  one = Constant <value = int64 {1}> ()
  axes = Constant <value = int64[1] {0}> ()
  heads = Constant <value = int64[1] {-1}> ()
  size = Constant <value = int64[1] {8}> ()
  shape = Shape(hidden)
  batch = Gather(shape, zero)
  seq = Gather(shape, one)
  batch1 = Unsqueeze(batch, axes)
  seq1 = Unsqueeze(seq, axes)
  target = Concat <axis = 0> (batch1, seq1, heads, size)
  projected = MatMul(hidden, w)
  biased = Add(projected, b)
  split = Reshape(biased, target)"""


def _model(body: str) -> ir.Model:
    return tm.ir_from_text(
        f"{HEADER}\n{body}",
        {
            "w": RNG.standard_normal((16, 16)).astype(np.float32),
            "b": RNG.standard_normal(16).astype(np.float32),
        },
    )


def _reshape_targets(model: ir.Model) -> list:
    return [
        n.inputs[1].producer().op_type if n.inputs[1].producer() else "initializer"
        for n in tm.all_nodes(model)
        if n.op_type == "Reshape"
    ]


def _check_folds(model: ir.Model, feeds: dict[str, np.ndarray], expected_count: int) -> None:
    before = tm.run_model(model, feeds)
    result = FoldReshapeTargets()(model)
    assert (result.name, result.count, result.modified) == (
        "reshape_targets_folded",
        expected_count,
        expected_count > 0,
    )
    for got, want in zip(tm.run_model(model, feeds), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_exporters_head_split_becomes_a_constant_target_and_its_arithmetic_goes():
    model = _model(f"""
g (float[batch, seq, 16] hidden) => (float[batch, seq, 2, 8] split) {{{SPLIT_HEADS}
}}""")
    hidden = RNG.standard_normal((3, 5, 16)).astype(np.float32)

    _check_folds(model, {"hidden": hidden}, 1)

    (reshape,) = [n for n in tm.all_nodes(model) if n.op_type == "Reshape"]
    assert reshape.inputs[1].producer().attributes["value"].value.numpy().tolist() == [0, 0, -1, 8]
    ops = [n.op_type for n in tm.all_nodes(model)]
    assert not {"Shape", "Gather", "Unsqueeze", "Concat"} & set(ops)


def test_a_head_split_inside_an_if_branch_is_folded_with_outer_scope_shapes():
    model = _model(f"""
g (bool[1] c, float[batch, seq, 16] hidden) => (float[batch, seq, 2, 8] y) {{
  y = If(c) <
    then_branch = t () => (float[batch, seq, 2, 8] split) {{{SPLIT_HEADS} }},
    else_branch = e () => (float[batch, seq, 2, 8] other) {{
      fixed = Constant <value = int64[4] {{0, 0, 2, 8}}> ()
      other = Reshape(hidden, fixed) }}
  >
}}""")
    for branch in (True, False):
        feeds = {"c": np.array([branch]), "hidden": RNG.standard_normal((2, 3, 16), np.float32)}
        _check_folds(model, feeds, 1 if branch else 0)


def test_an_element_from_another_tensor_of_unproven_size_is_not_folded_and_says_why():
    # The batch size is read from `other`, whose first axis has another name than hidden's.
    model = _model("""
g (float[batch, seq, 16] hidden, float[rows, 4] other) => (float[batch, seq, 2, 8] split) {
  zero = Constant <value = int64 {0}> ()
  axes = Constant <value = int64[1] {0}> ()
  rest = Constant <value = int64[3] {-1, 2, 8}> ()
  shape = Shape(other)
  batch = Gather(shape, zero)
  batch1 = Unsqueeze(batch, axes)
  target = Concat <axis = 0> (batch1, rest)
  split = Reshape(hidden, target)
}""")
    (reshape,) = [n for n in tm.all_nodes(model) if n.op_type == "Reshape"]

    reason = folded_target(reshape, inferred_shapes(model))

    assert reason == NoMatch("element 0 (rows) is not proven equal to axis 0 of the data")
    feeds = {
        "hidden": RNG.standard_normal((2, 3, 16), np.float32),
        "other": RNG.standard_normal((2, 4), np.float32),
    }
    _check_folds(model, feeds, 0)
    assert _reshape_targets(model) == ["Concat"]


def test_allowzero_reshapes_are_left_alone():
    model = _model(f"""
g (float[batch, seq, 16] hidden) => (float[batch, seq, 2, 8] split) {{{
        SPLIT_HEADS.replace("Reshape(biased", "Reshape <allowzero = 1> (biased")
    }
}}""")
    (reshape,) = [n for n in tm.all_nodes(model) if n.op_type == "Reshape"]

    assert folded_target(reshape, inferred_shapes(model)).reason.startswith("allowzero=1")


def test_inference_leaves_the_model_as_it_was():
    model = _model(f"""
g (float[batch, seq, 16] hidden) => (float[batch, seq, 2, 8] split) {{{SPLIT_HEADS}
}}""")
    before = ir.serde.serialize_model(model).SerializeToString()

    shapes = inferred_shapes(model)

    assert shapes["biased"] == ("batch", "seq", 16)
    assert ir.serde.serialize_model(model).SerializeToString() == before
