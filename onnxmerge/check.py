"""The output check that every writer (merge, quantize, the generator, and through them the web
page and batch) runs on its file before publishing it.

The ONNX checker holds the written model to what its inputs already pass: operators that the
sources hold and the checker has no schema for (onnxruntime's own, written by its transformer
optimizer, e.g. ``SimplifiedLayerNormalization``) are not held against it. Then, where onnxruntime
is installed, the model runs once on tiny inputs (a merged or quantized file: both branches; a
generator: two tokens), so a model that the runtime refuses (sizes that its shapes promise equal
but are not, say) is never written.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from onnxmerge import _proto, contract
from onnxmerge._ort import open_session
from onnxmerge.errors import InvalidMergedModelError, MergedModelRunError
from onnxmerge.samples import first_step_feeds, one_run_options, sample_inputs

__all__ = ["check_written_model", "run_once", "unknown_operators"]

logger = logging.getLogger(__name__)

# The checker skips operators of domains it does not know; tolerated nodes are checked under this.
_UNCHECKED_DOMAIN = "onnxmerge.unchecked"
# Sizes of the trial run: encoder and decoder lengths differ so that mixed-up sizes show.
_BATCH, _ENCODER_LENGTH, _DECODER_LENGTH = 2, 7, 3
# Tokens a generator makes in its trial run: the first step and one turn of its loop.
_GENERATED = 2


def _domain(node: ir.Node) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def unknown_operators(models: Iterable[ir.Model]) -> frozenset[tuple[str, str]]:
    """(domain, op_type) of the nodes the ONNX checker has no schema for; functions excepted."""
    keys = set()
    functions = set()
    for model in models:
        functions |= {(f.domain, f.name) for f in model.functions.values()}
        keys |= {(_domain(n), n.op_type) for n in ir.traversal.RecursiveGraphIterator(model.graph)}
    return frozenset(key for key in keys - functions if not onnx.defs.has(key[1], key[0]))


def check_written_model(
    path: Path,
    *,
    what: str = "merged model",
    tolerated: frozenset[tuple[str, str]] = frozenset(),
    sources: Sequence[Path] = (),
    run: bool = True,
) -> None:
    """Validate a written model before it is published.

    ``what`` names it in messages; ``tolerated`` are the operators its sources hold that the
    checker does not know (see :func:`unknown_operators`); ``sources`` the files it was made
    from, which onnxruntime must load for the run to be required.

    Raises:
        InvalidMergedModelError: the checker refused it.
        MergedModelRunError: onnxruntime could not load or run it.
    """
    if tolerated:
        _check_tolerating(path, tolerated, what)
    else:
        _checker(path, what)
    if run:
        run_once(path, sources)


def _checker(path: Path, what: str) -> None:
    """The ONNX checker with full shape inference, on the written file."""
    try:
        onnx.checker.check_model(os.fspath(path), full_check=True)
    except Exception as e:  # the checker raises several types
        raise InvalidMergedModelError(
            f"the {what} failed the ONNX checker ({e}); nothing was written. Please report this "
            "with the export folder's config.json"
        ) from e


def _check_tolerating(path: Path, tolerated: frozenset[tuple[str, str]], what: str) -> None:
    # Weights are still in the data file here: this reads the graph only.
    proto = onnx.load(os.fspath(path), load_external_data=False)

    for graph in _proto.graph_protos(proto.graph):
        for node in graph.node:
            if (node.domain if node.domain != "ai.onnx" else "", node.op_type) in tolerated:
                node.domain = _UNCHECKED_DOMAIN
    proto.opset_import.append(onnx.helper.make_opsetid(_UNCHECKED_DOMAIN, 1))
    # Beside the original, so that its external data references resolve.
    relabelled = path.with_name(f"{path.stem}.relabelled.onnx")
    onnx.save(proto, os.fspath(relabelled))
    try:
        _checker(relabelled, what)
    finally:
        relabelled.unlink()


def run_once(path: Path, sources: Sequence[Path] = ()) -> None:
    """Run the model once on tiny inputs; skipped without onnxruntime.

    A merged or quantized file runs its first and a cached step; a generator generates two tokens.

    A model that onnxruntime cannot load here is refused unless one of ``sources`` cannot be
    loaded either (operators of another execution provider, say): then it is held to no more.

    Raises:
        MergedModelRunError: onnxruntime failed to load the model or to run a step; the message
            says which step (branch, or the generator's loop) and gives onnxruntime's reason.
    """
    if importlib.util.find_spec("onnxruntime") is None:
        return
    session = _load_unless_sources_fail(path, sources)
    if session is None:
        return
    meta = session.get_modelmeta().custom_metadata_map
    config = json.loads(meta.get(contract.META_CONFIG, "{}"))
    rng = np.random.default_rng(0)
    feeds, vocab = sample_inputs(
        session, path, config, batch=_BATCH, length=_ENCODER_LENGTH, rng=rng
    )
    if contract.META_GENERATOR in meta:
        _generate_once(session, feeds, rng)
        return
    one_decoder = contract.is_merged(meta) and contract.format_of(meta, path).one_decoder
    suffix = "-one-decoder" if one_decoder else ""
    ids = rng.integers(0, vocab, (_BATCH, _DECODER_LENGTH)).astype(np.int64)
    first = dict(feeds, **{contract.DECODER_INPUT_IDS: ids})
    has_past = contract.USE_CACHE_BRANCH in {i.name for i in session.get_inputs()}
    if has_past:
        first.update(first_step_feeds(session, _BATCH))
    names = [o.name for o in session.get_outputs()]
    try:
        outputs = dict(zip(names, session.run(None, first), strict=True))
    except Exception as e:
        raise MergedModelRunError("first" + suffix, _reason(e)) from e
    if not has_past:
        return
    try:
        session.run(None, _cached_feeds(feeds, ids, outputs))
    except Exception as e:
        raise MergedModelRunError("cached" + suffix, _reason(e)) from e


def _load_unless_sources_fail(path: Path, sources: Sequence[Path]):
    """An onnxruntime session of ``path``; None where one of ``sources`` cannot be loaded
    either."""
    options = one_run_options()
    try:
        return open_session(path, options)
    except Exception as e:  # onnxruntime raises its own types
        for source in sources:
            try:
                open_session(source, options)
            except Exception:
                logger.info("not run: onnxruntime cannot load %s here either", source)
                return None
        raise MergedModelRunError("load", _reason(e)) from e


def _generate_once(session, feeds: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    """Run a generator for two tokens."""
    inputs = {i.name for i in session.get_inputs()}
    feeds[contract.MAX_NEW_TOKENS] = np.array(_GENERATED, np.int64)
    if "audio" in inputs:  # the audio generator: a second of 16 kHz noise a row
        feeds = {k: v for k, v in feeds.items() if k in inputs}
        feeds["audio"] = (0.1 * rng.standard_normal((_BATCH, 16000))).astype(np.float32)
        feeds["audio_lengths"] = np.full(_BATCH, 16000, np.int64)
    try:
        session.run(None, feeds)
    except Exception as e:
        raise MergedModelRunError("generate", _reason(e)) from e


def _cached_feeds(
    feeds: dict[str, np.ndarray], ids: np.ndarray, first: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """A cached step after the first: the last token, the first step's presents as the past,
    the encoder inputs cut to zero length (all but the mask, which the step reads)."""
    cached = {
        name: value if name == contract.ATTENTION_MASK else value[:, ..., :0]
        for name, value in feeds.items()
    }
    cached[contract.DECODER_INPUT_IDS] = ids[:, -1:]
    cached[contract.USE_CACHE_BRANCH] = np.array([True])
    for name, value in first.items():
        if contract.is_present_name(name):
            cached[contract.past_name_of(name)] = value
    return cached


def _reason(error: Exception) -> str:
    # onnxruntime's messages carry a source location and advice; the first line says what failed.
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__
