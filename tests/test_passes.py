"""Each rewrite pass of the merge alone, on small text graphs: what it changed and what it said."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnxmerge import merge, merge_seq2seq_with_report, passes
from onnxmerge.passes import dedup, tied_head, zero_bias
from onnxmerge.quantization import _rewrite as quant_rewrite
from tests import textmodels as tm

RNG = np.random.default_rng(11)
HEADER = '<ir_version: 8, opset_import: ["" : 17]>'


def _matrix(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _model(body: str, tensors: dict[str, np.ndarray] | None = None) -> ir.Model:
    return tm.ir_from_text(f"{HEADER}\n{body}", tensors)


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in tm.all_nodes(model)]


def _run_once(step, model: ir.Model, feeds: dict[str, np.ndarray], name: str):
    """Run ``step``: it reports one change under ``name`` and the model's outputs stay the same."""
    before = tm.run_model(model, feeds)
    result = step(model)
    assert (result.name, result.count, result.modified) == (name, 1, True)
    for got, expected in zip(tm.run_model(model, feeds), before, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    return result


def test_lift_moves_a_large_branch_constant_to_the_main_graph_and_leaves_a_small_one():
    weight = np.round(_matrix(16, 16), 3)
    values = ", ".join(f"{v:.3f}" for v in weight.reshape(-1))
    model = _model(f"""
g (bool[1] c, float[2, 16] x) => (float[2, 16] y) {{
  y = If(c) <
    then_branch = t () => (float[2, 16] ty) {{
      w = Constant <value = float[16, 16] {{{values}}}> ()
      ty = MatMul(x, w) }},
    else_branch = e () => (float[2, 16] ey) {{
      two = Constant <value = float[1] {{2.0}}> ()
      ey = Mul(x, two) }}
  >
}}""")
    _run_once(
        dedup.LiftLargeConstants(),
        model,
        {"c": np.array([True]), "x": _matrix(2, 16)},
        "constants_lifted",
    )

    assert list(model.graph.initializers) == ["w"]
    assert _ops(model).count("Constant") == 1


def test_deduplicate_reports_the_shared_tensor():
    weight = _matrix(16, 16)
    model = _model(
        "g (float[2, 16] x) => (float[2, 16] y) { a = MatMul(x, w)\n y = MatMul(a, w_copy) }",
        {"w": weight, "w_copy": weight.copy()},
    )
    result = _run_once(
        dedup.DeduplicateInitializers(), model, {"x": _matrix(2, 16)}, "tensors_shared"
    )

    assert [(s.kept, s.removed, s.nbytes, s.transposed) for s in result.records] == [
        ("w", "w_copy", weight.nbytes, False)
    ]


def test_hoist_moves_a_branch_transpose_of_an_initializer_to_the_main_graph():
    model = _model(
        """
g (bool[1] c, float[2, 16] x) => (float[2, 8] y) {
  y = If(c) <
    then_branch = t () => (float[2, 8] ty) { wt = Transpose <perm = [1, 0]> (w)
      ty = MatMul(x, wt) },
    else_branch = e () => (float[2, 8] ey) { ey = Slice(x, starts, ends, axes) }
  >
}""",
        {
            "w": _matrix(8, 16),
            "starts": np.array([0], np.int64),
            "ends": np.array([8], np.int64),
            "axes": np.array([1], np.int64),
        },
    )
    _run_once(
        dedup.HoistConstantNodes(),
        model,
        {"c": np.array([True]), "x": _matrix(2, 16)},
        "nodes_hoisted",
    )

    assert [n.op_type for n in model.graph] == ["Transpose", "If"]


def test_merge_equal_constant_nodes_keeps_one_of_two_equal_transposes():
    model = _model(
        """
g (float[2, 16] x) => (float[2, 8] y) {
  t1 = Transpose <perm = [1, 0]> (w)
  t2 = Transpose <perm = [1, 0]> (w)
  a = MatMul(x, t1)
  b = MatMul(x, t2)
  y = Add(a, b)
}""",
        {"w": _matrix(8, 16)},
    )
    _run_once(dedup.MergeEqualConstantNodes(), model, {"x": _matrix(2, 16)}, "nodes_merged")

    assert _ops(model).count("Transpose") == 1


def test_drop_aliases_makes_readers_read_the_initializer():
    model = _model(
        "g (float[2, 16] x) => (float[2, 16] y) { alias = Identity(w)\n y = MatMul(x, alias) }",
        {"w": _matrix(16, 16)},
    )
    _run_once(dedup.DropInitializerAliases(), model, {"x": _matrix(2, 16)}, "aliases_dropped")

    assert _ops(model) == ["MatMul"]
    assert model.graph.node(0).inputs[1] is model.graph.initializers["w"]


def test_remove_unused_initializers_keeps_the_read_ones():
    model = _model(
        "g (float[2, 16] x) => (float[2, 16] y) { y = MatMul(x, w) }",
        {"w": _matrix(16, 16), "unused": _matrix(4)},
    )

    result = dedup.RemoveUnusedInitializers()(model)

    assert (result.name, result.count, result.modified) == ("initializers_removed_unused", 1, True)
    assert list(model.graph.initializers) == ["w"]


def test_gemm_replaces_matmul_of_a_transposed_initializer():
    model = _model(
        """
g (float[2, 16] x) => (float[2, 96] y) {
  wt = Transpose <perm = [1, 0]> (embedding)
  y = MatMul(x, wt)
}""",
        {"embedding": _matrix(96, 16)},
    )
    _run_once(tied_head.GemmForTransposedWeights(), model, {"x": _matrix(2, 16)}, "matmuls_to_gemm")

    assert "Gemm" in _ops(model) and "MatMul" not in _ops(model)


def test_gemm_names_its_values_apart_when_two_matmuls_share_a_name():
    embedding, x = _matrix(96, 16), _matrix(2, 16)
    model = _model(
        """
g (float[2, 16] x) => (float[2, 96] y) {
  wt = Transpose <perm = [1, 0]> (embedding)
  [head] a = MatMul(x, wt)
  [head] b = MatMul(x, wt)
  y = Add(a, b)
}""",
        {"embedding": embedding},
    )

    assert tied_head.GemmForTransposedWeights()(model).count == 2

    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    (got,) = tm.run_model(model, {"x": x})
    np.testing.assert_allclose(got, 2 * x @ embedding.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight", ["w", "wt"])
def test_a_zero_bias_after_a_product_is_dropped_and_the_output_keeps_its_name(weight):
    model = _model(
        f"""
g (float[2, 3, 16] x) => (float[2, 3, 96] logits) {{
  wt = Transpose <perm = [1, 0]> (embedding)
  product = MatMul(x, {weight})
  logits = Add(product, bias)
}}""",
        {"w": _matrix(16, 96), "embedding": _matrix(96, 16), "bias": np.zeros((1, 96), np.float32)},
    )
    _run_once(zero_bias.DropZeroBias(), model, {"x": _matrix(2, 3, 16)}, "zero_biases_dropped")

    assert "Add" not in _ops(model)
    assert [v.name for v in model.graph.outputs] == ["logits"]
    assert model.graph.outputs[0].producer().op_type == "MatMul"
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


@pytest.mark.parametrize(
    ("bias", "why"),
    [
        (np.full((1, 96), 0.5, np.float32), "not all zeros"),
        (np.zeros((3, 96), np.float32), "may broadcast"),
        (np.zeros((1,), np.float32), "may broadcast"),
        (np.zeros((1, 1, 1, 96), np.float32), "may add dimensions"),
    ],
)
def test_a_bias_that_may_change_the_result_stays(bias, why, caplog):
    model = _model(
        """
g (float[2, 3, 16] x) => (float[2, 3, 96] y) {
  product = MatMul(x, w)
  y = Add(product, bias)
}""",
        {"w": _matrix(16, 96), "bias": bias},
    )
    with caplog.at_level("DEBUG", logger="onnxmerge.passes.zero_bias"):
        result = zero_bias.DropZeroBias()(model)

    assert (result.count, result.modified) == (0, False)
    assert "Add" in _ops(model)
    assert why in caplog.text


def test_quantize_weights_stores_int8_codes_and_reports_each_weight():
    weight = _matrix(16, 16)
    model = _model("g (float[2, 16] x) => (float[2, 16] y) { y = MatMul(x, w) }", {"w": weight})
    feeds = {"x": _matrix(2, 16)}
    (expected,) = tm.run_model(model, feeds)

    result = quant_rewrite.QuantizeWeights(lambda _: "int8")(model)

    assert (result.name, result.count, result.modified) == ("weights_quantized", 1, True)
    assert [(w.name, w.precision, w.bytes_before) for w in result.records] == [
        ("w", "int8", weight.nbytes)
    ]
    assert "w" not in model.graph.initializers and "MatMulInteger" in _ops(model)
    (got,) = tm.run_model(model, feeds)
    np.testing.assert_allclose(got, expected, atol=0.05 * np.abs(expected).max())


@pytest.mark.parametrize(
    "step",
    [*merge.rewrite_steps(), quant_rewrite.QuantizeWeights(lambda _: "fp32")],
    ids=lambda s: type(s).__name__,
)
def test_a_pass_with_nothing_to_do_reports_no_change(step):
    model = _model(
        "g (float[2, 16] x) => (float[2, 16] y) { y = MatMul(x, w) }", {"w": _matrix(16, 16)}
    )
    before = ir.serde.serialize_model(model).SerializeToString()

    result = step(model)

    assert isinstance(result, passes.StepResult)
    assert (result.model, result.count, result.modified, result.records) == (model, 0, False, ())
    assert ir.serde.serialize_model(model).SerializeToString() == before


@pytest.mark.parametrize("format", [None, 2])
def test_merge_result_reports_every_pass(tmp_path, format):
    folder = tm.write_export(tmp_path / "export", head="tied")

    result = merge_seq2seq_with_report(folder, format=format)

    # Format 3 compares the decoders' weights before the folding removes unused ones.
    folded_first = format == 2
    assert list(result.rewrites) == [
        "symbolic_dims_renamed",
        *(["reshape_targets_folded"] if folded_first else []),
        "constants_lifted",
        "tensors_shared",
        *([] if folded_first else ["reshape_targets_folded"]),
        "nodes_hoisted",
        "nodes_merged",
        "aliases_dropped",
        "zero_biases_dropped",
        "initializers_removed_unused",
        "matmuls_to_gemm",
        # The one-decoder form's choice between versions 3 and 4 (none here: no product).
        *([] if folded_first else ["cross_attention_per_input"]),
    ]
    assert result.rewrites.get("cross_attention_per_input", 0) == 0
    assert result.rewrites["tensors_shared"] == len(result.shared) > 0
    assert result.rewrites["constants_lifted"] == result.constants_lifted
