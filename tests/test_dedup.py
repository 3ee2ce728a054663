"""Storing every tensor once: equal and transposed initializers, lifted constants, hoisting."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
import pytest

from onnxmerge import merge_seq2seq, merge_seq2seq_with_report, passes
from onnxmerge.passes import dedup
from tests import textmodels as tm
from tests.checks import find_duplicates

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


def _if_model(then_body: str, else_body: str, out_type: str, inputs: str = "float[2, 16] x") -> str:
    return f"""
<ir_version: 8, opset_import: ["" : 17]>
g (bool[1] c, {inputs}) => ({out_type} y) {{
  y = If(c) <
    then_branch = t () => ({out_type} ty) {{ {then_body} }},
    else_branch = e () => ({out_type} ey) {{ {else_body} }}
  >
}}
"""


def _outputs(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model's outputs; with an ``If`` on input ``c``, those of both branches."""
    if "c" not in {v.name for v in model.graph.inputs}:
        return tm.run_model(model, feeds)
    return [
        out
        for flag in (True, False)
        for out in tm.run_model(model, {**feeds, "c": np.array([flag])})
    ]


def _store_once(model: ir.Model):
    return passes.run(model, dedup.store_once_steps())


def _deduplicate(model: ir.Model) -> list:
    return dedup.deduplicate_initializers(model.graph)


def _rewrite_keeping_outputs(model: ir.Model, feeds: dict[str, np.ndarray], rewrite=_store_once):
    """``rewrite(model)``, checking that the model computes what it did before."""
    before = _outputs(model, feeds)
    result = rewrite(model)
    for got, expected in zip(_outputs(model, feeds), before, strict=True):
        np.testing.assert_array_equal(got, expected)
    return result


def _transposes(model: ir.Model) -> tuple[list[ir.Node], list[ir.Node]]:
    """Transpose nodes in the main graph and in subgraphs."""
    main = [n for n in model.graph if n.op_type == "Transpose"]
    inner = [
        n for n in tm.all_nodes(model) if n.op_type == "Transpose" and n.graph is not model.graph
    ]
    return main, inner


# ------------------------------------------------------------------ equal tensors


@pytest.mark.parametrize(
    ("second", "transposed"),
    [(np.copy, False), (lambda w: np.ascontiguousarray(w.T), True)],
    ids=["equal", "transposed square"],
)
def test_equal_or_transposed_initializers_are_stored_once(second, transposed):
    w = _matrix(16, 16)
    text = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 16] x) => (float[2, 16] y) { h = MatMul(x, w1)
  y = MatMul(h, w2) }
"""
    model = tm.ir_from_text(text, {"w1": w, "w2": second(w)})

    shared = _rewrite_keeping_outputs(model, {"x": _matrix(2, 16)}, _deduplicate)

    assert _initializer_names(model) == {"w1"}
    assert [(s.kept, s.removed, s.nbytes, s.transposed) for s in shared] == [
        ("w1", "w2", 1024, transposed)
    ]
    assert [n.op_type for n in model.graph].count("Transpose") == int(transposed)


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

    results = _rewrite_keeping_outputs(model, {"x": _matrix(2, 3, 16)})

    assert _initializer_names(model) == {"shape_a", "shape_b"}
    assert [(s.kept, s.removed) for s in passes.records(results)] == [("shape_a", "shape_a_copy")]


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
    model = tm.ir_from_text(text, {"embedding": embedding, "head": head, "head_again": head.copy()})
    feeds = {"x": _matrix(2, 16), "ids": np.array([3, 5], np.int64)}

    results = _rewrite_keeping_outputs(model, feeds)

    assert _initializer_names(model) == {"embedding"}
    main, inner = _transposes(model)
    assert len(main) == 1 and inner == []
    assert main[0].inputs[0].name == "embedding"
    # The second copy equals the first, the first is the embedding transposed: both are
    # reported against the tensor actually kept.
    assert sorted((s.removed, s.kept, s.transposed) for s in passes.records(results)) == [
        ("head", "embedding", True),
        ("head_again", "embedding", True),
    ]


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

    results = _rewrite_keeping_outputs(model, {"x": _matrix(2, 16)})

    assert passes.counts(results)["constants_lifted"] == 2
    assert len(passes.records(results)) == 1
    assert [n.op_type for n in tm.all_nodes(model)].count("Constant") == 0
    (only,) = model.graph.initializers.values()
    np.testing.assert_array_equal(only.const_value.numpy(), weight)


def test_transpose_of_a_shared_weight_in_both_branches_is_hoisted_once():
    # onnxruntime folds a Transpose of a constant once per branch: two copies in memory.
    embedding = _matrix(96, 16)
    text = _if_model(
        "t1 = Transpose <perm = [1, 0]> (embedding)\n ty = MatMul(x, t1)",
        "t2 = Transpose <perm = [1, 0]> (embedding)\n h = MatMul(x, t2)\n ey = Add(h, h)",
        "float[2, 96]",
    )
    model = tm.ir_from_text(text, {"embedding": embedding})

    results = _rewrite_keeping_outputs(model, {"x": _matrix(2, 16)})

    main, inner = _transposes(model)
    assert (len(main), len(inner)) == (1, 0)
    assert passes.counts(results)["nodes_hoisted"] == 2
    assert passes.counts(results)["nodes_merged"] == 1


@pytest.mark.parametrize(
    ("then_body", "else_body"),
    [
        (
            "s = Add(x, x)\n ty = MatMul(s, embedding)",
            "s2 = Mul(x, x)\n ey = MatMul(s2, embedding)",
        ),
        ("r = RandomUniformLike(embedding)\n ty = MatMul(x, r)", "ey = MatMul(x, embedding)"),
    ],
    ids=["reading graph inputs", "impure"],
)
def test_nodes_that_are_not_constant_stay_in_their_branch(then_body, else_body):
    model = tm.ir_from_text(
        _if_model(then_body, else_body, "float[2, 16]"), {"embedding": _matrix(16, 16)}
    )
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
    _rewrite_keeping_outputs(model, {"unused": np.zeros(1, np.float32)})
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


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
    folder = tm.write_export(
        tmp_path / "export", head=head, out_proj_as_constant=out_proj_as_constant
    )
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
        # Format 3 keeps only the cross-attention part of the decoder without past: its copy of
        # the constant goes with the rest, and the decoder with past's is lifted.
        assert result.format_version == "3"
        assert result.constants_lifted == 1


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


def test_find_duplicates_sees_none_in_a_merged_model(tmp_path):
    source = ir.load(tm.write_export(tmp_path / "export") / tm.DECODER)
    found = find_duplicates(source.graph)
    # The decoder file alone holds the embedding and its transposed copy as the LM head.
    assert [({s.kept, s.removed}, s.transposed) for s in found] == [
        ({tm.EMBEDDING, tm.LM_HEAD}, True)
    ]
    merged = ir.load(merge_seq2seq(tmp_path / "export"))
    assert find_duplicates(merged.graph) == []
