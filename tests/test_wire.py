"""Wire-level reading and writing: the same tensors as onnx.load, without parsing the weights."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxmerge import _wire
from onnxmerge.errors import OnnxMergeError


def _model(tmp_path, arrays: dict[str, np.ndarray]):
    inits = [numpy_helper.from_array(a, name) for name, a in arrays.items()]
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name in arrays]
    outputs = [
        helper.make_tensor_value_info(f"{n}_out", onnx.TensorProto.UNDEFINED, None) for n in arrays
    ]
    graph = helper.make_graph(nodes, "g", [], outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "m.onnx"
    onnx.save(model, os.fspath(path))
    return path


ARRAYS = {
    "big": np.arange(4096, dtype=np.float32).reshape(64, 64),
    "small": np.array([1, 2, 3], np.int64),
    "half": np.ones((1000,), np.float16),
}


def test_skeleton_points_large_tensors_into_the_file(tmp_path):
    path = _model(tmp_path, ARRAYS)
    skeleton = _wire.load_skeleton(path)
    by_name = {t.name: t for t in skeleton.graph.initializer}
    assert by_name["big"].data_location == onnx.TensorProto.EXTERNAL
    assert by_name["small"].data_location != onnx.TensorProto.EXTERNAL
    assert skeleton.ByteSize() < 1024
    onnx.external_data_helper.load_external_data_for_model(skeleton, os.fspath(tmp_path))
    for tensor in skeleton.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), ARRAYS[tensor.name])


def test_inline_restores_a_single_file(tmp_path):
    path = _model(tmp_path, ARRAYS)
    model = onnx.load(os.fspath(path))
    onnx.save(
        model,
        os.fspath(tmp_path / "ext.onnx"),
        save_as_external_data=True,
        location="ext.onnx_data",
        size_threshold=0,
    )
    _wire.inline_external_data(
        tmp_path / "ext.onnx", tmp_path / "ext.onnx_data", tmp_path / "one.onnx"
    )
    restored = onnx.load(os.fspath(tmp_path / "one.onnx"), load_external_data=False)
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in restored.graph.initializer)
    for tensor in restored.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), ARRAYS[tensor.name])


def test_graph_structure_reads_nodes_at_every_depth_and_where_weights_lie(tmp_path):
    branch = helper.make_graph(
        [helper.make_node("Add", ["big", "inner"], ["y"], domain="")],
        "then",
        [],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.ones(512, np.float32), "inner")],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["big", "small"], ["rows"]),
            helper.make_node(
                "If", ["cond"], ["y"], then_branch=branch, else_branch=branch, domain=""
            ),
            helper.make_node("FusedMatMul", ["rows", "half"], ["z"], domain="com.microsoft"),
        ],
        "g",
        [helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(a, n) for n, a in ARRAYS.items()],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), os.fspath(path))
    structure = _wire.graph_structure(path)
    assert [(n.op_type, n.domain, n.input, n.output) for n in structure.node] == [
        ("Gather", "", ("big", "small"), ("rows",)),
        ("If", "", ("cond",), ("y",)),
        ("FusedMatMul", "com.microsoft", ("rows", "half"), ("z",)),
    ]
    # Each name is one string object however many nodes read it.
    names = [name for g in structure.graphs() for n in g.node for name in n.input + n.output]
    assert len({id(name) for name in names}) == len(set(names)) < len(names)
    inner = [n.op_type for g in structure.graphs() for n in g.node]
    assert inner == ["Gather", "If", "FusedMatMul", "Add", "Add"]
    # As the skeleton: main-graph raw data of 1 KiB or more points into the file; the
    # branches' initializers stay inline.
    skeleton = _wire.load_skeleton(path).graph
    assert {t.name: t.external_data for t in structure.initializer} == {
        t.name: {e.key: e.value for e in t.external_data} for t in skeleton.initializer
    }
    assert structure.initializer[0].external_data["location"] == "m.onnx"
    assert structure.node[1].subgraphs[0].initializer[0].external_data == {}


@pytest.mark.parametrize("data", [b"", b"\x08", b"\x3a\xff\xff\xff\xff\x0f", b"\x0b\x00"])
@pytest.mark.parametrize("reader", ["load_skeleton", "skeleton_bytes", "graph_structure"])
def test_malformed_bytes_raise(tmp_path, data, reader):
    path = tmp_path / "bad.onnx"
    path.write_bytes(data)
    with pytest.raises(OnnxMergeError):  # one hierarchy: callers catch OnnxMergeError
        getattr(_wire, reader)(path)


def test_fields_written_by_hand_are_what_protobuf_writes():
    """The runtime's one-node LogSoftmax model is written field by field (no protobuf in the
    runtime): byte for byte the message onnx builds, and a valid model."""
    from onnxmerge.runtime.processors import _log_softmax_model

    shape = ["rows", "vocab"]
    graph = helper.make_graph(
        [helper.make_node("LogSoftmax", ["scores"], ["log_probs"], axis=-1)],
        "log_softmax",
        [helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("log_probs", onnx.TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 13)])
    model.ClearField("producer_name")
    model.ClearField("producer_version")
    assert _log_softmax_model() == model.SerializeToString()
    onnx.checker.check_model(onnx.load_from_string(_log_softmax_model()), full_check=True)
    assert _wire.field(3, -1) == b"\x18" + b"\xff" * 9 + b"\x01"
