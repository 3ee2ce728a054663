"""Memory handed back after loading: only pages that a file can give again are dropped."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest

from onnxmerge.runtime._memory import clean_file_mappings, is_data_file_of, release_mapped_weights
from tests.smaps import resident_bytes, resident_bytes_of

PAGE = mmap.PAGESIZE

SMAPS = """\
7f0000000000-7f0000004000 rw-p 00000000 fe:00 11 /models/a/model.onnx_data
Rss:                  16 kB
Anonymous:             0 kB
7f0000004000-7f0000008000 rw-p 00004000 fe:00 11 /models/a/model.onnx_data
Rss:                  16 kB
Anonymous:             4 kB
7f0000008000-7f000000c000 r-xp 00000000 fe:00 12 /models/a/model.so
Anonymous:             0 kB
7f000000c000-7f0000010000 r--p 00000000 fe:00 13 /models/b/model.onnx_data
Anonymous:             0 kB
7f0000014000-7f0000018000 r--p 00000000 fe:00 14 /models/a/model_int8.onnx_data
Anonymous:             0 kB
7f0000018000-7f000001c000 r--p 00000000 fe:00 15 /models/a/model.1.onnx_data
Anonymous:             0 kB
7f0000010000-7f0000014000 rw-p 00000000 00:00 0
Anonymous:            16 kB
7f000001c000-7f0000020000 rw-p 00004000 fe:00 16 /models/a/model.onnx
Anonymous:             0 kB
7f0000020000-7f0000024000 rw-p 00000000 fe:00 17 /models/a/other.onnx
Anonymous:             0 kB
7f0000024000-7f0000028000 rw-p 00000000 fe:00 18 /models/b/model.onnx
Anonymous:             0 kB
"""


def test_only_unwritten_mappings_of_the_model_data_are_chosen(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    chosen = is_data_file_of(Path("/models/a/model.onnx"))
    assert clean_file_mappings(chosen, str(smaps)) == [
        (0x7F0000000000, 0x7F0000004000),
        (0x7F0000018000, 0x7F000001C000),
        (0x7F000001C000, 0x7F0000020000),  # the model file itself, opened through its skeleton
    ]


def test_proc_files_are_read_line_by_line_and_an_unreadable_one_gives_nothing(tmp_path):
    """The readers of /proc iterate the file: a trailing newline is not part of a path, and
    a file that cannot be read reads as no mapping."""
    from onnxmerge.runtime._memory import _lines, mapped_file_states

    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    assert list(_lines(str(smaps)))[-1] == "Anonymous:             0 kB"
    assert list(_lines(str(tmp_path / "absent"))) == []
    assert clean_file_mappings(lambda path: True, str(tmp_path / "absent")) == []
    assert mapped_file_states(Path("/models/a/model.onnx"), str(tmp_path / "absent")) == {}
    model = tmp_path / "model.onnx"
    model.write_bytes(b"x")
    maps = tmp_path / "maps"
    maps.write_text(f"7f0000000000-7f0000001000 r--p 00000000 fe:00 11 {model}\n")
    assert list(mapped_file_states(model, str(maps))) == [str(model)]


def _mapped_data(folder: Path) -> tuple[Path, Path, bytes, mmap.mmap]:
    """A model's data file of eight pages, mapped private and writable as onnxruntime maps
    external data: the model's path, the file's, its bytes and the mapping."""
    model, data = folder / "model.onnx", folder / "model.onnx_data"
    content = bytes(range(256)) * (8 * PAGE // 256)
    data.write_bytes(content)
    with data.open("rb") as f:
        return model, data, content, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")
def test_clean_pages_are_dropped_and_written_pages_kept(tmp_path):
    model, _, content, view = _mapped_data(tmp_path)
    try:
        start = next(s for s, _ in clean_file_mappings(is_data_file_of(model)))
        assert bytes(view) == content  # every page resident now
        assert resident_bytes(start) >= 8 * PAGE

        assert release_mapped_weights(model) == 8 * PAGE
        assert resident_bytes(start) == 0
        assert bytes(view) == content  # read back from the file

        view[0] = 255  # a page of the process's own now: the mapping is left alone
        assert clean_file_mappings(is_data_file_of(model)) == []
        assert release_mapped_weights(model) == 0
        assert view[0] == 255 and bytes(view[1:]) == content[1:]
    finally:
        view.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")
def test_gathered_pages_drop_only_the_pages_of_their_tensors(tmp_path):
    from onnxmerge.runtime._memory import GatheredPages

    model, data, content, view = _mapped_data(tmp_path)
    try:
        start = next(s for s, _ in clean_file_mappings(is_data_file_of(model)))
        # Pages 2-4 are the gathered tensor's; its first and last bytes share pages with others.
        gathered = GatheredPages(model, [(data, 2 * PAGE - 8, 3 * PAGE + 16)])
        assert gathered.regions == [(start + 2 * PAGE, start + 5 * PAGE)]
        assert bytes(view) == content
        gathered.drop()
        assert resident_bytes_of(data) == (8 - 3) * PAGE
        assert bytes(view) == content  # read back from the file
        assert GatheredPages(model, [(tmp_path / "other.onnx_data", 0, PAGE)]).regions == []
    finally:
        view.close()
    # Unmapped (its session gone), the addresses may hold other memory now, which dropping
    # would zero: the region is forgotten, not dropped.
    gathered.drop()
    assert gathered.regions == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")
def test_gathered_pages_of_the_model_file_itself(tmp_path):
    """A one-file model opened through its skeleton: onnxruntime maps the weights from the model
    file, whose pages are dropped as a data file's are, while its mapping is the file's."""
    from onnxmerge.runtime._memory import GatheredPages

    model = tmp_path / "model.onnx"
    content = bytes(range(256)) * (8 * PAGE // 256)
    model.write_bytes(content)
    with model.open("rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        start = next(s for s, _ in clean_file_mappings(is_data_file_of(model)))
        gathered = GatheredPages(model, [(model, PAGE, 2 * PAGE)])
        assert gathered.regions == [(start + PAGE, start + 3 * PAGE)]
        assert bytes(view) == content
        gathered.drop()
        assert resident_bytes_of(model) == (8 - 2) * PAGE
        assert bytes(view) == content
    finally:
        view.close()
    gathered.drop()  # the mapping is gone: forgotten, never dropped
    assert gathered.regions == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")
def test_a_gathered_row_maps_its_own_pages_not_a_large_folio(tmp_path):
    """Regression: where the page cache held the file in large folios (ext4, Linux 6.x), reading
    one row of an embedding mapped 2 MB around it, and one input's rows 66 MB of the opus-mt
    embedding for the step."""
    from onnxmerge.runtime._memory import GatheredPages

    model = tmp_path / "model.onnx"
    size = 16 * 1024 * 1024
    with model.open("wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())  # clean pages, as a model saved a while ago has
    assert len(model.read_bytes()) == size  # cached, in large folios where the kernel has them
    with model.open("rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        gathered = GatheredPages(model, [(model, 0, size)])
        for row in (size // 2, size // 4, size - PAGE):
            assert view[row] == model.read_bytes()[row]  # the bytes are the file's
        # At most the kernel's fault-around (16 pages) a row.
        assert resident_bytes_of(model) <= 3 * 16 * PAGE
        gathered.drop()
        assert resident_bytes_of(model) == 0
        # Still dropped at the next step: the advice split the mapping, and the region's
        # mapping is named as it is after the split.
        assert view[size // 3] == model.read_bytes()[size // 3]
        assert gathered.regions != []
        gathered.drop()
        assert resident_bytes_of(model) == 0 and gathered.regions != []
    finally:
        view.close()


def test_mapped_files_count_as_changed_only_when_written_in_place(tmp_path):
    from onnxmerge.runtime._memory import changed_files, mapped_file_states

    written, replaced = tmp_path / "model.onnx", tmp_path / "model.onnx_data"
    written.write_bytes(b"a" * 10)
    replaced.write_bytes(b"b" * 10)
    maps = tmp_path / "maps"
    maps.write_text(
        "".join(
            f"7f000000{i}000-7f000000{i + 1}000 r--p 00000000 fe:00 1{i} {path.resolve()}\n"
            for i, path in enumerate((written, replaced, tmp_path / "other.onnx"))
        )
    )
    states = mapped_file_states(written, str(maps))
    assert sorted(states) == [str(written.resolve()), str(replaced.resolve())]
    assert changed_files(states) == []
    with written.open("r+b") as f:
        f.write(b"c" * 20)
    (tmp_path / "new").write_bytes(b"d" * 30)
    os.replace(tmp_path / "new", replaced)  # a new file under the name: the old one is mapped
    assert changed_files(states) == [str(written.resolve())]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")
def test_steps_dropping_pages_look_the_c_library_up_once(tmp_path, monkeypatch):
    """Regression: every step's drop ran ``find_library``, which starts ldconfig each time. The C
    library is now the process's own symbols, opened once, and nothing is searched for."""
    import ctypes
    import ctypes.util

    from onnxmerge.runtime import _memory
    from onnxmerge.runtime._memory import GatheredPages

    lookups, opened = [], []
    find_library, cdll = ctypes.util.find_library, ctypes.CDLL
    monkeypatch.setattr(
        ctypes.util, "find_library", lambda name: lookups.append(name) or find_library(name)
    )
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: opened.append(a) or cdll(*a, **k))
    _memory._libc.cache_clear()
    model, data, content, view = _mapped_data(tmp_path)
    try:
        gathered = GatheredPages(model, [(data, 0, 8 * PAGE)])
        for _ in range(3):
            assert bytes(view) == content
            gathered.drop()
            assert resident_bytes_of(data) == 0
        assert lookups == [] and opened == [(None,)]
    finally:
        view.close()
        _memory._libc.cache_clear()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")
def test_gathered_pages_are_kept_until_the_resident_file_pages_grew_by_kept(tmp_path, monkeypatch):
    """Regression: dropping after every step made each long-form Whisper step fault its rows
    in again (1.08x the call's time); the pages now stay until they add up to ``kept``."""
    from onnxmerge.runtime import _memory
    from onnxmerge.runtime._memory import GatheredPages

    resident = [0]
    monkeypatch.setattr(_memory, "resident_file_bytes", lambda: resident[0])
    model, data, content, view = _mapped_data(tmp_path)
    try:
        gathered = GatheredPages(model, [(data, 0, 8 * PAGE)], kept=3 * PAGE)
        every_step = GatheredPages(model, [(data, 0, 8 * PAGE)])
        assert bytes(view) == content
        gathered.after_step()  # the first step drops what the load left and counts from there
        assert resident_bytes_of(data) == 0
        assert bytes(view) == content
        resident[0] = 2 * PAGE
        gathered.after_step()  # grown by less than kept: the rows stay resident
        assert resident_bytes_of(data) == 8 * PAGE
        resident[0] = 3 * PAGE
        gathered.after_step()
        assert resident_bytes_of(data) == 0
        assert bytes(view) == content
        every_step.after_step()  # kept=0: after every step, whatever the growth
        assert resident_bytes_of(data) == 0
        resident[0] = None  # unreadable: every step
        assert bytes(view) == content
        gathered.after_step()
        assert resident_bytes_of(data) == 0
    finally:
        view.close()


def test_resident_file_bytes_counts_the_pages_a_mapping_reads(tmp_path):
    from onnxmerge.runtime._memory import resident_file_bytes

    if resident_file_bytes() is None:
        pytest.skip("no /proc/self/statm")
    path = tmp_path / "pages"
    path.write_bytes(os.urandom(64 * PAGE))
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        before = resident_file_bytes()
        assert bytes(view) == path.read_bytes()
        assert resident_file_bytes() - before >= 64 * PAGE
    statm = tmp_path / "statm"
    statm.write_text("garbled")
    assert resident_file_bytes(str(statm)) is None


GATHERS = """
<ir_version: 9, opset_import: ["" : 18]>
g (int64[3] ids, float[3,4] hidden) => (float[3,4] rows, float[3,5] logits, float[3,4] summed) {
    rows = Gather(tied, ids)
    logits = Gemm<transB = 1>(hidden, tied)
    added_rows = Gather(added, ids)
    summed = Add(added_rows, added)
    packed = MatMul(hidden, weight)
}
"""


def test_gathered_only_takes_weights_read_by_gathers_and_packed_products(tmp_path):
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from onnxmerge._wire import graph_structure
    from onnxmerge.runtime._graph_reads import gathered_only

    graph = onnx.parser.parse_model(GATHERS).graph
    graph.initializer.extend(
        numpy_helper.from_array(np.zeros(shape, np.float32), name)
        for name, shape in (("tied", (5, 4)), ("added", (5, 4)), ("weight", (4, 4)))
    )
    # `added` is read whole by Add, `weight` gathered by none: their pages stay.
    onnx.save(onnx.helper.make_model(graph), tmp_path / "model.onnx")
    assert [t.name for t in gathered_only(graph_structure(tmp_path / "model.onnx"))] == ["tied"]
