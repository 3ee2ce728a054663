"""Quantized merged files: every weight stored once, quantized; standard operators; quality kept."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from onnxmerge import contract, model_io
from onnxmerge._ort import open_session, session_options
from onnxmerge.errors import (
    InvalidArgumentError,
    OnnxMergeError,
    QuantizationError,
    RefusedOutputError,
)
from onnxmerge.quantization import _codes as quant_math
from onnxmerge.quantization import _rewrite as quant_rewrite
from tests import quality
from tests import textmodels as tm
from tests.checks import dequantize, expand, find_duplicates
from tests.zoo import ARCHITECTURES

ort = pytest.importorskip("onnxruntime")

PRECISIONS = ("int8", "uint8", "fp16", "int4")

# Floors on the cosine similarity between fp32 and quantized logits of a teacher-forced sequence,
# per precision and architecture. The tiny models have wide random weights (std 0.5), harder to
# quantize than trained ones; docs/benchmarks.md reports the measured values.
COSINE_FLOOR = {"fp16": 0.9999, "int8": 0.96, "uint8": 0.975, "int4": 0.85}
COSINE_FLOOR_BY_ARCH: dict[tuple[str, str], float] = {
    ("mbart", "int4"): 0.64,
    ("m2m100", "int4"): 0.77,
    ("blenderbot", "int4"): 0.77,
    ("whisper", "int4"): 0.72,
    ("vision-encoder-decoder", "int4"): 0.68,
}
# Tensor bytes of the quantized file over the float32 file's, at most (small tensors stay float).
TENSOR_BYTES_RATIO = {"fp16": 0.55, "int8": 0.35, "uint8": 0.35, "int4": 0.25}


# -- the arithmetic --------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["int8", "uint8", "int4"])
@pytest.mark.parametrize("axis", [0, 1])
def test_codes_restore_the_weight_within_half_a_step(precision, axis):
    weight = np.random.default_rng(0).standard_normal((70, 130)).astype(np.float32)
    weight[3] = 0.0  # an all-zero channel must not divide by zero
    q = quant_math.quantize(weight, precision, axis)
    restored = dequantize(q)
    assert restored.shape == weight.shape
    step = expand(q.scale, q, weight.shape)
    assert np.all(np.abs(restored - weight) <= step / 2 + 1e-6)


def test_uint8_zero_is_exact():
    weight = np.array([[0.0, 1.0, -3.0], [0.5, 0.0, 2.0]], np.float32)
    restored = dequantize(quant_math.quantize(weight, "uint8", 0))
    assert restored[0, 0] == 0.0 and restored[1, 1] == 0.0


# -- shared initializers read by several subgraphs (onnxruntime #19418) ----------------------

_SHARED = """
<ir_version: 8, opset_import: ["" : 18]>
shared (int64[N] ids, float[N, 16] x, bool[1] cond) => (float[N, 16] y)
    <float[32, 16] table = {TABLE}, float[16, 16] w = {W}>
{
    y = If (cond) <
        then_branch = g1 () => (float[N, 16] a) {
            rows = Gather (table, ids)
            a = MatMul (rows, w)
        },
        else_branch = g2 () => (float[N, 16] b) {
            h = MatMul (x, w)
            b = Gemm <transB: int = 1> (h, table)
        }
    >
}
"""


def _shared_model() -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    table = rng.standard_normal((32, 16)).astype(np.float32)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    text = _SHARED.replace("{TABLE}", "{" + ",".join(map(str, table.ravel().tolist())) + "}")
    text = text.replace("{W}", "{" + ",".join(map(str, w.ravel().tolist())) + "}")
    # The else branch's Gemm reads 16 columns from a 32-row table: keep shapes consistent.
    text = text.replace("float[N, 16] b", "float[N, 32] b").replace(
        "(float[N, 16] y)", "(float[N, ?] y)"
    )
    return onnx.parser.parse_model(text), table, w


def _opset_model(opset: int) -> ir.Model:
    return ir.from_onnx_text(
        f"""
        < ir_version: 8, opset_import: ["" : {opset}] >
        g (float[2, 3] x) => (float[2, 3] y) {{
            y = Relu(x)
        }}
        """
    )


def test_int4_precondition_refuses_an_opset_whose_operators_change_meaning():
    model = _opset_model(13)
    with pytest.raises(ir.passes.PreconditionError, match=r"need ONNX opset 21.*opset 13.*int8"):
        quant_rewrite.RaiseOpsetForInt4()(model)
    assert model.opset_imports[""] == 13 and model.ir_version == 8  # refused before any change
    with pytest.raises(QuantizationError, match=r"Export with --opset 18 or later"):
        quant_rewrite.raise_opset_for_int4(model)


@pytest.mark.parametrize(("opset", "raised"), [(18, 1), (21, 0)])
def test_int4_pass_raises_an_opset_that_keeps_its_meaning(opset, raised):
    model = _opset_model(opset)
    result = quant_rewrite.RaiseOpsetForInt4()(model)
    assert (result.name, result.count) == ("opset_raised", raised)
    assert model.opset_imports[""] == 21
    assert model.ir_version == (10 if raised else 8)


def _tied_head_model(*, unflattened_by_shape_of_x: bool) -> ir.Model:
    """A tied head as ``passes.tied_head`` writes it, or with a constant target in its last
    Reshape: the same numbers, in a form the int8 rewrite does not unwrap."""
    from onnxmerge.passes import initializer, tied_head

    rng = np.random.default_rng(5)
    model = tm.ir_from_text(
        """<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 3, 16] x) => (float[2, 3, 96] logits) {
  wt = Transpose <perm = [1, 0]> (embedding)
  logits = MatMul(x, wt)
}""",
        {"embedding": rng.standard_normal((96, 16)).astype(np.float32)},
    )
    tied_head.GemmForTransposedWeights()(model)
    if not unflattened_by_shape_of_x:
        target = initializer(model.graph, "fixed", np.array([2, 3, 96], np.int64))
        model.graph.outputs[0].producer().replace_input_with(1, target)
    return model


def test_int8_tied_head_writes_the_logits_without_a_reshape_copy():
    feeds = {"x": np.random.default_rng(6).standard_normal((2, 3, 16)).astype(np.float32)}
    unwrapped = _tied_head_model(unflattened_by_shape_of_x=True)
    kept = _tied_head_model(unflattened_by_shape_of_x=False)
    for model in (unwrapped, kept):
        quant_rewrite.QuantizeWeights(lambda _: "int8")(model)

    assert unwrapped.graph.outputs[0].producer().op_type == "Mul"
    ops = {n.op_type for n in tm.all_nodes(unwrapped)}
    assert not {"Gemm", "Reshape", "Shape", "Slice", "Concat"} & ops
    assert kept.graph.outputs[0].producer().op_type == "Reshape"
    onnx.checker.check_model(ir.serde.serialize_model(unwrapped), full_check=True)
    # One quantization scale over the same elements, an exact integer product: the same bits.
    np.testing.assert_array_equal(tm.run_model(unwrapped, feeds)[0], tm.run_model(kept, feeds)[0])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_weights_shared_by_both_branches_are_quantized_once(precision):
    proto, table, w = _shared_model()
    model = ir.serde.deserialize_model(proto)
    if precision == "int4":
        quant_rewrite.raise_opset_for_int4(model)
    done = quant_rewrite.QuantizeWeights(lambda _: precision)(model).records
    assert {d.name for d in done} == {"table", "w"}
    main = model.graph
    # No float copy left, no initializer inside a branch, one stored tensor per weight and part.
    assert "table" not in main.initializers and "w" not in main.initializers
    for branch in main.subgraphs():
        assert len(branch.initializers) == 0
    stored = [
        v.name
        for v in main.initializers.values()
        if len(v.const_value.shape) == 2 and v.const_value.dtype != ir.DataType.FLOAT
    ]
    assert len(stored) == 2, stored
    assert find_duplicates(main, min_bytes=64) == []
    # Both branches read the very same stored tensors from the outer scope.
    for branch in main.subgraphs():
        outer = [i for n in branch for i in n.inputs if i is not None and i.graph is main]
        # Directly, or through the one main-graph Cast of an fp16 weight.
        stored = {v.name for v in outer} | {
            i.name for v in outer if v.producer() is not None for i in v.producer().inputs
        }
        assert any(name.startswith("table_") for name in stored)

    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    session = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([0, 5, 31], np.int64)
    x = np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32)
    for cond, expected in ((True, table[ids] @ w), (False, (x @ w) @ table.T)):
        (got,) = session.run(None, {"ids": ids, "x": x, "cond": np.array([cond])})
        cosine = np.dot(got.ravel(), expected.ravel()) / (
            np.linalg.norm(got) * np.linalg.norm(expected)
        )
        assert cosine > COSINE_FLOOR[precision], (cond, cosine)


# -- the zoo ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def merged(tiny_export, tmp_path_factory):
    from onnxmerge import merge_seq2seq

    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            folder = tmp_path_factory.mktemp(arch)
            export = tiny_export(arch, quality.mergeable_variant(arch)).onnx_dir
            made[arch] = merge_seq2seq(export, folder / "model.onnx")
        return made[arch]

    return get


@pytest.fixture(scope="module")
def reference_logits(merged):
    made: dict[str, np.ndarray] = {}

    def get(arch: str) -> np.ndarray:
        if arch not in made:
            made[arch] = quality.teacher_forced_logits(merged(arch))
        return made[arch]

    return get


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_quantizes_to_every_precision(
    merged, reference_logits, arch, precision, tmp_path
):
    from onnxmerge import quantize
    from onnxmerge.generator import build_generator
    from onnxmerge.runtime import Seq2SeqModel

    source = merged(arch)
    path = quantize(source, tmp_path / "model.onnx", weights=precision)

    onnx.checker.check_model(os.fspath(path), full_check=True)
    model = ir.load(path)
    assert find_duplicates(model.graph) == []
    for graph in model.graph.subgraphs():
        assert len(graph.initializers) == 0
    ops = {(n.domain, n.op_type) for n in ir.traversal.RecursiveGraphIterator(model.graph)}
    assert {domain for domain, _ in ops} <= {"", "ai.onnx"}
    left_in_float = [
        v.name
        for v in model.graph.initializers.values()
        if v.const_value.dtype == ir.DataType.FLOAT
        and v.const_value.nbytes >= 1024
        and len(v.const_value.shape) >= 2
        and not v.name.endswith("_scale")
    ]
    assert left_in_float == []
    ratio = model_io.tensor_bytes(model) / model_io.tensor_bytes(ir.load(source))
    assert ratio <= TENSOR_BYTES_RATIO[precision]

    cosine = quality.cosine(reference_logits(arch), quality.teacher_forced_logits(path))
    floor = COSINE_FLOOR_BY_ARCH.get((arch, precision), COSINE_FLOOR[precision])
    assert cosine >= floor, cosine

    runtime = Seq2SeqModel(path, session_options=session_options(threads=1))
    assert runtime.precision == {"encoder": precision, "decoder": precision}
    rng = np.random.default_rng(3)
    from onnxmerge.samples import sample_encoder_inputs

    inputs = sample_encoder_inputs(runtime.session, runtime.config, batch=1, length=5, rng=rng)
    tokens = runtime.generate(**inputs, max_new_tokens=4)
    assert tokens.shape[0] == 1 and tokens.shape[1] >= 2

    if not runtime.has_past:
        return  # the generator needs a decoder with past; a model merged without one is refused
    generator = build_generator(path, tmp_path / "generator.onnx")
    session = open_session(generator, session_options(threads=1))
    feeds = {i.name: inputs[i.name] for i in session.get_inputs() if i.name in inputs}
    feeds["max_new_tokens"] = np.array(4, np.int64)
    (out, *_) = session.run(None, feeds)
    assert out.shape[0] == 1


# -- the API ---------------------------------------------------------------------------------


def test_default_output_uses_transformers_js_suffixes(merged):
    from onnxmerge import quantize

    source = merged("marian")
    names = {p: quantize(source, weights=p).name for p in PRECISIONS}
    assert names == {
        "int8": "model_int8.onnx",
        "uint8": "model_uint8.onnx",
        "fp16": "model_fp16.onnx",
        "int4": "model_q4.onnx",
    }
    with pytest.raises(RefusedOutputError, match="exists"):
        quantize(source, weights="int8")


def test_the_source_is_never_the_output(tmp_path):
    from onnxmerge import merge_seq2seq, quantize

    source = merge_seq2seq(tm.write_export(tmp_path / "export"))
    before = source.read_bytes()
    with pytest.raises(RefusedOutputError, match="is the input"):
        quantize(source, source, overwrite=True)
    with pytest.raises(RefusedOutputError, match="is the input"):
        quantize(source, source)
    assert source.read_bytes() == before


def test_the_source_data_file_is_never_the_output(tmp_path):
    from onnxmerge import merge_seq2seq, quantize

    source = merge_seq2seq(tm.write_export(tmp_path / "export"), external_data=True)
    (data,) = model_io.data_files_of(source)
    before = tm.folder_digest(source.parent)
    with pytest.raises(RefusedOutputError, match="is the input"):
        quantize(source, data, overwrite=True)
    assert tm.folder_digest(source.parent) == before


def test_external_data_follows_the_source_unless_asked(tmp_path):
    from onnxmerge import merge_seq2seq, quantize
    from onnxmerge.runtime import Seq2SeqModel

    single = merge_seq2seq(tm.write_export(tmp_path / "single"))
    external = merge_seq2seq(tm.write_export(tmp_path / "external"), external_data=True)
    written = {
        "one file, as the source": quantize(single),
        "data file, as the source": quantize(external),
        "data file, asked": quantize(single, tmp_path / "asked.onnx", external_data=True),
        "one file, asked": quantize(external, tmp_path / "inline.onnx", external_data=False),
    }
    data_files = {k: model_io.data_files_of(path) for k, path in written.items()}
    assert data_files["data file, as the source"] == {
        (tmp_path / "external" / "model_int8.onnx_data").resolve()
    }
    assert data_files["data file, asked"] == {(tmp_path / "asked.onnx_data").resolve()}
    assert data_files["one file, as the source"] == data_files["one file, asked"] == set()
    # The layout changes where the bytes are, not the model.
    ids = np.array([[5, 17, 33, 2]], np.int64)
    tokens = {
        k: Seq2SeqModel(path, session_options=session_options(threads=1)).generate(
            input_ids=ids,
            attention_mask=np.ones_like(ids),
            decoder_start_token_id=0,
            max_new_tokens=4,
        )
        for k, path in written.items()
    }
    first = next(iter(tokens.values()))
    assert all(np.array_equal(t, first) for t in tokens.values()), tokens


def test_no_file_of_the_export_is_the_output(tmp_path):
    from onnxmerge import quantize

    folder = tm.write_export(tmp_path / "export")
    before = tm.folder_digest(folder)
    with pytest.raises(RefusedOutputError, match="is the input"):
        quantize(folder, folder / tm.ENCODER, overwrite=True)
    assert tm.folder_digest(folder) == before


def test_encoder_keeps_its_own_precision(merged, tmp_path):
    from onnxmerge import quantize
    from onnxmerge.runtime import Seq2SeqModel

    path = quantize(merged("marian"), tmp_path / "m.onnx", weights="int8", encoder="fp32")
    meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    # A format 4 source stays format 4; its precision says what is quantized.
    assert meta[contract.META_FORMAT_VERSION] == contract.PER_INPUT_FORMAT_VERSION
    assert json.loads(meta[contract.META_PRECISION]) == {"encoder": "fp32", "decoder": "int8"}
    assert Seq2SeqModel(path).precision == {"encoder": "fp32", "decoder": "int8"}
    assert Seq2SeqModel(merged("marian")).activation_scale is None  # float weights
    model = ir.load(path)
    assert any(
        v.const_value.dtype == ir.DataType.FLOAT
        and v.const_value.nbytes >= 1024
        and len(v.const_value.shape) == 2
        for v in model.graph.initializers.values()
    )


def test_export_folder_is_merged_then_quantized(tiny_export, tmp_path):
    from onnxmerge import quantize

    export = tiny_export("bart")
    path = quantize(export.onnx_dir, tmp_path / "out.onnx", weights="uint8")
    assert path.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx"]
    assert not (export.onnx_dir / "model_uint8.onnx").exists()


def test_refusals_name_the_problem(merged, tmp_path):
    from onnxmerge import quantize

    source = merged("t5")
    before = source.read_bytes()
    with pytest.raises(InvalidArgumentError, match="int8, uint8, fp16, int4") as bad:
        quantize(source, tmp_path / "a.onnx", weights="int3")
    assert bad.value.argument == "weights"
    with pytest.raises(InvalidArgumentError, match="choose one of tensor, row") as bad:
        quantize(source, tmp_path / "a.onnx", activation_scale="column")
    assert bad.value.argument == "activation_scale"
    with pytest.raises(InvalidArgumentError, match="applies to the products of int8 and uint8"):
        quantize(source, tmp_path / "a.onnx", weights="fp16", activation_scale="row")
    once = quantize(source, tmp_path / "b.onnx", weights="int8")
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize(once, tmp_path / "c.onnx", weights="int8")
    assert source.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.onnx"]


def _first_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    from onnxmerge.runtime import Seq2SeqModel

    model = Seq2SeqModel(path)
    start = np.full((len(ids), 1), model.resolve_settings().decoder_start_token_id, np.int64)
    return model.first_step({"input_ids": ids}, start).logits


@pytest.mark.parametrize("precision", ["int8", "uint8"])
def test_row_scales_give_every_input_the_logits_it_gets_alone(
    tiny_export, merged, precision, tmp_path
):
    from onnxmerge import quantize
    from onnxmerge.runtime import Seq2SeqModel
    from onnxmerge.verify import verify

    ids = np.random.default_rng(3).integers(4, 90, size=(3, 7)).astype(np.int64)
    ids[:, -1] = 2  # eos, as the tokenizer ends every input
    alone_equal = {}
    for scale in ("tensor", "row"):
        path = quantize(
            merged("marian"), tmp_path / f"{scale}.onnx", weights=precision, activation_scale=scale
        )
        assert Seq2SeqModel(path).activation_scale == scale
        batched = _first_logits(path, ids)
        alone_equal[scale] = [
            np.array_equal(batched[i], _first_logits(path, ids[i : i + 1])[0])
            for i in range(len(ids))
        ]
        report = verify(path, tiny_export("marian").onnx_dir)
        assert report.ok, [(d.name, d.max_abs_diff, d.reference_peak) for d in report.diffs]
    assert alone_equal["row"] == [True, True, True]
    # One scale over the batch: the rows below its largest value get other codes than alone.
    assert not all(alone_equal["tensor"])


def test_row_scales_quantize_each_row_on_its_own_and_zero_rows_to_zero():
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((16, 24)).astype(np.float32)
    model = tm.ir_from_text(
        """<ir_version: 9, opset_import: ["" : 18]>
g (float[4, 16] x) => (float[4, 24] y) {
  y = MatMul(x, w)
}""",
        {"w": weight},
    )
    quant_rewrite.QuantizeWeights(lambda _: "int8", "row")(model)
    ops = {n.op_type for n in tm.all_nodes(model)}
    assert "MatMulInteger" in ops and "DynamicQuantizeLinear" not in ops
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    x = rng.standard_normal((4, 16)).astype(np.float32) * np.array([[1e-3], [1.0], [1e3], [0]])
    x = x.astype(np.float32)
    got = tm.run_model(model, {"x": x})[0]
    assert not got[3].any()  # an all-zero row: its codes are the zero point, its product 0
    # Each row within its own step: half of max|row| / 127 times the weights' column sums.
    step = np.abs(x).max(axis=1, keepdims=True) / 127
    bound = step / 2 * np.abs(weight).sum(axis=0) + 0.01 * np.abs(x @ weight) + 1e-6
    assert np.all(np.abs(got - x @ weight) <= bound)


# -- the shipped trained model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_translations(demo_export, tmp_path_factory):
    """Every held-out number translated by the fp32 file and by each quantized file."""
    from onnxmerge import merge_seq2seq, quantize
    from onnxmerge.demo import LARGEST_NUMBER, french_number, is_held_out
    from onnxmerge.runtime import Seq2SeqModel

    folder = tmp_path_factory.mktemp("demo")
    for path in demo_export.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):  # translate() reads it beside
            shutil.copy2(path, folder / path.name)
    merged = merge_seq2seq(demo_export, folder / "model.onnx")
    sources = [french_number(n) for n in range(LARGEST_NUMBER + 1) if is_held_out(n)]
    made = {"fp32": Seq2SeqModel(merged).translate(sources)}
    for precision in PRECISIONS:
        made[precision] = Seq2SeqModel(quantize(merged, weights=precision)).translate(sources)
    by_row = quantize(merged, folder / "model_int8_row.onnx", activation_scale="row")
    made["int8 row"] = Seq2SeqModel(by_row).translate(sources)
    return made


@pytest.mark.parametrize("precision", ["int8", "int8 row", "uint8", "fp16"])
def test_demo_model_translates_held_out_numbers_as_fp32_does(demo_translations, precision):
    reference, got = demo_translations["fp32"], demo_translations[precision]
    same = sum(a == b for a, b in zip(reference, got, strict=True))
    assert same >= 0.99 * len(reference), [
        (a, b) for a, b in zip(reference, got, strict=True) if a != b
    ][:10]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_verify_and_inspect_read_quantized_files(tiny_export, merged, precision, tmp_path):
    from onnxmerge import quantize
    from onnxmerge.inspection import inspect_model
    from onnxmerge.verify import RELATIVE_TOLERANCE, verify

    path = quantize(merged("marian"), tmp_path / "m.onnx", weights=precision)
    report = verify(path, tiny_export("marian").onnx_dir)
    assert report.relative and report.tolerance == RELATIVE_TOLERANCE[precision]
    assert report.ok, [(d.name, d.max_abs_diff, d.reference_peak) for d in report.diffs]
    found = inspect_model(path)
    assert found.metadata[contract.META_PRECISION]
    # Only integer products quantize their input, and only they say how.
    expected = "tensor" if precision in ("int8", "uint8") else None
    assert found.metadata.get(contract.META_ACTIVATION_SCALE) == expected
    # The quantized embedding still counts as the embedding, read by both Gathers.
    assert found.bytes_by_part["embedding"] > 0 and found.bytes_by_part["decoder"] > 0


@pytest.mark.parametrize(
    ("arguments", "argument"),
    [
        ({"weights": "int3"}, "weights"),
        ({"weights": None}, "weights"),
        ({"encoder": "bf16"}, "encoder"),
        ({"activation_scale": "column"}, "activation_scale"),
        ({"embedding": "int3"}, "embedding"),
    ],
)
def test_a_bad_argument_is_refused_before_the_source_is_read(tmp_path, arguments, argument):
    from onnxmerge import quantize

    # The source does not exist: the argument is refused before it is looked for.
    with pytest.raises(ValueError, match=argument) as refused:
        quantize(tmp_path / "missing.onnx", tmp_path / "out" / "q.onnx", **arguments)
    assert isinstance(refused.value, OnnxMergeError) and refused.value.argument == argument
    assert list(tmp_path.iterdir()) == []


def test_the_result_is_the_path_and_carries_the_report(merged, tmp_path):
    from onnxmerge import quantize
    from onnxmerge.quantization import QuantizeResult, quantize_with_report

    source = merged("marian")
    written = quantize(source, tmp_path / "q.onnx", weights="int8")
    assert written == tmp_path / "q.onnx" and isinstance(written, Path)
    assert written.report.path == written and written.report.precision["decoder"] == "int8"
    assert written.report.bytes_after == Path(written).stat().st_size
    steps: list[str] = []
    quantize(source, tmp_path / "p.onnx", progress=steps.append)
    assert steps == ["storing the weights as int8"]
    with pytest.warns(DeprecationWarning, match="quantize_with_report"):
        old = quantize_with_report(source, tmp_path / "r.onnx", weights="int8")
    assert isinstance(old, QuantizeResult) and old.path.read_bytes() == written.read_bytes()


def test_an_int4_embedding_is_asked_for_and_makes_the_smallest_file(merged, tmp_path):
    """Under int4 weights the embedding is int8 unless ``embedding="int4"``: then the file is
    smaller, and its first logits are those of a dequantized embedding (close to the default's)."""
    from onnxmerge import quantize

    source = merged("marian")
    default = quantize(source, tmp_path / "q4.onnx", weights="int4")
    smallest = quantize(source, tmp_path / "q4e.onnx", weights="int4", embedding="int4")
    stored = {w.name: w.precision for w in default.report.weights}
    asked = {w.name: w.precision for w in smallest.report.weights}
    gathered = [name for name, precision in stored.items() if asked[name] != precision]
    assert gathered and all(stored[n] == "int8" and asked[n] == "int4" for n in gathered)
    assert Path(smallest).stat().st_size < Path(default).stat().st_size
    ids = np.array([[5, 6, 7, 2]], dtype=np.int64)
    a, b = _first_logits(default, ids), _first_logits(smallest, ids)
    cosine = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    assert cosine > 0.9
    # Under int8 weights the default embedding is int8 too; fp32 leaves it float.
    kept = quantize(source, tmp_path / "q8.onnx", weights="int8", embedding="fp32")
    assert all(w.name not in gathered for w in kept.report.weights)
