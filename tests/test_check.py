"""The output check: the merged file passes the checker as its inputs do, and both branches run."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import pytest

from onnxmerge import check, merge_seq2seq
from onnxmerge.errors import InvalidMergedModelError, MergedModelRunError, OnnxMergeError
from tests import textmodels as tm

pytest.importorskip("onnxruntime")


def _edit(folder, file, edit) -> None:
    model = onnx.load(str(folder / file))
    edit(model)
    onnx.save(model, str(folder / file))


def _tokens_outside_the_vocabulary(model: onnx.ModelProto) -> None:
    """The embedding reads ids shifted past its rows: valid to the checker, fails when run."""
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and "input_ids" in n.input)
    gather.input[1] = "shifted_ids"
    model.graph.initializer.append(
        onnx.numpy_helper.from_array(np.array(tm.VOCAB, np.int64), "vocab_offset")
    )
    model.graph.node.insert(
        0, onnx.helper.make_node("Add", ["input_ids", "vocab_offset"], ["shifted_ids"])
    )


@pytest.mark.parametrize(
    ("file", "format", "step", "match"),
    [
        (tm.DECODER, 2, "first", "use_cache_branch = false"),
        (tm.DECODER_WITH_PAST, 2, "cached", "use_cache_branch = true"),
        # Version 3 cannot take a decoder without past that fails: it falls back to version 2.
        (tm.DECODER, None, "first", "use_cache_branch = false: encoder and decoder without"),
        # Its first step runs the decoder with past.
        (tm.DECODER_WITH_PAST, None, "first", "use_cache_branch = false: .* decoder with past"),
    ],
)
def test_a_branch_that_fails_in_onnxruntime_is_named_and_nothing_is_written(
    tmp_path, file, format, step, match
):
    folder = tm.write_export(tmp_path / "export")
    _edit(folder, file, _tokens_outside_the_vocabulary)
    before = tm.folder_digest(folder)
    with pytest.raises(MergedModelRunError, match=match) as caught:
        merge_seq2seq(folder, format=format)
    assert caught.value.step == step
    assert "Gather" in caught.value.reason
    # A written file that fails to run is not "not a merged model".
    assert isinstance(caught.value, OnnxMergeError)
    assert not isinstance(caught.value, InvalidMergedModelError)
    assert tm.folder_digest(folder) == before
    assert not (folder / "model.onnx").exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []


def _simplified_layer_norm(model: onnx.ModelProto) -> None:
    """onnxruntime's RMS norm in the default domain, as its transformer optimizer writes it."""
    graph = model.graph
    producer = next(n for n in graph.node if "last_hidden_state" in n.output)
    producer.output[0] = "unnormalised"
    graph.initializer.append(
        onnx.numpy_helper.from_array(np.ones(tm.D_MODEL, np.float32), "norm.weight")
    )
    graph.node.append(
        onnx.helper.make_node(
            "SimplifiedLayerNormalization",
            ["unnormalised", "norm.weight"],
            ["last_hidden_state"],
            axis=-1,
            epsilon=1e-6,
            stash_type=1,
        )
    )


def test_operators_the_inputs_already_hold_do_not_fail_the_checker(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    _edit(folder, tm.ENCODER, _simplified_layer_norm)
    with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
        onnx.checker.check_model(str(folder / tm.ENCODER), full_check=True)

    path = merge_seq2seq(folder)
    inputs = tm.sample_inputs()
    first, cached = tm.run_sources(folder, inputs)
    assert tm.max_abs_diff(first, tm.run_merged(path, inputs, use_cache=False)) <= 1e-6
    assert tm.max_abs_diff(cached, tm.run_merged(path, inputs, use_cache=True)) <= 1e-6
    # The output keeps the operator as it was; only the check looks past it.
    merged = onnx.load(str(path))
    assert any(
        n.op_type == "SimplifiedLayerNormalization" and n.domain == ""
        for g in (merged.graph, *(a.g for n in merged.graph.node for a in n.attribute))
        for n in g.node
    )


def test_unknown_operators_are_those_without_a_schema(tmp_path):
    import onnx_ir as ir

    folder = tm.write_export(tmp_path / "export")
    _edit(folder, tm.ENCODER, _simplified_layer_norm)
    models = [ir.load(folder / f) for f in (tm.ENCODER, tm.DECODER)]
    assert check.unknown_operators(models) == {("", "SimplifiedLayerNormalization")}


def _custom_operator(model: onnx.ModelProto) -> None:
    """A node of a domain that neither the checker nor onnxruntime's CPU provider knows."""
    graph = model.graph
    producer = next(n for n in graph.node if "last_hidden_state" in n.output)
    producer.output[0] = "before_custom"
    graph.node.append(
        onnx.helper.make_node(
            "Scale", ["before_custom"], ["last_hidden_state"], domain="example.accelerator"
        )
    )
    model.opset_import.append(onnx.helper.make_opsetid("example.accelerator", 1))


def test_sources_that_do_not_load_here_hold_the_output_to_no_more(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    _edit(folder, tm.ENCODER, _custom_operator)
    path = merge_seq2seq(folder)
    merged = onnx.load(str(path))
    assert any(
        n.domain == "example.accelerator"
        for g in (a.g for n in merged.graph.node for a in n.attribute)
        for n in g.node
    )
