"""Properties of storing every tensor once, over random graphs and random export folders.

The graphs hold shared tensors, exact and transposed copies (square matrices and symmetric ones
included), tensors whose bytes equal another's under a different dtype (which must not merge),
small 1-D int64 tensors, tensors just under, at and just over the 1 KiB threshold, as main-graph
initializers or as ``Constant`` nodes, read from the main graph, from an ``If`` and from an ``If``
inside it (outer-scope references). After the merge's rewrite passes
(:func:`onnxmerge.merge.rewrite_steps`: storing once, then the tied head):

(a) every output of every branch is the same as before (onnxruntime, optimisations off);
(b) no two initializers of 1 KiB or more hold the same data or transposed data;
(c) the model passes ``onnx.checker.check_model(full_check=True)``.

Over whole fake export folders: the merge gives both branches of the source files, keeps no
duplicate and writes the same bytes every time.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.checker
import onnx.helper
import onnx.numpy_helper
import onnx_ir as ir
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from onnxmerge import merge, merge_seq2seq, model_io, passes
from onnxmerge.passes import dedup
from tests import textmodels as tm
from tests.checks import find_duplicates

OPSET = 17
TOLERANCE = 1e-6
# Derandomised so every run checks the same cases; no shrinking, so a failure stays quick to
# report (each case runs onnxruntime several times).
_BOUNDED = {
    "deadline": None,
    "derandomize": True,
    "phases": (Phase.explicit, Phase.generate),
    "suppress_health_check": [HealthCheck.too_slow],
}
SETTINGS = settings(max_examples=40, **_BOUNDED)
EXPORT_SETTINGS = settings(max_examples=8, **_BOUNDED)

# Shapes around the 1 KiB threshold: the bytes are in the comments.
MATRIX_SHAPES = {
    # 1024, 1020, 1088, 1024, 960, 64 bytes
    np.float32: [(16, 16), (15, 17), (16, 17), (8, 32), (6, 40), (4, 4)],
    np.float16: [(16, 32), (16, 31), (24, 24)],  # 1024 992 1152
    np.float64: [(8, 16), (11, 11), (12, 12)],  # 1024 968 1152
}
VECTOR_LENGTHS = [4, 127, 128, 129, 255, 256, 257]  # int64: 32 1016 1024 1032 ...; float32: ...
# The integer type with the same width: its bytes are the float's, its values are not.
SAME_WIDTH_INT = {np.float32: np.int32, np.float16: np.int16, np.float64: np.int64}
ONNX_TYPE = {
    np.dtype(t): onnx.helper.np_dtype_to_tensor_dtype(np.dtype(t))
    for t in (np.float32, np.float16, np.float64, np.int32, np.int16, np.int64)
}

# Scopes of the generated graph: the main graph, the branches of an outer If and, inside its
# then-branch, the branches of an inner If. A scope's values are visible in the scopes nested in it.
SCOPES = ("main", "outer_then", "outer_else", "inner_then", "inner_else")
VISIBLE_FROM = {
    "main": ("main",),
    "outer_then": ("main", "outer_then"),
    "outer_else": ("main", "outer_else"),
    "inner_then": ("main", "outer_then", "inner_then"),
    "inner_else": ("main", "outer_then", "inner_else"),
}


# ---------------------------------------------------------------- the random graphs


@dataclass
class TensorSpec:
    name: str
    array: np.ndarray
    home: str  # "main" for an initializer, else the scope of its Constant node
    uses: list[tuple[str, str]] = field(default_factory=list)  # (kind, scope)


@dataclass
class GraphSpec:
    tensors: list[TensorSpec]
    same_node_names: bool  # every tied-head MatMul has the same node name, as in copied branches


USE_KINDS_2D_FLOAT = ("matmul", "tied", "gather")
# onnxruntime's float16 Gemm rounds differently from its float16 MatMul (see
# test_tied_head_on_float16_is_exact), so the random graphs read float16 heads through MatMul only.
USE_KINDS_FLOAT16 = ("matmul", "gather")


@st.composite
def graph_specs(draw) -> GraphSpec:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tensors: list[TensorSpec] = []
    counter = itertools.count()

    def add(array: np.ndarray, is_matrix_float: bool) -> None:
        index = next(counter)
        home = draw(st.sampled_from(["main", "main", "main", *SCOPES]))
        visible = [s for s in SCOPES if home in VISIBLE_FROM[s]]
        kinds = ("gather",)
        if is_matrix_float:
            kinds = USE_KINDS_FLOAT16 if array.dtype == np.float16 else USE_KINDS_2D_FLOAT
        uses = draw(
            st.lists(
                st.tuples(st.sampled_from(kinds), st.sampled_from(visible)), min_size=1, max_size=3
            )
        )
        tensors.append(TensorSpec(f"t{index}.{array.dtype.name}", array, home, uses))

    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["matrix", "matrix", "vector_int64", "vector_float"]))
        if kind == "matrix":
            dtype = draw(st.sampled_from(list(MATRIX_SHAPES)))
            shape = draw(st.sampled_from(MATRIX_SHAPES[dtype]))
            base = (rng.standard_normal(shape) * 0.3).astype(dtype)
            if shape[0] == shape[1] and draw(st.booleans()):
                base = ((base + base.T) / 2).astype(dtype)  # symmetric: its transpose is itself
            add(base, True)
            copies = draw(
                st.lists(st.sampled_from(["exact", "transposed", "same_bytes_int"]), max_size=3)
            )
            for copy in copies:
                if copy == "exact":
                    add(base.copy(), True)
                elif copy == "transposed":
                    add(np.ascontiguousarray(base.T), True)
                else:
                    add(base.view(SAME_WIDTH_INT[dtype]).copy(), False)
        else:
            length = draw(st.sampled_from(VECTOR_LENGTHS))
            if kind == "vector_int64":
                base = rng.integers(-1000, 1000, size=length, dtype=np.int64)
            else:
                base = rng.standard_normal(length).astype(np.float32)
            add(base, False)
            for copy in draw(st.lists(st.sampled_from(["exact", "same_bytes_int"]), max_size=2)):
                if copy == "exact":
                    add(base.copy(), False)
                elif base.dtype == np.float32:
                    add(base.view(np.int32).copy(), False)
    # The inner If is always there (each branch outputs at least a marker), used or not.
    return GraphSpec(tensors, draw(st.booleans()))


class _Builder:
    """Collects the nodes and outputs of each scope while the uses are added."""

    def __init__(self, spec: GraphSpec):
        self.spec = spec
        self.nodes: dict[str, list[onnx.NodeProto]] = {s: [] for s in SCOPES}
        self.pieces: dict[str, list[str]] = {s: [] for s in SCOPES}
        self.inputs: dict[str, onnx.ValueInfoProto] = {}
        self.feeds: dict[str, np.ndarray] = {}
        self.initializers: list[onnx.TensorProto] = [
            onnx.numpy_helper.from_array(np.array([-1], np.int64), "flat")
        ]
        self.names = itertools.count()
        self.named_heads: set[str] = set()

    def fresh(self, stem: str) -> str:
        return f"{stem}.{next(self.names)}"

    def node(self, scope: str, op: str, inputs: list[str], name: str | None = None, **attrs) -> str:
        out = self.fresh(op.lower())
        self.nodes[scope].append(
            onnx.helper.make_node(
                op, inputs, [out], name=name or self.fresh(f"/{scope}/{op}"), **attrs
            )
        )
        return out

    def x(self, length: int, dtype: np.dtype, rng: np.random.Generator) -> str:
        name = f"x_{length}_{dtype.name}"
        if name not in self.inputs:
            self.inputs[name] = onnx.helper.make_tensor_value_info(
                name, ONNX_TYPE[dtype], [2, length]
            )
            self.feeds[name] = rng.standard_normal((2, length)).astype(dtype)
        return name

    def indices(self, upper: int) -> str:
        name = f"rows_below_{upper}"
        if name not in self.inputs:
            self.inputs[name] = onnx.helper.make_tensor_value_info(
                name, onnx.TensorProto.INT64, [3]
            )
            self.feeds[name] = np.array([0, upper - 1, upper // 2], np.int64)
        return name

    def use(
        self, tensor: TensorSpec, source: str, kind: str, scope: str, rng: np.random.Generator
    ) -> None:
        array = tensor.array
        if kind == "matmul":
            out = self.node(scope, "MatMul", [self.x(array.shape[0], array.dtype, rng), source])
        elif kind == "tied":  # x @ W^T, as a tied LM head reads the embedding
            transposed = self.node(scope, "Transpose", [source], perm=[1, 0])
            name = None
            if self.spec.same_node_names and scope not in self.named_heads:
                # One per graph (onnxruntime refuses two equal node names in one graph), the
                # same name in nested graphs.
                self.named_heads.add(scope)
                name = "/lm_head/MatMul"
            out = self.node(
                scope, "MatMul", [self.x(array.shape[1], array.dtype, rng), transposed], name=name
            )
        else:
            out = self.node(scope, "Gather", [source, self.indices(array.shape[0])], axis=0)
        as_float = self.node(scope, "Cast", [out], to=onnx.TensorProto.FLOAT)
        self.pieces[scope].append(self.node(scope, "Reshape", [as_float, "flat"]))

    def concat(self, scope: str, marker: float) -> str:
        """One float vector of everything the scope computed, with a marker of the scope."""
        const = self.fresh(f"marker_{scope}")
        self.nodes[scope].append(
            onnx.helper.make_node(
                "Constant",
                [],
                [const],
                name=self.fresh("/marker"),
                value=onnx.numpy_helper.from_array(np.array([marker], np.float32)),
            )
        )
        return self.node(scope, "Concat", [*self.pieces[scope], const], axis=0)


def build(spec: GraphSpec, seed: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    b = _Builder(spec)
    for tensor in spec.tensors:
        if tensor.home == "main":
            b.initializers.append(onnx.numpy_helper.from_array(tensor.array, tensor.name))
        else:
            b.nodes[tensor.home].append(
                onnx.helper.make_node(
                    "Constant",
                    [],
                    [tensor.name],
                    name=f"/const/{tensor.name}",
                    value=onnx.numpy_helper.from_array(tensor.array),
                )
            )
        for kind, scope in tensor.uses:
            b.use(tensor, tensor.name, kind, scope, rng)

    def vector(name: str) -> onnx.ValueInfoProto:
        return onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["n"])

    def branch(scope: str, marker: float, extra: list[str] = ()) -> onnx.GraphProto:
        b.pieces[scope].extend(extra)
        out = b.concat(scope, marker)
        return onnx.helper.make_graph(b.nodes[scope], scope, [], [vector(out)])

    inner_out = b.fresh("inner")
    b.nodes["outer_then"].append(
        onnx.helper.make_node(
            "If",
            ["c_inner"],
            [inner_out],
            name="/inner_if",
            then_branch=branch("inner_then", 3.0),
            else_branch=branch("inner_else", 4.0),
        )
    )
    outer_then = branch("outer_then", 1.0, [inner_out])
    outer_else = branch("outer_else", 2.0)
    b.nodes["main"].append(
        onnx.helper.make_node(
            "If",
            ["c_outer"],
            ["y_if"],
            name="/outer_if",
            then_branch=outer_then,
            else_branch=outer_else,
        )
    )
    y_main = b.concat("main", 0.0)
    b.nodes["main"].append(onnx.helper.make_node("Identity", [y_main], ["y_main"], name="/y_main"))
    conditions = [
        onnx.helper.make_tensor_value_info(c, onnx.TensorProto.BOOL, [1])
        for c in ("c_outer", "c_inner")
    ]
    graph = onnx.helper.make_graph(
        b.nodes["main"],
        "random",
        [*conditions, *b.inputs.values()],
        [vector("y_main"), vector("y_if")],
        initializer=b.initializers,
    )
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)], ir_version=8
    )
    return model, b.feeds


def _run_all_branches(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = tm.session(proto.SerializeToString())
    results = []
    for outer, inner in itertools.product((True, False), repeat=2):
        run_feeds = {**feeds, "c_outer": np.array([outer]), "c_inner": np.array([inner])}
        results.extend(session.run(None, run_feeds))
    return results


def _after_passes(source: onnx.ModelProto) -> tuple[ir.Model, tuple[dedup.SharedTensor, ...]]:
    """The merge's rewrite passes on ``source``; the tensors they stored once."""
    model = ir.serde.deserialize_model(source)
    return model, passes.records(passes.run(model, merge.rewrite_steps()))


def _assert_same_outputs(expected: list[np.ndarray], actual: list[np.ndarray]) -> None:
    for before, after in zip(expected, actual, strict=True):
        assert before.shape == after.shape
        np.testing.assert_allclose(after, before, rtol=0, atol=TOLERANCE)


@SETTINGS
@given(spec=graph_specs(), seed=st.integers(0, 1000))
def test_store_once_keeps_outputs_removes_duplicates_and_passes_the_checker(spec, seed):
    source, feeds = build(spec, seed)
    onnx.checker.check_model(source, full_check=True)  # the generator itself is sound
    expected = _run_all_branches(source, feeds)

    model, shared_tensors = _after_passes(source)
    result = ir.serde.serialize_model(model)

    # (c) the checker, with full shape inference, on the serialised bytes
    onnx.checker.check_model(onnx.load_from_string(result.SerializeToString()), full_check=True)
    # (b) nothing of 1 KiB or more is stored twice, plainly or transposed
    assert find_duplicates(model.graph) == []
    # tensors whose bytes match under another dtype are different tensors
    dtypes = {t.name: t.array.dtype for t in spec.tensors}
    for shared in shared_tensors:
        assert dtypes[shared.kept] == dtypes[shared.removed], shared
    # (a) every output of every branch, before and after
    _assert_same_outputs(expected, _run_all_branches(result, feeds))


@SETTINGS
@given(spec=graph_specs(), seed=st.integers(0, 1000))
def test_store_once_stores_no_more_bytes_than_before(spec, seed):
    source, _ = build(spec, seed)
    before = model_io.tensor_bytes(ir.serde.deserialize_model(source))
    model, _ = _after_passes(source)
    after = model_io.tensor_bytes(model)
    # Each large tensor is stored once: the bytes left are those of distinct content only.
    distinct = {}
    for tensor in spec.tensors:
        if tensor.array.nbytes < dedup.MIN_SHARED_BYTES:
            continue
        array = tensor.array
        keys = [(array.dtype.str, array.shape, array.tobytes())]
        if array.ndim == 2:
            keys.append((array.dtype.str, array.T.shape, np.ascontiguousarray(array.T).tobytes()))
        if not any(k in distinct for k in keys):
            distinct[keys[0]] = array.nbytes
    large_after = sum(
        v.const_value.nbytes
        for v in model.graph.initializers.values()
        if v.const_value is not None and v.const_value.nbytes >= dedup.MIN_SHARED_BYTES
    )
    assert large_after == sum(distinct.values())
    # Beyond that only the Gemm rewrite's small shape tensors are added (two int64 vectors per
    # head width).
    assert after <= before + 64 * len(spec.tensors)


@pytest.mark.parametrize("scope", ["main", "outer_then", "inner_else"])
def test_tied_head_on_float16_is_exact(scope):
    head = (np.random.default_rng(0).standard_normal((16, 32)) * 0.3).astype(np.float16)
    spec = GraphSpec([TensorSpec("head", head, "main", [("tied", scope)])], False)
    source, feeds = build(spec, 0)
    expected = _run_all_branches(source, feeds)
    model, _ = _after_passes(source)
    _assert_same_outputs(expected, _run_all_branches(ir.serde.serialize_model(model), feeds))


# ---------------------------------------------------------------- whole export folders


@st.composite
def export_options(draw) -> dict:
    return {
        "layout": draw(st.sampled_from(tm.LAYOUTS)),
        "head": draw(st.sampled_from(["copy", "tied"])),
        "seed": draw(st.integers(0, 2**16)),
        "out_proj_as_constant": draw(st.booleans()),
        "external_data": draw(st.booleans()),
    }


def _loaded_ir(path: Path) -> ir.Model:
    return ir.load(os.fspath(path))


@EXPORT_SETTINGS
@given(options=export_options(), input_seed=st.integers(0, 1000))
def test_merged_folder_matches_its_sources_and_stores_everything_once(options, input_seed):
    with tempfile.TemporaryDirectory(prefix="onnxmerge-prop-") as tmp:
        tmp = Path(tmp)
        layout = options["layout"]
        folder = tm.write_export(tmp / "export", **options)
        # The reference: the separate files of the same checkpoint (merged_only has none).
        reference = folder
        if layout == "merged_only":
            reference = tm.write_export(tmp / "reference", **{**options, "layout": "with_past"})
        merged = merge_seq2seq(folder, tmp / "out" / "model.onnx")
        inputs = tm.sample_inputs(input_seed)
        first, cached = tm.run_sources(reference, inputs)
        assert tm.max_abs_diff(first, tm.run_merged(merged, inputs, use_cache=False)) <= TOLERANCE
        if layout != "no_past":
            assert cached is not None
            cached_merged = tm.run_merged(merged, inputs, use_cache=True)
            assert tm.max_abs_diff(cached, cached_merged) <= TOLERANCE
        assert find_duplicates(_loaded_ir(merged).graph) == []
        onnx.checker.check_model(os.fspath(merged), full_check=True)


@EXPORT_SETTINGS
@given(options=export_options())
def test_merging_twice_writes_the_same_bytes(options):
    with tempfile.TemporaryDirectory(prefix="onnxmerge-prop-") as tmp:
        tmp = Path(tmp)
        folder = tm.write_export(tmp / "export", **options)
        external = options["external_data"]
        a = merge_seq2seq(folder, tmp / "a" / "model.onnx", external_data=external)
        b = merge_seq2seq(folder, tmp / "b" / "model.onnx", external_data=external)
        files_a = sorted(p.name for p in a.parent.iterdir())
        assert files_a == sorted(p.name for p in b.parent.iterdir())
        for name in files_a:
            assert (a.parent / name).read_bytes() == (b.parent / name).read_bytes(), name
        # Over the same output: the same bytes again. With external data the new data file is
        # published under a fresh name first (the old model reads the old one until replaced).
        before = tm.folder_digest(a.parent)
        merge_seq2seq(folder, a, external_data=external, overwrite=True)
        after = tm.folder_digest(a.parent)
        if not external:
            assert after == before
        else:
            data_after = [digest for name, digest in after.items() if name != "model.onnx"]
            assert data_after == [before["model.onnx_data"]]


@pytest.mark.parametrize("opset", [13, 14])
@pytest.mark.parametrize("head", ["copy", "tied"])
def test_merge_of_an_export_below_opset_15_with_a_tied_head(tmp_path, opset, head):
    files = (tm.ENCODER, tm.DECODER, tm.DECODER_WITH_PAST)
    folder = tm.write_export(tmp_path / "export", head=head, opsets={name: opset for name in files})
    merged = merge_seq2seq(folder)
    inputs = tm.sample_inputs()
    first, cached = tm.run_sources(folder, inputs)
    assert tm.max_abs_diff(first, tm.run_merged(merged, inputs, use_cache=False)) <= TOLERANCE
    assert tm.max_abs_diff(cached, tm.run_merged(merged, inputs, use_cache=True)) <= TOLERANCE
