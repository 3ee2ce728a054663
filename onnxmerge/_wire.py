"""Protobuf wire-level access to ONNX files, so weights never pass through a parsed message.

``onnx.load`` parses a whole file into memory, and serialising builds the whole file once more;
for a 300 MB model that is well over a gigabyte at the peak. Here the weights stay on disk:

- :func:`load_skeleton` parses only the structure of a model. Each large ``raw_data`` of a
  main-graph initializer becomes an external-data reference into the file itself, which onnx-ir
  then memory-maps.
- :func:`skeleton_bytes` gives the same model serialized, unparsed, for onnxruntime to map.
- :func:`graph_structure` reads the nodes and initializers of a model's graph without protobuf,
  for readers that need only which node reads what: importing protobuf and parsing a graph
  cost a process megabytes that it keeps.
- :func:`inline_external_data` writes a model whose initializers live in a data file as one
  self-contained file, copying the weights through in slices.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from onnxmerge.errors import WireFormatError

if TYPE_CHECKING:
    from onnxmerge import _proto

# Field numbers of onnx.proto.
_MODEL_GRAPH = 7
_GRAPH_NODE = 1
_GRAPH_INITIALIZER = 5
_NODE_INPUT, _NODE_OUTPUT, _NODE_OP_TYPE, _NODE_ATTRIBUTE, _NODE_DOMAIN = 1, 2, 4, 5, 7
_ATTRIBUTE_GRAPH, _ATTRIBUTE_GRAPHS = 6, 11
_TENSOR_NAME = 8
_TENSOR_RAW_DATA = 9
_TENSOR_EXTERNAL_DATA = 13
_TENSOR_DATA_LOCATION = 14
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL
_ENTRY_KEY, _ENTRY_VALUE = 1, 2
_LEN, _VARINT, _I64, _I32 = 2, 0, 1, 5
_COPY_CHUNK = 16 * 2**20


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise WireFormatError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireFormatError("varint longer than 10 bytes")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _encode_varint(field << 3 | wire_type)


def _fields(buf, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field, wire type, field start, value start, value end) of each field in buf[start:end]."""
    pos = start
    while pos < end:
        field_start = pos
        key, pos = _varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            _, value_end = _varint(buf, pos, end)
            value_start = pos
        elif wire_type == _LEN:
            length, value_start = _varint(buf, pos, end)
            value_end = value_start + length
        elif wire_type == _I64:
            value_start, value_end = pos, pos + 8
        elif wire_type == _I32:
            value_start, value_end = pos, pos + 4
        else:
            raise WireFormatError(f"unsupported wire type {wire_type}")
        if value_end > end:
            raise WireFormatError("field runs past the end of its message")
        yield field, wire_type, field_start, value_start, value_end
        pos = value_end


def field(number: int, value: int | str | bytes) -> bytes:
    """One serialized field: an int as a varint (a negative one as its 64-bit two's
    complement, as protobuf writes int64), a str (UTF-8) or bytes (a message) length-delimited."""
    if isinstance(value, int):
        return _key(number, _VARINT) + _encode_varint(value & (2**64 - 1))
    payload = value.encode() if isinstance(value, str) else value
    return _length_delimited(number, payload)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, _LEN) + _encode_varint(len(payload)) + payload


def _entry(key: str, value: str) -> bytes:
    body = _length_delimited(_ENTRY_KEY, key.encode()) + _length_delimited(
        _ENTRY_VALUE, value.encode()
    )
    return _length_delimited(_TENSOR_EXTERNAL_DATA, body)


def _externalised_tensor(buf, start: int, end: int, location: str, min_bytes: int) -> bytes | None:
    """The tensor with its ``raw_data`` as a reference into ``location``; None where it stays
    as it is (external already, no ``raw_data``, or less than ``min_bytes`` of it)."""
    raw = None
    kept = bytearray()
    for field, wire_type, field_start, value_start, value_end in _fields(buf, start, end):
        if field == _TENSOR_RAW_DATA and wire_type == _LEN:
            raw = (value_start, value_end)
        else:
            if field in (_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION):
                return None  # already external: leave it alone
            kept += buf[field_start:value_end]
    if raw is None or raw[1] - raw[0] < min_bytes:
        return None
    kept += _entry("location", location)
    kept += _entry("offset", str(raw[0]))
    kept += _entry("length", str(raw[1] - raw[0]))
    kept += _key(_TENSOR_DATA_LOCATION, _VARINT) + _encode_varint(_EXTERNAL)
    return bytes(kept)


def _mapped(path: Path) -> mmap.mmap:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise WireFormatError("empty file")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def skeleton_bytes(path: str | os.PathLike, min_bytes: int = 1024) -> tuple[bytes, int]:
    """The model serialized with each ``raw_data`` of at least ``min_bytes`` of a main-graph
    initializer replaced by an external-data reference into the file itself, and how many were."""
    path = Path(path)
    externalised = 0
    with _mapped(path) as buf:
        model = bytearray()
        for field, wire_type, field_start, value_start, value_end in _fields(buf, 0, len(buf)):
            if field != _MODEL_GRAPH or wire_type != _LEN:
                model += buf[field_start:value_end]
                continue
            graph = bytearray()
            for g_field, g_type, g_start, g_value, g_end in _fields(buf, value_start, value_end):
                tensor = None
                if g_field == _GRAPH_INITIALIZER and g_type == _LEN:
                    tensor = _externalised_tensor(buf, g_value, g_end, path.name, min_bytes)
                if tensor is None:
                    graph += buf[g_start:g_end]
                else:
                    externalised += 1
                    graph += _length_delimited(_GRAPH_INITIALIZER, tensor)
            model += _length_delimited(_MODEL_GRAPH, bytes(graph))
    return bytes(model), externalised


def load_skeleton(path: str | os.PathLike, min_bytes: int = 1024) -> _proto.ModelProto:
    """Parse a model with its large initializers left in the file as external references."""
    from onnxmerge import _proto

    proto = _proto.ModelProto()
    proto.ParseFromString(skeleton_bytes(path, min_bytes)[0])
    return proto


@dataclass(frozen=True, slots=True)
class Node:
    """What a node reads and writes: ``NodeProto``'s fields of those names, and its subgraphs."""

    op_type: str
    domain: str
    input: tuple[str, ...]
    output: tuple[str, ...]
    subgraphs: tuple[Graph, ...]


@dataclass(frozen=True, slots=True)
class Initializer:
    """An initializer's name and where its data lies, as the skeleton gives it: ``external_data``
    holds ``location``, ``offset`` and ``length`` of a tensor stored outside its message (in a
    data file, or as ``raw_data`` of at least the skeleton's ``min_bytes`` in the model file)."""

    name: str
    external_data: dict[str, str]


@dataclass(frozen=True, slots=True)
class Graph:
    node: tuple[Node, ...]
    initializer: tuple[Initializer, ...]

    def graphs(self) -> Iterator[Graph]:
        """This graph and every graph inside its nodes, at any depth."""
        yield self
        for node in self.node:
            for sub in node.subgraphs:
                yield from sub.graphs()


def graph_structure(path: str | os.PathLike, min_bytes: int = 1024) -> Graph:
    """The structure of the main graph of the model in ``path``, read field by field: the weights
    are skipped, never copied."""
    path = Path(path)
    with _mapped(path) as buf:
        for field, wire_type, _, start, end in _fields(buf, 0, len(buf)):
            if field == _MODEL_GRAPH and wire_type == _LEN:
                return _graph(buf, start, end, path.name, min_bytes, {})
    raise WireFormatError("no graph")


def _text(buf, start: int, end: int, names: dict[str, str] | None = None) -> str:
    """The string in buf[start:end]; with ``names``, one object for every equal string read."""
    text = bytes(buf[start:end]).decode()
    return text if names is None else names.setdefault(text, text)


def _graph(
    buf, start: int, end: int, location: str, min_bytes: int | None, names: dict[str, str]
) -> Graph:
    """``min_bytes``: None in subgraphs, whose initializers the skeleton leaves inline.
    ``names``: every name and operator read so far, each kept once (a name is read once for
    its writer and again for each reader)."""
    nodes, initializers = [], []
    for field, wire_type, _, value_start, value_end in _fields(buf, start, end):
        if wire_type != _LEN:
            continue
        if field == _GRAPH_NODE:
            nodes.append(_node(buf, value_start, value_end, location, min_bytes, names))
        elif field == _GRAPH_INITIALIZER:
            initializers.append(
                _initializer(buf, value_start, value_end, location, min_bytes, names)
            )
    return Graph(tuple(nodes), tuple(initializers))


def _node(
    buf, start: int, end: int, location: str, min_bytes: int | None, names: dict[str, str]
) -> Node:
    inputs, outputs, subgraphs = [], [], []
    op_type = domain = ""
    for field, wire_type, _, value_start, value_end in _fields(buf, start, end):
        if wire_type != _LEN:
            continue
        if field == _NODE_INPUT:
            inputs.append(_text(buf, value_start, value_end, names))
        elif field == _NODE_OUTPUT:
            outputs.append(_text(buf, value_start, value_end, names))
        elif field == _NODE_OP_TYPE:
            op_type = _text(buf, value_start, value_end, names)
        elif field == _NODE_DOMAIN:
            domain = _text(buf, value_start, value_end, names)
        elif field == _NODE_ATTRIBUTE:
            for a_field, a_type, _, a_start, a_end in _fields(buf, value_start, value_end):
                if a_field in (_ATTRIBUTE_GRAPH, _ATTRIBUTE_GRAPHS) and a_type == _LEN:
                    subgraphs.append(_graph(buf, a_start, a_end, location, None, names))
    return Node(op_type, domain, tuple(inputs), tuple(outputs), tuple(subgraphs))


def _initializer(
    buf, start: int, end: int, location: str, min_bytes: int | None, names: dict[str, str]
) -> Initializer:
    name = ""
    entries: dict[str, str] = {}
    raw: tuple[int, int] | None = None
    for field, wire_type, _, value_start, value_end in _fields(buf, start, end):
        if field == _TENSOR_NAME and wire_type == _LEN:
            name = _text(buf, value_start, value_end, names)
        elif field == _TENSOR_RAW_DATA and wire_type == _LEN:
            raw = (value_start, value_end)
        elif field == _TENSOR_EXTERNAL_DATA and wire_type == _LEN:
            key = value = ""
            for e_field, _, _, e_start, e_end in _fields(buf, value_start, value_end):
                if e_field == _ENTRY_KEY:
                    key = _text(buf, e_start, e_end)
                elif e_field == _ENTRY_VALUE:
                    value = _text(buf, e_start, e_end)
            entries[key] = value
    if raw is not None and not entries and min_bytes is not None and raw[1] - raw[0] >= min_bytes:
        entries = {"location": location, "offset": str(raw[0]), "length": str(raw[1] - raw[0])}
    return Initializer(name, entries)


def _external_location(buf, start: int, end: int) -> tuple[bytes, str, int, int] | None:
    """The tensor's fields other than its external reference, and where its data lies."""
    kept = bytearray()
    entries: dict[str, str] = {}
    external = False
    for field, wire_type, field_start, value_start, value_end in _fields(buf, start, end):
        if field == _TENSOR_EXTERNAL_DATA and wire_type == _LEN:
            key = value = ""
            for e_field, _, _, e_start, e_end in _fields(buf, value_start, value_end):
                text = bytes(buf[e_start:e_end]).decode()
                if e_field == _ENTRY_KEY:
                    key = text
                elif e_field == _ENTRY_VALUE:
                    value = text
            entries[key] = value
        elif field == _TENSOR_DATA_LOCATION:
            location, _ = _varint(buf, value_start, value_end)
            external = location == _EXTERNAL
        else:
            kept += buf[field_start:value_end]
    if not external or "location" not in entries:
        return None
    return bytes(kept), entries["location"], int(entries.get("offset", 0)), int(entries["length"])


def inline_external_data(model_path: Path, data_path: Path, output: Path) -> None:
    """Write ``model_path`` with every initializer stored in ``data_path`` copied inline."""
    with open(model_path, "rb") as f:
        skeleton = f.read()
    end = len(skeleton)
    # Plan the output as byte strings and (offset, length) slices of the data file.
    top: list[bytes | tuple[int, int]] = []
    for field, wire_type, field_start, value_start, value_end in _fields(skeleton, 0, end):
        if field != _MODEL_GRAPH or wire_type != _LEN:
            top.append(skeleton[field_start:value_end])
            continue
        graph: list[bytes | tuple[int, int]] = []
        for g_field, g_type, g_start, g_value, g_end in _fields(skeleton, value_start, value_end):
            found = None
            if g_field == _GRAPH_INITIALIZER and g_type == _LEN:
                found = _external_location(skeleton, g_value, g_end)
            if found is None or found[1] != data_path.name:
                graph.append(skeleton[g_start:g_end])
                continue
            fields, _, offset, length = found
            raw_header = _key(_TENSOR_RAW_DATA, _LEN) + _encode_varint(length)
            tensor_length = len(fields) + len(raw_header) + length
            graph.append(
                _key(_GRAPH_INITIALIZER, _LEN) + _encode_varint(tensor_length) + fields + raw_header
            )
            graph.append((offset, length))
        graph_length = sum(len(p) if isinstance(p, bytes) else p[1] for p in graph)
        top.append(_key(_MODEL_GRAPH, _LEN) + _encode_varint(graph_length))
        top.extend(graph)
    with open(data_path, "rb") as data, open(output, "wb") as out:
        for piece in top:
            if isinstance(piece, bytes):
                out.write(piece)
                continue
            offset, length = piece
            data.seek(offset)
            while length:
                chunk = data.read(min(length, _COPY_CHUNK))
                if not chunk:
                    raise WireFormatError(f"{data_path} ends before offset {offset + length}")
                out.write(chunk)
                length -= len(chunk)
