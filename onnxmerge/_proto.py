"""ONNX's protobuf messages without importing the ``onnx`` package.

``import onnx`` loads its helpers and, through them, ml_dtypes' extension: 0.6-0.7 s on an AMD
EPYC, most of opening a model. The runtime reads a model's structure only, which the generated
messages module gives in 0.03 s. That module is registered under its own name, so a later
``import onnx`` reuses it and both see the same classes.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING

_MESSAGES = "onnx.onnx_ml_pb2"


def _messages() -> ModuleType:
    loaded = sys.modules.get(_MESSAGES)
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("onnx")  # finds the package without running it
    if package is None or not package.submodule_search_locations:
        import onnx  # noqa: F401  (raises the usual ImportError)

        return sys.modules[_MESSAGES]
    folder = package.submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(_MESSAGES, f"{folder}/onnx_ml_pb2.py")
    if spec is None or spec.loader is None:
        import onnx  # noqa: F401

        return sys.modules[_MESSAGES]
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MESSAGES] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_MESSAGES]
        raise
    return module


if TYPE_CHECKING:
    from onnx import (
        AttributeProto,
        GraphProto,
        ModelProto,
        NodeProto,
        OperatorSetIdProto,
        TensorProto,
        TypeProto,
        ValueInfoProto,
    )
else:
    _m = _messages()
    AttributeProto = _m.AttributeProto
    GraphProto = _m.GraphProto
    ModelProto = _m.ModelProto
    NodeProto = _m.NodeProto
    OperatorSetIdProto = _m.OperatorSetIdProto
    TensorProto = _m.TensorProto
    TypeProto = _m.TypeProto
    ValueInfoProto = _m.ValueInfoProto
    del _m


def graph_protos(graph: GraphProto) -> Iterator[GraphProto]:
    """``graph`` and every subgraph of its nodes' attributes, at any depth (an If's branches, a
    Loop's body)."""
    yield graph
    for node in graph.node:
        for sub in node_subgraphs(node):
            yield from graph_protos(sub)


def node_subgraphs(node: NodeProto) -> Iterator[GraphProto]:
    """The graphs in ``node``'s attributes, one level deep."""
    for attr in node.attribute:
        if attr.HasField("g"):
            yield attr.g
        yield from attr.graphs
