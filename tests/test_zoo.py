"""The tiny model zoo exports every architecture with the file layout and names optimum writes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.zoo import (
    DECODER_FILE,
    DECODER_MERGED_FILE,
    DECODER_WITH_PAST_FILE,
    ENCODER_FILE,
    sample_encoder_inputs,
    special_tokens,
)

onnx = pytest.importorskip("onnx")

EXPECTED_ENCODER_INPUTS = {
    "whisper": ["input_features"],
    "vision-encoder-decoder": ["pixel_values"],
}
# Decoders of these architectures take no encoder_attention_mask.
NO_ENCODER_MASK = {"whisper", "vision-encoder-decoder"}


def _io_names(path) -> tuple[list[str], list[str]]:
    model = onnx.load(str(path), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    return inputs, [o.name for o in model.graph.output]


def _cache_names(prefix: str, layers: int, parts: tuple[str, ...]) -> set[str]:
    if not parts:  # GPT-2 style names, without the decoder/encoder part
        return {f"{prefix}.{i}.{kind}" for i in range(layers) for kind in ("key", "value")}
    return {
        f"{prefix}.{i}.{part}.{kind}"
        for i in range(layers)
        for part in parts
        for kind in ("key", "value")
    }


def test_every_architecture_exports_with_past(tiny_export, arch):
    export = tiny_export(arch)
    names = {p.name for p in export.onnx_dir.iterdir()}
    assert {ENCODER_FILE, DECODER_FILE, DECODER_WITH_PAST_FILE, DECODER_MERGED_FILE} <= names
    assert {"config.json", "generation_config.json"} <= names
    exported = json.loads((export.onnx_dir / "config.json").read_text())
    original = json.loads((export.pytorch_dir / "config.json").read_text())
    for key in ("model_type", "decoder_start_token_id", "eos_token_id", "pad_token_id"):
        assert exported.get(key) == original.get(key)


def test_io_names_follow_optimum(tiny_export, arch):
    export = tiny_export(arch)
    layers = 2
    encoder_inputs, encoder_outputs = _io_names(export.onnx_dir / ENCODER_FILE)
    assert encoder_inputs == EXPECTED_ENCODER_INPUTS.get(arch, ["input_ids", "attention_mask"])
    assert encoder_outputs == ["last_hidden_state"]

    decoder_inputs, decoder_outputs = _io_names(export.onnx_dir / DECODER_FILE)
    expected = {"input_ids", "encoder_hidden_states"}
    if arch not in NO_ENCODER_MASK:
        expected.add("encoder_attention_mask")
    assert set(decoder_inputs) == expected
    # The vision decoder (GPT-2 with cross-attention) caches only its self-attention, under
    # GPT-2's names, and its cached decoder still reads encoder_hidden_states.
    vision = arch == "vision-encoder-decoder"
    parts = () if vision else ("decoder", "encoder")
    self_parts = () if vision else ("decoder",)
    assert decoder_outputs[0] == "logits"
    assert set(decoder_outputs[1:]) == _cache_names("present", layers, parts)

    past_inputs, past_outputs = _io_names(export.onnx_dir / DECODER_WITH_PAST_FILE)
    assert _cache_names("past_key_values", layers, parts) <= set(past_inputs)
    assert ("encoder_hidden_states" in past_inputs) == vision
    assert set(past_outputs) == {"logits"} | _cache_names("present", layers, self_parts)

    merged_inputs, merged_outputs = _io_names(export.onnx_dir / DECODER_MERGED_FILE)
    assert "use_cache_branch" in merged_inputs
    assert set(merged_outputs) == set(decoder_outputs)


@pytest.mark.parametrize("arch_name", ["marian", "t5", "whisper", "vision-encoder-decoder"])
def test_sample_encoder_inputs_match_the_encoder(tiny_export, arch_name):
    pytest.importorskip("onnxruntime")
    from onnxmerge._ort import open_session

    export = tiny_export(arch_name)
    inputs = sample_encoder_inputs(export, batch=2, seq=7)
    session = open_session(export.onnx_dir / ENCODER_FILE)
    assert [i.name for i in session.get_inputs()] == list(inputs)
    (hidden,) = session.run(None, inputs)
    assert hidden.shape[0] == 2
    assert np.isfinite(hidden).all()
    if "input_ids" in inputs:
        mask = inputs["attention_mask"].astype(bool)
        assert mask[0].all() and not mask[1].all()
        real = inputs["input_ids"][mask]
        config = json.loads((export.pytorch_dir / "config.json").read_text())
        specials = special_tokens(export) - {config["eos_token_id"]}
        assert set(real[:-1].tolist()) & specials == set()
        assert not set(inputs["input_ids"][0, :-1].tolist()) & special_tokens(export)


@pytest.mark.parametrize("arch_name", ["marian", "bart", "t5"])
def test_head_variants_store_the_tied_head_differently(tiny_export, arch_name):
    def transposes_of_initializers(path):
        graph = onnx.load(str(path)).graph
        initializers = {t.name for t in graph.initializer}
        return [n for n in graph.node if n.op_type == "Transpose" and n.input[0] in initializers]

    copy = tiny_export(arch_name, "head-copy").onnx_dir / DECODER_FILE
    tied = tiny_export(arch_name, "head-tied").onnx_dir / DECODER_FILE
    assert transposes_of_initializers(copy) == []
    assert len(transposes_of_initializers(tied)) == 1
    copy_count = len(onnx.load(str(copy)).graph.initializer)
    assert len(onnx.load(str(tied)).graph.initializer) == copy_count - 1
