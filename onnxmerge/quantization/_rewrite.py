"""Rewrite a merged model so that its weights are stored quantized, each still once.

Every large float weight of the main graph is replaced by its codes (and scales, zero points) in the
main graph. Each reader is rewritten in its own graph, so both ``If`` branches read the same stored
tensors and nothing is computed on a branch that does not run:

- ``Gather`` of embedding rows gathers codes and per-row scales, then dequantizes only those rows;
- ``MatMul`` with an int8/uint8 weight quantizes its input on the fly and multiplies integers
  (``MatMulInteger``): with one scale for the whole input (``DynamicQuantizeLinear``), as
  onnxruntime's dynamic quantization does, or with one scale per row;
- any other reader gets the weight through one ``DequantizeLinear`` per graph;
- fp16 weights are widened by one ``Cast`` in the main graph, which runtimes fold at load.

All operators are standard ``ai.onnx`` ones.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxmerge.errors import QuantizationError
from onnxmerge.passes import base as passes_base
from onnxmerge.passes.base import (
    StepResult,
    free_name,
    graph_of,
    initializer,
    is_op,
    name_of,
    replace_result,
    tensor_of,
)
from onnxmerge.quantization import _codes

logger = logging.getLogger(__name__)

# Smaller weights (norms, biases, small position tables) stay in float: they cost little.
MIN_QUANTIZED_BYTES = 1024
# Blocked DequantizeLinear and the int4 type arrived with opset 21 and IR version 10.
INT4_OPSET = 21
INT4_IR_VERSION = 10
# Opsets 18..21 changed no operator's meaning, only added types; older opsets need a converter.
_SAME_MEANING_SINCE = 18

_ROWS, _COLUMNS = 0, 1
# Precisions whose MatMuls multiply integers.
INTEGER_MATMUL = frozenset({"int8", "uint8"})
# With one scale per row (contract.ACTIVATION_SCALES), a row's codes do not depend on the other
# rows of the batch as one scale for the whole tensor's do. onnxruntime's MatMulInteger takes one
# input zero point only: a row's codes are symmetric around 128.
_ROW_CODE_ZERO = 128
_ROW_CODE_PEAK = 127.0
# ReduceMax reads its axes from an input since opset 18, before from an attribute.
_REDUCE_AXES_INPUT = 18


@dataclass(frozen=True)
class QuantizedWeight:
    name: str
    precision: str
    bytes_before: int
    bytes_after: int


def _reads_rows(node: ir.Node, index: int) -> bool:
    """Whether this use reads the weight row by row: an embedding Gather or ``Gemm(transB=1)``."""
    if is_op(node, "Gather") and index == 0:
        axis = node.attributes.get("axis")
        return axis is None or axis.value == 0
    if is_op(node, "Gemm") and index == 1:
        trans_b = node.attributes.get("transB")
        return trans_b is not None and trans_b.value == 1
    return False


def rows_gathered(weight: ir.Value) -> bool:
    """Whether a reader of ``weight`` gathers its rows: an embedding (and a head tied to it)."""
    return any(_reads_rows(node, index) for node, index in weight.uses())


def _reads_columns(node: ir.Node, index: int) -> bool:
    return is_op(node, "MatMul") and index == 1


def _plain_head_gemm(node: ir.Node, index: int) -> bool:
    """``Gemm(x, W, transB=1)`` with no bias and unit factors: the tied LM head."""
    if not (_reads_rows(node, index) and node.op_type == "Gemm") or len(node.inputs) > 2:
        return False
    return all(
        node.attributes.get(name) is None or node.attributes[name].value == 1.0
        for name in ("alpha", "beta")
    ) and (node.attributes.get("transA") is None or node.attributes["transA"].value == 0)


def _channel_axis(weight: ir.Value) -> int | None:
    """One scale per output feature where every reader agrees on which axis that is."""
    uses = list(weight.uses())
    if weight.shape is None or len(weight.shape) != 2:
        return 0 if uses else None
    if all(_reads_rows(n, i) for n, i in uses):
        return _ROWS
    if all(_reads_columns(n, i) for n, i in uses):
        return _COLUMNS
    return None


def _block_axis(weight: ir.Value) -> int:
    """The axis int4 blocks run along: input features (the first axis) of a matrix that only
    ``MatMul`` nodes of its own graph read, the last axis of other matrices, input channels of
    a kernel.

    Blocks along a MatMul weight's first axis match onnxruntime's fusion into its 4-bit MatMul
    (``MatMulNBits``), which (1.32) fails to load where the weight is an outer-scope initializer
    of an ``If`` branch: every weight of a version 1 file, and the encoder's of version 3.
    """
    rank = len(weight.shape) if weight.shape is not None else 2
    if rank != 2:
        return 1
    uses = list(weight.uses())
    if uses and all(
        use.node.op_type == "MatMul" and use.idx == 1 and use.node.graph is weight.graph
        for use in uses
    ):
        return 0
    return 1


class _Rewriter:
    def __init__(self, model: ir.Model, activation_scale: str = "tensor"):
        self.model = model
        self.main = model.graph
        self.activation_scale = activation_scale
        self.names: set[str] = {
            v.name
            for node in ir.traversal.RecursiveGraphIterator(self.main)
            for v in (*node.inputs, *node.outputs)
            if v is not None and v.name
        } | set(self.main.initializers)
        self._dequantized: dict[tuple[int, str], ir.Value] = {}

    def fresh(self, base: str) -> str:
        name = free_name(base, self.names, separator="_", first=1)
        self.names.add(name)
        return name

    def initializer(
        self, base: str, array: np.ndarray, dtype: ir.DataType | None = None
    ) -> ir.Value:
        name = self.fresh(base)
        tensor = ir.Tensor(array, dtype=dtype, name=name) if dtype else ir.tensor(array, name=name)
        value = ir.Value(
            name=name,
            type=ir.TensorType(tensor.dtype),
            shape=ir.Shape(array.shape),
            const_value=tensor,
        )
        self.main.register_initializer(value)
        return value

    def constant(self, name: str, array: np.ndarray) -> ir.Value:
        """A small shared main-graph constant (axes, shapes), created once."""
        self.names.add(name)
        return initializer(self.main, name, array)

    def node(self, op: str, inputs: list, outputs: int | list[str] = 1, **attrs) -> ir.Node:
        names = outputs if isinstance(outputs, list) else [op.lower()] * outputs
        while inputs and inputs[-1] is None:
            inputs = inputs[:-1]
        values = [ir.Value(name=self.fresh(f"onnxmerge.q/{n}")) for n in names]
        return passes_base.node(op, inputs, values, name=self.fresh(f"onnxmerge.q/{op}"), **attrs)

    # -- readers -------------------------------------------------------------------------------

    def dequantized(self, graph: ir.Graph, key: str, make: Callable[[], ir.Node]) -> ir.Value:
        """The weight in float inside ``graph``: one node per graph, before all others."""
        cache_key = (id(graph), key)
        if cache_key not in self._dequantized:
            node = make()
            graph.insert_before(graph.node(0), node)
            self._dequantized[cache_key] = node.outputs[0]
        return self._dequantized[cache_key]

    def gather_rows(self, node: ir.Node, codes: ir.Value, scale: ir.Value, zero: ir.Value | None):
        indices = node.inputs[1]
        rows = self.node("Gather", [codes, indices], ["rows"], axis=0)
        values = self.node("Cast", [rows.outputs[0]], ["rows_float"], to=ir.DataType.FLOAT)
        nodes = [rows, values]
        current = values.outputs[0]
        per_row = scale.shape is not None and len(scale.shape) == 1
        last_axis = self.constant("onnxmerge.last_axis", np.array([-1], np.int64))

        def row_values(param: ir.Value, label: str) -> ir.Value:
            if not per_row:
                return param
            picked = self.node("Gather", [param, indices], [label], axis=0)
            nodes.append(picked)
            out = picked.outputs[0]
            if param.dtype != ir.DataType.FLOAT:
                cast = self.node("Cast", [out], [label + "_float"], to=ir.DataType.FLOAT)
                nodes.append(cast)
                out = cast.outputs[0]
            column = self.node("Unsqueeze", [out, last_axis], [label + "_column"])
            nodes.append(column)
            return column.outputs[0]

        if zero is not None:
            zero_value = zero
            if not per_row:
                cast = self.node("Cast", [zero], ["zero_float"], to=ir.DataType.FLOAT)
                nodes.append(cast)
                zero_value = cast.outputs[0]
            sub = self.node("Sub", [current, row_values(zero_value, "row_zero")], ["centered"])
            nodes.append(sub)
            current = sub.outputs[0]
        mul = self.node("Mul", [current, row_values(scale, "row_scale")], ["embedding"])
        nodes.append(mul)
        replace_result(node, nodes, mul.outputs[0])

    def transposed_codes(self, codes: ir.Value) -> ir.Value:
        """``codes`` transposed by one main-graph node: onnxruntime folds it once, at load."""
        key = (id(self.main), "transposed:" + (codes.name or ""))
        if key not in self._dequantized:
            node = self.node("Transpose", [codes], ["codes_transposed"], perm=[1, 0])
            self.main.insert_before(self.main.node(0), node)
            self._dequantized[key] = node.outputs[0]
        return self._dequantized[key]

    def integer_matmul(
        self, node: ir.Node, codes: ir.Value, scale: ir.Value, zero: ir.Value | None
    ):
        rows, replaced, left = node.inputs[0], node, []
        around = _flattened_around(node)
        if around is not None:
            # The product of the unflattened rows is the logits themselves: the last Mul writes
            # them, where a Reshape would copy them on every step.
            rows, replaced = around
            left = [node, *(v.producer() for v in replaced.inputs[1:] if v is not None)]
        assert rows is not None  # a MatMul's first input, or the rows its Reshape flattens
        if self.activation_scale == "row":
            quant, (x_q, x_scale, x_zero) = self.row_codes(rows)
        else:
            whole = self.node("DynamicQuantizeLinear", [rows], ["x_q", "x_scale", "x_zero"])
            quant, (x_q, x_scale, x_zero) = [whole], whole.outputs
        product = self.node("MatMulInteger", [x_q, codes, x_zero, zero], ["product"])
        as_float = self.node("Cast", [product.outputs[0]], ["product_float"], to=ir.DataType.FLOAT)
        if self.activation_scale == "row":
            # Row scales times the weight's, as a [rows, columns] product, would be one more
            # tensor the size of the result (the logits, for the head).
            by_row = self.node("Mul", [as_float.outputs[0], x_scale], ["by_row"])
            result = self.node("Mul", [by_row.outputs[0], scale], ["result"])
            scaling = [by_row, result]
        else:
            scales = self.node("Mul", [x_scale, scale], ["scales"])
            result = self.node("Mul", [as_float.outputs[0], scales.outputs[0]], ["result"])
            scaling = [scales, result]
        replace_result(replaced, [*quant, product, as_float, *scaling], result.outputs[0])
        for unread in left:
            if unread is not None:
                _remove_unread(unread)

    def row_codes(self, rows: ir.Value) -> tuple[list[ir.Node], tuple[ir.Value, ...]]:
        """uint8 codes of ``rows`` with one scale per row (the last axis): ``round(x / scale) +
        128``, ``scale = max|x| / 127``; the nodes, then codes, scales and the zero point."""
        tiny = self.constant("onnxmerge.q.tiny", np.array(np.finfo(np.float32).tiny, np.float32))
        peak = self.constant("onnxmerge.q.row_peak", np.array(_ROW_CODE_PEAK, np.float32))
        zero = self.constant("onnxmerge.q.row_zero", np.array(_ROW_CODE_ZERO, np.uint8))
        shift = self.constant("onnxmerge.q.row_shift", np.array(_ROW_CODE_ZERO, np.float32))
        low = self.constant("onnxmerge.q.code_low", np.array(0.0, np.float32))
        high = self.constant("onnxmerge.q.code_high", np.array(255.0, np.float32))
        nodes = [self.node("Abs", [rows], ["x_abs"])]
        if _default_opset(self.model) >= _REDUCE_AXES_INPUT:
            last_axis = self.constant("onnxmerge.last_axis", np.array([-1], np.int64))
            peak_of = self.node("ReduceMax", [nodes[-1].outputs[0], last_axis], ["x_peak"])
        else:
            peak_of = self.node("ReduceMax", [nodes[-1].outputs[0]], ["x_peak"], axes=[-1])
        nodes.append(peak_of)
        # An all-zero row gets a tiny scale, not 0/0: its codes are the zero point.
        nodes.append(self.node("Max", [nodes[-1].outputs[0], tiny], ["x_peak_positive"]))
        nodes.append(self.node("Div", [nodes[-1].outputs[0], peak], ["x_scale"]))
        x_scale = nodes[-1].outputs[0]
        nodes.append(self.node("Div", [rows, x_scale], ["x_scaled"]))
        nodes.append(self.node("Round", [nodes[-1].outputs[0]], ["x_rounded"]))
        nodes.append(self.node("Add", [nodes[-1].outputs[0], shift], ["x_shifted"]))
        nodes.append(self.node("Clip", [nodes[-1].outputs[0], low, high], ["x_clipped"]))
        nodes.append(self.node("Cast", [nodes[-1].outputs[0]], ["x_q"], to=ir.DataType.UINT8))
        return nodes, (nodes[-1].outputs[0], x_scale, zero)


def _flattened_around(gemm: ir.Node) -> tuple[ir.Value, ir.Node] | None:
    """``Reshape(x, [-1, K]) -> gemm -> Reshape(to x's leading dims and the width)``, the form
    ``passes.tied_head`` gives the head: ``x`` and the last Reshape."""
    flatten = gemm.inputs[0].producer() if gemm.inputs[0] is not None else None
    if not is_op(flatten, "Reshape") or flatten.inputs[1] is None:
        return None
    target = flatten.inputs[1].const_value
    rows = flatten.inputs[0]
    if rows is None or target is None or target.numpy().tolist()[:1] != [-1]:
        return None
    uses = list(gemm.outputs[0].uses())
    if len(uses) != 1 or uses[0].idx != 0 or not is_op(uses[0].node, "Reshape"):
        return None
    unflatten = uses[0].node
    shape = unflatten.inputs[1]
    concat = shape.producer() if shape is not None else None
    if not is_op(concat, "Concat") or len(concat.inputs) != 2 or concat.inputs[0] is None:
        return None
    leading = concat.inputs[0].producer()
    if not is_op(leading, "Slice") or leading.inputs[0] is None:
        return None
    source = leading.inputs[0].producer()
    bounds = [
        v.const_value.numpy().tolist() if v is not None and v.const_value is not None else None
        for v in leading.inputs[1:]
    ]
    if not is_op(source, "Shape") or source.inputs[0] is not rows or bounds != [[0], [-1]]:
        return None
    return rows, unflatten


def _remove_unread(node: ir.Node) -> None:
    """Remove ``node`` and then each producer of its inputs that nothing reads any more."""
    graph = graph_of(node)
    if any(v.uses() or v in graph.outputs for v in node.outputs):
        return
    inputs = [v for v in node.inputs if v is not None and v.producer() is not None]
    graph.remove(node, safe=True)
    for value in inputs:
        producer = value.producer()
        if producer is not None and producer.graph is graph:
            _remove_unread(producer)


def _default_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


class RaiseOpsetForInt4(ir.passes.InPlacePass):
    """Blocked int4 weights need opset 21: raise the model's default opset to it. Its
    precondition: no operator of the model changes meaning on the way (opset 18 or later)."""

    def requires(self, model: ir.Model) -> None:
        current = _default_opset(model)
        if current < _SAME_MEANING_SINCE:
            raise ir.passes.PreconditionError(
                f"int4 weights need ONNX opset {INT4_OPSET}; the model uses opset {current}, "
                f"whose operators changed meaning before opset {_SAME_MEANING_SINCE}. Export "
                f"with --opset {_SAME_MEANING_SINCE} or later, or choose int8"
            )

    def call(self, model: ir.Model) -> StepResult:
        if _default_opset(model) >= INT4_OPSET:
            return StepResult.counted(model, "opset_raised", 0)
        model.opset_imports[""] = INT4_OPSET
        model.opset_imports.pop("ai.onnx", None)
        model.ir_version = max(model.ir_version or 0, INT4_IR_VERSION)
        return StepResult.counted(model, "opset_raised", 1)


def raise_opset_for_int4(model: ir.Model) -> None:
    """:class:`RaiseOpsetForInt4` on ``model``; its refused precondition as the error
    quantization raises."""
    try:
        RaiseOpsetForInt4()(model)
    except ir.passes.PreconditionError as e:
        raise QuantizationError(str(e)) from e


def quantizable(value: ir.Value) -> bool:
    tensor = value.const_value
    return (
        tensor is not None
        and tensor.dtype == ir.DataType.FLOAT
        and len(tensor.shape) >= 2
        and tensor.nbytes >= MIN_QUANTIZED_BYTES
        and not value.is_graph_input()
        and not value.is_graph_output()
        and bool(value.uses())
    )


class QuantizeWeights(ir.passes.InPlacePass):
    """:func:`quantize_weights` as a pass; its records are the weights it quantized."""

    def __init__(self, precision_of: Callable[[ir.Value], str], activation_scale: str = "tensor"):
        super().__init__()
        self.precision_of = precision_of
        self.activation_scale = activation_scale

    def call(self, model: ir.Model) -> StepResult:
        done = tuple(quantize_weights(model, self.precision_of, self.activation_scale))
        return StepResult(model, bool(done), "weights_quantized", len(done), done)


def quantize_weights(
    model: ir.Model, precision_of: Callable[[ir.Value], str], activation_scale: str = "tensor"
) -> list[QuantizedWeight]:
    """Store each large float weight of the main graph in ``precision_of(weight)``; return them.

    ``precision_of`` returns one of :data:`contract.PRECISIONS`; ``"fp32"`` leaves the weight
    as it is. ``activation_scale`` (:data:`contract.ACTIVATION_SCALES`) is how integer products
    scale their input. The caller raises the opset first when any weight becomes int4.
    """
    rewriter = _Rewriter(model, activation_scale)
    done: list[QuantizedWeight] = []
    for weight in [v for v in model.graph.initializers.values() if quantizable(v)]:
        precision = precision_of(weight)
        if precision == "fp32":
            continue
        tensor = tensor_of(weight)
        name = name_of(weight)
        array = tensor.numpy()
        before = tensor.nbytes
        if precision == "fp16":
            stored = rewriter.initializer(name + "_fp16", array.astype(np.float16))
            # One Cast in the main graph, which onnxruntime folds once at load; a Cast in each
            # branch would be folded once per branch, a float copy each (1.77x fp32's memory).
            floats = rewriter.dequantized(
                model.graph,
                name,
                functools.partial(
                    rewriter.node, "Cast", [stored], ["weight"], to=ir.DataType.FLOAT
                ),
            )
            for node, index in list(weight.uses()):
                node.replace_input_with(index, floats)
            after = tensor_of(stored).nbytes
        else:
            after = _rewrite_integer(rewriter, weight, array, precision)
        del array
        if isinstance(tensor, ir.ExternalTensor):
            with contextlib.suppress(BufferError):  # unmapped later if a view is still alive
                tensor.release()
        model.graph.initializers.pop(name)
        done.append(QuantizedWeight(name, precision, before, after))
    logger.debug("quantized %d weights", len(done))
    return done


def _rewrite_integer(
    rewriter: _Rewriter, weight: ir.Value, array: np.ndarray, precision: str
) -> int:
    """Store ``weight`` as integer codes, rewrite its readers; return the bytes now stored."""
    if precision == "int4" and array.ndim != 2:
        precision = "int8"  # convolution kernels: blocks along their short axes cost more scales
    axis = _block_axis(weight) if precision == "int4" else _channel_axis(weight)
    q = _codes.quantize(array, precision, axis)
    codes_type = {"int8": ir.DataType.INT8, "uint8": ir.DataType.UINT8, "int4": ir.DataType.INT4}
    codes = rewriter.initializer(f"{weight.name}_{precision}", q.codes, codes_type[precision])
    scale = rewriter.initializer(f"{weight.name}_scale", q.scale.astype(np.float32))
    zero = (
        rewriter.initializer(f"{weight.name}_zero_point", q.zero_point)
        if q.zero_point is not None
        else None
    )
    attrs: dict[str, int] = {}
    if q.axis is not None and len(q.scale.shape) > 0:
        attrs["axis"] = q.axis
    if q.block_size is not None:
        attrs["block_size"] = q.block_size
    inputs = [codes, scale] + ([zero] if zero is not None else [])
    for node, index in list(weight.uses()):
        if precision != "int4" and _reads_rows(node, index) and node.op_type == "Gather":
            rewriter.gather_rows(node, codes, scale, zero)
        elif precision in INTEGER_MATMUL and _reads_columns(node, index) and q.axis != _ROWS:
            rewriter.integer_matmul(node, codes, scale, zero)
        elif precision in INTEGER_MATMUL and _plain_head_gemm(node, index):
            # The tied head multiplies integers too, with the embedding's codes transposed: an
            # int8 copy at run time (a quarter of a float one), instead of dequantizing the whole
            # embedding at every step.
            rewriter.integer_matmul(node, rewriter.transposed_codes(codes), scale, zero)
        else:
            floats = rewriter.dequantized(
                graph_of(node),
                name_of(weight),
                lambda: rewriter.node("DequantizeLinear", inputs, ["weight"], **attrs),
            )
            node.replace_input_with(index, floats)
    return sum(tensor_of(v).nbytes for v in inputs)
