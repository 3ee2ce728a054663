"""Format version 3: one decoder for every step.

The cross-attention part is found in graphs written as ONNX text (with the cases it refuses);
the merge proves the first step against the decoder without past, and where a decoder with past
was traced for one new token it feeds the prompt one token per step.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import pytest

from onnxmerge import contract, merge_seq2seq, merge_seq2seq_with_report
from onnxmerge.errors import IncompatibleModelsError
from onnxmerge.merge._cross_attention import find_cross_attention
from onnxmerge.passes.base import NoMatch
from tests import textmodels as tm

_HEADER = '<ir_version: 8, opset_import: ["" : 17]>'


def _graph(body: str, extra_inputs: str = ""):
    text = f"""{_HEADER}
decoder (int64[batch, 3] input_ids, float[batch, 5, 4] encoder_hidden_states{extra_inputs})
    => (float[batch, 2, 5, 2] key) {{
  x = Gather(embedding, input_ids)
{body}
}}"""
    model = tm.ir_from_text(
        text, {"embedding": np.ones((9, 4), np.float32), "w": np.ones((4, 4), np.float32)}
    )
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    return graph, [graph.outputs[0]], [inputs["input_ids"]]


_PROJECT = """
  proj = MatMul(encoder_hidden_states, w)
  heads = Reshape(proj, target)
  key = Transpose<perm = [0, 2, 1, 3]>(heads)"""

# The batch size of the projections' Reshape read from the decoder's own states, as torch's
# exporter writes it.
_BATCH_FROM_DECODER = """
  shape = Shape(x)
  zero = Constant<value = int64[1] {0}>()
  batch = Gather<axis = 0>(shape, zero)
  rest = Constant<value = int64[3] {-1, 2, 2}>()
  target = Concat<axis = 0>(batch, rest)"""


def test_the_projections_are_found_and_the_batch_size_is_read_as_a_shape():
    graph, outputs, decoder_inputs = _graph(_BATCH_FROM_DECODER + _PROJECT)
    found = find_cross_attention(graph, outputs, decoder_inputs)
    assert not isinstance(found, NoMatch), found
    assert [n.op_type for n in found.nodes] == [
        "Shape",
        "Constant",
        "Gather",
        "Constant",
        "Concat",
        "MatMul",
        "Reshape",
        "Transpose",
    ]
    assert [n.op_type for n in found.batch_reads] == ["Shape"]
    # The embedding of the decoder's tokens is not needed.
    assert all(n.op_type != "Gather" or n.inputs[0].name == "shape" for n in found.nodes)


def test_projections_of_the_decoder_tokens_are_refused_with_the_node():
    body = """
  e = ReduceMean<axes = [1], keepdims = 1>(x)
  mixed = Add(encoder_hidden_states, e)
  proj = MatMul(mixed, w)
  target = Constant<value = int64[4] {0, -1, 2, 2}>()
  heads = Reshape(proj, target)
  key = Transpose<perm = [0, 2, 1, 3]>(heads)"""
    graph, outputs, decoder_inputs = _graph(body)
    found = find_cross_attention(graph, outputs, decoder_inputs)
    assert isinstance(found, NoMatch)
    assert "Add" in found.reason and "decoder's tokens" in found.reason


def test_a_shape_read_beyond_the_batch_size_is_refused():
    body = _BATCH_FROM_DECODER.replace("{0}>()\n  batch", "{1}>()\n  batch") + _PROJECT
    graph, outputs, decoder_inputs = _graph(body)
    found = find_cross_attention(graph, outputs, decoder_inputs)
    assert isinstance(found, NoMatch)
    assert "more than the batch size" in found.reason


def _edit(path, edit) -> None:
    model = onnx.load(os.fspath(path))
    edit(model)
    onnx.save(model, os.fspath(path))


def _causal_self_context(model: onnx.ModelProto) -> None:
    """The decoder without past lets each position see only the positions before it."""
    node = next(n for n in model.graph.node if n.output[0] == "self_ctx")
    node.op_type = "CumSum"
    del node.attribute[:]
    node.input[:] = [node.input[0], "cumsum_axis"]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1), "cumsum_axis"))


def _doubled_self_context(model: onnx.ModelProto) -> None:
    """The decoder with past computes something else even for one new token."""
    node = next(n for n in model.graph.node if n.output[0] == "self_ctx")
    node.output[0] = "self_ctx_once"
    index = list(model.graph.node).index(node)
    model.graph.node.insert(
        index + 1, onnx.helper.make_node("Add", ["self_ctx_once"] * 2, ["self_ctx"])
    )


def test_one_decoder_form_is_the_default_and_matches_the_two_decoder_form(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    result = merge_seq2seq_with_report(folder, tmp_path / "v3.onnx")
    old = merge_seq2seq_with_report(folder, tmp_path / "v2.onnx", format=2)
    assert (result.format_version, old.format_version) == ("3", "1")
    # These graphs' cross-attention reads its values through a Reshape, not a product.
    assert result.format_reason.startswith("one decoder for every step; ")
    assert "not format 4: no product reads present.0.encoder.key" in result.format_reason
    assert old.format_reason == "format 2 was asked for"
    inputs = tm.sample_inputs()
    for use_cache in (False, True):
        got = tm.run_merged(result.path, inputs, use_cache=use_cache)
        expected = tm.run_merged(old.path, inputs, use_cache=use_cache)
        assert tm.max_abs_diff({k: v for k, v in expected.items() if v.size}, got) <= 1e-6


def test_the_proof_reads_the_source_weights_where_they_are_stored(tmp_path, monkeypatch):
    """The proof maps the source files' weights rather than copying them into its sessions: a
    copy of the decoder's weights made the merge's peak memory 35% larger on opus-mt's shape."""
    pytest.importorskip("onnxruntime")
    from onnxmerge.merge import _first_step as first_step

    folder = tm.write_export(tmp_path / "export")
    opened = []
    real_open = first_step.open_session

    def recording_open(source, *args, **kwargs):
        opened.append(source)
        return real_open(source, *args, **kwargs)

    monkeypatch.setattr(first_step, "open_session", recording_open)
    result = merge_seq2seq_with_report(folder, tmp_path / "v3.onnx")
    assert result.format_version == "3"
    # Only the merged file itself is opened from its path.
    assert [os.path.basename(p) for p in opened] == ["v3.onnx"]


def test_a_decoder_traced_for_one_token_takes_the_prompt_one_token_per_step(tmp_path):
    pytest.importorskip("onnxruntime")
    from onnxmerge.runtime._session import MergedSession

    folder = tm.write_export(tmp_path / "export")
    _edit(folder / tm.DECODER, _causal_self_context)
    result = merge_seq2seq_with_report(folder, tmp_path / "v3.onnx")
    old = merge_seq2seq(folder, tmp_path / "v2.onnx", format=2)
    assert result.format_version == "3"
    assert "one token per step" in result.format_reason
    meta = {p.key: p.value for p in onnx.load(os.fspath(result.path)).metadata_props}
    assert meta[contract.META_PROMPT_TOKENS_PER_STEP] == "1"

    inputs = tm.sample_inputs()
    encoder = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    prompt = np.array([[3, 7, 11], [3, 5, 2]], np.int64)
    ours, theirs = MergedSession(result.path), MergedSession(old)
    a, b = ours.first_step(encoder, prompt), theirs.first_step(encoder, prompt)
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-5)
    assert a.cache.length == b.cache.length == 3
    # Fed all at once, the decoder with past would have given other logits.
    per_step = MergedSession(result.path)
    object.__setattr__(per_step.info, "prompt_tokens_per_step", None)
    assert np.abs(per_step.first_step(encoder, prompt).logits - b.logits).max() > 1e-3


def test_a_cached_step_leaves_the_cross_attention_tensors_where_they_are(tmp_path):
    """Format 3's cached steps return the past cross-attention tensors unchanged: onnxruntime
    writes them into the inputs' own buffers instead of a copy (11% of a float beam step on the
    opus-mt shape). The logits are session.run's; a past it may not write into is copied."""
    pytest.importorskip("onnxruntime")
    from onnxmerge.runtime._session import Cache, MergedSession

    folder = tm.write_export(tmp_path / "export")
    session = MergedSession(merge_seq2seq(folder, tmp_path / "v3.onnx"))
    inputs = tm.sample_inputs()
    encoder = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    first = session.first_step(encoder, np.array([[3], [3]], np.int64))
    before = [t.copy() for t in first.cache.encoder]
    token = np.array([[7], [5]], np.int64)

    step = session.next_step(token, first.cache)
    assert session._passed_through  # format 2's cached steps return other tensors
    plain = MergedSession(session.path)
    plain._passed_through = None
    expected = plain.next_step(token, first.cache)
    np.testing.assert_array_equal(step.logits, expected.logits)
    for got, was in zip(first.cache.encoder, before, strict=True):
        np.testing.assert_array_equal(got, was)

    frozen = [t.copy() for t in first.cache.encoder]
    for t in frozen:
        t.flags.writeable = False
    cache = Cache(first.cache.attention_mask, first.cache.decoder, tuple(frozen))
    np.testing.assert_array_equal(session.next_step(token, cache).logits, expected.logits)


def test_a_decoder_with_past_that_differs_for_one_token_keeps_format_2(tmp_path):
    pytest.importorskip("onnxruntime")
    folder = tm.write_export(tmp_path / "export")
    _edit(folder / tm.DECODER_WITH_PAST, _doubled_self_context)
    result = merge_seq2seq_with_report(folder)
    assert result.format_version == "1"
    assert "first step of 1 token" in result.format_reason
    assert "not proven" in result.format_reason
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_cross_attention_from_the_decoder_tokens_keeps_format_2_or_is_refused(tmp_path):
    folder = tm.write_export(tmp_path / "export")

    def mix_tokens_into_the_keys(model: onnx.ModelProto) -> None:
        node = next(n for n in model.graph.node if n.output[0] == "present.0.encoder.key/proj")
        node.input[0] = "mixed"
        mean = onnx.helper.make_node("ReduceMean", ["x"], ["x_mean"], axes=[1], keepdims=1)
        mix = onnx.helper.make_node("Add", ["encoder_hidden_states", "x_mean"], ["mixed"])
        model.graph.node.insert(1, mix)
        model.graph.node.insert(1, mean)

    _edit(folder / tm.DECODER, mix_tokens_into_the_keys)
    result = merge_seq2seq_with_report(folder, tmp_path / "model.onnx")
    assert result.format_version == "1"
    assert "decoder's tokens" in result.format_reason
    with pytest.raises(IncompatibleModelsError, match="cannot be merged as format 3"):
        merge_seq2seq(folder, tmp_path / "v3.onnx", format=3)
    assert not (tmp_path / "v3.onnx").exists()


def test_every_reader_takes_both_forms_alike(tmp_path):
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    from onnxmerge import build_generator, quantize
    from onnxmerge.inspection import inspect_model
    from onnxmerge.runtime import Seq2SeqModel
    from onnxmerge.verify import verify

    folder = tm.write_export(tmp_path / "export")
    forms = {
        "3": merge_seq2seq(folder, tmp_path / "v3" / "model.onnx"),
        "1": merge_seq2seq(folder, tmp_path / "v1" / "model.onnx", format=2),
    }
    inputs = tm.sample_inputs()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    tokens = {}
    for version, path in forms.items():
        assert inspect_model(path).metadata[contract.META_FORMAT_VERSION] == version
        assert verify(path, folder).ok
        model = Seq2SeqModel(path)
        # The fake export's generation config names no start token.
        found = [
            model.generate(
                ids, attention_mask=mask, max_new_tokens=5, num_beams=b, decoder_start_token_id=2
            )
            for b in (1, 2)
        ]
        int8 = quantize(path, path.with_name("model_int8.onnx"), weights="int8")
        meta = inspect_model(int8).metadata
        assert meta[contract.META_FORMAT_VERSION] == ("3" if version == "3" else "2")
        found.append(
            Seq2SeqModel(int8).generate(
                ids, attention_mask=mask, max_new_tokens=5, decoder_start_token_id=2
            )
        )
        for search in ("greedy", "beam"):
            generator = build_generator(
                path,
                path.with_name(f"{search}.onnx"),
                search=search,
                num_beams=2,
                generation_config={"decoder_start_token_id": 2},
            )
            session = ort.InferenceSession(str(generator), providers=["CPUExecutionProvider"])
            found.append(
                session.run(
                    None, {"input_ids": ids, "attention_mask": mask, "max_new_tokens": np.array(5)}
                )[0]
            )
        tokens[version] = found
    for a, b in zip(tokens["3"], tokens["1"], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
