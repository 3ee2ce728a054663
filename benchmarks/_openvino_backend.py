"""An OpenVINO model behind the part of onnxruntime's session interface that MergedSession uses.

OpenVINO compiles the merged file for the CPU once; every step is one inference request. It
computes in float32 (``INFERENCE_PRECISION_HINT``): left to itself it picks bfloat16 on
processors that have it, which changes tokens.

Only the benchmarks run it (``bench_ctranslate2``'s ``openvino`` rows): measured slower and
heavier than onnxruntime, it is not part of the package (docs/runtime.md, "Accelerations").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

# ONNX element types as onnxruntime's type strings, which MergedSession reads.
_ORT_TYPES = {
    onnx.TensorProto.INT64: "tensor(int64)",
    onnx.TensorProto.INT32: "tensor(int32)",
    onnx.TensorProto.FLOAT: "tensor(float)",
    onnx.TensorProto.FLOAT16: "tensor(float16)",
    onnx.TensorProto.DOUBLE: "tensor(double)",
    onnx.TensorProto.BOOL: "tensor(bool)",
}


@dataclass(frozen=True)
class _Arg:
    """What onnxruntime's ``NodeArg`` tells: name, type string, dims (int, name or None)."""

    name: str
    type: str
    shape: list


@dataclass(frozen=True)
class _Meta:
    custom_metadata_map: dict[str, str]


def _args(values) -> list[_Arg]:
    args = []
    for value in values:
        tensor = value.type.tensor_type
        dims = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim
        ]
        args.append(_Arg(value.name, _ORT_TYPES.get(tensor.elem_type, "tensor(float)"), dims))
    return args


class OpenVinoSession:
    """``run``, ``get_inputs``, ``get_outputs`` and ``get_modelmeta`` over an OpenVINO model."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None):
        import openvino as ov

        path = Path(path)
        proto = onnx.load(os.fspath(path), load_external_data=False)
        self._inputs = _args(proto.graph.input)
        self._outputs = _args(proto.graph.output)
        self._meta = _Meta({p.key: p.value for p in proto.metadata_props})
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
        if threads:
            config["INFERENCE_NUM_THREADS"] = int(threads)
        self.compiled = ov.Core().compile_model(os.fspath(path), "CPU", config)
        self._request = self.compiled.create_infer_request()
        # A port may carry several tensor names; the graph output's is the one asked for.
        names = [o.name for o in self._outputs]
        self._port = {
            next(n for n in names if n in port.get_names()): i
            for i, port in enumerate(self.compiled.outputs)
        }

    def get_inputs(self) -> list[_Arg]:
        return self._inputs

    def get_outputs(self) -> list[_Arg]:
        return self._outputs

    def get_modelmeta(self) -> _Meta:
        return self._meta

    def run(self, output_names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        # Outputs are copied: the request reuses its buffers on the next step, and the cache
        # keeps this step's tensors.
        results = self._request.infer(feeds, share_inputs=True, share_outputs=False)
        values = list(results.values())
        names = output_names or [o.name for o in self._outputs]
        return [values[self._port[n]] for n in names]


def openvino_model(path: str | os.PathLike, threads: int | None = None) -> Any:
    """A ``Seq2SeqModel`` over ``path`` whose steps OpenVINO runs, under the same search."""
    from onnxmerge.runtime import Seq2SeqModel
    from onnxmerge.runtime._session import MergedSession

    return Seq2SeqModel._on(MergedSession.over(path, OpenVinoSession(path, threads)))
