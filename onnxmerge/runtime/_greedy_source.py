"""A second LM head for greedy search, stored as int8 rows, for onnxruntime's session cache.

Greedy search needs the largest logit of each row, not every logit. At batch 1 the cached step's
head reads its whole float32 weight each token (122 MB on the opus-mt-fr-en shape), about a third
of the step. :func:`add_greedy_head` gives the cached branch a second head, chosen by the
boolean input ``FLAG``: the embedding's rows quantized to int8 (a quarter of the bytes) through
the integer matrix product, with the head's input as the extra output ``HIDDEN``. The tables
:func:`row_tables` returns bound how far each int8 logit can be from the float one, so the
runtime computes float logits only for the tokens that can still be the largest
(``onnxmerge/runtime/_greedy_head.py``).

The graph this makes is for onnxruntime on one machine: session-cache entries hold it, merged
files never do.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from onnxmerge import contract as c
from onnxmerge.model_io import load_model
from onnxmerge.passes import NoMatch, initializer, is_op, name_of, tensor_of
from onnxmerge.quantization import INT8_PEAK
from onnxmerge.runtime._greedy_head import FLAG, HIDDEN, write_tables

logger = logging.getLogger(__name__)

CODES = "onnxmerge.greedy_head.codes"
SCALES = "onnxmerge.greedy_head.scales"
ROWS = "onnxmerge.greedy_head.rows"  # an untied head's weight, stored as rows
_BIAS_SHAPE = "onnxmerge.greedy_head.bias_shape"
_HIDDEN_SHAPE = "onnxmerge.greedy_head.hidden_shape"
# DynamicQuantizeLinear arrived in opset 11.
_MIN_OPSET = 11
_CHUNK_ROWS = 4096
_PREFIX = "onnxmerge.greedy_head/"  # the names of the nodes and values added


@dataclass(frozen=True)
class Head:
    """The float head both branches end with, plus ``bias`` (or nothing): a tied head,
    ``Gemm(rows, weight, transB=1)`` reshaped into the logits, or, where ``columns``, an untied
    one as exported, ``MatMul(hidden, weight)`` with ``weight`` ``[hidden, vocab]``."""

    weight: ir.Value
    bias: ir.Value | None
    # The cached branch's and the uncached branch's; the main graph's one in format 3.
    products: tuple[ir.Node, ...]
    branches: ir.Node | None  # the If on use_cache_branch; None in format 3
    index: int  # the logits' place among the If's outputs (the main graph's in format 3)
    columns: bool = False

    def rows(self) -> np.ndarray:
        """The weight as ``[vocab, hidden]``: one row per token."""
        weight = tensor_of(self.weight).numpy()
        return np.ascontiguousarray(weight.T) if self.columns else weight


@dataclass(frozen=True)
class RowTables:
    """Per-row int8 codes of a ``[vocab, hidden]`` weight and what bounds their error."""

    codes: np.ndarray  # int8 [vocab, hidden]
    scales: np.ndarray  # float32 [vocab]: row ~= codes * scale
    error: np.ndarray  # float64 [vocab]: max |row - codes * scale|
    l1: np.ndarray  # float64 [vocab]: sum |codes * scale|
    amax: np.ndarray  # float64 [vocab]: max |row|


def row_tables(weight: np.ndarray) -> RowTables:
    """Symmetric codes in [-63, 63] with one scale per row, and their error tables (read in
    chunks). Seven bits, not eight: without VNNI, onnxruntime's x86 kernels add pairs of
    uint8 x int8 products in int16, which saturates past 32767; 255 * 63 * 2 stays below it, so
    the integer product is exact on every processor and the bounds hold."""
    vocab, hidden = weight.shape
    codes = np.empty((vocab, hidden), np.int8)
    scales = np.empty(vocab, np.float32)
    error, l1, amax = (np.empty(vocab) for _ in range(3))
    for start in range(0, vocab, _CHUNK_ROWS):
        part = slice(start, start + _CHUNK_ROWS)
        rows = np.asarray(weight[part], dtype=np.float64)
        amax[part] = np.abs(rows).max(axis=1)
        scale = (amax[part] / INT8_PEAK).astype(np.float32)
        scale[scale == 0] = 1
        scales[part] = scale
        codes[part] = np.clip(np.rint(rows / scale[:, None]), -INT8_PEAK, INT8_PEAK)
        dequantized = codes[part] * scale[:, None].astype(np.float64)
        error[part] = np.abs(rows - dequantized).max(axis=1)
        l1[part] = np.abs(dequantized).sum(axis=1)
    return RowTables(codes, scales, error, l1, amax)


def find_head(model: ir.Model) -> Head | NoMatch:
    """The float head of both branches, or why there is none to add a greedy head to."""
    main = model.graph
    if model.opset_imports.get("", 0) < _MIN_OPSET:  # the nodes added are in domain ""
        return NoMatch(f"default-domain opset below {_MIN_OPSET}")
    taken = {FLAG, HIDDEN, CODES, SCALES, ROWS, _BIAS_SHAPE, _HIDDEN_SHAPE}
    if any(v.name in taken for v in (*main.inputs, *main.outputs, *main.initializers.values())):
        return NoMatch("it already has a greedy head")
    flag = next((v for v in main.inputs if v.name == c.USE_CACHE_BRANCH), None)
    logits = next((v for v in main.outputs if v.name == c.LOGITS), None)
    if logits is None or logits.uses():
        return NoMatch(f"no {c.LOGITS} output read by nothing else")
    if not is_op(logits.producer(), "If"):
        # Format version 3: the head is in the main graph, read by every step.
        head = _branch_head(logits, main)
        if isinstance(head, NoMatch):
            return head
        product, weight, bias = head
        return _checked(
            Head(weight, bias, (product,), None, main.outputs.index(logits), _untied(product))
        )
    branches = [n for n in main if is_op(n, "If") and n.inputs[0] is flag] if flag else []
    if len(branches) != 1:
        return NoMatch(f"no single If on {c.USE_CACHE_BRANCH}")
    node = branches[0]
    if logits.producer() is not node:
        return NoMatch("the logits do not come from the If")
    index = list(node.outputs).index(logits)
    found = []
    for branch in ("then_branch", "else_branch"):
        head = _branch_head(node.attributes[branch].as_graph().outputs[index], main)
        if isinstance(head, NoMatch):
            return NoMatch(f"{branch}: {head}")
        found.append(head)
    (product, weight, bias), (first_product, first_weight, first_bias) = found
    if first_weight is not weight or first_bias is not bias:
        return NoMatch("the branches' heads read different weights")
    if _untied(product) != _untied(first_product):
        return NoMatch("the branches' heads multiply differently")
    return _checked(Head(weight, bias, (product, first_product), node, index, _untied(product)))


def _untied(product: ir.Node) -> bool:
    return is_op(product, "MatMul")


def _checked(head: Head) -> Head | NoMatch:
    """``head``, or why an untied one is left alone: the rows the cache entry stores in its
    place would be a second copy where the weight is read elsewhere too."""
    if head.columns and any(node not in head.products for node, _ in head.weight.uses()):
        return NoMatch("the head's weight is read by other nodes too")
    return head


def _branch_head(
    logits: ir.Value, main: ir.Graph
) -> tuple[ir.Node, ir.Value, ir.Value | None] | NoMatch:
    node, bias = logits.producer(), None
    if is_op(node, "Add"):
        bias = next(
            (
                v
                for v in node.inputs
                if v is not None and v.graph is main and v.const_value is not None
            ),
            None,
        )
        other = next((v for v in node.inputs if v is not bias), None)
        if bias is None or bias.const_value is None or other is None:
            return NoMatch("the logits add something other than a stored bias")
        node = other.producer()
    product: ir.Node | None = node
    if is_op(node, "MatMul"):  # untied, as exported: the weight is [hidden, vocab]
        pass
    elif is_op(node, "Reshape") and node.inputs[0] is not None:
        product = node.inputs[0].producer()
        if not is_op(product, "Gemm") or len([v for v in product.inputs if v is not None]) != 2:
            return NoMatch("the head is not a Gemm without bias")
        attrs = {name: attr.value for name, attr in product.attributes.items()}
        if attrs.get("transB") != 1 or attrs.get("transA", 0) != 0 or attrs.get("alpha", 1.0) != 1:
            return NoMatch("the head's Gemm does not read the weight's rows as stored (transB=1)")
    else:
        found = "nothing" if node is None else f"a {node.op_type}"
        return NoMatch(
            f"the logits come from {found}, not a float head (a MatMul, or a Gemm reshaped)"
        )
    assert product is not None  # is_op found a node
    weight = product.inputs[1]
    if (
        weight is None
        or weight.graph is not main
        or weight.const_value is None
        or weight.dtype != ir.DataType.FLOAT
    ):
        return NoMatch("the head's weight is not a stored float32 tensor of the main graph")
    if weight.shape is None or len(weight.shape) != 2:
        return NoMatch("the head's weight is not a matrix")
    vocab = weight.shape[1 if _untied(product) else 0]
    if bias is not None and tensor_of(bias).size != vocab:
        return NoMatch("the bias does not match the vocabulary")
    return product, weight, bias


def add_greedy_head(model: ir.Model, head: Head) -> RowTables:
    """Move the head out of both branches, under ``FLAG``: int8 rows where it is true, the
    float head where it is false; the branches' output in place of the logits is the head's
    input, ``HIDDEN`` (flattened to ``[rows * new tokens, hidden]`` where the head was a MatMul).
    The logits this graph returns are ``[rows * new tokens, vocab]``, as the head computes them.

    Nested one level deeper, inside the cached branch, onnxruntime does not pre-pack the
    head's weights, and both heads ran at the float head's speed. Reshaped into
    ``[rows, new tokens, vocab]`` in the graph, or with the bias added after the float
    product, the logits are copied once more on their way out: 88 MB a step for 372 rows of
    the opus-mt-fr-en shape. The bias is the float product's third operand instead.
    """
    main = model.graph
    rows = head.rows()
    vocab, hidden_size = rows.shape
    hidden, after, logits_at = _take_head_out(main, head)
    tail: list[ir.Node] = []
    weight = head.weight
    if head.columns:
        # A MatMul's input may have any rank: [rows * new tokens, hidden] for the Gemms. The
        # float head reads the weight's rows, stored once, as the tied head does.
        shape = initializer(main, _HIDDEN_SHAPE, np.array([-1, hidden_size], np.int64))
        tail.append(ir.node("Reshape", [hidden, shape], name=_PREFIX + "hidden"))
        hidden = tail[-1].outputs[0]
        weight = initializer(main, ROWS, rows)

    tables = row_tables(rows)
    codes = initializer(main, CODES, np.ascontiguousarray(tables.codes.T))
    scales = initializer(main, SCALES, tables.scales)
    flag = ir.Value(name=FLAG, type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([1]))
    main.inputs.append(flag)
    hidden.name = HIDDEN
    hidden.type = hidden.type or ir.TensorType(ir.DataType.FLOAT)
    hidden.shape = ir.Shape([None, hidden_size])

    bias = head.bias
    if bias is not None and len(tensor_of(bias).shape) != 1:
        # Gemm's third operand broadcasts to [rows, vocab] only as [vocab] or [1, vocab].
        flat = initializer(main, _BIAS_SHAPE, np.array([vocab], np.int64))
        tail.append(ir.node("Reshape", [bias, flat], name=_PREFIX + "bias"))
        bias = tail[-1].outputs[0]
    choose = _choose_head(flag, hidden, weight, codes, scales, bias)
    tail.append(choose)
    for node in tail[:-1]:
        if node.outputs[0] is not hidden:
            node.outputs[0].name = node.name
    main.insert_after(after, tail)
    result = choose.outputs[0]
    result.name = c.LOGITS
    result.type = ir.TensorType(ir.DataType.FLOAT)
    result.shape = ir.Shape([None, vocab])
    main.outputs[logits_at] = result
    main.outputs.append(hidden)
    ir.passes.common.RemoveUnusedNodesPass()(model)  # the heads' nodes left in the branches
    return tables


def _take_head_out(main: ir.Graph, head: Head) -> tuple[ir.Value, ir.Node, int]:
    """The head's input where its logits were (each branch ends with it), the node after which
    the new heads go, and the logits' place among the main graph's outputs."""
    if head.branches is None:
        return _head_input(head.products[0]), head.products[0], head.index
    for branch, product in zip(("then_branch", "else_branch"), head.products, strict=True):
        graph = head.branches.attributes[branch].as_graph()
        graph.outputs[head.index] = _head_input(product)
    hidden = head.branches.outputs[head.index]
    hidden.name = _PREFIX + "head_input"  # the logits' name until now
    return hidden, head.branches, main.outputs.index(hidden)


def _choose_head(
    flag: ir.Value,
    hidden: ir.Value,
    weight: ir.Value,
    codes: ir.Value,
    scales: ir.Value,
    bias: ir.Value | None,
) -> ir.Node:
    """``If(flag)``: the int8 rows' product where it is true, the float head's where false."""
    p = _PREFIX
    quantize = ir.Node("", "DynamicQuantizeLinear", [hidden], num_outputs=3, name=p + "quantize")
    for value, suffix in zip(quantize.outputs, ("rows_q", "rows_scale", "rows_zero"), strict=True):
        value.name = p + suffix
    q_rows, q_scale, q_zero = quantize.outputs
    product = ir.node("MatMulInteger", [q_rows, codes, q_zero], name=p + "int8/product")
    as_float = ir.node("Cast", [product.outputs[0]], {"to": ir.DataType.FLOAT}, name=p + "cast")
    column_scales = ir.node("Mul", [q_scale, scales], name=p + "column_scales")
    approximate = ir.node("Mul", [as_float.outputs[0], column_scales.outputs[0]], name=p + "int8")
    int8_nodes = [quantize, product, as_float, column_scales, approximate]
    if bias is not None:
        int8_nodes.append(ir.node("Add", [approximate.outputs[0], bias], name=p + "int8/bias"))
    exact_inputs = [hidden, weight] + ([bias] if bias is not None else [])
    exact = ir.node("Gemm", exact_inputs, {"transB": 1}, name=p + "float")
    for node in [*int8_nodes[1:], exact]:
        node.outputs[0].name = node.name
    return ir.node(
        "If",
        [flag],
        {
            "then_branch": ir.Graph([], int8_nodes[-1].outputs, nodes=int8_nodes, name="int8_head"),
            "else_branch": ir.Graph([], exact.outputs, nodes=[exact], name="float_head"),
        },
        name=p + "choose",
    )


def _head_input(product: ir.Node) -> ir.Value:
    """What a head's product multiplies: its first input, which ONNX requires."""
    rows = product.inputs[0]
    if rows is None:
        raise ValueError(f"the head's {product.op_type} {product.name} has no first input")
    return rows


@dataclass(frozen=True)
class GreedySource:
    """A merged model with a greedy head, written for onnxruntime to optimize and save."""

    path: Path
    weight_name: str
    weight: np.ndarray  # the float rows, as the merged model stores them
    bias: np.ndarray | None
    tables: RowTables

    def write_tables(self, saved: Path) -> None:
        """Write the runtime's tables beside ``saved``, onnxruntime's optimized graph of
        ``path``; raises ValueError where that graph does not keep the float rows unchanged in
        a data file, which the runtime reads them from."""
        import onnx

        proto = onnx.load(saved, load_external_data=False)
        tensor = next((t for t in proto.graph.initializer if t.name == self.weight_name), None)
        if (
            tensor is None
            or tensor.data_location != onnx.TensorProto.EXTERNAL
            or tensor.data_type != onnx.TensorProto.FLOAT
            or tuple(tensor.dims) != self.weight.shape
        ):
            raise ValueError(f"the optimized graph does not keep {self.weight_name} as stored")
        where = {entry.key: entry.value for entry in tensor.external_data}
        name, offset = where["location"], int(where.get("offset", 0))
        stored = np.memmap(saved.parent / name, np.float32, "r", offset, self.weight.shape)
        if not np.array_equal(stored, self.weight):
            raise ValueError(f"the optimized graph changed {self.weight_name}")
        write_tables(
            saved.parent,
            weight_file=name,
            weight_offset=offset,
            weight_shape=self.weight.shape,
            bias=self.bias,
            error=self.tables.error,
            l1=self.tables.l1,
            amax=self.tables.amax,
        )


def write_greedy_source(model_path: Path, folder: Path) -> GreedySource | None:
    """``model_path`` with a greedy head, saved in ``folder`` with its weights in a data file;
    None (and why, in the log) where its head is not one this applies to."""
    model, _ = load_model(model_path)
    head = find_head(model)
    if isinstance(head, NoMatch):
        logger.debug("no greedy head for %s: %s", model_path, head)
        return None
    weight = head.rows()
    weight_name = ROWS if head.columns else name_of(head.weight)
    bias = None if head.bias is None else tensor_of(head.bias).numpy().reshape(-1)
    tables = add_greedy_head(model, head)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    ir.save(model, path, external_data="model.onnx_data", size_threshold_bytes=1024)
    # The codes are in the saved model now; only the tables that bound them stay.
    tables = dataclasses.replace(tables, codes=np.empty((0, 0), np.int8))
    return GreedySource(path, weight_name, weight, bias, tables)
