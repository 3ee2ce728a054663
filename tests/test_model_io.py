"""Safe reading of external data, and atomic writing of the merged model."""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
import pytest

from onnxmerge import (
    RefusedOutputError,
    UnsafeExternalDataError,
    merge_seq2seq,
    merge_seq2seq_with_report,
    model_io,
)
from tests import textmodels as tm

WEIGHT = np.arange(256, dtype=np.float32).reshape(16, 16) / 7.0

TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 16] x) => (float[2, 16] y) { y = MatMul(x, w) }
"""


def _external_model(
    folder: Path,
    location: str,
    *,
    offset: int | None = None,
    length: int | None = None,
    write_data: bool = True,
) -> Path:
    """A model whose only weight ``w`` is external data at ``location`` (relative to folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = tm.proto_from_text(TEXT, {"w": WEIGHT})
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entries = {"location": location}
    if offset is not None:
        entries["offset"] = str(offset)
    if length is not None:
        entries["length"] = str(length)
    for key, value in entries.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    if write_data:
        target = Path(location) if os.path.isabs(location) else folder / location
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(WEIGHT.tobytes())
    path = folder / "model.onnx"
    onnx.save(model, os.fspath(path))
    return path


def _temp_leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or ".tmp" in p.name)


# ------------------------------------------------------------------ reading


def test_external_data_is_memory_mapped(tmp_path):
    path = _external_model(tmp_path / "m", "weights.bin", offset=0, length=WEIGHT.nbytes)
    model, data_files = model_io.load_model(path)
    assert data_files == {(tmp_path / "m" / "weights.bin").resolve()}
    tensor = model.graph.initializers["w"].const_value
    assert isinstance(tensor, ir.ExternalTensor)
    np.testing.assert_array_equal(tensor.numpy(), WEIGHT)
    assert isinstance(tensor.raw, mmap.mmap)


@pytest.mark.parametrize(
    "location", ["weights.bin", "sub/weights.bin", "./weights.bin", "model.onnx.data"]
)
def test_relative_locations_inside_the_folder_load(tmp_path, location):
    path = _external_model(tmp_path / "m", location)
    model, _ = model_io.load_model(path)
    np.testing.assert_array_equal(model.graph.initializers["w"].const_value.numpy(), WEIGHT)


def test_symlink_inside_the_folder_loads(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "real.bin").write_bytes(WEIGHT.tobytes())
    (folder / "link.bin").symlink_to(folder / "real.bin")
    path = _external_model(folder, "link.bin", write_data=False)
    model, _ = model_io.load_model(path)
    np.testing.assert_array_equal(model.graph.initializers["w"].const_value.numpy(), WEIGHT)


def test_absolute_location_is_refused(tmp_path):
    outside = tmp_path / "outside.bin"
    path = _external_model(tmp_path / "m", os.fspath(outside))
    with pytest.raises(UnsafeExternalDataError, match="absolute"):
        model_io.load_model(path)


@pytest.mark.parametrize("location", ["../outside.bin", "sub/../../outside.bin"])
def test_parent_folder_location_is_refused(tmp_path, location):
    (tmp_path / "outside.bin").write_bytes(WEIGHT.tobytes())
    path = _external_model(tmp_path / "m", location, write_data=False)
    (tmp_path / "m" / "sub").mkdir()
    with pytest.raises(UnsafeExternalDataError, match="outside"):
        model_io.load_model(path)


@pytest.mark.parametrize(
    ("link", "match"),
    [(lambda target, link: link.symlink_to(target), "outside"), (os.link, "hard links")],
    ids=["symlink", "hard link"],
)
def test_data_file_linked_to_a_file_outside_is_refused(tmp_path, link, match):
    (tmp_path / "secret.bin").write_bytes(WEIGHT.tobytes())
    folder = tmp_path / "m"
    folder.mkdir()
    link(tmp_path / "secret.bin", folder / "weights.bin")
    path = _external_model(folder, "weights.bin", write_data=False)
    with pytest.raises(UnsafeExternalDataError, match=match):
        model_io.load_model(path)


def _hf_snapshot(tmp_path: Path, repo_name: str = "models--org--name") -> tuple[Path, Path]:
    """A Hugging Face cache repo: snapshots/<rev>/ holds links into blobs/."""
    repo = tmp_path / "hub" / repo_name
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / "f00d").write_bytes(WEIGHT.tobytes())
    (snapshot / "model.onnx_data").symlink_to(Path("..") / ".." / "blobs" / "f00d")
    return repo, snapshot


def test_hugging_face_cache_links_into_its_blobs_load(tmp_path):
    repo, snapshot = _hf_snapshot(tmp_path)
    path = _external_model(snapshot, "model.onnx_data", write_data=False)
    model, data_files = model_io.load_model(path)
    assert data_files == {(repo / "blobs" / "f00d").resolve()}
    np.testing.assert_array_equal(model.graph.initializers["w"].const_value.numpy(), WEIGHT)


def test_links_into_blobs_are_accepted_only_inside_a_cache_repo(tmp_path):
    _, snapshot = _hf_snapshot(tmp_path, repo_name="not-a-cache-repo")
    path = _external_model(snapshot, "model.onnx_data", write_data=False)
    with pytest.raises(UnsafeExternalDataError, match="outside"):
        model_io.load_model(path)


@pytest.mark.parametrize(
    ("offset", "length", "match"),
    [
        (0, 2 * WEIGHT.nbytes, "truncated"),
        (512, WEIGHT.nbytes, "truncated"),
        (-4, WEIGHT.nbytes, "truncated"),
        (0, WEIGHT.nbytes // 2, "need"),
        (None, None, None),  # no offset, no length: fine when the file holds the tensor
    ],
)
def test_offset_and_length_must_fit(tmp_path, offset, length, match):
    path = _external_model(tmp_path / "m", "weights.bin", offset=offset, length=length)
    if match is None:
        model_io.load_model(path)
        return
    with pytest.raises(UnsafeExternalDataError, match=match):
        model_io.load_model(path)


def test_file_shorter_than_the_tensor_without_length_is_refused(tmp_path):
    path = _external_model(tmp_path / "m", "weights.bin")
    (tmp_path / "m" / "weights.bin").write_bytes(WEIGHT.tobytes()[:100])
    with pytest.raises(UnsafeExternalDataError, match="truncated"):
        model_io.load_model(path)


def test_missing_data_file_and_folder_as_data_are_refused(tmp_path):
    path = _external_model(tmp_path / "m", "missing.bin", write_data=False)
    with pytest.raises(UnsafeExternalDataError, match="does not exist"):
        model_io.load_model(path)
    (tmp_path / "m" / "missing.bin").mkdir()
    with pytest.raises(UnsafeExternalDataError, match="not a regular file"):
        model_io.load_model(path)


def test_non_numeric_offset_is_refused(tmp_path):
    path = _external_model(tmp_path / "m", "weights.bin")
    model = onnx.load(os.fspath(path), load_external_data=False)
    entry = model.graph.initializer[0].external_data.add()
    entry.key, entry.value = "offset", "zero"
    onnx.save(model, os.fspath(path))
    with pytest.raises(UnsafeExternalDataError, match="non-numeric"):
        model_io.load_model(path)


def test_external_data_inside_a_subgraph_constant_is_checked(tmp_path):
    (tmp_path / "outside.bin").write_bytes(WEIGHT.tobytes())
    tensor = onnx.numpy_helper.from_array(WEIGHT, "c")
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "../outside.bin"
    then_branch = onnx.helper.make_graph(
        [onnx.helper.make_node("Constant", [], ["t"], value=tensor)],
        "t",
        [],
        [onnx.helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [16, 16])],
    )
    else_branch = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["w"], ["e"])],
        "e",
        [],
        [onnx.helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [16, 16])],
    )
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node(
                "If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch
            )
        ],
        "g",
        [onnx.helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [16, 16])],
        initializer=[onnx.numpy_helper.from_array(WEIGHT, "w")],
    )
    folder = tmp_path / "m"
    folder.mkdir()
    onnx.save(onnx.helper.make_model(graph), os.fspath(folder / "model.onnx"))
    with pytest.raises(UnsafeExternalDataError, match="outside"):
        model_io.load_model(folder / "model.onnx")


def test_unsafe_export_folder_is_refused_before_anything_is_written(tmp_path):
    folder = tm.write_export(tmp_path / "export", external_data=True)
    (tmp_path / "secret.bin").write_bytes(b"\0" * 10_000)
    data = folder / (tm.DECODER + "_data")
    data.unlink()
    data.symlink_to(tmp_path / "secret.bin")
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(UnsafeExternalDataError, match=tm.DECODER):
        merge_seq2seq(folder)
    assert sorted(p.name for p in folder.iterdir()) == before


# ------------------------------------------------------------------ writing


def test_data_file_name():
    assert model_io.data_file_name(Path("a/model.onnx")) == "model.onnx_data"
    assert model_io.data_file_name(Path("a/model.bin")) == "model.bin.data"


def test_external_data_is_written_when_asked(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    output = tmp_path / "out" / "model.onnx"
    result = merge_seq2seq_with_report(folder, output, external_data=True)
    assert sorted(p.name for p in output.parent.iterdir()) == ["model.onnx", "model.onnx_data"]
    data = output.parent / "model.onnx_data"
    assert result.output_bytes == output.stat().st_size + data.stat().st_size
    loaded = onnx.load(os.fspath(output))  # reads the data file
    embedding = next(t for t in loaded.graph.initializer if t.name == tm.EMBEDDING)
    np.testing.assert_array_equal(
        onnx.numpy_helper.to_array(embedding), tm.make_weights(0)[tm.EMBEDDING]
    )
    inputs = tm.sample_inputs()
    first, cached = tm.run_sources(folder, inputs)
    assert tm.max_abs_diff(first, tm.run_merged(output, inputs, use_cache=False)) <= 1e-6
    assert tm.max_abs_diff(cached, tm.run_merged(output, inputs, use_cache=True)) <= 1e-6


def test_rewriting_external_data_does_not_append(tmp_path):
    # onnx.save(save_as_external_data=True) appends to an existing data file.
    folder = tm.write_export(tmp_path / "export")
    output = tmp_path / "out" / "model.onnx"
    merge_seq2seq(folder, output, external_data=True)
    data = output.parent / "model.onnx_data"
    first = data.read_bytes()
    merge_seq2seq(folder, output, external_data=True, overwrite=True)
    # The new data goes to a fresh file (the old output reads the old one until replaced);
    # the old file is removed once the new model is in place.
    (current,) = model_io.data_files_of(output)
    assert current.read_bytes() == first
    assert sorted(p.name for p in output.parent.iterdir()) == sorted(["model.onnx", current.name])
    onnx.checker.check_model(os.fspath(output), full_check=True)
    merge_seq2seq(folder, output, external_data=True, overwrite=True)
    assert model_io.data_files_of(output) == {data}


def test_saving_leaves_the_callers_model_usable(tmp_path):
    # onnx.save(save_as_external_data=True) clears raw_data in the caller's model.
    model = tm.ir_from_text(TEXT, {"w": WEIGHT})
    model_io.save_model_atomically(model, tmp_path / "a.onnx", external_data=True)
    np.testing.assert_array_equal(model.graph.initializers["w"].const_value.numpy(), WEIGHT)
    model_io.save_model_atomically(model, tmp_path / "b.onnx", external_data=False)
    loaded = onnx.load(os.fspath(tmp_path / "b.onnx"))
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(loaded.graph.initializer[0]), WEIGHT)


def test_large_models_get_external_data_automatically(tmp_path, monkeypatch):
    monkeypatch.setattr(model_io, "EXTERNAL_DATA_THRESHOLD", 4096)
    folder = tm.write_export(tmp_path / "export")
    result = merge_seq2seq_with_report(folder, tmp_path / "out" / "model.onnx")
    data = tmp_path / "out" / "model.onnx_data"
    assert data.exists()
    assert result.output_bytes == result.path.stat().st_size + data.stat().st_size
    with pytest.raises(RefusedOutputError, match="external data"):
        merge_seq2seq(folder, tmp_path / "out2" / "model.onnx", external_data=False)
    assert not (tmp_path / "out2" / "model.onnx").exists()


def test_not_enough_disk_space_is_refused(tmp_path, monkeypatch):
    folder = tm.write_export(tmp_path / "export")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(model_io.shutil, "disk_usage", lambda _: usage._replace(free=1000))
    with pytest.raises(RefusedOutputError, match="free"):
        merge_seq2seq(folder)
    assert not (folder / "model.onnx").exists()
    assert _temp_leftovers(folder) == []


# ------------------------------------------------------------------ failures while saving


@pytest.fixture
def previous_output(tmp_path) -> tuple[Path, Path, bytes]:
    """An export folder, and a merged model of another checkpoint already at its output path."""
    folder = tm.write_export(tmp_path / "export", seed=0)
    other = tm.write_export(tmp_path / "other", seed=1)
    output = tmp_path / "out" / "model.onnx"
    merge_seq2seq(other, output)
    return folder, output, output.read_bytes()


def test_failure_inside_save_keeps_the_previous_output(previous_output, monkeypatch):
    folder, output, previous = previous_output
    real_save = ir.save

    def save_half_then_fail(model, path, **kwargs):
        real_save(model, path, **kwargs)
        with open(path, "r+b") as f:
            f.truncate(100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ir, "save", save_half_then_fail)
    # An OSError while writing is the output's problem: reported as a refused output.
    with pytest.raises(RefusedOutputError, match="No space"):
        merge_seq2seq(folder, output, overwrite=True)
    assert output.read_bytes() == previous
    assert _temp_leftovers(output.parent) == []
    assert sorted(p.name for p in output.parent.iterdir()) == ["model.onnx"]


def test_failing_replace_keeps_the_previous_output(previous_output, monkeypatch):
    folder, output, previous = previous_output

    def fail(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(model_io.os, "replace", fail)
    with pytest.raises(RefusedOutputError, match="Input/output error"):
        merge_seq2seq(folder, output, overwrite=True)
    assert output.read_bytes() == previous
    assert sorted(p.name for p in output.parent.iterdir()) == ["model.onnx"]


def test_failure_between_data_and_model_keeps_the_previous_output(tmp_path, monkeypatch):
    folder = tm.write_export(tmp_path / "export", seed=0)
    output = tmp_path / "out" / "model.onnx"
    merge_seq2seq(tm.write_export(tmp_path / "other", seed=1), output, external_data=True)
    inputs = tm.sample_inputs()
    before = tm.run_merged(output, inputs, use_cache=False)
    real_replace = os.replace

    def fail_on_the_model(src, dst, **kwargs):
        # The data file is already in place when the model file is moved.
        if Path(dst) == output:
            raise OSError(5, "Input/output error")
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(model_io.os, "replace", fail_on_the_model)
    with pytest.raises(RefusedOutputError):
        merge_seq2seq(folder, output, overwrite=True, external_data=True)
    monkeypatch.undo()
    assert _temp_leftovers(output.parent) == []
    # The new data file that was moved in first is taken back out: only the old pair is left.
    assert sorted(p.name for p in output.parent.iterdir()) == ["model.onnx", "model.onnx_data"]
    after = tm.run_merged(output, inputs, use_cache=False)
    assert tm.max_abs_diff(before, after) == 0.0


@pytest.mark.parametrize("write", ["model", "text"])
def test_writers_sync_the_folder_after_the_new_name_is_in_place(tmp_path, monkeypatch, write):
    """A renamed file's new name lives in its folder: without syncing the folder after
    ``os.replace``, a power cut can bring back the old file or none."""
    output = tmp_path / "out" / "result"
    events: list[tuple[str, Path]] = []
    real_replace = os.replace

    def replace(src, dst, **kwargs):
        real_replace(src, dst, **kwargs)
        events.append(("replace", Path(dst)))

    monkeypatch.setattr(model_io.os, "replace", replace)
    monkeypatch.setattr(model_io, "_fsync_dir", lambda path: events.append(("sync", Path(path))))
    if write == "model":
        merge_seq2seq(tm.write_export(tmp_path / "export", seed=0), output)
    else:
        with model_io.text_written_atomically(output) as stream:
            stream.write("one line\n")
    assert events[-1] == ("sync", output.parent)
    assert ("replace", output) in events[:-1]


def test_check_output_of_a_folder(tmp_path):
    from onnxmerge.model_io import check_output

    source = tmp_path / "export"
    source.mkdir()
    with pytest.raises(RefusedOutputError, match="holds the input"):
        check_output(tmp_path, [source], overwrite=True, folder=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(RefusedOutputError, match="not a folder"):
        check_output(tmp_path / "file", [source], overwrite=True, folder=True)
    (tmp_path / "site").mkdir()
    check_output(tmp_path / "site", [source], overwrite=False, folder=True)  # empty: taken
    (tmp_path / "site" / "index.html").write_text("x")
    with pytest.raises(RefusedOutputError, match="not empty.*overwrite"):
        check_output(tmp_path / "site", [source], overwrite=False, folder=True)
    check_output(tmp_path / "site", [source], overwrite=True, folder=True)
    with pytest.raises(RefusedOutputError, match="is a folder"):
        check_output(tmp_path / "site", [], overwrite=True)


def test_a_written_path_goes_wherever_a_path_did(tmp_path):
    import pickle

    from onnxmerge.model_io import WrittenPath

    (tmp_path / "model.onnx").write_bytes(b"12345")
    written = WrittenPath.of(tmp_path / "model.onnx", {"bytes": 5})
    assert written == tmp_path / "model.onnx" and hash(written) == hash(tmp_path / "model.onnx")
    assert {written: 1}[tmp_path / "model.onnx"] == 1
    assert os.fspath(written) == str(tmp_path / "model.onnx")
    with open(written, "rb") as f:
        assert f.read() == b"12345"
    assert written.stat().st_size == 5 and Path(written).read_bytes() == b"12345"
    assert written.with_suffix(".txt").name == "model.txt" and written.parent == tmp_path
    assert (written.parent / "x").name == "x"
    assert pickle.loads(pickle.dumps(written)).report == {"bytes": 5}
