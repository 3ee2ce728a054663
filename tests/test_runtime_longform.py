"""Long-form Whisper in the runtime: the ids and segments of transformers' Whisper generate()."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from onnxmerge.errors import GenerationError

pytestmark = pytest.mark.export

pytest.importorskip("onnxruntime")

# Whisper's timestamp fields for the tiny vocabulary (128 tokens): text below 94, 94 is
# <|notimestamps|>, 95..127 the 33 timestamps of one 64-frame window (0.00 s to 0.64 s).
TIMESTAMPS = {
    "no_timestamps_token_id": 94,
    "prev_sot_token_id": 90,
    "begin_suppress_tokens": [2],
    "suppress_tokens": [1],
}
LANGUAGES = {
    "lang_to_id": {"<|en|>": 80, "<|fr|>": 81, "<|de|>": 82},
    "task_to_id": {"transcribe": 85, "translate": 84},
    "is_multilingual": True,
}
FRAMES = 300  # about five windows of the tiny model's 64 frames


@pytest.fixture(scope="module")
def models(tiny_export, tmp_path_factory):
    """(Seq2SeqModel, transformers model) of the tiny Whisper, timestamp fields set in both."""
    import onnxmerge
    from tests import zoo

    export = tiny_export("whisper")
    out = tmp_path_factory.mktemp("longform") / "model.onnx"
    onnxmerge.merge_seq2seq(export.onnx_dir, out)
    model = onnxmerge.Seq2SeqModel(out)
    pt_model = zoo.load_pytorch(export)
    return model, pt_model


@pytest.fixture(scope="module")
def screened(models, tmp_path_factory):
    """The same file through a session cache's int8 head, every greedy step screened."""
    import onnxmerge
    from onnxmerge.runtime import Accelerations

    model, _ = models
    return onnxmerge.Seq2SeqModel(
        model.path,
        session_cache=tmp_path_factory.mktemp("longform-cache"),
        accelerations=Accelerations(greedy_cheaper_below=1),
    )


def _configure(model, pt_model, fields: dict) -> None:
    base = dict(TIMESTAMPS)
    for key in ("lang_to_id", "task_to_id", "is_multilingual"):
        model.generation_config.pop(key, None)
        if hasattr(pt_model.generation_config, key):
            delattr(pt_model.generation_config, key)
    base.update(fields)
    for key, value in base.items():
        model.generation_config[key] = value
        setattr(pt_model.generation_config, key, value)


def _audio(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.uniform(-1.0, 1.0, size=(rows, 16, FRAMES)).astype(np.float32)
    mask = np.ones((rows, FRAMES), dtype=np.int64)
    mask[1:, 210:] = 0  # later rows end earlier
    return features, mask


def _reference(pt_model, features, mask, **settings):
    import torch

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pt_model.generate(
            input_features=torch.from_numpy(features),
            attention_mask=torch.from_numpy(mask),
            return_timestamps=True,
            return_segments=True,
            **settings,
        )


CASES = {
    "greedy": ({}, {}),
    "max-new-tokens": ({}, {"max_new_tokens": 12}),
    "condition-on-previous": ({}, {"condition_on_prev_tokens": True}),
    "condition-max-new-tokens": ({}, {"condition_on_prev_tokens": True, "max_new_tokens": 10}),
    # Thresholds that fail every window: the second, greedy again, decodes the same tokens.
    "fallback": (
        {},
        {
            "condition_on_prev_tokens": True,
            "temperature": (0.0, 0.0),
            "compression_ratio_threshold": 1.2,
            "logprob_threshold": -1.0,
        },
    ),
    # Windows whose tokens are unlikely while no-speech is likely are skipped as silence.
    "no-speech": ({}, {"temperature": 0.0, "logprob_threshold": -0.5, "no_speech_threshold": 1e-3}),
    # The second row skips its first windows: transformers still gives it the previous-text
    # start token once the first row has text.
    "no-speech-condition-fallback": (
        {},
        {
            "temperature": (0.0, 0.0),
            "logprob_threshold": -0.5,
            "no_speech_threshold": 1e-3,
            "condition_on_prev_tokens": True,
        },
    ),
    "language-detected": (LANGUAGES, {}),
    "language-given": (LANGUAGES, {"language": "fr"}),
    "task-translate": (LANGUAGES, {"language": "en", "task": "translate"}),
}


@pytest.mark.parametrize("head", ["float", "int8 bounds"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_ids_and_segments_match_transformers(models, screened, case, rows, head, monkeypatch):
    model, pt_model = models
    fields, settings = CASES[case]
    _configure(model, pt_model, fields)
    if head == "int8 bounds":
        screened.generation_config = dict(model.generation_config)
        model = screened
        steps = _steps_through_the_int8_head(model, monkeypatch)
    features, mask = _audio(rows)
    ours = model.generate(
        input_features=features,
        attention_mask=mask,
        return_timestamps=True,
        return_segments=True,
        **settings,
    )
    theirs = _reference(pt_model, features, mask, **settings)
    np.testing.assert_array_equal(ours["sequences"], theirs["sequences"].numpy())
    assert len(ours["segments"]) == rows
    assert sum(len(row) for row in ours["segments"]) > rows  # several windows, several segments
    for our_row, their_row in zip(ours["segments"], theirs["segments"], strict=True):
        assert len(our_row) == len(their_row)
        for mine, other in zip(our_row, their_row, strict=True):
            np.testing.assert_array_equal(mine["tokens"], other["tokens"].numpy())
            assert mine["start"] == pytest.approx(float(other["start"]), abs=1e-9)
            assert mine["end"] == pytest.approx(float(other["end"]), abs=1e-9)
    # Without return_segments, the ids alone.
    plain = model.generate(input_features=features, attention_mask=mask, **settings)
    np.testing.assert_array_equal(plain, ours["sequences"])
    if head == "int8 bounds":
        # Greedy windows go through the int8 head unless the fallback needs log-probabilities.
        assert (len(steps) > 10) == ("logprob_threshold" not in settings), len(steps)


def _steps_through_the_int8_head(model, monkeypatch) -> list[int]:
    """A list that grows by one at each cached step the model runs through its int8 head."""
    session = model._session
    next_step = session.next_step
    steps: list[int] = []

    def noted(*args, greedy=False, **kwargs):
        if greedy:
            steps.append(1)
        return next_step(*args, greedy=greedy, **kwargs)

    monkeypatch.setattr(session, "next_step", noted)
    return steps


@pytest.mark.parametrize("max_initial", [None, 3])
def test_the_exact_columns_are_the_timestamps_no_mask_removes(max_initial):
    """The greedy head takes float logits only of the timestamps the rule weighs at a step:
    every timestamp outside them is -inf after the rules whatever the scores, none inside."""
    import dataclasses

    from onnxmerge.runtime import _longform

    begin, vocab = 20, 40
    plan = _longform._Plan.__new__(_longform._Plan)
    fields = dict(timestamp_begin=begin, no_timestamps=begin - 1, eos=1, vocab_size=vocab)
    fields.update(max_initial_timestamp=max_initial, return_timestamps=True)
    for name, value in fields.items():
        object.__setattr__(plan, name, value)
    assert dataclasses.is_dataclass(plan)
    rng = np.random.default_rng(0)
    for _ in range(300):
        generated = [int(t) for t in rng.integers(2, vocab, rng.integers(0, 6))]
        scores = rng.standard_normal(vocab).astype(np.float32)
        _longform._timestamp_rules(plan, scores, generated, at_begin=not generated)
        exact = _longform._weighed_timestamps(plan, generated)
        kept = np.zeros(vocab, bool)
        if exact is not None:
            kept[exact] = True
            assert kept[begin:].any()
        assert np.isneginf(scores[begin:][~kept[begin:]]).all()
        assert np.isfinite(scores[kept]).all()


def test_one_row_needs_no_mask_and_timestamps_are_implied(models):
    model, pt_model = models
    _configure(model, pt_model, {})
    features, mask = _audio(1)
    theirs = _reference(pt_model, features, mask)
    np.testing.assert_array_equal(model.generate(features), theirs["sequences"].numpy())


def test_sampled_fallback_is_seeded(models):
    model, pt_model = models
    _configure(model, pt_model, {})
    features, _ = _audio(1)
    settings = {"temperature": (0.0, 0.5, 1.0), "compression_ratio_threshold": 1.2, "seed": 3}
    first = model.generate(input_features=features, **settings)
    again = model.generate(input_features=features, **settings)
    greedy = model.generate(input_features=features)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, greedy)  # every window fell back to sampling


@pytest.mark.parametrize(
    ("fields", "settings", "message"),
    [
        ({}, {"return_timestamps": False}, "need timestamps"),
        ({}, {"no_speech_threshold": 0.6}, "no_speech_threshold needs logprob_threshold"),
        ({}, {"num_beams": 2}, "does not take ['num_beams']"),
        ({"no_timestamps_token_id": None}, {}, "no_timestamps_token_id"),
        (LANGUAGES, {"language": "ja"}, "not in the generation config's lang_to_id"),
        ({}, {"max_new_tokens": 64}, "exceed the model's 64 positions"),
    ],
)
def test_refused_settings(models, fields, settings, message):
    model, pt_model = models
    _configure(model, pt_model, fields)
    features, _ = _audio(1)
    with pytest.raises(GenerationError) as error:
        model.generate(input_features=features, **settings)
    assert message in str(error.value)


def test_a_batch_needs_its_mask(models):
    model, pt_model = models
    _configure(model, pt_model, {})
    features, _ = _audio(2)
    with pytest.raises(GenerationError, match="attention_mask"):
        model.generate(input_features=features)


# -- transcribe() ---------------------------------------------------------------------------------

RATE = 16_000


def _speech(seconds: float, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    tone = 0.3 * np.sin(2 * np.pi * 440.0 * t) * (1 + np.sin(2 * np.pi * 0.7 * t))
    return (tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


# 70 s: more frames than one block of the numpy path, and more than Whisper's 30 s window.
@pytest.mark.parametrize(("seconds", "bins"), [(0.4, 16), (3.0, 16), (70.0, 80)])
def test_log_mel_matches_the_feature_extractor(seconds, bins):
    from transformers import WhisperFeatureExtractor

    from onnxmerge.runtime.speech import log_mel

    extractor = WhisperFeatureExtractor(feature_size=bins)
    audio = _speech(seconds)
    expected = extractor(
        audio, sampling_rate=RATE, truncation=False, padding="longest", return_tensors="np"
    ).input_features[0]
    got = log_mel(audio, bins)
    assert got.shape == expected.shape == (bins, audio.size // 160)
    np.testing.assert_allclose(got, expected, atol=2e-4)


class _Letters:
    """A stand-in tokenizer: token t is the letter chr(ord('a') + t % 26)."""

    def decode(self, tokens, skip_special_tokens=False):
        return "".join(chr(ord("a") + t % 26) for t in tokens)


def test_transcribe_gives_text_segments_and_progress(models):
    from onnxmerge.runtime.speech import log_mel, transcribe

    model, pt_model = models
    _configure(model, pt_model, {})
    audio = _speech(3.0)
    heard = []
    result = transcribe(
        model, audio, RATE, tokenizer=_Letters(), progress=lambda d, t: heard.append((d, t))
    )
    expected = model.generate(log_mel(audio, 16)[None], return_segments=True)["segments"][0]
    assert len(result.segments) == len(expected) > 1
    for segment, reference in zip(result.segments, expected, strict=True):
        assert segment.tokens == reference["tokens"].tolist()
        assert (segment.start, segment.end) == (reference["start"], reference["end"])
        assert segment.text == _Letters().decode([t for t in segment.tokens if t < 94])
    assert result.text == "".join(s.text for s in result.segments).strip()
    assert heard[-1] == (3.0, 3.0)
    assert [d for d, _ in heard] == sorted(d for d, _ in heard)


def test_transcribe_without_tokenizer_keeps_tokens(models):
    from onnxmerge.runtime.speech import transcribe

    model, pt_model = models
    _configure(model, pt_model, {})
    result = transcribe(model, _speech(0.3), RATE)  # shorter than a window: padded to it
    assert result.text is None
    assert result.segments and all(s.text is None and s.tokens for s in result.segments)


@pytest.mark.parametrize(
    ("audio", "rate", "message"),
    [
        (np.zeros(1600, np.float32), 8000, "sampled at 8000 Hz"),
        (np.zeros((2, 1600), np.float32), RATE, "mono float PCM"),
        (np.zeros(1600, np.int16), RATE, "mono float PCM"),
        (np.full(1600, np.nan, np.float32), RATE, "NaN"),
    ],
)
def test_transcribe_refuses_bad_audio(models, audio, rate, message):
    from onnxmerge.errors import InvalidArgumentError
    from onnxmerge.runtime.speech import transcribe

    model, _ = models
    with pytest.raises(InvalidArgumentError, match=message):
        transcribe(model, audio, rate)


@pytest.mark.parametrize("settings", [{}, {"max_new_tokens": 8}])
def test_one_window_with_timestamps_matches_transformers(models, settings):
    model, pt_model = models
    _configure(model, pt_model, {})
    rng = np.random.default_rng(4)
    features = rng.uniform(-1.0, 1.0, size=(2, 16, 64)).astype(np.float32)
    mask = np.ones((2, 64), dtype=np.int64)
    ours = model.generate(
        input_features=features, attention_mask=mask, return_timestamps=True, **settings
    )
    theirs = _reference(pt_model, features, mask, **settings)["sequences"].numpy()
    np.testing.assert_array_equal(ours, theirs)
    assert (ours >= 95).any()  # timestamps among the ids


def test_monitor_progress_hears_each_window(models):
    model, pt_model = models
    _configure(model, pt_model, {})
    features, mask = _audio(2)
    heard = []
    model.generate(input_features=features, attention_mask=mask, monitor_progress=heard.append)
    assert heard[-1].tolist() == [[FRAMES, FRAMES], [210, 210]]
    assert all((h[:, 0] <= h[:, 1]).all() for h in heard) and len(heard) > 2


def test_the_generation_configs_temperature_is_not_read(models):
    """transformers' Whisper takes the temperature given to generate() only: a config's 1.0
    (GenerationConfig's default, saved with many models) must not make the windows sampled."""
    model, pt_model = models
    _configure(model, pt_model, {})
    features, _ = _audio(1)
    greedy = model.generate(input_features=features)
    model.generation_config["temperature"] = 1.0
    try:
        np.testing.assert_array_equal(model.generate(input_features=features, seed=1), greedy)
    finally:
        del model.generation_config["temperature"]
