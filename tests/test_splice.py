"""Splicing the files of an export into one model: wiring, names, layouts, parity, determinism."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnxmerge import contract, merge_seq2seq, merge_seq2seq_with_report
from tests import textmodels as tm

PARITY = 1e-6


def _rename_everywhere(model: onnx.ModelProto, old: str, new: str) -> None:
    """Rename a value in a proto, in subgraphs too (initializers, node inputs and outputs)."""

    def visit(graph: onnx.GraphProto) -> None:
        for tensor in graph.initializer:
            if tensor.name == old:
                tensor.name = new
        for node in graph.node:
            node.input[:] = [new if n == old else n for n in node.input]
            node.output[:] = [new if n == old else n for n in node.output]
            for attr in node.attribute:
                if attr.HasField("g"):
                    visit(attr.g)

    visit(model.graph)


def _assert_parity(path: Path, reference: Path, inputs: dict[str, np.ndarray]) -> None:
    """Both branches of the merged model match the source files, optimisations off."""
    first, cached = tm.run_sources(reference, inputs)
    assert tm.max_abs_diff(first, tm.run_merged(path, inputs, use_cache=False)) <= PARITY
    if cached is not None:
        got = tm.run_merged(path, inputs, use_cache=True)
        assert tm.max_abs_diff(cached, got) <= PARITY
        encoder_presents = [n for n in got if n.startswith("present.") and ".encoder." in n]
        assert len(encoder_presents) == 2 * tm.LAYERS
        one_decoder = contract.read_contract(
            {
                p.key: p.value
                for p in onnx.load(os.fspath(path), load_external_data=False).metadata_props
            },
            ["decoder_input_ids"],
            ["logits"],
        ).one_decoder
        for name in encoder_presents:
            if one_decoder:  # the past, passed through
                past = contract.past_name(*contract.parse_cache_name(name)[1:])
                np.testing.assert_array_equal(got[name], inputs[past])
            else:  # empty: the caller keeps the first step's
                assert got[name].size == 0


def _all_value_names(proto: onnx.ModelProto) -> list[str]:
    names: list[str] = [i.name for i in proto.graph.input]
    names += [t.name for t in proto.graph.initializer]

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            names.extend(o for o in node.output if o)
            for attr in node.attribute:
                if attr.HasField("g"):
                    visit(attr.g)

    visit(proto.graph)
    return names


def _all_node_names(proto: onnx.ModelProto) -> list[str]:
    names: list[str] = []

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            if node.name:
                names.append(node.name)
            for attr in node.attribute:
                if attr.HasField("g"):
                    visit(attr.g)

    visit(proto.graph)
    return names


# ------------------------------------------------------------------ layouts


@pytest.mark.parametrize(("format", "version"), [(None, "3"), (2, "1")])
def test_with_past_layout_follows_the_contract(tmp_path, format, version):
    folder = tm.write_export(tmp_path / "export")
    path = merge_seq2seq(folder, format=format)
    onnx.checker.check_model(os.fspath(path), full_check=True)
    proto = onnx.load(os.fspath(path))

    expected_inputs = [
        "input_ids",
        "attention_mask",
        "decoder_input_ids",
        *tm.past_names(),
        "use_cache_branch",
    ]
    assert [i.name for i in proto.graph.input] == expected_inputs
    use_cache = proto.graph.input[-1].type.tensor_type
    assert use_cache.elem_type == onnx.TensorProto.BOOL
    assert [d.dim_value for d in use_cache.shape.dim] == [1]
    presents = [
        f"present.{layer}.{part}.{kind}"
        for layer in range(tm.LAYERS)
        for part in ("decoder", "encoder")
        for kind in ("key", "value")
    ]
    assert sorted(o.name for o in proto.graph.output) == sorted(["logits", *presents])
    assert proto.graph.output[0].name == "logits"
    assert [n.op_type for n in proto.graph.node if n.op_type == "If"] == ["If"]
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta[contract.META_FORMAT_VERSION] == version
    assert meta[contract.META_LAYOUT] == "with_past"
    assert json.loads(meta[contract.META_ENCODER_INPUTS]) == ["input_ids", "attention_mask"]
    assert json.loads(meta[contract.META_CONFIG])["vocab_size"] == tm.VOCAB
    assert json.loads(meta[contract.META_GENERATION_CONFIG]) == {"max_length": 8}
    _assert_parity(path, folder, tm.sample_inputs())


def test_no_past_layout_has_no_if_and_no_cache(tmp_path):
    folder = tm.write_export(tmp_path / "export", layout="no_past")
    result = merge_seq2seq_with_report(folder)
    onnx.checker.check_model(os.fspath(result.path), full_check=True)
    proto = onnx.load(os.fspath(result.path))

    assert result.layout == contract.LAYOUT_WITHOUT_PAST
    assert [i.name for i in proto.graph.input] == [
        "input_ids",
        "attention_mask",
        "decoder_input_ids",
    ]
    assert [o.name for o in proto.graph.output] == ["logits"]
    assert not any(n.op_type == "If" for n in proto.graph.node)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta[contract.META_LAYOUT] == "without_past"
    _assert_parity(result.path, folder, tm.sample_inputs())


def test_decoder_with_presents_but_no_decoder_with_past_gives_no_cache(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    (folder / tm.DECODER_WITH_PAST).unlink()
    proto = onnx.load(os.fspath(merge_seq2seq(folder)))
    assert [o.name for o in proto.graph.output] == ["logits"]
    assert "use_cache_branch" not in [i.name for i in proto.graph.input]
    inputs = tm.sample_inputs()
    first, _ = tm.run_sources(folder, inputs)
    got = tm.run_merged(folder / "model.onnx", inputs, use_cache=False)
    assert tm.max_abs_diff({"logits": first["logits"]}, got) <= PARITY


@pytest.mark.parametrize("head", ["copy", "tied"])
def test_merged_only_layout_gives_the_same_model(tmp_path, head):
    separate = tm.write_export(tmp_path / "separate", head=head)
    merged_only = tm.write_export(tmp_path / "merged_only", layout="merged_only", head=head)
    a = onnx.load(os.fspath(merge_seq2seq(separate)))
    b = onnx.load(os.fspath(merge_seq2seq(merged_only)))

    assert a.graph.input == b.graph.input
    assert [o.name for o in a.graph.output] == [o.name for o in b.graph.output]
    assert {t.name: t.raw_data for t in a.graph.initializer} == {
        t.name: t.raw_data for t in b.graph.initializer
    }
    assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node]
    inputs = tm.sample_inputs()
    for use_cache in (False, True):
        expected = tm.run_merged(a.SerializeToString(), inputs, use_cache=use_cache)
        got = tm.run_merged(b.SerializeToString(), inputs, use_cache=use_cache)
        assert tm.max_abs_diff(expected, got) == 0.0
    _assert_parity(merged_only / "model.onnx", separate, inputs)


def test_folder_with_all_four_files_uses_the_separate_decoders(tmp_path):
    three = merge_seq2seq(tm.write_export(tmp_path / "three"))
    four_result = merge_seq2seq_with_report(tm.write_export(tmp_path / "four", layout="all"))
    assert three.read_bytes() == four_result.path.read_bytes()
    assert sorted(f.role for f in four_result.inputs) == ["decoder", "decoder_with_past", "encoder"]


def test_external_data_sources_merge_into_one_self_contained_file(tmp_path):
    folder = tm.write_export(tmp_path / "export", external_data=True)
    assert (folder / (tm.ENCODER + "_data")).exists()
    plain = merge_seq2seq(tm.write_export(tmp_path / "plain"))
    path = merge_seq2seq(folder)
    # The same bytes but for the record of the files read, which differ (data files).
    assert _without_sources_record(path) == _without_sources_record(plain)
    _assert_parity(path, folder, tm.sample_inputs())


def _without_sources_record(path: Path) -> bytes:
    model = onnx.load(os.fspath(path))
    kept = [p for p in model.metadata_props if p.key != contract.META_SOURCES]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    return model.SerializeToString()


def test_external_data_sources_merge_into_external_data(tmp_path):
    folder = tm.write_export(tmp_path / "export", external_data=True)
    path = merge_seq2seq(folder, tmp_path / "out" / "model.onnx", external_data=True)
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "model.onnx_data"]
    onnx.checker.check_model(os.fspath(path), full_check=True)
    _assert_parity(path, folder, tm.sample_inputs())


# ------------------------------------------------------------------ names and outer scope


@pytest.mark.parametrize("layout", ["with_past", "merged_only"])
def test_outer_scope_references_follow_renamed_initializers(tmp_path, layout):
    # The encoder's projection takes the name of a decoder weight, with other values: one of the
    # two must be renamed, and the decoders' branches must still read theirs from the main graph
    # (onnx.compose.add_prefix left such references on the old names).
    folder = tm.write_export(tmp_path / "export", layout=layout)
    encoder = onnx.load(os.fspath(folder / tm.ENCODER))
    _rename_everywhere(encoder, tm.ENCODER_PROJ, tm.OUT_PROJ)
    tm.save(encoder, folder / tm.ENCODER)

    path = merge_seq2seq(folder)
    onnx.checker.check_model(os.fspath(path), full_check=True)
    proto = onnx.load(os.fspath(path))
    projections = [t.name for t in proto.graph.initializer if t.name.endswith(tm.OUT_PROJ)]
    assert len(projections) == 2
    _assert_parity(path, tm.write_export(tmp_path / "reference"), tm.sample_inputs())


def test_intermediate_names_that_clash_with_the_contract_are_renamed(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    encoder = onnx.load(os.fspath(folder / tm.ENCODER))
    for old, new in (
        ("projected", "logits"),
        ("embedded", "decoder_input_ids"),
        ("mask_float", "use_cache_branch"),
        ("mask_3d", "present.0.decoder.key"),
    ):
        _rename_everywhere(encoder, old, new)
    tm.save(encoder, folder / tm.ENCODER)

    path = merge_seq2seq(folder)
    onnx.checker.check_model(os.fspath(path), full_check=True)
    proto = onnx.load(os.fspath(path))
    assert [o.name for o in proto.graph.output][:3] == [
        "logits",
        "present.0.decoder.key",
        "present.0.decoder.value",
    ]
    _assert_parity(path, tm.write_export(tmp_path / "reference"), tm.sample_inputs())


@pytest.mark.parametrize("layout", ["with_past", "merged_only"])
def test_every_value_and_node_name_is_unique(tmp_path, layout):
    # All three files use the same intermediate and node names, as optimum's exports do.
    folder = tm.write_export(tmp_path / "export", layout=layout, head="tied")
    proto = onnx.load(os.fspath(merge_seq2seq(folder)))
    duplicates = [n for n, c in Counter(_all_value_names(proto)).items() if c > 1]
    assert duplicates == []
    node_duplicates = [n for n, c in Counter(_all_node_names(proto)).items() if c > 1]
    assert node_duplicates == []


def test_branches_read_the_shared_weights_from_the_main_graph(tmp_path):
    folder = tm.write_export(tmp_path / "export")
    proto = onnx.load(os.fspath(merge_seq2seq(folder, format=2)))
    (if_node,) = [n for n in proto.graph.node if n.op_type == "If"]
    for attr in if_node.attribute:
        assert len(attr.g.initializer) == 0
        read = {i for n in attr.g.node for i in n.input}
        assert tm.EMBEDDING in read


def test_one_decoder_form_reads_every_decoder_weight_in_the_main_graph(tmp_path):
    proto = onnx.load(os.fspath(merge_seq2seq(tm.write_export(tmp_path / "export"))))
    (if_node,) = [n for n in proto.graph.node if n.op_type == "If"]
    branches = {a.name: a.g for a in if_node.attribute}
    weights = {t.name for t in proto.graph.initializer}
    main_reads = {i for n in proto.graph.node for i in n.input} & weights
    else_reads = {i for n in branches["else_branch"].node for i in n.input} & weights
    then_reads = {i for n in branches["then_branch"].node for i in n.input}
    # The cached branch only passes the cross-attention keys and values through.
    assert then_reads == {n for n in tm.past_names() if ".encoder." in n}
    assert {n.op_type for n in branches["then_branch"].node} == {"Identity"}
    # The encoder and the cross-attention projections read theirs in the else branch; the
    # decoder, the head and the embedding are read in the main graph.
    assert tm.EMBEDDING in main_reads and tm.EMBEDDING in else_reads
    assert main_reads | else_reads == weights
    assert all(len(g.initializer) == 0 for g in branches.values())
    assert sorted(if_node.output) == sorted(
        n.replace("past_key_values", "present") for n in tm.past_names() if ".encoder." in n
    )


# ------------------------------------------------------------------ determinism


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_output_is_byte_identical_across_runs_and_hash_seeds(tmp_path):
    # optimum chose kept names with set.pop(), so its output changed with PYTHONHASHSEED.
    folder = tm.write_export(tmp_path / "export", head="tied", out_proj_as_constant=True)
    in_process = _sha(merge_seq2seq(folder, tmp_path / "a.onnx"))
    assert _sha(merge_seq2seq(folder, tmp_path / "b.onnx")) == in_process
    code = (
        "import sys; from onnxmerge import merge_seq2seq; merge_seq2seq(sys.argv[1], sys.argv[2])"
    )
    for seed in ("0", "123"):
        out = tmp_path / f"seed{seed}.onnx"
        subprocess.run(
            [sys.executable, "-c", code, os.fspath(folder), os.fspath(out)],
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
            capture_output=True,
        )
        assert _sha(out) == in_process, f"PYTHONHASHSEED={seed} changed the output"


def test_merge_does_not_depend_on_file_order_on_disk(tmp_path):
    # Same files written in another order (and so other inode/directory order).
    a = tm.write_export(tmp_path / "a")
    b = tmp_path / "b"
    b.mkdir()
    for name in sorted((p.name for p in a.iterdir()), reverse=True):
        (b / name).write_bytes((a / name).read_bytes())
    assert merge_seq2seq(a).read_bytes() == merge_seq2seq(b).read_bytes()


def test_merged_model_loads_in_onnx_ir_and_round_trips(tmp_path):
    path = merge_seq2seq(tm.write_export(tmp_path / "export"))
    model = ir.load(path)
    assert model.graph.name == "onnxmerge"
    assert model.opset_imports[""] == tm.OPSET


# ---------------------------------------------------------------- splice's steps, alone


def test_splice_called_directly_follows_the_contract():
    from onnxmerge.merge._splice import splice

    parts, models = tm.export_parts()
    model = splice(parts, models)
    graph = model.graph
    meta = model.metadata_props
    assert meta[contract.META_FORMAT_VERSION] == contract.FORMAT_VERSION
    assert meta[contract.META_LAYOUT] == contract.LAYOUT_WITH_PAST
    assert json.loads(meta[contract.META_ENCODER_INPUTS]) == ["input_ids", "attention_mask"]
    names = [v.name for v in graph.inputs]
    assert names[:3] == ["input_ids", "attention_mask", "decoder_input_ids"]
    assert names[-1] == contract.USE_CACHE_BRANCH
    outputs = [v.name for v in graph.outputs]
    presents = contract.present_names(tm.LAYERS, "decoder") + contract.present_names(
        tm.LAYERS, "encoder"
    )
    assert outputs[0] == "logits" and sorted(outputs[1:]) == sorted(presents)
    (if_node,) = [n for n in graph if n.op_type == "If"]
    assert if_node.inputs[0].name == contract.USE_CACHE_BRANCH


def test_main_inputs_rename_optimum_names_and_report_dtype_clashes():
    from onnxmerge.merge._splice import _main_inputs

    parts, _ = tm.export_parts()
    encoder, decoder, with_past = parts
    inputs, renames, problems = _main_inputs(encoder, [decoder, with_past], cached=True)
    assert renames[contract.OPTIMUM_DECODER_INPUT_IDS] == contract.DECODER_INPUT_IDS
    assert renames[contract.OPTIMUM_ENCODER_ATTENTION_MASK] == contract.ATTENTION_MASK
    assert contract.OPTIMUM_ENCODER_HIDDEN_STATES not in inputs and problems == []
    decoder.inputs["input_ids"].dtype = ir.DataType.INT32
    _, _, problems = _main_inputs(encoder, [decoder, with_past], cached=True)
    assert problems == [
        "decoder_with_past.onnx input 'input_ids' is INT64, but 'decoder_input_ids' is INT32 "
        "elsewhere"
    ]


def test_output_names_drop_presents_without_a_cached_branch():
    from onnxmerge.merge._splice import _output_names

    parts, _ = tm.export_parts()
    decoder = parts[1]
    assert _output_names(decoder, cached=True) == list(decoder.outputs)
    assert _output_names(decoder, cached=False) == ["logits"]


def test_hidden_state_problems_name_the_files():
    from onnxmerge.merge._splice import _hidden_state_problems

    parts, _ = tm.export_parts()
    encoder, decoder, with_past = parts
    output = encoder.outputs[contract.OPTIMUM_ENCODER_OUTPUT]
    assert _hidden_state_problems(encoder, decoder, with_past, output) == []
    del decoder.inputs[contract.OPTIMUM_ENCODER_HIDDEN_STATES]
    assert _hidden_state_problems(encoder, decoder, with_past, output) == [
        "decoder.onnx has no encoder_hidden_states input"
    ]


def test_two_files_defining_one_local_function_are_refused():
    from onnxmerge.errors import IncompatibleModelsError
    from onnxmerge.merge._splice import _local_functions

    text = """
<ir_version: 8, opset_import: ["" : 17, "local" : 1]>
g (float[2] x) => (float[2] y) { y = local.twice(x) }
<domain: "local", opset_import: ["" : 17]>
twice (a) => (b) { b = Add(a, a) }
"""
    models = {Path("a.onnx"): tm.ir_from_text(text), Path("b.onnx"): tm.ir_from_text(text)}
    assert len(_local_functions({Path("a.onnx"): models[Path("a.onnx")]})) == 1
    with pytest.raises(IncompatibleModelsError, match="local function"):
        _local_functions(models)
