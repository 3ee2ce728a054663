"""Hand memory that onnxruntime no longer needs after loading back to the system (Linux only),
and arrays whose memory goes back to the system when they are freed.

The loading steps are best effort: elsewhere, or where the C library lacks the call, they do
nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from onnxmerge._ort import libc as _libc

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

logger = logging.getLogger(__name__)

_MADV_DONTNEED = 4  # Linux's values on every architecture onnxruntime ships for
_MADV_RANDOM = 1


def clean_file_mappings(
    chosen: Callable[[Path], bool], smaps: str = "/proc/self/smaps"
) -> list[tuple[int, int]]:
    """``(start, end)`` of this process's mappings of ``chosen`` files that hold no page of their
    own: every resident page is the file's, so dropping it loses nothing."""
    return [(start, end) for start, end, _, _ in _clean_mappings(chosen, smaps)]


def _clean_mappings(
    chosen: Callable[[Path], bool], smaps: str = "/proc/self/smaps"
) -> list[tuple[int, int, Path, int]]:
    """``clean_file_mappings`` with each mapping's file and the file offset it starts at."""
    found = []
    region: tuple[int, int, Path, int] | None = None
    for line in _lines(smaps):
        fields = line.split(maxsplit=5)
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            region = None
            if len(fields) == 6 and "x" not in fields[1] and chosen(Path(fields[5])):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                region = (start, end, Path(fields[5]), int(fields[2], 16))
        elif region is not None and fields[0] == "Anonymous:":
            # Pages written since mapping (copy on write) are the process's own: keep those.
            if fields[1] == "0":
                found.append(region)
            region = None
    return found


def is_data_file_of(model: Path) -> Callable[[Path], bool]:
    """Whether a path is one of the files that hold ``model``'s weights, without parsing the
    model: the model file itself (opened through its skeleton, ``_ort.open_session``,
    onnxruntime maps the weights from inside it) and its external data files by the names
    writers give them (``model.onnx_data``, ``model.onnx.data``, ``model.0.onnx_data``)."""
    model = model.resolve()
    folder, prefix = model.parent, f"{model.stem}."

    def chosen(path: Path) -> bool:
        return path.parent == folder and (path.name.startswith(prefix) or path == model)

    return chosen


def release_mapped_weights(model: Path) -> int:
    """Drop this process's resident pages of ``model``'s weights mapped from its files (the
    model file and its external data); returns the bytes.

    onnxruntime maps such weights instead of reading them. Pre-packing then reads every weight
    once, which leaves them all resident in the process although the packed copies are what
    runs: only the embedding rows a step gathers are read again. Dropping clean pages costs
    nothing: they stay in the page cache, and a later read maps them back.
    """
    regions = clean_file_mappings(is_data_file_of(model))
    return _drop(regions)


def mapped_file_states(model: Path, maps: str = "/proc/self/maps") -> dict[str, tuple[int, ...]]:
    """Device, inode, size and modification time of each of ``model``'s files (``is_data_file_of``)
    this process maps. A mapping reads the file as it is now: a file rewritten in place
    changes the weights under a session (``changed_files``)."""
    chosen = is_data_file_of(model)
    states = {}
    for line in _lines(maps):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] not in states and chosen(Path(fields[5])):
            with contextlib.suppress(OSError):
                states[fields[5]] = _state(fields[5])
    return states


def changed_files(states: dict[str, tuple[int, ...]]) -> list[str]:
    """The files of ``states`` (``mapped_file_states``) written since: the same file (device
    and inode) with another size or modification time. A path that names another file now
    (replaced by a rename, as onnxmerge's writers replace files, or deleted) is not: the
    mappings still read the file they mapped, which nothing can change any more."""
    changed = []
    for path, (device, inode, *written) in states.items():
        try:
            now = _state(path)
        except OSError:
            continue
        if now[:2] == (device, inode) and list(now[2:]) != written:
            changed.append(path)
    return changed


def _state(path: str) -> tuple[int, ...]:
    found = os.stat(path)
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns


def _drop(regions: Sequence[tuple[int, int]]) -> int:
    libc = _libc()
    if libc is None:
        return 0
    released = 0
    for start, end in regions:
        if libc.madvise(start, end - start, _MADV_DONTNEED) == 0:
            released += end - start
        else:  # pragma: no cover - the kernel refused; nothing is lost
            logger.debug("madvise failed: errno %d", ctypes.get_errno())
    return released


def resident_file_bytes(statm: str = "/proc/self/statm") -> int | None:
    """The bytes of files (and shared memory) this process has resident; None where unknown."""
    try:
        with open(statm, "rb") as file:
            return int(file.read().split()[2]) * mmap.PAGESIZE
    except (OSError, IndexError, ValueError):
        return None


class GatheredPages:
    """The mapped pages of weights that steps only gather rows of (an embedding whose other
    reader, a tied head, runs from its pre-packed copy), dropped again once they add up.

    Each gathered row maps back the kernel's fault-around window of pages around it: over a
    corpus of varied tokens the whole embedding becomes resident beside the head's packed copy,
    twice what the weights need. :meth:`after_step` drops them once the process's resident file
    pages grew by ``kept`` bytes since the last drop (after every step where that cannot be
    read): a row read again before then costs no fault, and what steps keep stays bounded.
    ``tensors``: ``(file, offset, length)`` of each such weight in the model's data files.

    A region is dropped only while its mapping is still that file's (``/proc/self/map_files``):
    a mapping another session held may be gone, and its addresses reused by memory that
    dropping would zero.
    """

    def __init__(
        self, model: Path, tensors: Sequence[tuple[Path, int, int]], kept: int = 0
    ) -> None:
        self._kept = kept
        self._resident_after_drop: int | None = None
        # Each region with its mapping (map_files entry, file), replaced only as a whole: steps
        # of batches run at once drop from several threads.
        self._regions: list[tuple[tuple[int, int], tuple[str, str]]] = []
        if not tensors:
            return
        page = mmap.PAGESIZE
        found: list[tuple[int, int, Path]] = []
        for start, end, path, offset in _clean_mappings(is_data_file_of(model)):
            for file, at, length in tensors:
                if file.resolve() != path.resolve():
                    continue
                # The whole pages of the tensor's bytes inside this mapping.
                low = max(start, start + at - offset)
                high = min(end, start + at + length - offset)
                low = -(-low // page) * page
                high = high // page * page
                if high > low:
                    found.append((low, high, path))
        _read_page_by_page([(low, high) for low, high, _ in found], tensors)
        # The advice splits a mapping where a region starts and ends: name each region's
        # mapping as it is now.
        mappings = _mapping_ranges()
        for low, high, path in found:
            start, end = next(((s, e) for s, e in mappings if s <= low < e), (low, high))
            entry = f"/proc/self/map_files/{start:x}-{end:x}"
            self._regions.append(((low, high), (entry, str(path))))

    @property
    def regions(self) -> list[tuple[int, int]]:
        return [region for region, _ in self._regions]

    def after_step(self) -> None:
        """:meth:`drop` once the pages kept since the last drop may add up to ``kept`` bytes."""
        if not self._regions:
            return
        if self._kept and self._resident_after_drop is not None:
            resident = resident_file_bytes()
            if resident is not None and resident - self._resident_after_drop < self._kept:
                return
        self.drop()

    def drop(self) -> None:
        regions = self._regions
        if not regions:
            return
        kept = [(region, mapping) for region, mapping in regions if _maps(*mapping)]
        if len(kept) < len(regions):  # gone for good: never dropped again
            self._regions = kept
        _drop([region for region, _ in kept])
        if self._kept:
            self._resident_after_drop = resident_file_bytes()


def _read_page_by_page(
    regions: Sequence[tuple[int, int]], tensors: Sequence[tuple[Path, int, int]]
) -> None:
    """Have each gathered row map its own page, not the large folio it was cached in.

    Where the page cache holds a file in large folios (ext4 on Linux 6.x), a fault maps the whole
    folio, up to 2 MB: the 59 rows of one opus-mt-fr-en input mapped 66 MB of its embedding
    for the step, a batch of 32 the whole 122 MB. The tensors' cached pages, unmapped since the
    load's release, are evicted, and the regions read without read-ahead, so that a row is read
    back into a page of its own; written or mapped pages are not evicted, and other readers of
    the file only read its pages again.
    """
    libc = _libc()
    if libc is None or not regions or not hasattr(os, "posix_fadvise"):
        return
    for start, end in regions:
        if libc.madvise(start, end - start, _MADV_RANDOM) != 0:  # pragma: no cover
            logger.debug("madvise(MADV_RANDOM) failed: errno %d", ctypes.get_errno())
    for file, at, length in tensors:
        try:
            descriptor = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(descriptor, at, length, os.POSIX_FADV_DONTNEED)
        except OSError:  # pragma: no cover - advice a file system does not take
            pass
        finally:
            os.close(descriptor)


def _mapping_ranges(maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    ranges = []
    for line in _lines(maps):
        start, _, end = line.partition(" ")[0].partition("-")
        ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _lines(path: str) -> Iterator[str]:
    """The lines of a ``/proc`` file, none where it cannot be read. Read one at a time: the
    whole text and its list of lines, thousands under onnxruntime's per-tensor mappings, would
    leave the interpreter's memory fragmented for the session's life."""
    try:
        with open(path) as file:
            for line in file:
                yield line.rstrip("\n")
    except OSError:
        return


def _maps(entry: str, path: str) -> bool:
    try:
        return os.readlink(entry) == path
    except OSError:
        return False


def anonymous_array(size: int, dtype: np.dtype, *, huge_pages: bool = True) -> np.ndarray:
    """``np.empty(size, dtype)`` in a private anonymous mapping of its own: its pages are
    resident only once written and go back to the system when the array is freed (malloc
    serves sizes below its threshold, which freeing a mapping raises to 32 MB, from a heap that
    keeps them).

    ``huge_pages`` asks for transparent huge pages, as numpy does for its large arrays: fewer
    TLB misses over an array written once and read often. Where the system compacts memory for
    such a mapping's faults (``defrag`` set to ``madvise``, a common default), a fault can stall
    for tens of milliseconds: an array whose pages are written a few at every step asks for none.
    """
    nbytes = max(size * dtype.itemsize, 1)
    try:
        if hasattr(mmap, "MAP_ANONYMOUS"):  # POSIX; a plain anonymous mapping would be shared
            buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            buffer = mmap.mmap(-1, nbytes)
    except OSError:  # a system that will not reserve this much address space
        return np.empty(size, dtype)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            buffer.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(buffer, dtype, count=size)


class Workspace:
    """Arrays by name that a search's steps work in, kept between its steps (each in a mapping
    of its own, :func:`anonymous_array`): fresh arrays of a step's ``[rows, vocab]`` would map
    their pages and fault them in again at every step."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
        """The array ``name`` in ``shape``; the same memory as the last call's where it fits."""
        size, dtype = math.prod(shape), np.dtype(dtype)  # math's: numpy's is 10x slower
        kept = self._arrays.get(name)
        if kept is None or kept.size < size or kept.dtype != dtype:
            kept = self._arrays[name] = anonymous_array(size, dtype)
        return kept[:size].reshape(shape)
