"""One-file models opened through their skeleton: onnxruntime maps the weights from inside the
file. The same logits and tokens as opening by path; by path where no skeleton can be built; a
file rewritten under an open model is refused, a file replaced by a rename is not seen."""

from __future__ import annotations

import gc
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxmerge import _ort
from onnxmerge.errors import GenerationError

pytest.importorskip("onnxruntime")

ARCHS = ("marian", "t5", "whisper", "m2m100")
PRECISIONS = ("float32", "int8", "int4")
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's"
)

_written: dict = {}


@pytest.fixture(scope="module")
def written(tiny_export, tmp_path_factory):
    """``written(arch, precision)`` -> (one-file model, export), built once."""
    import onnxmerge

    def get(arch: str, precision: str = "float32"):
        if (arch, precision) not in _written:
            export = tiny_export(arch)
            folder = tmp_path_factory.mktemp(f"{arch}-{precision}")
            path = onnxmerge.merge_seq2seq(export.onnx_dir, folder / "model.onnx")
            if precision != "float32":
                path = onnxmerge.quantize(path, weights=precision)
            _written[arch, precision] = (Path(path), export)
        return _written[arch, precision]

    return get


def _options():
    return _ort.session_options(threads=1, spinning=False)


def _open(path: Path, *, by_path: bool = False):
    from onnxmerge import Seq2SeqModel
    from onnxmerge.runtime import Accelerations

    opening = Accelerations(mapped_open=not by_path)
    return Seq2SeqModel(path, session_options=_options(), accelerations=opening)


def _maps(path: Path) -> bool:
    """Whether this process maps ``path``."""
    target = str(path.resolve())
    return any(line.rstrip("\n").endswith(" " + target) for line in open("/proc/self/maps"))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_skeleton_opening_gives_what_opening_by_path_gives(written, arch, precision):
    from tests import zoo

    path, export = written(arch, precision)
    assert _ort.mapped_skeleton(path) is not None  # its large weights are mapped, not parsed
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=3)
    mapped, by_path = _open(path), _open(path, by_path=True)
    start = np.full((2, 1), mapped.resolve_settings().decoder_start_token_id, dtype=np.int64)
    np.testing.assert_array_equal(
        mapped.first_step(inputs, start).logits, by_path.first_step(inputs, start).logits
    )
    for settings in ({}, {"num_beams": 3}):
        np.testing.assert_array_equal(
            mapped.generate(**inputs, max_new_tokens=8, **settings),
            by_path.generate(**inputs, max_new_tokens=8, **settings),
        )


@linux_only
def test_a_skeleton_opening_maps_the_model_file(written):
    path, _ = written("marian")
    model = _open(path)
    assert _maps(path)
    del model
    gc.collect()
    model = _open(path, by_path=True)  # Accelerations(mapped_open=False): parsed, not mapped
    assert not _maps(path)
    del model


def test_a_skeleton_opening_keeps_neither_the_skeleton_nor_the_graph(written):
    """onnxruntime's Python session keeps the bytes it was given for its life; a CPU session
    falls back to no other provider, so the skeleton is let go. The graph structure read at
    load is not kept either: the model still runs after both are gone."""
    from onnxmerge import _wire

    path, _ = written("marian")
    session = _ort.open_session(path, _options())
    assert _ort.mapped_skeleton(path) is not None
    assert session._model_bytes is None

    def structures() -> int:
        gc.collect()
        return sum(isinstance(o, _wire.Node) for o in gc.get_objects())

    before = structures()
    model = _open(path)
    assert structures() == before
    assert model.generate(input_ids=np.array([[5, 6, 1]]), max_new_tokens=3).shape[0] == 1


def _typed_fields_copy(source: Path, target: Path) -> Path:
    """``source`` with every float initializer stored as ``float_data``, which a skeleton leaves
    inline: nothing would be mapped."""
    model = onnx.load(source)
    for tensor in model.graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT and tensor.HasField("raw_data"):
            values = onnx.numpy_helper.to_array(tensor).ravel()
            tensor.ClearField("raw_data")
            tensor.float_data.extend(values.tolist())
    onnx.save(model, target)
    return target


@linux_only
def test_a_file_without_a_skeleton_opens_by_path(written, tmp_path):
    from tests import zoo

    path, export = written("marian")
    typed = _typed_fields_copy(path, tmp_path / "model.onnx")
    assert _ort.mapped_skeleton(typed) is None
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=4)
    model = _open(typed)
    assert not _maps(typed)
    np.testing.assert_array_equal(
        model.generate(**inputs, max_new_tokens=8),
        _open(path, by_path=True).generate(**inputs, max_new_tokens=8),
    )


@linux_only
def test_a_file_the_wire_reader_refuses_opens_by_path(written, tmp_path, monkeypatch):
    from onnxmerge import _wire
    from onnxmerge.errors import WireFormatError

    path, _ = written("t5")
    copy = Path(shutil.copy(path, tmp_path / "model.onnx"))

    def refuse(path, min_bytes=1024):
        raise WireFormatError("refused")

    monkeypatch.setattr(_wire, "skeleton_bytes", refuse)
    model = _open(copy)
    assert not _maps(copy)
    assert model.generate(input_ids=np.array([[5, 6, 1]]), max_new_tokens=3).shape[0] == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_the_graph_structure_is_the_skeletons(written, arch):
    """The runtime reads which node reads what field by field, without protobuf: the same
    nodes, in the same order at every depth, and the same initializers and data references as
    the parsed skeleton."""
    from onnxmerge import _proto, _wire

    for precision in PRECISIONS:
        path, _ = written(arch, precision)
        structure = _wire.graph_structure(path)
        skeleton = _wire.load_skeleton(path).graph
        ours = [
            (n.op_type, n.domain, n.input, n.output) for g in structure.graphs() for n in g.node
        ]
        theirs = [
            (n.op_type, n.domain, tuple(n.input), tuple(n.output))
            for g in _proto.graph_protos(skeleton)
            for n in g.node
        ]
        assert ours == theirs
        assert [(t.name, t.external_data) for t in structure.initializer] == [
            (t.name, {e.key: e.value for e in t.external_data}) for t in skeleton.initializer
        ]
        assert any(t.external_data for t in structure.initializer)


@linux_only
def test_page_release_leaves_other_files_mappings_alone(written, tmp_path):
    """Release drops only the pages of the model's own files; another file of the folder,
    mapped by this process and read, keeps its pages resident."""
    import mmap

    from onnxmerge.runtime._memory import release_mapped_weights
    from tests.smaps import resident_bytes

    path, _ = written("marian")
    folder = tmp_path / "both"
    folder.mkdir()
    model_path = Path(shutil.copy(path, folder / "model.onnx"))
    other = folder / "other.onnx"
    other.write_bytes(bytes(range(256)) * (4 * mmap.PAGESIZE // 256))
    with other.open("rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        model = _open(model_path)
        assert bytes(view[:: mmap.PAGESIZE])  # every page resident
        address = np.frombuffer(view, np.uint8).ctypes.data
        before = resident_bytes(address)
        assert before == 4 * mmap.PAGESIZE
        release_mapped_weights(model_path)
        assert resident_bytes(address) == before
        del model
    finally:
        view.close()


def test_a_file_replaced_by_a_rename_leaves_an_open_model_as_it_was(written, tmp_path):
    from tests import zoo

    path, export = written("marian")
    copy = Path(shutil.copy(path, tmp_path / "model.onnx"))
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=5)
    model = _open(copy)
    expected = model.generate(**inputs, max_new_tokens=8)
    other, _ = written("marian", "int8")
    shutil.copy(other, tmp_path / "next.onnx")
    os.replace(tmp_path / "next.onnx", copy)  # as onnxmerge's writers replace a file
    np.testing.assert_array_equal(model.generate(**inputs, max_new_tokens=8), expected)


@linux_only
def test_a_file_rewritten_in_place_under_an_open_model_is_refused(written, tmp_path):
    from tests import zoo

    path, export = written("marian")
    copy = Path(shutil.copy(path, tmp_path / "model.onnx"))
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=6)
    model = _open(copy)
    model.generate(**inputs, max_new_tokens=4)
    content = copy.read_bytes()
    with copy.open("r+b") as f:  # as `cp` writes over a file: the same inode, new bytes
        f.write(content[::-1][: len(content) // 2])
    with pytest.raises(GenerationError, match="written to since the model was opened"):
        model.generate(**inputs, max_new_tokens=4)
    # A model opened by path holds none of the file: it runs on.
    del model
    gc.collect()
    copy.write_bytes(content)
    by_path = _open(copy, by_path=True)
    with copy.open("r+b") as f:
        f.write(content[: len(content) // 2])
    by_path.generate(**inputs, max_new_tokens=4)
