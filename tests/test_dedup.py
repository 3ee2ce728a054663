"""Storing every tensor once: equal and transposed initializers, lifted constants, hoisting."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
import pytest

from onnxmerge import dedup, merge_seq2seq, merge_seq2seq_with_report, passes
from tests import textmodels as tm

RNG = np.random.default_rng(7)


def _matrix(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _initializer_names(model: ir.Model) -> set[str]:
    return set(model.graph.initializers)


def _saved_tensor_bytes(path, min_bytes: int = 0) -> int:
    """Bytes of the initializers and Constant tensors of at least ``min_bytes`` in a saved file,
    subgraphs included."""
    proto = onnx.load(str(path))
    sizes: list[int] = []

    def visit(graph: onnx.GraphProto) -> None:
        sizes.extend(onnx.numpy_helper.to_array(t).nbytes for t in graph.initializer)
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    sizes.append(onnx.numpy_helper.to_array(attr.t).nbytes)
                if attr.HasField("g"):
                    visit(attr.g)

    visit(proto.graph)
    return sum(size for size in sizes if size >= min_bytes)


def _if_model(then_body: str, else_body: str, out_type: str, inputs: str = "float[2, 16] x"
              ) -> str:
    return f"""
<ir_version: 8, opset_import: ["" : 17]>
g (bool[1] c, {inputs}) => ({out_type} y) {{
  y = If(c) <
    then_branch = t () => ({out_type} ty) {{ {then_body} }},
    else_branch = e () => ({out_type} ey) {{ {else_body} }}
  >
}}
"""


def _both_branches(model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [tm.run_model(model, {**feeds, "c": np.array([flag])})[0] for flag in (True, False)]


def _transposes(model: ir.Model) -> tuple[list[ir.Node], list[ir.Node]]:
    """Transpose nodes in the main graph and in subgraphs."""
    main = [n for n in model.graph if n.op_type == "Transpose"]
    inner = [n for n in tm.all_nodes(model)
             if n.op_type == "Transpose" and n.graph is not model.graph]
    return main, inner


# ------------------------------------------------------------------ equal tensors


def test_equal_initializers_are_stored_once():
    w = _matrix(16, 16)
    text = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 16] x) => (float[2, 16] y) { h = MatMul(x, w1)
  y = MatMul(h, w2) }
"""
    model = tm.ir_from_text(text, {"w1": w, "w2": w.copy()})
    x = _matrix(2, 16)
    before = tm.run_model(model, {"x": x})[0]

    shared = dedup.deduplicate_initializers(model.graph)

    assert _initializer_names(model) == {"w1"}
    assert [(s.kept, s.removed, s.nbytes, s.transposed) for s in shared] == [
        ("w1", "w2", 1024, False)
    ]
    np.testing.assert_array_equal(tm.run_model(model, {"x": x})[0], before)


def test_same_bytes_but_other_dtype_or_shape_are_not_merged():
    # All-zero tensors of 1 KiB: identical bytes, identical sha256, different tensors.
    zeros = {
        "f_16x16": np.zeros((16, 16), np.float32),
        "i_16x16": np.zeros((16, 16), np.int32),
        "f_256": np.zeros(256, np.float32),
        "f_2x128": np.zeros((2, 128), np.float32),
        "u_16x16": np.zeros((16, 16), np.uint32),
    }
    outputs = ", ".join(
        f"{'int32' if n.startswith('i') else 'uint32' if n.startswith('u') else 'float'}"
        f"{list(a.shape)} o_{n}"
        for n, a in zeros.items()
    )
    body = "\n".join(f"  o_{n} = Identity({n})" for n in zeros)
    text = f"""
<ir_version: 8, opset_import: ["" : 17]>
g (float[1] unused) => ({outputs}) {{
{body}
}}
"""
    model = tm.ir_from_text(text, zeros)
    shared = dedup.deduplicate_initializers(model.graph)
    assert shared == []
    assert _initializer_names(model) == set(zeros)


def test_equal_1d_int64_initializers_are_merged_without_error():
    # optimum's merge_decoders raised KeyError on exactly this kind of tensor.
    text = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 3, 16] x) => (float[2, 3, 2, 8] a, float[2, 3, 4, 4] b) {
  a = Reshape(x, shape_a)
  b2 = Reshape(x, shape_b)
  a2 = Reshape(x, shape_a_copy)
  b = Reshape(a2, shape_b)
}
"""
    tensors = {
        "shape_a": np.array([0, 0, 2, 8], np.int64),
        "shape_a_copy": np.array([0, 0, 2, 8], np.int64),
        "shape_b": np.array([0, 0, 4, 4], np.int64),
    }
    model = tm.ir_from_text(text, tensors)
    x = _matrix(2, 3, 16)
    before = tm.run_model(model, {"x": x})

    results = passes.run(model, dedup.store_once_steps())

    assert _initializer_names(model) == {"shape_a", "shape_b"}
    assert [(s.kept, s.removed) for s in passes.records(results)] == [("shape_a", "shape_a_copy")]
    for got, expected in zip(tm.run_model(model, {"x": x}), before, strict=True):
        np.testing.assert_array_equal(got, expected)


# ------------------------------------------------------------------ transposed tensors


def test_transposed_copy_becomes_one_transpose_in_the_main_graph():
    # An LM head stored as embedding^T (twice), read in both branches; the embedding is read too.
    embedding = _matrix(96, 16)
    head = np.ascontiguousarray(embedding.T)
    text = """
<ir_version: 8, opset_import: ["" : 17]>
g (bool[1] c, float[2, 16] x, int64[2] ids) => (float[2, 96] y, float[2, 16] emb) {
  emb = Gather(embedding, ids)
  y = If(c) <
    then_branch = t () => (float[2, 96] ty) { ty = MatMul(x, head) },
    else_branch = e () => (float[2, 96] ey) { h = MatMul(x, head_again)
      ey = Add(h, h) }
  >
}
"""
    model = tm.ir_from_text(
        text, {"embedding": embedding, "head": head, "head_again": head.copy()}
    )
    feeds = {"x": _matrix(2, 16), "ids": np.array([3, 5], np.int64)}
    before = _both_branches(model, feeds)

    results = passes.run(model, dedup.store_once_steps())

    assert _initializer_names(model) == {"embedding"}
    main, inner = _transposes(model)
    assert len(main) == 1 and inner == []
    assert main[0].inputs[0].name == "embedding"
    # The second copy equals the first, the first is the embedding transposed: both are
    # reported against the tensor actually kept.
    assert sorted((s.removed, s.kept, s.transposed) for s in passes.records(results)) == [
        ("head", "embedding", True), ("head_again", "embedding", True)
    ]
    for got, expected in zip(_both_branches(model, feeds), before, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_square_transposed_matrix_is_found():
    w = _matrix(16, 16)
    text = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 16] x) => (float[2, 16] y) { h = MatMul(x, w)
  y = MatMul(h, w_t) }
"""
    model = tm.ir_from_text(text, {"w": w, "w_t": np.ascontiguousarray(w.T)})
    x = _matrix(2, 16)
    before = tm.run_model(model, {"x": x})[0]

    shared = dedup.deduplicate_initializers(model.graph)

    assert _initializer_names(model) == {"w"}
    assert [(s.kept, s.removed, s.transposed) for s in shared] == [("w", "w_t", True)]
    assert [n.op_type for n in model.graph].count("Transpose") == 1
    np.testing.assert_array_equal(tm.run_model(model, {"x": x})[0], before)


def test_matrix_that_is_not_a_transpose_is_kept():
    # Same multiset of values, same shapes as a transpose, but a different layout.
    w = _matrix(32, 16)
    not_transposed = np.ascontiguousarray(w.reshape(16, 32))
    text = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 32] x) => (float[2, 16] y, float[2, 32] z) { y = MatMul(x, w)
  z = MatMul(y, other) }
"""
    model = tm.ir_from_text(text, {"w": w, "other": not_transposed})
    assert dedup.deduplicate_initializers(model.graph) == []
    assert _initializer_names(model) == {"w", "other"}


def test_small_tensors_keep_their_transposed_copy_and_constants_stay():
    # Below 1 KiB a Transpose node is not worth it and Constant nodes stay where they are.
    small = _matrix(4, 8)
    text = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 4] x) => (float[2, 4] y) {
  c = Constant <value = float[4] {1.0, 2.0, 3.0, 4.0}> ()
  h = MatMul(x, small)
  g2 = MatMul(h, small_t)
  y = Add(g2, c)
}
"""
    model = tm.ir_from_text(text, {"small": small, "small_t": np.ascontiguousarray(small.T)})
    results = passes.run(model, dedup.store_once_steps())
    assert passes.records(results) == () and passes.counts(results)["constants_lifted"] == 0
    assert _initializer_names(model) == {"small", "small_t"}
    assert [n.op_type for n in model.graph] == ["Constant", "MatMul", "MatMul", "Add"]


def test_equal_small_initializers_are_still_stored_once():
    bias = _matrix(8)
    text = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 8] x) => (float[2, 8] y) { h = Add(x, b1)
  y = Add(h, b2) }
"""
    model = tm.ir_from_text(text, {"b1": bias, "b2": bias.copy()})
    assert len(dedup.deduplicate_initializers(model.graph)) == 1
    assert _initializer_names(model) == {"b1"}


# ------------------------------------------------------------------ constants and hoisting


def _constant_text(array: np.ndarray) -> str:
    values = ", ".join(repr(float(v)) for v in array.reshape(-1))
    return f"float[{', '.join(map(str, array.shape))}] {{{values}}}"


def test_large_constants_in_both_branches_are_lifted_and_stored_once():
    # Exactly 1 KiB each: the threshold is inclusive.
    weight = np.round(_matrix(16, 16), 3)
    constant = _constant_text(weight)
    text = _if_model(
        f"w = Constant <value = {constant}> ()\n ty = MatMul(x, w)",
        f"w2 = Constant <value = {constant}> ()\n h = MatMul(x, w2)\n ey = Add(h, h)",
        "float[2, 16]",
    )
    model = tm.ir_from_text(text)
    feeds = {"x": _matrix(2, 16)}
    before = _both_branches(model, feeds)

    results = passes.run(model, dedup.store_once_steps())

    assert passes.counts(results)["constants_lifted"] == 2
    assert len(passes.records(results)) == 1
    assert [n.op_type for n in tm.all_nodes(model)].count("Constant") == 0
    (only,) = model.graph.initializers.values()
    np.testing.assert_array_equal(only.const_value.numpy(), weight)
    for got, expected in zip(_both_branches(model, feeds), before, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_transpose_of_a_shared_weight_in_both_branches_is_hoisted_once():
    # onnxruntime folds a Transpose of a constant once per branch: two copies in memory.
    embedding = _matrix(96, 16)
    text = _if_model(
        "t1 = Transpose <perm = [1, 0]> (embedding)\n ty = MatMul(x, t1)",
        "t2 = Transpose <perm = [1, 0]> (embedding)\n h = MatMul(x, t2)\n ey = Add(h, h)",
        "float[2, 96]",
    )
    model = tm.ir_from_text(text, {"embedding": embedding})
    feeds = {"x": _matrix(2, 16)}
    before = _both_branches(model, feeds)

    results = passes.run(model, dedup.store_once_steps())

    main, inner = _transposes(model)
    assert (len(main), len(inner)) == (1, 0)
    assert passes.counts(results)["nodes_hoisted"] == 2
    assert passes.counts(results)["nodes_merged"] == 1
    for got, expected in zip(_both_branches(model, feeds), before, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_nodes_reading_graph_inputs_stay_in_their_branch():
    embedding = _matrix(16, 16)
    text = _if_model(
        "s = Add(x, x)\n ty = MatMul(s, embedding)",
        "s2 = Mul(x, x)\n ey = MatMul(s2, embedding)",
        "float[2, 16]",
    )
    model = tm.ir_from_text(text, {"embedding": embedding})
    assert dedup.hoist_constant_nodes(model.graph) == 0
    assert [n.op_type for n in model.graph] == ["If"]


def test_hoisting_keeps_branch_outputs_produced_inside_the_branch():
    embedding = _matrix(96, 16)
    text = _if_model(
        "ty = Transpose <perm = [1, 0]> (embedding)",
        "h = Transpose <perm = [1, 0]> (embedding)\n ey = Neg(h)",
        "float[16, 96]",
        inputs="float[1] unused",
    )
    model = tm.ir_from_text(text, {"embedding": embedding})
    before = _both_branches(model, {"unused": np.zeros(1, np.float32)})
    passes.run(model, dedup.store_once_steps())
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    after = _both_branches(model, {"unused": np.zeros(1, np.float32)})
    for got, expected in zip(after, before, strict=True):
        np.testing.assert_array_equal(got, expected)


# ------------------------------------------------------------------ on a whole export


def _unique_source_bytes(folder, min_bytes: int = 0) -> int:
    """Bytes of the sources' tensors of at least ``min_bytes`` when equal ones, and 2-D
    transposed copies of 1 KiB or more, count once."""
    arrays: list[np.ndarray] = []
    for path in sorted(folder.glob("*.onnx")):
        graph = onnx.load(str(path)).graph
        arrays += [onnx.numpy_helper.to_array(t) for t in graph.initializer]
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("t") and onnx.numpy_helper.to_array(attr.t).nbytes >= 1024:
                    arrays.append(onnx.numpy_helper.to_array(attr.t))
    counted: set[tuple] = set()
    total = 0
    for a in arrays:
        key = (a.dtype.str, a.shape, a.tobytes())
        if key in counted:
            continue
        if a.ndim == 2 and a.nbytes >= 1024:
            flipped = (a.dtype.str, a.shape[::-1], np.ascontiguousarray(a.T).tobytes())
            if flipped in counted:
                continue
        counted.add(key)
        total += a.nbytes if a.nbytes >= min_bytes else 0
    return total


@pytest.mark.parametrize("head", ["copy", "tied"])
@pytest.mark.parametrize("out_proj_as_constant", [False, True])
def test_merged_file_holds_each_tensor_once(tmp_path, head, out_proj_as_constant):
    folder = tm.write_export(tmp_path / "export", head=head,
                             out_proj_as_constant=out_proj_as_constant)
    sources = sum(_saved_tensor_bytes(p) for p in folder.glob("*.onnx"))
    result = merge_seq2seq_with_report(folder)

    # Every tensor of 1 KiB or more is stored exactly once; small ones at most once each (later
    # passes may add a few small shape tensors of their own).
    assert _saved_tensor_bytes(result.path, 1024) == _unique_source_bytes(folder, 1024)
    small = _saved_tensor_bytes(result.path) - _saved_tensor_bytes(result.path, 1024)
    unique_small = _unique_source_bytes(folder) - _unique_source_bytes(folder, 1024)
    assert small <= unique_small + 64
    assert _saved_tensor_bytes(result.path) < sources / 2
    proto = onnx.load(str(result.path))
    names = {t.name for t in proto.graph.initializer}
    assert tm.LM_HEAD not in names
    assert sum(1 for t in proto.graph.initializer if tuple(t.dims) == (tm.VOCAB, tm.D_MODEL)) == 1
    if out_proj_as_constant:
        assert result.constants_lifted == 2


@pytest.mark.parametrize("head", ["copy", "tied"])
def test_lm_head_is_one_transpose_in_the_main_graph(tmp_path, head):
    folder = tm.write_export(tmp_path / "export", head=head)
    path = merge_seq2seq(folder)
    model = ir.load(path)
    main, inner = _transposes(model)
    # At most one, in the main graph (a later pass may read the embedding without any).
    assert [n for n in inner if n.inputs[0].is_initializer()] == []
    reading_weights = [n for n in main if n.inputs[0].is_initializer()]
    assert len(reading_weights) <= 1
    assert all(n.inputs[0].name == tm.EMBEDDING for n in reading_weights)

    inputs = tm.sample_inputs()
    first, cached = tm.run_sources(folder, inputs)
    for use_cache, expected in ((False, first), (True, cached)):
        got = tm.run_merged(path, inputs, use_cache=use_cache, optimize=True)
        assert tm.max_abs_diff(expected, got) <= 1e-5


def test_impure_nodes_are_not_hoisted():
    embedding = _matrix(16, 16)
    text = _if_model(
        "r = RandomUniformLike(embedding)\n ty = MatMul(x, r)",
        "ey = MatMul(x, embedding)",
        "float[2, 16]",
    )
    model = tm.ir_from_text(text, {"embedding": embedding})
    assert dedup.hoist_constant_nodes(model.graph) == 0


def test_find_duplicates_sees_none_in_a_merged_model(tmp_path):
    source = ir.load(tm.write_export(tmp_path / "export") / tm.DECODER)
    found = dedup.find_duplicates(source.graph)
    # The decoder file alone holds the embedding and its transposed copy as the LM head.
    assert [({s.kept, s.removed}, s.transposed) for s in found] == [
        ({tm.EMBEDDING, tm.LM_HEAD}, True)
    ]
    merged = ir.load(merge_seq2seq(tmp_path / "export"))
    assert dedup.find_duplicates(merged.graph) == []
