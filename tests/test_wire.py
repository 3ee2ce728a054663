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


@pytest.mark.parametrize("data", [b"", b"\x08", b"\x3a\xff\xff\xff\xff\x0f", b"\x0b\x00"])
def test_malformed_bytes_raise(tmp_path, data):
    path = tmp_path / "bad.onnx"
    path.write_bytes(data)
    with pytest.raises(OnnxMergeError):  # one hierarchy: callers catch OnnxMergeError
        _wire.load_skeleton(path)
