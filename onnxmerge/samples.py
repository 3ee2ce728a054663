"""Random but valid inputs for a merged model's encoder, for the output check and verify."""

from __future__ import annotations

import json

import numpy as np

from onnxmerge import contract
from onnxmerge.errors import InvalidMergedModelError
from onnxmerge.runtime.ort import ORT_TO_NUMPY


def sample_encoder_inputs(
    session, config: dict, *, batch: int, length: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Random but valid encoder inputs for a merged model's session."""
    names = set(_encoder_input_names(session))
    vocab = int(config.get("vocab_size") or 100)
    feeds: dict[str, np.ndarray] = {}
    for info in session.get_inputs():
        if info.name not in names:
            continue
        dtype = ORT_TO_NUMPY.get(info.type, np.float32)
        if info.name == "input_features":
            frames = 2 * int(config.get("max_source_positions", 1500))
            dims = [batch, int(config.get("num_mel_bins", 80)), frames]
            feeds[info.name] = rng.standard_normal(dims).astype(dtype)
        elif info.name == contract.ATTENTION_MASK:
            mask: np.ndarray = np.ones((batch, length), dtype)
            mask[1:, length - 2 :] = 0  # padding on every row but the first
            feeds[info.name] = mask
        elif np.issubdtype(dtype, np.integer):
            feeds[info.name] = rng.integers(2, max(3, vocab - 2), (batch, length)).astype(dtype)
        elif info.name == "pixel_values":
            vision = config.get("encoder", {})
            size = int(vision.get("image_size", 224))
            dims = [batch, int(vision.get("num_channels", 3)), size, size]
            feeds[info.name] = rng.standard_normal(dims).astype(dtype)
        else:
            raise InvalidMergedModelError(
                f"cannot make sample values for the encoder input {info.name!r}; "
                "verify supports text, speech (input_features) and image (pixel_values) encoders"
            )
    return feeds


def _encoder_input_names(session) -> list[str]:
    meta = session.get_modelmeta().custom_metadata_map
    return json.loads(meta.get(contract.META_ENCODER_INPUTS, "[]"))
