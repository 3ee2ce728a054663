"""The proof behind format version 3: its first step gives what the decoder without past gives.

Version 3 runs the decoder with past on the first step too, with a zero-length self-attention
past. An exporter may have traced that decoder for one new token a step (transformers builds no
causal mask when the query has length 1), so before such a file is published its first step runs
on sample inputs beside the source files, for one decoder token and for several.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from onnxmerge import contract, model_io
from onnxmerge._ort import open_session, release_free_heap
from onnxmerge.merge._roles import Role
from onnxmerge.passes import tied_head
from onnxmerge.samples import first_step_feeds, one_run_options, sample_inputs

logger = logging.getLogger(__name__)

_BATCH, _ENCODER_LENGTH = 2, 7
# A first step of several tokens: a forced prefix, a user's decoder_input_ids, Whisper's prompt.
SEVERAL = 3


@dataclass(frozen=True)
class Verdict:
    """``tokens_per_step``: the longest first step proven equal (0: not even one token), or
    None when both lengths were; ``reason`` says what differed or why nothing was proven."""

    tokens_per_step: int | None
    reason: str = ""

    @property
    def holds(self) -> bool:
        return self.tokens_per_step != 0


def prove_first_step(path: Path, sources: Mapping[Role, Path]) -> Verdict:
    """Run the merged file's first step and the source files on the same sample inputs."""
    if importlib.util.find_spec("onnxruntime") is None:
        return Verdict(0, "onnxruntime, which proves the first step, is not installed")
    try:
        merged = open_session(path, one_run_options())
        meta = merged.get_modelmeta().custom_metadata_map
        config = json.loads(meta.get(contract.META_CONFIG, "{}"))
        rng = np.random.default_rng(1)
        feeds, vocab = sample_inputs(
            merged, path, config, batch=_BATCH, length=_ENCODER_LENGTH, rng=rng
        )
        trials = {n: rng.integers(0, vocab, (_BATCH, n)).astype(np.int64) for n in (1, SEVERAL)}
        ours = {n: _merged_first_step(merged, feeds, ids) for n, ids in trials.items()}
        del merged
        gc.collect()
        release_free_heap()
        theirs = _source_first_steps(sources, feeds, trials)
    except Exception as e:  # onnxruntime raises its own types
        # Nothing is proven where the files do not run here (another provider's operators).
        text = str(e).strip().splitlines()
        return Verdict(0, f"onnxruntime could not run it here ({text[0] if text else e!r})")
    for n in (1, SEVERAL):
        problem = _difference(ours[n], theirs[n])
        if problem:
            reason = f"with a first step of {n} token{'s' if n > 1 else ''}, {problem}"
            logger.info("first step not proven: %s", reason)
            return Verdict(0 if n == 1 else 1, reason)
    return Verdict(None)


def _merged_first_step(session, feeds: dict, ids: np.ndarray) -> dict[str, np.ndarray]:
    run = dict(feeds, **first_step_feeds(session, ids.shape[0]))
    run[contract.DECODER_INPUT_IDS] = ids
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, run), strict=True))


def _source_session(path: Path):
    """A session over a source file whose weights stay in the file, memory-mapped (the pages the
    merge has read already), and whose tied head reads the embedding through ``Gemm`` rather
    than a transposed copy made per run."""
    import onnxruntime

    options = one_run_options()
    model, _ = model_io.load_model(path)
    tied_head.gemm_for_transposed_weights(model)
    proto = ir.serde.serialize_model(model)
    folder = path.parent.resolve()
    for tensor in model_io.tensor_protos(proto.graph):
        for entry in tensor.external_data:
            if entry.key == "location" and os.path.isabs(entry.value):
                relative = os.path.relpath(entry.value, folder)
                if relative.startswith(".."):  # data outside the folder: read as it is
                    return open_session(path, options)
                entry.value = relative
    options.add_session_config_entry(
        "session.model_external_initializers_file_folder_path", os.fspath(path.parent)
    )
    return onnxruntime.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _source_first_steps(
    sources: Mapping[Role, Path], feeds: dict, trials: dict[int, np.ndarray]
) -> dict[int, dict[str, np.ndarray]]:
    encoder = _source_session(sources[Role.ENCODER])
    names = {i.name for i in encoder.get_inputs()}
    hidden = encoder.run(
        [contract.OPTIMUM_ENCODER_OUTPUT], {k: v for k, v in feeds.items() if k in names}
    )[0]
    del encoder
    gc.collect()  # sessions hold reference cycles: free the encoder's before the decoder loads
    release_free_heap()
    merged_decoder = Role.DECODER not in sources
    decoder = _source_session(sources[Role.MERGED_DECODER if merged_decoder else Role.DECODER])
    inputs = {i.name for i in decoder.get_inputs()}
    outputs = [o.name for o in decoder.get_outputs()]
    results = {}
    for n, ids in trials.items():
        run: dict[str, np.ndarray] = {
            contract.OPTIMUM_DECODER_INPUT_IDS: ids,
            contract.OPTIMUM_ENCODER_HIDDEN_STATES: hidden,
        }
        mask = feeds.get(contract.ATTENTION_MASK)
        if mask is not None:
            run[contract.OPTIMUM_ENCODER_ATTENTION_MASK] = mask
        if merged_decoder:
            run.update(first_step_feeds(decoder, ids.shape[0]))
        run = {k: v for k, v in run.items() if k in inputs}
        results[n] = dict(zip(outputs, decoder.run(None, run), strict=True))
    return results


def _difference(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> str | None:
    """What differs between the merged first step and the sources', beyond float rounding."""
    for name, expected in theirs.items():
        if name != contract.LOGITS and not (
            contract.is_present_name(name) and not contract.is_encoder_present(name)
        ):
            continue
        got = ours.get(name)
        if got is None or got.shape != expected.shape:
            shape = None if got is None else got.shape
            return f"{name} has shape {shape}, the decoder without past's {expected.shape}"
        expected64, got64 = expected.astype(np.float64), got.astype(np.float64)
        scale = 1.0 + float(np.abs(expected64).max(initial=0.0))
        tolerance = (1e-4 if expected.dtype == np.float32 else 1e-2) * scale
        largest = float(np.abs(got64 - expected64).max(initial=0.0))
        if not largest <= tolerance:
            return f"{name} differs from the decoder without past's by {largest:.3g}"
    return None


__all__ = ["Verdict", "prove_first_step", "SEVERAL"]
