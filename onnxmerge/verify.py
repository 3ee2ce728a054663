"""Run a merged model and the files it came from on the same inputs; report every output's diff."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnxmerge import contract
from onnxmerge._ort import ORT_TO_NUMPY, open_session, session_options
from onnxmerge.errors import ExportFolderError, InvalidMergedModelError
from onnxmerge.merge import Role
from onnxmerge.samples import first_step_feeds, sample_inputs

logger = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 1e-4
# For files whose weights were quantized: the bound on max |diff| as a share of the largest
# |value| of that output in the original files (measured on the test zoo, with room to spare).
RELATIVE_TOLERANCE = {"fp16": 0.02, "int8": 0.25, "uint8": 0.15, "int4": 0.6}


@dataclass(frozen=True)
class OutputDiff:
    step: str  # "first" (use_cache_branch false) or "cached"
    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    reference_peak: float = 0.0  # the original's largest |value|, the scale of a relative bound


@dataclass(frozen=True)
class VerifyReport:
    diffs: tuple[OutputDiff, ...]
    tolerance: float
    relative: bool = False  # tolerance as a share of each output's reference_peak

    @property
    def max_abs_diff(self) -> float:
        return max((d.max_abs_diff for d in self.diffs), default=0.0)

    @property
    def ok(self) -> bool:
        return bool(self.diffs) and all(
            d.max_abs_diff <= self.tolerance * (d.reference_peak if self.relative else 1.0)
            for d in self.diffs
        )


def _session(path: Path, optimized: bool):
    return open_session(path, session_options(optimize=optimized))


def verify(
    merged: str | os.PathLike,
    export_dir: str | os.PathLike,
    *,
    batch: int = 2,
    encoder_length: int = 7,
    decoder_length: int = 3,
    seed: int = 0,
    optimized: bool = False,
    tolerance: float | None = None,
    dtype: str | None = None,
) -> VerifyReport:
    """Compare both branches of ``merged`` with the original files of ``export_dir``.

    The first step (``use_cache_branch = false``) runs against encoder + decoder; the cached step
    runs against the decoder with past, both fed the same past key/values. ``tolerance`` bounds
    max |diff|: by default 1e-4 for a float32 file; for a quantized file, a share of each output's
    largest |value| that fits its precision (:data:`RELATIVE_TOLERANCE`). ``export_dir`` may be
    a Hub repository (models under ``onnx/``); ``dtype`` picks its files, by default the dtype
    the merged file records it was made from, else fp32.
    """
    from onnxmerge import export_layout
    from onnxmerge.merge import load_export

    merged, export_dir = Path(merged), Path(export_dir)
    model, meta, info = _open_merged(merged, optimized)
    tolerance, relative = _tolerance(info.precision, tolerance)
    dtype = dtype or export_layout.recorded_dtype(meta.get(contract.META_SOURCES))
    layout = export_layout.resolve(export_dir, dtype)
    chosen, _, _ = load_export(layout.model_dir, merged, ignore_merged=True, files=layout.files)
    rng = np.random.default_rng(seed)
    feeds, vocab = sample_inputs(
        model, merged, info.config, batch=batch, length=encoder_length, rng=rng
    )
    decoder_ids = rng.integers(2, max(3, vocab - 2), (batch, decoder_length)).astype(np.int64)
    first_ref, diffs = _compare_first_step(model, chosen, optimized, feeds, decoder_ids)
    if contract.USE_CACHE_BRANCH in {i.name for i in model.get_inputs()}:
        next_ids = rng.integers(2, max(3, vocab - 2), (batch, 1)).astype(np.int64)
        diffs += _compare_cached_step(model, chosen, optimized, feeds, first_ref, next_ids)
    report = VerifyReport(tuple(diffs), tolerance, relative)
    logger.info("verified %s: %d outputs, max |diff| %.3g", merged, len(diffs), report.max_abs_diff)
    return report


def _open_merged(merged: Path, optimized: bool):
    """A session of ``merged``, its metadata and its contract (checked)."""
    if not merged.is_file():
        raise InvalidMergedModelError(f"{merged} does not exist")
    try:
        model = _session(merged, optimized)
    except Exception as e:  # onnxruntime raises its own types for unreadable files
        raise InvalidMergedModelError(f"onnxruntime cannot load {merged}: {e}") from e
    meta = model.get_modelmeta().custom_metadata_map
    info = contract.read_contract(
        meta, [i.name for i in model.get_inputs()], [o.name for o in model.get_outputs()], merged
    )
    return model, meta, info


def _tolerance(precision: dict[str, str], tolerance: float | None) -> tuple[float, bool]:
    """The bound on max |diff| and whether it is relative: a quantized file's coarsest
    precision sets a share of each output's peak."""
    coarsest = max(
        precision.values(),
        key=lambda p: RELATIVE_TOLERANCE.get(p, 0.0),
        default=None,
    )
    if coarsest not in RELATIVE_TOLERANCE:
        return (DEFAULT_TOLERANCE if tolerance is None else tolerance), False
    return (RELATIVE_TOLERANCE[coarsest] if tolerance is None else tolerance), True


def _outputs(session, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feed), strict=True))


def _compare_first_step(
    model, chosen, optimized: bool, feeds: dict[str, np.ndarray], ids: np.ndarray
) -> tuple[dict[str, np.ndarray], list[OutputDiff]]:
    """The original encoder + decoder's outputs on a first step, and the merged file's diffs."""
    encoder = _session(chosen[Role.ENCODER], optimized)
    hidden = encoder.run(None, {i.name: feeds[i.name] for i in encoder.get_inputs()})[0]
    mask = feeds.get(contract.ATTENTION_MASK)
    reference = _run_decoder(chosen, optimized, ids, mask, hidden, past=None)
    feed = dict(feeds, decoder_input_ids=ids)
    if contract.USE_CACHE_BRANCH in {i.name for i in model.get_inputs()}:
        feed.update(first_step_feeds(model, ids.shape[0]))
    actual = _outputs(model, feed)
    diffs = [_diff("first", n, actual[n], ref) for n, ref in reference.items() if n in actual]
    return reference, diffs


def _compare_cached_step(
    model,
    chosen,
    optimized: bool,
    feeds: dict[str, np.ndarray],
    first_ref: dict[str, np.ndarray],
    ids: np.ndarray,
) -> list[OutputDiff]:
    """The merged file's diffs on a cached step, both sides fed the reference's first presents."""
    past = {
        contract.past_name_of(n): v for n, v in first_ref.items() if contract.is_present_name(n)
    }
    mask = feeds.get(contract.ATTENTION_MASK)
    reference = _run_decoder(chosen, optimized, ids, mask, None, past=past)
    # A cached step reads no encoder input but the mask: the others go in empty.
    feed = {
        name: np.zeros((ids.shape[0],) + (0,) * (value.ndim - 1), value.dtype)
        if name != contract.ATTENTION_MASK
        else value
        for name, value in feeds.items()
    }
    feed.update(past, decoder_input_ids=ids)
    feed[contract.USE_CACHE_BRANCH] = np.array([True])
    actual = _outputs(model, feed)
    # Encoder presents are not recomputed on a cached step.
    return [
        _diff("cached", n, actual[n], ref)
        for n, ref in reference.items()
        if n in actual and not contract.is_encoder_present(n)
    ]


def _diff(step: str, name: str, actual: np.ndarray, expected: np.ndarray) -> OutputDiff:
    if actual.shape != expected.shape:
        return OutputDiff(step, name, tuple(actual.shape), float("inf"))
    if not expected.size:
        return OutputDiff(step, name, tuple(actual.shape), 0.0)
    delta = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    peak = float(np.abs(expected).max())
    return OutputDiff(step, name, tuple(actual.shape), float(delta.max()), peak)


def _run_decoder(chosen, optimized, ids, mask, hidden, past) -> dict[str, np.ndarray]:
    """Run the original decoder for a first step (``past`` None) or a cached step."""
    if Role.MERGED_DECODER in chosen:
        session = _session(chosen[Role.MERGED_DECODER], optimized)
        feed = (
            first_step_feeds(session, ids.shape[0])
            if past is None
            else {contract.USE_CACHE_BRANCH: np.array([True])}
        )
        for info in session.get_inputs():
            if info.name == contract.OPTIMUM_ENCODER_HIDDEN_STATES and hidden is None:
                dims = [d if isinstance(d, int) and d > 0 else 1 for d in info.shape]
                dims[0], dims[1] = ids.shape[0], 0
                feed[info.name] = np.zeros(dims, ORT_TO_NUMPY.get(info.type, np.float32))
    else:
        role = Role.DECODER if past is None else Role.DECODER_WITH_PAST
        if role not in chosen:
            raise ExportFolderError(f"the export has no {role.value} file to compare with")
        session = _session(chosen[role], optimized)
        feed = {}
    available = {
        contract.OPTIMUM_DECODER_INPUT_IDS: ids,
        contract.OPTIMUM_ENCODER_ATTENTION_MASK: mask,
        contract.OPTIMUM_ENCODER_HIDDEN_STATES: hidden,
        **(past or {}),
    }
    for info in session.get_inputs():
        if info.name not in feed and available.get(info.name) is not None:
            feed[info.name] = available[info.name]
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feed), strict=True))
