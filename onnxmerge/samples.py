"""Random but valid inputs for a merged model, and the session options of one such run, for the
output check, the first-step proof and verify."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx

from onnxmerge import _proto, contract
from onnxmerge._ort import ORT_TO_NUMPY, session_options
from onnxmerge.errors import InvalidMergedModelError

# Where neither the model nor a config says how many tokens there are: ids below this are valid
# for any vocabulary a real model has.
SMALL_VOCAB = 4
# Operators an embedding table may pass through between its initializer and the Gather, and
# token ids between the graph input and the Gather (optimum's exports reshape them).
_TABLE_PASS_THROUGH = {"DequantizeLinear", "Cast", "Identity", "Mul"}
_IDS_PASS_THROUGH = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast", "Identity"}


def token_counts(path: str | os.PathLike) -> dict[str, int]:
    """How many ids each token input of a model takes: the rows of the embedding that ``Gather``
    reads it with (also inside subgraphs, and behind a ``DequantizeLinear``), else, for the
    decoder's ids, the width of the ``logits`` output. Inputs that neither tells are left out."""
    proto = onnx.load(os.fspath(Path(path)), load_external_data=False)
    shapes: dict[str, list[int]] = {}
    producers: dict[str, onnx.NodeProto] = {}
    gathers: list[onnx.NodeProto] = []

    for graph in _proto.graph_protos(proto.graph):
        for tensor in graph.initializer:
            shapes[tensor.name] = list(tensor.dims)
        for node in graph.node:
            for out in node.output:
                producers[out] = node
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value":
                        shapes[node.output[0]] = list(attr.t.dims)
            if node.op_type in ("Gather", "GatherBlockQuantized") and len(node.input) > 1:
                gathers.append(node)

    def rows(name: str, depth: int = 0) -> int | None:
        if name in shapes:
            dims = shapes[name]
            return int(dims[0]) if len(dims) == 2 and dims[0] > 0 else None
        node = producers.get(name)
        if node is None or depth > 4 or node.op_type not in _TABLE_PASS_THROUGH:
            return None
        return rows(node.input[0], depth + 1)

    def origin(name: str) -> str:
        for _ in range(4):
            node = producers.get(name)
            if node is None or node.op_type not in _IDS_PASS_THROUGH:
                break
            name = node.input[0]
        return name

    counts: dict[str, int] = {}
    token_inputs = {i.name for i in proto.graph.input} & {
        "input_ids",
        contract.DECODER_INPUT_IDS,
    }
    for node in gathers:
        ids = origin(node.input[1])
        if ids in token_inputs:
            found = rows(node.input[0])
            if found is not None:
                counts[ids] = min(found, counts.get(ids, found))
    for output in proto.graph.output:
        if output.name == contract.LOGITS and contract.DECODER_INPUT_IDS not in counts:
            dims = output.type.tensor_type.shape.dim
            if dims and dims[-1].HasField("dim_value") and dims[-1].dim_value > 0:
                counts[contract.DECODER_INPUT_IDS] = int(dims[-1].dim_value)
    return counts


def vocabulary(counts: dict[str, int], config: dict, name: str) -> int:
    """The number of valid ids of the token input ``name``: the model's own count, else the
    config's ``vocab_size``, else :data:`SMALL_VOCAB`."""
    if name in counts:
        return counts[name]
    key = "decoder_vocab_size" if name == contract.DECODER_INPUT_IDS else "vocab_size"
    return int(config.get(key) or config.get("vocab_size") or SMALL_VOCAB)


def sample_encoder_inputs(
    session,
    config: dict,
    *,
    batch: int,
    length: int,
    rng: np.random.Generator,
    vocab: int | None = None,
) -> dict[str, np.ndarray]:
    """Random but valid encoder inputs for a merged model's session; ``vocab``: how many ids
    the encoder takes (see :func:`token_counts`), else the config's ``vocab_size``."""
    names = set(_encoder_input_names(session))
    vocab = vocab or int(config.get("vocab_size") or SMALL_VOCAB)
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


def sample_inputs(
    session,
    path: str | os.PathLike,
    config: dict,
    *,
    batch: int,
    length: int,
    rng: np.random.Generator,
) -> tuple[dict[str, np.ndarray], int]:
    """Encoder inputs for ``session`` of the model at ``path``, and how many ids its decoder
    takes: the sizes the model states itself first (a folder may hold no config.json: Hub
    ``onnx/``), then the config's."""
    counts = token_counts(path)
    feeds = sample_encoder_inputs(
        session,
        config,
        batch=batch,
        length=length,
        rng=rng,
        vocab=vocabulary(counts, config, "input_ids"),
    )
    return feeds, vocabulary(counts, config, contract.DECODER_INPUT_IDS)


def one_run_options():
    """onnxruntime session options for a model run once on sample inputs: no graph optimization
    (shapes, kernels and types fail without it too, which would only add time), no log lines
    (the error is raised with its reason) and no pre-packed copies of the weights."""
    options = session_options(optimize=False)
    options.log_severity_level = 4
    options.add_session_config_entry("session.disable_prepacking", "1")
    return options


def _encoder_input_names(session) -> list[str]:
    meta = session.get_modelmeta().custom_metadata_map
    return json.loads(meta.get(contract.META_ENCODER_INPUTS, "[]"))


def first_step_feeds(session, rows: int) -> dict[str, np.ndarray]:
    """``use_cache_branch`` False and zero-length ``past_key_values.*``: a first step of ``rows``
    rows (docs/format.md)."""
    feeds: dict[str, np.ndarray] = {contract.USE_CACHE_BRANCH: np.array([False])}
    for info in session.get_inputs():
        if contract.is_past_name(info.name):
            dims = [d if isinstance(d, int) and d > 0 else 1 for d in info.shape]
            dims[0], dims[2] = rows, 0
            feeds[info.name] = np.zeros(dims, ORT_TO_NUMPY.get(info.type, np.float32))
    return feeds
