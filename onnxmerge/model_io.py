"""Reading models safely and writing them atomically.

Reads check every external-data reference before any byte is mapped: it must name a regular file
inside the model's folder, and its offset and length must fit the file and the tensor. Writes go
to a temporary folder beside the output, are checked, fsynced and moved into place with
``os.replace``, so a failure never leaves a half-written output nor harms an existing one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Generic, TextIO, TypeVar

import numpy as np
import onnx
import onnx_ir as ir

from onnxmerge import _wire
from onnxmerge._proto import graph_protos
from onnxmerge.errors import (
    IncompatibleModelsError,
    ModelNotFoundError,
    RefusedOutputError,
    UnsafeExternalDataError,
    WireFormatError,
)

if sys.platform == "win32":
    from pathlib import WindowsPath as _SystemPath
else:
    from pathlib import PosixPath as _SystemPath

logger = logging.getLogger(__name__)

# Write external data well before protobuf's 2 GiB limit: graph structure and metadata also count.
EXTERNAL_DATA_THRESHOLD = int(1.8 * 2**30)


def tensor_protos(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of a graph and its subgraphs, sparse initializers included."""
    for current in graph_protos(graph):
        yield from current.initializer
        for sparse in current.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in current.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("sparse_tensor"):
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                for sparse in attr.sparse_tensors:
                    yield sparse.values
                    yield sparse.indices


def _expected_nbytes(tensor: onnx.TensorProto, where: str) -> int:
    """Bytes the tensor's dims and type need; refuses types that cannot live in a data file."""
    count = 1
    for dim in tensor.dims:
        count *= dim
    try:
        dtype = ir.DataType(tensor.data_type)
    except ValueError:
        dtype = None
    if dtype is None or dtype in (ir.DataType.UNDEFINED, ir.DataType.STRING):
        raise UnsafeExternalDataError(
            f"{where} has external data of type {tensor.data_type}, which has no fixed size; "
            "the model is corrupt or uses a type onnxmerge cannot check"
        )
    return (count * dtype.bitwidth + 7) // 8


_DRIVE = re.compile(r"^[A-Za-z]:")


def _resolve_location(model_path: Path, location: str, tensor_name: str) -> Path:
    folder = model_path.parent.resolve()
    where = f"tensor {tensor_name!r} of {model_path}"
    if not location:
        raise UnsafeExternalDataError(f"{where} has external data with an empty location")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or _DRIVE.match(location):
        raise UnsafeExternalDataError(
            f"{where} refers to external data by absolute path {location!r}; only paths "
            "relative to the model's folder are accepted"
        )
    parts = Path(location.replace("\\", "/")).parts
    if ".." in parts:
        raise UnsafeExternalDataError(
            f"{where} refers to external data {location!r} outside the model's folder"
        )
    candidate = folder.joinpath(*parts)
    # Links may point anywhere; accept one only if its target is still inside the folder, or in
    # the blob store of the Hugging Face cache the folder is a snapshot of.
    try:
        resolved = candidate.resolve(strict=False)
        is_link = candidate.is_symlink()
    except (OSError, RuntimeError, ValueError) as e:  # loops, NUL bytes, names too long
        raise UnsafeExternalDataError(
            f"{where}: external data {location!r} cannot be resolved: {e}"
        ) from e
    blobs = hf_cache_blobs(folder)
    if not resolved.is_relative_to(folder) and not (
        blobs is not None and is_link and resolved.is_relative_to(blobs)
    ):
        raise UnsafeExternalDataError(
            f"{where} refers to {location!r}, which resolves to {resolved}, outside the "
            f"model's folder {folder}; copy the data file into the folder"
        )
    try:
        info = resolved.stat()
    except FileNotFoundError:
        raise UnsafeExternalDataError(
            f"{where} refers to external data file {location!r}, which does not exist in {folder}"
        ) from None
    except OSError as e:
        raise UnsafeExternalDataError(f"{where}: external data {location!r}: {e}") from e
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeExternalDataError(f"{where}: external data {location!r} is not a regular file")
    if info.st_nlink > 1:
        # A hard link can smuggle any file of the same file system into the folder.
        raise UnsafeExternalDataError(
            f"{where}: external data {location!r} has {info.st_nlink} hard links; copy it "
            "(cp, not cp -l or ln) so the folder holds its own file"
        )
    return resolved


def hf_cache_blobs(folder: Path) -> Path | None:
    """``<repo>/blobs`` when ``folder`` lies in ``<repo>/snapshots/<revision>/`` of a Hugging Face
    cache (``models--org--name``), where every file is a link into ``blobs``; else None."""
    parts = folder.parts
    for index in range(len(parts) - 2, 0, -1):
        if parts[index] != "snapshots":
            continue
        repo = Path(*parts[:index])
        if (
            repo.name.startswith(("models--", "datasets--", "spaces--"))
            and (repo / "blobs").is_dir()
        ):
            return (repo / "blobs").resolve()
        return None
    return None


def check_external_data(model: onnx.ModelProto, model_path: Path) -> dict[str, Path]:
    """Refuse any external-data reference that could read outside the folder or past a file.

    Returns each location the model names, resolved to the file it reads.
    """
    files: dict[str, Path] = {}
    for tensor in tensor_protos(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        location = entries.get("location", "")
        where = f"tensor {tensor.name!r} of {model_path}"
        if location == model_path.name:
            # Weights inside the model file itself (as load_skeleton leaves them): the file the
            # caller chose to open, whatever its name or links.
            data_file = model_path.resolve()
        else:
            data_file = files.get(location) or _resolve_location(model_path, location, tensor.name)
        try:
            offset = int(entries.get("offset", "0"))
            length = int(entries["length"]) if "length" in entries else None
        except ValueError:
            raise UnsafeExternalDataError(f"{where} has a non-numeric offset or length") from None
        size = data_file.stat().st_size
        expected = _expected_nbytes(tensor, where)
        if length is None:
            length = expected
        if offset < 0 or length < 0 or offset + length > size:
            raise UnsafeExternalDataError(
                f"{where} reads bytes {offset}..{offset + length} of {data_file.name}, "
                f"which has {size} bytes; the data file is truncated or the model is corrupt"
            )
        if length != expected:
            raise UnsafeExternalDataError(
                f"{where} declares {length} bytes of external data but its shape "
                f"{list(tensor.dims)} and type need {expected}"
            )
        files[location] = data_file
    return files


def load_model(path: Path) -> tuple[ir.Model, set[Path]]:
    """Load a model with its external data memory-mapped, after checking every reference.

    Returns the model and the external data files it reads.
    """
    path = Path(path)
    # Large weights stay in the file, memory-mapped on demand, never parsed into memory.
    proto = _skeleton(path)
    _refuse_sparse(proto.graph, path)
    locations = check_external_data(proto, path)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as e:  # a corrupt file can parse as protobuf yet not be a valid model
        raise WireFormatError(f"{path} is not a valid ONNX model: {e}") from e
    ir.external_data.set_base_dir(model.graph, path.parent.resolve())
    _pin_external_tensors(model, locations)
    data_files = set(locations.values()) - {path.resolve()}
    logger.debug("loaded %s (%d external data files)", path, len(data_files))
    return model, data_files


def read_metadata(path: Path) -> dict[str, str]:
    """A model file's metadata, its weights left unread."""
    return {entry.key: entry.value for entry in _skeleton(path).metadata_props}


def _skeleton(path: Path) -> onnx.ModelProto:
    """The model without its large weights' bytes, which stay in the file (``_wire``)."""
    try:
        return _wire.load_skeleton(path)
    except FileNotFoundError:
        raise ModelNotFoundError(f"{path} does not exist") from None
    except Exception as e:  # protobuf raises several unrelated types on a corrupt file
        raise WireFormatError(f"{path} is not a readable ONNX model: {e}") from e


def _refuse_sparse(graph: onnx.GraphProto, path: Path) -> None:
    """Sparse tensors would be lost on the way through onnx-ir; say so instead."""
    for current in graph_protos(graph):
        sparse = len(current.sparse_initializer) > 0
        for node in current.node:
            for attr in node.attribute:
                sparse |= attr.HasField("sparse_tensor") or len(attr.sparse_tensors) > 0
        if sparse:
            raise IncompatibleModelsError(
                f"{path} holds sparse tensors, which onnxmerge does not merge; export the model "
                "with dense weights"
            )


def _pinned(tensor: ir.TensorProtocol, locations: dict[str, Path]) -> ir.TensorProtocol:
    if not isinstance(tensor, ir.ExternalTensor) or tensor.location not in locations:
        return tensor
    if tensor.size == 0:
        return ir.Tensor(np.zeros(tensor.shape.numpy(), tensor.dtype.numpy()), name=tensor.name)
    return ir.ExternalTensor(
        os.fspath(locations[tensor.location]),
        tensor.offset,
        tensor.length,
        tensor.dtype,
        shape=tensor.shape,
        name=tensor.name,
        doc_string=tensor.doc_string,
        metadata_props=dict(tensor.metadata_props),
        base_dir="",
    )


def _pin_external_tensors(model: ir.Model, locations: dict[str, Path]) -> None:
    """Point external tensors at the files :func:`check_external_data` approved, by full path.

    The checks are done; reading by the approved path keeps a later change of links from
    redirecting a read, and lets the documented Hugging Face cache layout load.
    """
    for graph in (model.graph, *model.graph.subgraphs()):
        for value in graph.initializers.values():
            if value.const_value is not None:
                value.const_value = _pinned(value.const_value, locations)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for name, attr in list(node.attributes.items()):
            if attr.type == ir.AttributeType.TENSOR:
                pinned = _pinned(attr.value, locations)
                if pinned is not attr.value:
                    node.attributes[name] = ir.AttrTensor(name, pinned)
            elif attr.type == ir.AttributeType.TENSORS:
                tensors = [_pinned(t, locations) for t in attr.value]
                node.attributes[name] = ir.AttrTensors(name, tensors)


def file_bytes(path: Path, data_files: set[Path] | None = None) -> int:
    """Bytes on disk of a model file and its external data files."""
    return Path(path).stat().st_size + sum(f.stat().st_size for f in data_files or ())


def tensor_bytes(model: ir.Model) -> int:
    """Bytes of all initializers and Constant tensors, subgraphs included."""
    total = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.TENSOR:
                total += attr.value.nbytes
    return total


def data_file_name(output: Path) -> str:
    return output.name + "_data" if output.suffix == ".onnx" else output.name + ".data"


def _load_small_external_tensors(model: ir.Model, below: int) -> None:
    """Bring tensors the save keeps inline into memory, so none refers to an input's file."""
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and tensor.nbytes < below:
            value.const_value = ir.Tensor(np.array(tensor.numpy()), name=tensor.name)
            tensor.release()


def _release_mapped_weights(model: ir.Model) -> None:
    """Unmap input files the save touched, so their pages leave the resident set."""
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value.release()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _external_locations(model_path: Path) -> tuple[dict[str, Path], bool]:
    """An existing model's external-data locations (its own file left out), and whether onnxmerge
    wrote it; nothing if it is absent or unreadable."""
    if not model_path.is_file():
        return {}, False
    try:
        proto = _wire.load_skeleton(model_path)
        locations = check_external_data(proto, model_path)
    except Exception:  # an unreadable old output has no data we could safely delete
        return {}, False
    ours = any(p.key.startswith("onnxmerge.") for p in proto.metadata_props)
    locations.pop(model_path.name, None)
    return locations, ours


def data_files_of(model_path: Path) -> set[Path]:
    """The external data files an existing model reads, resolved."""
    return set(_external_locations(model_path)[0].values())


def _stale_data_links(model_path: Path) -> set[Path]:
    """Data files of an output onnxmerge wrote, as entries of its folder (links unresolved).

    Cleaning up removes these entries, never what a link points to (in a Hugging Face snapshot,
    a blob other revisions share), and never the data of a model onnxmerge did not write.
    """
    locations, ours = _external_locations(model_path)
    if not ours:
        return set()
    return {model_path.parent.joinpath(*Path(location).parts) for location in locations}


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path


def _free_data_name(output: Path) -> str:
    """``<name>_data``, or ``<stem>.<k><suffix>_data`` while that is taken by an older write."""
    name = data_file_name(output)
    counter = 0
    while (output.parent / name).exists():
        counter += 1
        name = data_file_name(output.with_name(f"{output.stem}.{counter}{output.suffix}"))
    return name


def check_output(
    output: str | os.PathLike,
    inputs: Iterable[str | os.PathLike],
    *,
    overwrite: bool,
    folder: bool = False,
) -> None:
    """Refuse an output every writer must refuse, before it reads or writes anything.

    Args:
        output: the file (or, with ``folder``, the folder) to write.
        inputs: every file (or folder) the write reads; none may be replaced by the output.
        overwrite: whether an existing output (a non-empty folder) may be replaced.
        folder: the output is a folder of files (a web site) rather than one model file.

    Raises:
        RefusedOutputError: the output (or a model's data file) is an input or holds one, exists
            without ``overwrite``, or is a folder where a file is written (or the reverse).
    """
    output = Path(output)
    read = [Path(path) for path in inputs]
    if folder:
        _check_output_folder(output, read, overwrite=overwrite)
        return
    for target in (output, output.parent / data_file_name(output)):
        for path in read:
            if target.exists() and path.exists() and os.path.samefile(target, path):
                raise RefusedOutputError(
                    f"the output {target} is the input {path}; choose another output path"
                )
    if output.exists() and not overwrite:
        raise RefusedOutputError(
            f"{output} exists; pass overwrite=True (--overwrite) to replace it"
        )
    if output.is_dir():
        raise RefusedOutputError(f"{output} is a folder; give a file path")


def _check_output_folder(output: Path, inputs: list[Path], *, overwrite: bool) -> None:
    for path in inputs:
        if _inside(path, output):
            raise RefusedOutputError(
                f"the folder {output} holds the input {path}; writing it would replace the "
                "input: choose another output folder"
            )
    if output.exists() and not output.is_dir():
        raise RefusedOutputError(f"{output} exists and is not a folder; choose another output")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise RefusedOutputError(
            f"{output} exists and is not empty; pass --overwrite (overwrite=True) to replace it, "
            "or choose another folder"
        )


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


Report = TypeVar("Report")


class WrittenPath(_SystemPath, Generic[Report]):
    """The path a writer wrote, carrying the writer's numbers in ``report``.

    It is a :class:`pathlib.Path`, so it goes wherever the path did (``str(path)``, ``open``,
    ``path.stat()``, ``path.parent``); paths derived from it carry no report.

    Example:
        >>> from onnxmerge.model_io import WrittenPath
        >>> written = WrittenPath.of("model.onnx", {"bytes": 1})
        >>> written.name, written.report
        ('model.onnx', {'bytes': 1})
    """

    report: Any = None

    @classmethod
    def of(cls, path: str | os.PathLike, report: Report) -> WrittenPath[Report]:
        """``path`` with ``report`` attached."""
        written = cls(path)
        written.report = report
        return written

    def with_segments(self, *segments: str | os.PathLike) -> Path:  # Python 3.12 and later
        return Path(*segments)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled with its report, as a batch worker sends results back.
        return (WrittenPath.of, (os.fspath(self), self.report))


def _new_file_mode(output: Path) -> int:
    """The permissions ``output`` would get from ``open()``, or keeps where it exists: a file
    made by ``mkstemp`` is its owner's alone."""
    with contextlib.suppress(OSError):
        return stat.S_IMODE(output.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def text_written_atomically(output: Path) -> Iterator[TextIO]:
    """A UTF-8 text stream that replaces ``output`` when the block ends without an error; on
    any error (or interruption) it is removed and ``output`` is left as it was. The folder is
    made here, so a path that cannot be written fails before any work."""
    folder = output.parent
    blocking = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise RefusedOutputError(f"cannot write {output}: {blocking} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise RefusedOutputError(f"cannot write {output}: {e.strerror or e}") from e
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="\n") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(name, _new_file_mode(output))
        os.replace(name, output)
        _fsync_dir(folder)  # the new name survives a power cut, as the model writer's does
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


def save_model_atomically(
    model: ir.Model,
    output: Path,
    *,
    external_data: bool | None = None,
    validate: Callable[[Path], None] | None = None,
    protected: frozenset[Path] = frozenset(),
) -> Path:
    """Write ``model`` to ``output`` all or nothing.

    With ``external_data=None`` the weights go to one ``<name>_data`` file beside the model when
    they would pass 2 GB; ``True`` forces that, ``False`` forbids it. ``validate`` is called on the
    written temporary file before it replaces anything. Data files of a replaced output are
    removed afterwards, except those in ``protected`` (the inputs).
    """
    output = Path(output)
    folder = output.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RefusedOutputError(f"cannot create the output folder {folder}: {e}") from e
    external_data = _room_for(model, folder, external_data)
    old_data = {link for link in _stale_data_links(output) if _resolved(link) not in set(protected)}
    data_name = _free_data_name(output) if external_data else None
    try:
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=folder))
    except OSError as e:
        raise RefusedOutputError(f"cannot write in {folder}: {e}") from e
    try:
        written = _write_staged(model, tmp_dir, output, data_name, validate)
        _publish(written, output)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    for stale in old_data - _stale_data_links(output):
        with contextlib.suppress(OSError):
            stale.unlink()
    logger.info("wrote %s", output)
    return output


def _room_for(model: ir.Model, folder: Path, external_data: bool | None) -> bool:
    """Whether the weights go to a data file; refuses a write the file system cannot hold."""
    payload = tensor_bytes(model)
    if external_data is None:
        external_data = payload > EXTERNAL_DATA_THRESHOLD
    elif not external_data and payload > EXTERNAL_DATA_THRESHOLD:
        raise RefusedOutputError(
            f"the merged model holds {payload / 2**30:.2f} GiB of tensors, more than one ONNX "
            "file can hold without external data; allow external data"
        )
    free = shutil.disk_usage(folder).free
    # A single-file output holds its weights twice while it is built: staging data, then inline.
    needed = payload * (1 if external_data else 2) + 16 * 2**20
    if free < needed:
        raise RefusedOutputError(
            f"{folder} has {free / 2**20:.0f} MiB free; the merged model needs about "
            f"{needed / 2**20:.0f} MiB while it is written; free some space or choose another "
            "output"
        )
    return external_data


def _write_staged(
    model: ir.Model,
    tmp_dir: Path,
    output: Path,
    data_name: str | None,
    validate: Callable[[Path], None] | None,
) -> list[Path]:
    """Save into the staging folder and check; the files to publish, the data file first."""
    tmp_model = tmp_dir / output.name
    try:
        # Weights are streamed to a data file first (tensors under 1 KiB stay inline, as in
        # optimum's exports); a single-file output then copies them in, slice by slice. No step
        # holds the serialised model in memory.
        staging = data_name or data_file_name(output)
        _load_small_external_tensors(model, 1024)
        ir.save(model, tmp_model, external_data=staging, size_threshold_bytes=1024)
        _release_mapped_weights(model)
        if validate is not None:
            # Checked with its weights still in the data file: the checker then reads only the
            # graph, not every weight.
            validate(tmp_model)
        written = [tmp_model]
        if data_name is not None:
            if (tmp_dir / data_name).exists():
                written.insert(0, tmp_dir / data_name)
        elif (tmp_dir / staging).exists():
            single = tmp_dir / f"{output.name}.single"
            _wire.inline_external_data(tmp_model, tmp_dir / staging, single)
            os.replace(single, tmp_model)
            (tmp_dir / staging).unlink()
        for path in written:
            _fsync(path)
    except OSError as e:
        raise RefusedOutputError(f"writing {output} failed: {e}; nothing was replaced") from e
    return written


def _publish(written: list[Path], output: Path) -> None:
    """Move the staged files beside ``output``, the data file first: until the model file is
    replaced, the previous output still reads its own, untouched data."""
    folder = output.parent
    published: list[Path] = []
    try:
        for path in written:
            os.replace(path, folder / path.name)
            published.append(folder / path.name)
        _fsync_dir(folder)
    except OSError as e:
        # A data file already moved in is read by no model yet: take it back out.
        for path in published:
            if path != output:
                with contextlib.suppress(OSError):
                    path.unlink()
        raise RefusedOutputError(f"writing {output} failed: {e}; nothing was replaced") from e
