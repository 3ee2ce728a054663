"""Format version 4: cross-attention keys and values held once per input, read by all its beams.

The pass is tested from ONNX text (its products with the keys fed once per row and once per
input, and the reads it refuses), the cache's row arithmetic alone, and the merge end to end.
"""

from __future__ import annotations

import numpy as np
import pytest

from onnxmerge import contract, merge_seq2seq_with_report
from onnxmerge.errors import IncompatibleModelsError
from onnxmerge.passes import per_input
from onnxmerge.passes.base import NoMatch
from onnxmerge.runtime._session import Cache
from tests import textmodels as tm

_HEADER = '<ir_version: 8, opset_import: ["" : 17]>'
RNG = np.random.default_rng(5)

# One layer's cross-attention as exporters write it: the keys transposed and scaled, softmax, the
# values; the keys and values are the graph's present outputs, as format 3's If returns them.
_ATTENTION = """
  kt = Transpose<perm = [0, 1, 3, 2]>(key_in)
  scale = Constant<value = float {0.5}>()
  scaled = Mul(kt, scale)
  scores = MatMul(q, scaled)
  probs = Softmax<axis = -1>(scores)
  out = MatMul(probs, value_in)"""


def _model(extra: str = ""):
    text = f"""{_HEADER}
step (float[rows, 2, t, 4] q, float[inputs, 2, 5, 4] key_in, float[inputs, 2, 5, 4] value_in)
    => (float[rows, 2, t, 4] out, float[inputs, 2, 5, 4] key, float[inputs, 2, 5, 4] value) {{
{_ATTENTION}
  key = Identity(key_in)
  value = Identity(value_in)
{extra}
}}"""
    model = tm.ir_from_text(text)
    # The pass follows the present outputs to their readers, which format 3 gives the If's.
    for name in ("key", "value"):
        output = next(v for v in model.graph.outputs if v.name == name)
        identity = output.producer()
        output.name = f"present.0.encoder.{name}"
        for use in list(identity.inputs[0].uses()):
            if use.node is not identity:
                use.node.replace_input_with(use.idx, output)
    return model


def _feeds(inputs: int, beams: int, length: int = 3) -> dict[str, np.ndarray]:
    rows = inputs * beams
    return {
        "q": RNG.standard_normal((rows, 2, length, 4)).astype(np.float32),
        "key_in": RNG.standard_normal((inputs, 2, 5, 4)).astype(np.float32),
        "value_in": RNG.standard_normal((inputs, 2, 5, 4)).astype(np.float32),
    }


def _replicated(feeds: dict[str, np.ndarray], beams: int) -> dict[str, np.ndarray]:
    return {k: v if k == "q" else np.repeat(v, beams, axis=0) for k, v in feeds.items()}


def test_each_product_reads_the_keys_once_per_input_and_once_per_row_alike():
    pytest.importorskip("onnxruntime")
    model = _model()
    feeds = _feeds(inputs=2, beams=3)
    expected = tm.run_model(model, _replicated(feeds, 3))[0]
    result = per_input.CrossAttentionPerInput()(model)
    assert (result.name, result.count, result.modified) == (per_input.RESULT_NAME, 2, True)
    once_per_row = tm.run_model(model, _replicated(feeds, 3))[0]
    once_per_input = tm.run_model(model, feeds)[0]
    np.testing.assert_allclose(once_per_row, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(once_per_input, expected, rtol=1e-6, atol=1e-6)
    # Row r reads input r // beams: rows of one input differ only by their queries.
    assert once_per_input.shape == (6, 2, 3, 4)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (
            "  shape = Shape(key_in)\n  zero = Constant<value = int64[1] {0}>()\n"
            "  batch = Gather<axis = 0>(shape, zero)",
            "reads its batch size",
        ),
        ("  added = Add(key_in, key_in)", "is not a product with it as second operand"),
        ("  moved = Transpose<perm = [1, 0, 2, 3]>(key_in)", "moves the batch"),
        (
            "  twice = Constant<value = float[4] {1.0, 2.0, 3.0, 4.0}>()\n"
            "  wide = Mul(key_in, twice)",
            "scales it by more than one number",
        ),
    ],
)
def test_a_read_of_the_rows_leaves_the_graph_as_it_is_and_says_why(extra, why):
    model = _model(extra)
    before = len(list(model.graph))
    result = per_input.CrossAttentionPerInput()(model)
    assert (result.count, result.modified) == (0, False)
    assert isinstance(result.records[0], NoMatch) and why in str(result.records[0])
    assert len(list(model.graph)) == before


def test_a_shape_read_past_the_batch_size_is_allowed():
    extra = (
        "  shape = Shape(key_in)\n  two = Constant<value = int64[1] {2}>()\n"
        "  length = Gather<axis = 0>(shape, two)"
    )
    assert per_input.CrossAttentionPerInput()(_model(extra)).count == 2


def _cache(inputs: int, beams: int) -> Cache:
    rows = inputs * beams
    layer = np.arange(rows * 2, dtype=np.float32).reshape(rows, 1, 2, 1)
    encoder = np.arange(inputs, dtype=np.float32).reshape(inputs, 1, 1, 1) * np.ones((1, 1, 3, 1))
    return Cache(
        np.ones((rows, 3), np.int64), (layer, layer + 1), (encoder, encoder), per_input=True
    )


def test_a_per_input_cache_expands_to_beams_without_touching_the_encoder_tensors():
    cache = _cache(inputs=3, beams=1)
    expanded = cache.expand(4)
    assert expanded.rows == 12
    assert all(a is b for a, b in zip(expanded.encoder, cache.encoder, strict=True))
    # Without per_input (format 3) they are repeated row by row.
    row_by_row = Cache(cache.attention_mask, cache.decoder, cache.encoder).expand(4)
    assert row_by_row.encoder[0].shape[0] == 12


@pytest.mark.parametrize(
    ("rows", "held"),
    [
        ([4, 5, 6, 7, 0, 1, 2, 3], [1, 0]),  # whole inputs moved: one row each
        ([0, 1, 2, 3], [0]),  # an input dropped
        ([0, 0, 4, 4, 1, 1], [0, 1, 0]),  # runs of one length, an input twice
        ([0, 4, 5], [0, 1, 1]),  # runs of other lengths: one row per decoder row
    ],
)
def test_a_per_input_cache_reorders_its_rows_by_input(rows, held):
    cache = _cache(inputs=2, beams=4)
    moved = cache.reorder(rows)
    assert moved.encoder[0][:, 0, 0, 0].tolist() == held
    assert moved.rows == len(rows)
    # Every decoder row still reads its own input's tensors.
    per_row = moved.rows // moved.encoder[0].shape[0]
    assert [held[r // per_row] for r in range(len(rows))] == [r // 4 for r in rows]


def test_the_merge_writes_version_4_and_generates_the_tokens_of_version_3(tmp_path, tiny_export):
    import onnxmerge
    from onnxmerge.runtime._session import MergedSession

    folder = tiny_export("marian").onnx_dir
    four = merge_seq2seq_with_report(folder, tmp_path / "v4.onnx")
    three = merge_seq2seq_with_report(folder, tmp_path / "v3.onnx", format=3)
    assert (four.format_version, three.format_version) == (
        contract.PER_INPUT_FORMAT_VERSION,
        contract.ONE_DECODER_FORMAT_VERSION,
    )
    layers = MergedSession(four.path).info.num_layers
    assert four.rewrites[per_input.RESULT_NAME] == 2 * layers  # a product of keys, one of values
    assert "once per input" in four.format_reason
    ids = np.array([[5, 9, 14, 3, 2], [7, 8, 2, 0, 0]], np.int64)
    mask = (ids != 0).astype(np.int64)
    settings = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6)
    new = onnxmerge.Seq2SeqModel(four.path).generate(ids, attention_mask=mask, **settings)
    old = onnxmerge.Seq2SeqModel(three.path).generate(ids, attention_mask=mask, **settings)
    np.testing.assert_array_equal(new, old)
    # The cross-attention tensors keep one row per input once expanded to beams.
    session = MergedSession(four.path)
    first = session.first_step({"input_ids": ids, "attention_mask": mask}, ids[:, :1])
    expanded = first.cache.expand(3)
    assert expanded.encoder[0].shape[0] == ids.shape[0] and expanded.rows == 3 * ids.shape[0]
    step = session.next_step(np.full((6, 1), 4, np.int64), expanded)
    replicated = MergedSession(three.path)
    old_first = replicated.first_step({"input_ids": ids, "attention_mask": mask}, ids[:, :1])
    old_step = replicated.next_step(np.full((6, 1), 4, np.int64), old_first.cache.expand(3))
    np.testing.assert_allclose(step.logits, old_step.logits, rtol=1e-5, atol=1e-5)


def test_format_4_is_refused_with_the_reason_where_the_pass_does_not_hold(
    tmp_path, monkeypatch, tiny_export
):
    folder = tiny_export("marian").onnx_dir
    monkeypatch.setattr(per_input, "find_products", lambda graph: NoMatch("a test said no"))
    with pytest.raises(IncompatibleModelsError, match="format 4: a test said no"):
        merge_seq2seq_with_report(folder, tmp_path / "v4.onnx", format=4)
    assert not (tmp_path / "v4.onnx").exists()
    result = merge_seq2seq_with_report(folder, tmp_path / "v3.onnx")
    assert result.format_version == contract.ONE_DECODER_FORMAT_VERSION
    assert "a test said no" in result.format_reason


def _repeated_for_beams(graph) -> list[str]:
    """What the beam generator's main graph repeats for the beams: the op type that produced each
    value gathered by the beam rows (``Range / num_beams``), or ``input`` for a graph input."""
    producers = {o: n for n in graph.node for o in n.output}

    def op(name: str) -> str:
        return producers[name].op_type if name in producers else "input"

    rows = {
        n.output[0]
        for n in graph.node
        if n.op_type == "Div" and n.input[0] in producers and op(n.input[0]) == "Range"
    }
    return [op(n.input[0]) for n in graph.node if n.op_type == "Gather" and n.input[1] in rows]


def test_a_beam_generator_of_version_4_keeps_one_row_per_input(tmp_path, tiny_export):
    """Built from a version 4 file, the generator's loop reads each input's cross-attention keys
    and values as the encoder wrote them (not repeated for the beams), with the same tokens."""
    import onnx

    from onnxmerge import build_generator
    from onnxmerge._ort import open_session

    folder = tiny_export("marian").onnx_dir
    ids = np.array([[5, 9, 14, 3, 2], [7, 8, 2, 0, 0]], np.int64)
    feeds = {
        "input_ids": ids,
        "attention_mask": (ids != 0).astype(np.int64),
        contract.MAX_NEW_TOKENS: np.array(6, np.int64),
    }
    tokens, repeated = [], []
    for format in (3, 4):
        merged = merge_seq2seq_with_report(folder, tmp_path / f"v{format}.onnx", format=format)
        path = build_generator(
            merged.path, tmp_path / f"g{format}.onnx", search="beam", num_beams=3
        )
        repeated.append(_repeated_for_beams(onnx.load(str(path), load_external_data=False).graph))
        tokens.append(open_session(path).run(None, feeds)[0])
    np.testing.assert_array_equal(tokens[1], tokens[0])
    # Format 3 repeats the cross-attention tensors; format 4 only the inputs, the prompt and the
    # empty pasts.
    cross = [[op for op in ops if op not in ("input", "Expand", "Slice")] for ops in repeated]
    assert len(cross[0]) >= 2 and cross[1] == []
    assert "Slice" in repeated[1]
