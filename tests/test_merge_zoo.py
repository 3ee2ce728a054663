"""The merge on real optimum exports of every architecture: parity, storage, checker."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnxmerge import contract, merge_seq2seq_with_report
from onnxmerge.verify import verify
from tests.checks import find_duplicates
from tests.zoo import ARCHITECTURES, TIED_HEAD_ARCHITECTURES

# GPT-2-style decoders re-read the encoder states on every cached step: refused below.
WITH_PAST = tuple(a for a in ARCHITECTURES if a != "vision-encoder-decoder")

pytest.importorskip("onnxruntime")

# ORT graph optimisations are off in verify(); both branches must then match to this bound.
PARITY = 1e-6


def _merge(export, tmp_path, **kwargs):
    return merge_seq2seq_with_report(export.onnx_dir, tmp_path / "model.onnx", **kwargs)


def _per_input_steps_match_per_row_steps(path, inputs: int = 2, beams: int = 3) -> None:
    """A cached step fed the encoder cache once per input gives the logits of one fed it once per
    row, as versions 3 and 4 both take it."""
    from onnxmerge.runtime._session import MergedSession
    from onnxmerge.samples import sample_inputs

    session = MergedSession(path)
    rng = np.random.default_rng(3)
    feeds, vocab = sample_inputs(
        session.session, path, session.info.config, batch=inputs, length=6, rng=rng
    )
    first = session.first_step(feeds, rng.integers(0, vocab, (inputs, 1)))
    shared = first.cache.expand(beams)
    assert shared.encoder[0].shape[0] == inputs
    per_row = dataclasses.replace(first.cache, per_input=False).expand(beams)
    assert per_row.encoder[0].shape[0] == inputs * beams
    tokens = rng.integers(0, vocab, (inputs * beams, 1))
    a, b = session.next_step(tokens, shared), session.next_step(tokens, per_row)
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", WITH_PAST)
def test_merged_model_matches_the_original_files(tiny_export, arch, tmp_path):
    export = tiny_export(arch)
    result = _merge(export, tmp_path)
    # Format 4: format 3, its first step proven against the decoder without past for 1 and 3
    # tokens, whose every cross-attention product reads the encoder cache once per input.
    assert (result.format_version, result.format_reason) == (
        "4",
        "one decoder for every step, its cross-attention keys and values once per input",
    )
    _per_input_steps_match_per_row_steps(result.path)

    report = verify(result.path, export.onnx_dir, tolerance=PARITY)
    assert {d.step for d in report.diffs} == {"first", "cached"}
    assert report.ok, [d for d in report.diffs if d.max_abs_diff > PARITY]

    onnx.checker.check_model(os.fspath(result.path), full_check=True)
    model = ir.load(result.path)
    assert find_duplicates(model.graph) == []
    if_nodes = [n for n in model.graph if n.op_type == "If"]
    assert len(if_nodes) == 1
    # Shared tensors live in the main graph; branches hold no initializers of their own.
    for attr in if_nodes[0].attributes.values():
        assert len(attr.value.initializers) == 0
    # The cached branch passes the cross-attention keys and values through.
    assert {n.op_type for n in if_nodes[0].attributes["then_branch"].value} == {"Identity"}
    assert result.output_bytes < result.input_bytes
    assert result.path.with_name("model.onnx_data").exists() is False


@pytest.mark.parametrize("arch", WITH_PAST)
def test_merged_model_interface_follows_the_contract(tiny_export, arch, tmp_path):
    export = tiny_export(arch)
    path = _merge(export, tmp_path).path
    model = onnx.load(os.fspath(path), load_external_data=False)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    meta = {p.key: p.value for p in model.metadata_props}

    assert contract.DECODER_INPUT_IDS in inputs
    assert inputs[-1] == contract.USE_CACHE_BRANCH
    assert outputs[0] == contract.LOGITS
    assert not any(n in inputs for n in ("encoder_hidden_states", "encoder_attention_mask"))
    layers = {contract.parse_cache_name(n)[1] for n in inputs if contract.is_past_name(n)}
    assert layers == set(range(len(layers))) and layers
    assert {
        contract.present_name(i, p, k)
        for i in layers
        for p in ("decoder", "encoder")
        for k in ("key", "value")
    } == {n for n in outputs if contract.is_present_name(n)}
    assert meta[contract.META_FORMAT_VERSION] == contract.PER_INPUT_FORMAT_VERSION
    assert "model_type" in meta[contract.META_CONFIG]
    assert contract.META_GENERATION_CONFIG in meta
    encoder_inputs = contract.read_contract(meta, inputs, outputs).encoder_inputs
    expected = {"whisper": ["input_features"], "vision-encoder-decoder": ["pixel_values"]}
    assert list(encoder_inputs) == expected.get(arch, ["input_ids", "attention_mask"])


@pytest.mark.parametrize("arch", ["marian", "bart", "t5"])
def test_merged_decoder_alone_gives_the_same_model(tiny_export, arch, tmp_path):
    separate = _merge(tiny_export(arch, "no-merged"), tmp_path / "a")
    merged_only = tiny_export(arch, "merged-only")
    alone = _merge(merged_only, tmp_path / "b")
    assert {f.role for f in alone.inputs} == {"encoder", "merged_decoder"}
    assert verify(alone.path, merged_only.onnx_dir, tolerance=PARITY).ok
    # Same tensors either way: the merged decoder already shared the two decoders' weights.
    sizes = [
        sum(v.const_value.nbytes for v in ir.load(r.path).graph.initializers.values())
        for r in (separate, alone)
    ]
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("arch", ["marian", "bart", "t5"])
def test_export_without_past_merges_without_if(tiny_export, arch, tmp_path):
    export = tiny_export(arch, "no-past")
    result = _merge(export, tmp_path)
    assert result.layout == contract.LAYOUT_WITHOUT_PAST
    model = ir.load(result.path)
    assert [n for n in model.graph if n.op_type == "If"] == []
    assert [v.name for v in model.graph.outputs] == [contract.LOGITS]
    assert not any(contract.is_past_name(v.name) for v in model.graph.inputs)
    report = verify(result.path, export.onnx_dir, tolerance=PARITY)
    assert report.ok and {d.step for d in report.diffs} == {"first"}


@pytest.mark.parametrize("arch", ["marian", "bart", "t5"])
def test_tied_head_forms_end_equally_small(tiny_export, arch, tmp_path):
    copy = _merge(tiny_export(arch, "head-copy"), tmp_path / "copy")
    tied = _merge(tiny_export(arch, "head-tied"), tmp_path / "tied")
    tensor_bytes = [
        sum(v.const_value.nbytes for v in ir.load(r.path).graph.initializers.values())
        for r in (copy, tied)
    ]
    assert tensor_bytes[0] == tensor_bytes[1]
    if arch in TIED_HEAD_ARCHITECTURES:
        assert copy.transposed, "the LM head copy should be found as the embedding transposed"
    for result in (copy, tied):
        model = ir.load(result.path)
        # A tied head is one Transpose in the main graph, never one per branch.
        branch_transposes_of_weights = [
            n
            for g in model.graph.subgraphs()
            for n in g
            if n.op_type == "Transpose" and n.inputs[0].is_initializer()
        ]
        assert branch_transposes_of_weights == []


@pytest.mark.parametrize("variant", ["fp16", "int8", "external-data"])
def test_other_storage_variants_merge_with_parity(tiny_export, variant, tmp_path):
    export = tiny_export("marian", variant)
    result = _merge(export, tmp_path)
    # onnxruntime computes most fp16 ops in float behind inserted Casts; where a graph boundary
    # disappears (encoder output into decoder) one rounding less happens: a few fp16 ulps at |x|~10.
    tolerance = {"fp16": 2e-2}.get(variant, PARITY)
    report = verify(result.path, export.onnx_dir, tolerance=tolerance)
    assert report.ok, report.max_abs_diff
    assert find_duplicates(ir.load(result.path).graph) == []
    assert result.output_bytes < result.input_bytes


def test_external_data_output_when_asked(tiny_export, tmp_path):
    export = tiny_export("marian")
    result = _merge(export, tmp_path, external_data=True)
    data = tmp_path / "model.onnx_data"
    assert data.exists() and result.output_bytes == result.path.stat().st_size + data.stat().st_size
    onnx.checker.check_model(os.fspath(result.path), full_check=True)
    assert verify(result.path, export.onnx_dir, tolerance=PARITY).ok


def test_merge_is_byte_identical_across_runs(tiny_export, tmp_path):
    export = tiny_export("bart")
    first = _merge(export, tmp_path / "a").path.read_bytes()
    second = _merge(export, tmp_path / "b").path.read_bytes()
    assert first == second


def test_inputs_are_untouched(tiny_export, tmp_path):
    export = tiny_export("t5")
    before = {p.name: p.read_bytes() for p in export.onnx_dir.iterdir() if p.is_file()}
    _merge(export, tmp_path)
    after = {p.name: p.read_bytes() for p in export.onnx_dir.iterdir() if p.is_file()}
    assert before == after


def test_numbers_of_a_merge_add_up(tiny_export, tmp_path):
    export = tiny_export("marian")
    result = _merge(export, tmp_path)
    assert result.input_bytes == sum(
        (export.onnx_dir / f.path.name).stat().st_size for f in result.inputs
    )
    assert result.output_bytes == result.path.stat().st_size
    assert (
        result.tensors_out == result.tensors_in - len(result.shared) - sum(1 for _ in ())
        or result.tensors_out < result.tensors_in
    )
    assert result.checkpoint_bytes is None or result.checkpoint_bytes > 0
    assert np.isclose(result.bytes_saved, result.input_bytes - result.output_bytes)


def test_decoder_that_needs_encoder_states_every_step_is_refused_clearly(tiny_export, tmp_path):
    from onnxmerge.errors import IncompatibleModelsError

    with pytest.raises(IncompatibleModelsError, match="encoder_hidden_states on every cached step"):
        _merge(tiny_export("vision-encoder-decoder"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_vision_encoder_decoder_without_past_merges(tiny_export, tmp_path):
    export = tiny_export("vision-encoder-decoder", "no-past")
    result = _merge(export, tmp_path)
    assert result.layout == contract.LAYOUT_WITHOUT_PAST
    assert verify(result.path, export.onnx_dir, tolerance=PARITY).ok
