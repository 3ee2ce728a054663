"""Seq2SeqModel refuses bad files, inputs and settings with errors that say what to do."""

from __future__ import annotations

import numpy as np
import pytest

from onnxmerge.errors import GenerationError, InvalidMergedModelError, OnnxMergeError

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def marian(tiny_export, tmp_path_factory):
    import onnxmerge
    from tests import zoo

    export = tiny_export("marian")
    out = onnxmerge.merge_seq2seq(export.onnx_dir, tmp_path_factory.mktemp("errors") / "m.onnx")
    return onnxmerge.Seq2SeqModel(out), zoo.sample_encoder_inputs(export, batch=2, seq=5), export


def test_a_file_that_is_not_merged_is_refused(marian):
    from onnxmerge import Seq2SeqModel

    _, _, export = marian
    with pytest.raises(InvalidMergedModelError, match="merge_seq2seq"):
        Seq2SeqModel(export.onnx_dir / "encoder_model.onnx")
    with pytest.raises(InvalidMergedModelError, match="not a file"):
        Seq2SeqModel(export.onnx_dir / "missing.onnx")


def test_a_file_onnxruntime_cannot_read_is_refused(tmp_path):
    from onnxmerge import Seq2SeqModel

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx model")
    with pytest.raises(InvalidMergedModelError, match="bad.onnx"):
        Seq2SeqModel(bad)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda x: {**x, "input_ids": x["input_ids"].astype(np.float32)}, "integers"),
        (lambda x: {**x, "input_ids": x["input_ids"][0]}, "2 dimensions"),
        (lambda x: {**x, "input_ids": x["input_ids"].tolist()}, "numpy array"),
        (lambda x: {"attention_mask": x["attention_mask"]}, "missing encoder inputs"),
        (lambda x: {**x, "token_type_ids": x["input_ids"]}, "unknown inputs"),
        (lambda x: {**x, "attention_mask": x["attention_mask"][:1]}, "batch size"),
        (lambda x: {}, "no encoder inputs"),
        (lambda x: {**x, "attention_mask": x["attention_mask"][:, :-1]}, "one mask value per"),
        (lambda x: {k: v[:, :0] for k, v in x.items()}, "input_ids is empty"),
        (lambda x: {k: v[:0] for k, v in x.items()}, "no rows"),
    ],
)
def test_bad_inputs(marian, change, match):
    model, inputs, _ = marian
    with pytest.raises(GenerationError, match=match):
        model.generate(**change(inputs))


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"num_beams": 0}, "num_beams"),
        ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
        ({"num_return_sequences": 2}, "greedy"),
        ({"max_length": 1}, "max_length"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"early_stopping": "sometimes", "num_beams": 2}, "early_stopping"),
        ({"do_sample": True, "temperature": 0.0}, "temperature"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"bad_words_ids": [[]]}, "bad_words_ids"),
    ],
)
def test_bad_settings(marian, settings, match):
    model, inputs, _ = marian
    with pytest.raises(GenerationError, match=match):
        model.generate(**inputs, **settings)


def test_negative_max_new_tokens_is_named_as_given(marian):
    model, inputs, _ = marian
    with pytest.raises(GenerationError, match="max_new_tokens must be >= 1, got -3") as caught:
        model.generate(**inputs, max_new_tokens=-3)
    assert "max_length" not in str(caught.value)


def test_refused_before_onnxruntime_runs(marian, monkeypatch):
    model, inputs, _ = marian

    def fail(*args, **kwargs):
        raise AssertionError("onnxruntime ran")

    monkeypatch.setattr(model.session, "run", fail)
    with pytest.raises(GenerationError):
        model.generate(**{**inputs, "attention_mask": inputs["attention_mask"][:, :2]})
    with pytest.raises(GenerationError, match="empty"):
        model.first_step(inputs, np.zeros((2, 0), dtype=np.int64))


def test_whisper_features_of_the_wrong_width_are_refused(tiny_export, tmp_path):
    import onnxmerge
    from tests import zoo

    export = tiny_export("whisper")
    model = onnxmerge.Seq2SeqModel(onnxmerge.merge_seq2seq(export.onnx_dir, tmp_path / "m.onnx"))
    features = zoo.sample_encoder_inputs(export, batch=1)["input_features"]
    assert model.generate(input_features=features, max_new_tokens=2).shape == (1, 3)
    for wrong in (features[:, :-1], features[:, :, :-4]):
        with pytest.raises(GenerationError, match="mel bins, frames"):
            model.generate(input_features=wrong, max_new_tokens=2)
    # More frames than a window is long-form audio, which needs Whisper's timestamp token.
    with pytest.raises(GenerationError, match="128 frames, more than one window.*no_timestamps"):
        model.generate(input_features=np.concatenate([features] * 2, axis=2), max_new_tokens=2)


def test_bad_decoder_input_ids(marian):
    model, inputs, _ = marian
    with pytest.raises(GenerationError, match="rows"):
        model.generate(**inputs, decoder_input_ids=np.zeros((3, 1), dtype=np.int64))
    with pytest.raises(GenerationError, match="integers"):
        model.generate(**inputs, decoder_input_ids=np.zeros((2, 1), dtype=np.float32))


def test_decoder_input_ids_are_checked_alike_by_generate_and_the_step_api(marian):
    model, inputs, _ = marian
    for call in (
        lambda ids: model.generate(**inputs, decoder_input_ids=ids, max_new_tokens=2),
        lambda ids: model.first_step(inputs, ids),
    ):
        with pytest.raises(GenerationError, match="3 rows but the encoder inputs have 2"):
            call(np.zeros((3, 1), dtype=np.int64))
        with pytest.raises(GenerationError, match="empty; give at least the decoder start"):
            call(np.zeros((2, 0), dtype=np.int64))
        with pytest.raises(GenerationError, match="must have 2 dimensions"):
            call(np.zeros(2, dtype=np.int64))


@pytest.mark.parametrize(
    "arguments, argument",
    [
        ({"threads": 0}, "threads"),
        ({"threads": True}, "threads"),
        ({"accelerations": 1}, "accelerations"),
    ],
)
def test_bad_arguments_are_refused_before_the_file_is_read(tmp_path, arguments, argument):
    from onnxmerge import Seq2SeqModel
    from onnxmerge.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as caught:  # the file does not even exist
        Seq2SeqModel(tmp_path / "absent.onnx", **arguments)
    assert caught.value.argument == argument


def test_bad_batching_names_its_argument(marian):
    from onnxmerge.errors import InvalidArgumentError

    model, _, _ = marian
    for options, argument in [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"parallel_batches": 1.5}, "parallel_batches"),
        ({"batch_type": "rows"}, "batch_type"),
        ({"decoder_input_ids": None}, "decoder_input_ids"),
    ]:
        with pytest.raises(InvalidArgumentError) as caught:
            model.generate_many([[5, 6]], **options)
        assert caught.value.argument == argument


def test_main_input_is_the_encoders_first_input_but_the_mask(marian):
    model, inputs, _ = marian
    assert model.main_input == "input_ids"
    np.testing.assert_array_equal(
        model.generate(inputs["input_ids"], max_new_tokens=2),
        model.generate(**{model.main_input: inputs["input_ids"]}, max_new_tokens=2),
    )


def test_step_api_errors(marian):
    model, inputs, _ = marian
    step = model.first_step(inputs, np.zeros((2, 1), dtype=np.int64))
    with pytest.raises(GenerationError, match="rows"):
        model.next_step(np.zeros((3, 1), dtype=np.int64), step.cache)
    with pytest.raises(GenerationError, match="cache"):
        model.next_step(np.zeros((2, 1), dtype=np.int64), None)
    with pytest.raises(GenerationError, match="reorder"):
        step.cache.reorder([0, 5])


def test_unsupported_generation_config_is_refused(marian):
    model, inputs, _ = marian
    model.generation_config = {**model.generation_config, "typical_p": 0.5}
    try:
        with pytest.raises(GenerationError, match="typical_p"):
            model.generate(**inputs)
    finally:
        model.generation_config = {
            k: v for k, v in model.generation_config.items() if k != "typical_p"
        }


def test_errors_share_the_base_class():
    assert issubclass(GenerationError, OnnxMergeError)
    assert issubclass(GenerationError, ValueError)


def test_a_tokenizer_that_is_not_a_transformers_tokenizer_is_refused(marian):
    model, _, _ = marian
    with pytest.raises(GenerationError, match="transformers tokenizer"):
        model.translate("x", tokenizer=lambda texts, **kwargs: texts)


def test_decoder_input_ids_stand_in_for_a_start_token_the_configs_lack(tmp_path):
    """The error for a missing start token says to pass decoder_input_ids; doing so works."""
    from onnxmerge import Seq2SeqModel, merge_seq2seq
    from tests import textmodels as tm

    # Merged away from its export folder: no config beside it names a start token.
    model = Seq2SeqModel(merge_seq2seq(tm.write_export(tmp_path / "e"), tmp_path / "m.onnx"))
    ids = np.array([[5, 6, 7, 1]])
    with pytest.raises(GenerationError, match="pass decoder_input_ids"):
        model.generate(ids, max_new_tokens=3)
    given = model.generate(ids, decoder_input_ids=np.array([[2]]), max_new_tokens=3)
    named = model.generate(ids, decoder_start_token_id=2, max_new_tokens=3)
    assert given.tolist() == named.tolist()
    assert given[0, 0] == 2 and given.shape == (1, 4)
