"""Store every tensor once: content keys, byte confirmation, transposed matches, hoisting.

All passes work on the main graph of a spliced model, where every initializer already lives.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnxmerge.passes import base as passes_base
from onnxmerge.passes.base import StepResult, graph_of, is_op, name_of, tensor_of

logger = logging.getLogger(__name__)

# Below this a tensor is not worth a Transpose node, and Constant nodes stay where they are.
MIN_SHARED_BYTES = 1024
# Work on large tensors in slices of about this many bytes, so memory stays bounded.
_CHUNK_BYTES = 64 * 2**20
# Ops that must not be moved or merged even when all their inputs are constant.
_IMPURE_OPS = frozenset(
    {
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "Dropout",
    }
)


@dataclass(frozen=True)
class SharedTensor:
    """One tensor that was stored more than once; ``removed`` now reads ``kept``."""

    kept: str
    removed: str
    nbytes: int
    transposed: bool


def contiguous_array(tensor: ir.TensorProtocol) -> np.ndarray | None:
    """A tensor's values as a C-contiguous array; None for strings, which have no bytes to key."""
    if tensor.dtype == ir.DataType.STRING:
        return None
    array = tensor.numpy()
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _byte_view(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def _rows_per_chunk(array: np.ndarray) -> int:
    row_bytes = max(1, array.itemsize * (array.size // max(1, array.shape[0])))
    return max(1, _CHUNK_BYTES // row_bytes)


def _transposed_slices(array: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """Rows of ``array.T`` as contiguous slices, with the index of each slice's first row."""
    transposed = array.T
    step = _rows_per_chunk(transposed)
    for start in range(0, transposed.shape[0], step):
        yield start, np.ascontiguousarray(transposed[start : start + step])


def array_digest(array: np.ndarray, *, transposed: bool = False) -> bytes:
    """sha256 of an array's bytes, or of its transpose's, read in bounded slices."""
    hasher = hashlib.sha256()
    if transposed:
        for _, rows in _transposed_slices(array):
            hasher.update(_byte_view(rows).data)
    else:
        hasher.update(_byte_view(array).data)
    return hasher.digest()


def _stored_chunks(tensor: ir.TensorProtocol) -> Iterator[bytes | memoryview]:
    """A tensor's stored bytes in slices of ``_CHUNK_BYTES``; read from disk when external.

    Reading, rather than mapping, keeps weights out of the process's resident memory.
    """
    if isinstance(tensor, ir.ExternalTensor):
        remaining = tensor.length if tensor.length is not None else tensor.nbytes
        with open(tensor.path, "rb") as f:
            f.seek(tensor.offset or 0)
            while remaining > 0:
                chunk = f.read(min(remaining, _CHUNK_BYTES))
                if not chunk:
                    raise OSError(f"{tensor.path} ends inside tensor {tensor.name!r}")
                remaining -= len(chunk)
                yield chunk
        return
    data = memoryview(tensor.tobytes())
    for start in range(0, len(data), _CHUNK_BYTES):
        yield data[start : start + _CHUNK_BYTES]


def _stored_digest(tensor: ir.TensorProtocol) -> bytes:
    hasher = hashlib.sha256()
    for chunk in _stored_chunks(tensor):
        hasher.update(chunk)
    return hasher.digest()


def _stored_equal(a: ir.TensorProtocol, b: ir.TensorProtocol) -> bool:
    if a.nbytes != b.nbytes:
        return False
    return all(x == y for x, y in zip(_stored_chunks(a), _stored_chunks(b), strict=True))


class _Mapped:
    """A 2-D tensor as an array; external tensors mapped privately so their pages can be dropped.

    Pages of a mapping count as resident memory until dropped; :meth:`drop` hands them back to
    the page cache after each slice, so a 1 GB embedding never stays mapped in full.
    """

    def __init__(self, tensor: ir.TensorProtocol):
        self._map: mmap.mmap | None = None
        self.array: np.ndarray
        if isinstance(tensor, ir.ExternalTensor) and tensor.size:
            with open(tensor.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            dtype = np.dtype(tensor.dtype.numpy()).newbyteorder("<")
            self.array = np.frombuffer(
                self._map, dtype=dtype, count=tensor.size, offset=tensor.offset or 0
            ).reshape(tuple(tensor.shape))
        else:
            array = contiguous_array(tensor)
            if array is None:
                raise ValueError(f"{tensor.name}: a string tensor is not compared by position")
            self.array = array

    def drop(self) -> None:
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)


def _row_blocks(rows: int, row_bytes: int, budget: int = _CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    step = max(1, budget // max(1, row_bytes))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _frame_hash(tensor: ir.TensorProtocol, *, transposed: bool) -> int:
    """A hash of a 2-D tensor's elements by position, read in its own row order.

    With ``transposed`` the positions are those of the transpose, so ``A.T == B`` gives
    ``_frame_hash(A, transposed=True) == _frame_hash(B, transposed=False)``, and neither side is
    ever read column-wise. It is a sum over elements: order-free, so it streams. Matches are
    always confirmed byte by byte.
    """
    mapped = _Mapped(tensor)
    array = mapped.array
    rows, cols = array.shape
    unsigned = np.dtype(f"u{array.dtype.itemsize}")
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        # Hashing widens each element to several uint64 temporaries: smaller slices.
        for start, end in _row_blocks(rows, cols * 8, _CHUNK_BYTES // 16):
            bits = array[start:end].view(unsigned).astype(np.uint64)
            r = np.arange(start, end, dtype=np.uint64)[:, None]
            c = np.arange(cols, dtype=np.uint64)[None, :]
            position = c * np.uint64(rows) + r if transposed else r * np.uint64(cols) + c
            total += _mix(_mix(position) ^ bits).sum(dtype=np.uint64)
            mapped.drop()
    return int(total)


def _equal_transposed(a: ir.TensorProtocol, b: ir.TensorProtocol) -> bool:
    """Byte equality of ``a.T`` and ``b``, a block of ``a``'s rows at a time."""
    mapped_a, mapped_b = _Mapped(a), _Mapped(b)
    left, right = mapped_a.array, mapped_b.array
    rows, cols = left.shape
    unsigned = np.dtype(f"u{left.dtype.itemsize}")
    for start, end in _row_blocks(rows, cols * left.itemsize):
        same = np.array_equal(left[start:end].view(unsigned), right[:, start:end].view(unsigned).T)
        mapped_a.drop()
        mapped_b.drop()
        if not same:
            return False
    return True


def _is_removable(graph: ir.Graph, value: ir.Value) -> bool:
    return value not in graph.outputs and value not in graph.inputs


def _new_value(name: str, like: ir.Value, shape: list | None = None) -> ir.Value:
    return ir.Value(
        name=name,
        type=like.type,
        shape=ir.Shape(shape) if shape is not None else like.shape,
    )


def lift_large_constants(model: ir.Model, min_bytes: int = MIN_SHARED_BYTES) -> int:
    """Turn large ``Constant`` nodes anywhere in the model into main-graph initializers.

    Returns how many were lifted.
    """
    main = model.graph
    lifted = 0
    for node in list(ir.traversal.RecursiveGraphIterator(main)):
        if not is_op(node, "Constant"):
            continue
        attr = node.attributes.get("value")
        if attr is None or attr.type != ir.AttributeType.TENSOR:
            continue
        tensor = attr.value
        if tensor.nbytes < min_bytes:
            continue
        output = node.outputs[0]
        graph = graph_of(node)
        if output in graph.outputs:
            continue
        initializer = ir.Value(
            name=output.name,
            type=ir.TensorType(tensor.dtype),
            shape=ir.Shape(tensor.shape),
            const_value=tensor,
        )
        ir.convenience.replace_all_uses_with(output, initializer)
        graph.remove(node, safe=True)
        main.register_initializer(initializer)
        lifted += 1
    return lifted


def deduplicate_initializers(graph: ir.Graph) -> list[SharedTensor]:
    """Keep the first of every group of equal initializers, and of transposed pairs.

    A tensor equal to another's transpose is replaced by one ``Transpose`` node in this graph.
    Keys are (dtype, shape, sha256); every match is confirmed byte by byte.
    """
    survivors, shared = _drop_equal(graph)
    shared = _resolve_chains(shared + _drop_transposed(graph, survivors))
    for item in shared:
        logger.debug(
            "%s is %s%s (%d bytes)",
            item.removed,
            item.kept,
            "^T" if item.transposed else "",
            item.nbytes,
        )
    return shared


def _drop_equal(graph: ir.Graph) -> tuple[list[ir.Value], list[SharedTensor]]:
    """Make every initializer equal to an earlier one read that one instead; return the
    initializers left and what was shared."""
    candidates = [
        v
        for v in graph.initializers.values()
        if v.const_value is not None and v.const_value.dtype != ir.DataType.STRING
    ]
    kept: dict[tuple, ir.Value] = {}
    survivors: list[ir.Value] = []
    shared: list[SharedTensor] = []
    for value in candidates:
        tensor = tensor_of(value)
        key = (tensor.dtype, tuple(tensor.shape), _stored_digest(tensor))
        first = kept.get(key)
        if (
            first is not None
            and _is_removable(graph, value)
            and _stored_equal(tensor_of(first), tensor)
        ):
            ir.convenience.replace_all_uses_with(value, first)
            graph.initializers.pop(name_of(value))
            shared.append(SharedTensor(name_of(first), name_of(value), tensor.nbytes, False))
            continue
        kept.setdefault(key, value)
        survivors.append(value)
    return survivors, shared


def _transposable(value: ir.Value) -> bool:
    tensor = tensor_of(value)
    return (
        len(tensor.shape) == 2
        and tensor.nbytes >= MIN_SHARED_BYTES
        and tensor.dtype.bitwidth in (8, 16, 32, 64)
    )


def _drop_transposed(graph: ir.Graph, survivors: list[ir.Value]) -> list[SharedTensor]:
    """Make every 2-D initializer equal to an earlier one's transpose read one shared
    ``Transpose`` of it; return what was shared."""
    # Only tensors whose transposed shape also occurs are hashed again.
    candidates = [v for v in survivors if _transposable(v)]
    shapes = {(tensor_of(v).dtype, tuple(tensor_of(v).shape)) for v in candidates}
    transposed_of: dict[tuple, ir.Value] = {}
    transposes: dict[str, ir.Value] = {}
    shared: list[SharedTensor] = []
    for value in candidates:
        tensor = tensor_of(value)
        shape = tuple(tensor.shape)
        flipped = (tensor.dtype, shape[::-1])
        if flipped not in shapes:
            continue
        source = transposed_of.get((tensor.dtype, shape, _frame_hash(tensor, transposed=False)))
        if (
            source is not None
            and _is_removable(graph, value)
            and _equal_transposed(tensor_of(source), tensor)
        ):
            source_name = name_of(source)
            if source_name not in transposes:
                transposes[source_name] = _transpose_node(graph, source)
            ir.convenience.replace_all_uses_with(value, transposes[source_name])
            graph.initializers.pop(name_of(value))
            shared.append(SharedTensor(source_name, name_of(value), tensor.nbytes, True))
            continue
        transposed_of.setdefault((*flipped, _frame_hash(tensor, transposed=True)), value)
    return shared


def _resolve_chains(shared: list[SharedTensor]) -> list[SharedTensor]:
    """Report each removed tensor against the tensor actually kept.

    ``b == a`` found first, then ``a == e^T``: ``b`` is stored as ``e``, transposed.
    """
    removed = {s.removed: s for s in shared}
    resolved = []
    for item in shared:
        kept, transposed = item.kept, item.transposed
        while kept in removed:
            kept, transposed = removed[kept].kept, transposed != removed[kept].transposed
        resolved.append(SharedTensor(kept, item.removed, item.nbytes, transposed))
    return resolved


def _transpose_node(graph: ir.Graph, source: ir.Value) -> ir.Value:
    shape = list(source.shape)[::-1] if source.shape is not None else None
    output = _new_value(f"{source.name}.transposed", source, shape)
    transpose = passes_base.node(
        "Transpose", [source], [output], name=f"{source.name}.transpose", perm=[1, 0]
    )
    if len(graph) > 0:
        graph.insert_before(graph[0], transpose)
    else:
        graph.append(transpose)
    return output


def _constant_inputs_only(node: ir.Node, main: ir.Graph, constant: set[ir.Value]) -> bool:
    if node.op_type in _IMPURE_OPS or not node.inputs:
        return False
    if any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for a in node.attributes.values()
    ):
        return False
    return all(
        v is None or v in constant or (v.is_initializer() and v.graph is main) for v in node.inputs
    )


def hoist_constant_nodes(graph: ir.Graph) -> int:
    """Move branch nodes that read only main-graph initializers to the main graph.

    onnxruntime folds such nodes once per branch: a ``Transpose`` of the shared embedding in both
    decoders would be materialised twice. In the main graph it is folded once.
    """
    hoisted: list[ir.Node] = []
    constant: set[ir.Value] = set()
    for node in list(ir.traversal.RecursiveGraphIterator(graph)):
        if node.graph is graph or not _constant_inputs_only(node, graph, constant):
            continue
        if any(out.is_graph_output() for out in node.outputs):
            # A branch must compute its outputs itself; leave this one in place.
            continue
        graph_of(node).remove(node)
        hoisted.append(node)
        constant.update(node.outputs)
    if hoisted:
        anchor = next((n for n in graph if n not in hoisted), None)
        if anchor is None:
            graph.extend(hoisted)
        else:
            graph.insert_before(anchor, hoisted)
    return len(hoisted)


def _attribute_key(node: ir.Node) -> tuple:
    items = []
    for name, attr in sorted(node.attributes.items()):
        value = attr.value
        if attr.type == ir.AttributeType.TENSOR:
            value = (value.dtype, tuple(value.shape), value.tobytes())
        elif isinstance(value, list):
            value = tuple(value)
        items.append((name, attr.type, value))
    return tuple(items)


def merge_equal_constant_nodes(graph: ir.Graph) -> int:
    """Merge main-graph nodes that compute the same thing from the same initializers."""
    seen: dict[tuple, ir.Node] = {}
    constant: set[ir.Value] = set()
    merged = 0
    for node in list(graph):
        if not _constant_inputs_only(node, graph, constant):
            continue
        key = (
            node.domain,
            node.op_type,
            node.overload,
            tuple(id(v) for v in node.inputs),
            len(node.outputs),
            _attribute_key(node),
        )
        first = seen.get(key)
        if first is None or any(o in graph.outputs for o in node.outputs):
            seen.setdefault(key, node)
            constant.update(node.outputs)
            continue
        ir.convenience.replace_all_uses_with(node.outputs, first.outputs)
        graph.remove(node, safe=True)
        merged += 1
    return merged


def drop_initializer_aliases(graph: ir.Graph) -> int:
    """Remove main-graph Identity nodes of initializers; their readers read the initializer.

    torch exports such aliases when one weight has several names. Left in place, onnxruntime
    tries to rename the branches' outer-scope references when it removes them, and warns.
    """
    dropped = 0
    for node in list(graph):
        if not is_op(node, "Identity"):
            continue
        source, alias = node.inputs[0], node.outputs[0]
        if source is None or not source.is_initializer() or alias.is_graph_output():
            continue
        if any(
            use.node.graph is not graph and alias in graph_of(use.node).outputs
            for use in alias.uses()
        ):
            continue
        ir.convenience.replace_all_uses_with(alias, source)
        graph.remove(node, safe=True)
        dropped += 1
    return dropped


def remove_unused_initializers(graph: ir.Graph) -> int:
    unused = [
        name for name, v in graph.initializers.items() if not v.uses() and v not in graph.outputs
    ]
    for name in unused:
        graph.initializers.pop(name)
    return len(unused)


class LiftLargeConstants(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> StepResult:
        return StepResult.counted(model, "constants_lifted", lift_large_constants(model))


class DeduplicateInitializers(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> StepResult:
        shared = tuple(deduplicate_initializers(model.graph))
        return StepResult(model, bool(shared), "tensors_shared", len(shared), shared)


class HoistConstantNodes(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> StepResult:
        return StepResult.counted(model, "nodes_hoisted", hoist_constant_nodes(model.graph))


class MergeEqualConstantNodes(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> StepResult:
        return StepResult.counted(model, "nodes_merged", merge_equal_constant_nodes(model.graph))


class DropInitializerAliases(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> StepResult:
        return StepResult.counted(model, "aliases_dropped", drop_initializer_aliases(model.graph))


class RemoveUnusedInitializers(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> StepResult:
        removed = remove_unused_initializers(model.graph)
        return StepResult.counted(model, "initializers_removed_unused", removed)


def store_once_steps() -> tuple[ir.passes.InPlacePass, ...]:
    """The passes of this module, in the order they must run."""
    return (
        LiftLargeConstants(),
        DeduplicateInitializers(),
        HoistConstantNodes(),
        MergeEqualConstantNodes(),
        DropInitializerAliases(),
        RemoveUnusedInitializers(),
    )
