"""Whisper's log-mel features in the graph: the numbers WhisperFeatureExtractor gives."""

from __future__ import annotations

import numpy as np
import pytest

from onnxmerge.generator import audio

ort = pytest.importorskip("onnxruntime")

RATE = 16_000
SIGNALS = ("silence", "noise", "sweep", "clipped")
DURATIONS = (0.5, 10.0, 30.0, 31.0)


def _signal(kind: str, seconds: float, seed: int = 0) -> np.ndarray:
    n = int(seconds * RATE)
    t = np.arange(n) / RATE
    if kind == "silence":
        x = np.zeros(n)
    elif kind == "noise":
        x = np.random.default_rng(seed).uniform(-1, 1, n)
    elif kind == "sweep":  # 50 Hz to 7.9 kHz, linear
        x = 0.5 * np.sin(2 * np.pi * (50 * t + (7850 / (2 * seconds)) * t * t))
    else:  # a 440 Hz sine driven past full scale
        x = np.clip(1.5 * np.sin(2 * np.pi * 440 * t), -1, 1)
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def whisper80(tmp_path_factory):
    path = tmp_path_factory.mktemp("features") / "features.onnx"
    audio.build_features(None, path, spec=audio.FeatureSpec())
    return ort.InferenceSession(str(path))


@pytest.fixture(scope="module")
def extractor():
    # Imported here, not at collection: transformers imports torch.
    transformers = pytest.importorskip("transformers")
    return transformers.WhisperFeatureExtractor()


def test_mel_bank_is_the_extractors():
    mel_filter_bank = pytest.importorskip("transformers.audio_utils").mel_filter_bank
    for bins in (16, 80, 128):
        expected = mel_filter_bank(
            num_frequency_bins=201,
            num_mel_filters=bins,
            min_frequency=0.0,
            max_frequency=8000.0,
            sampling_rate=RATE,
            norm="slaney",
            mel_scale="slaney",
        )
        got = audio.mel_filters(audio.FeatureSpec(n_mels=bins))
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seconds", DURATIONS)
@pytest.mark.parametrize("kind", SIGNALS)
def test_features_match_the_extractor(whisper80, extractor, kind, seconds):
    x = _signal(kind, seconds)
    expected = extractor(x, sampling_rate=RATE, return_tensors="np").input_features
    (got,) = whisper80.run(None, audio.prepare_audio(x, sampling_rate=RATE))
    assert got.shape == expected.shape == (1, 80, 3000)
    assert np.abs(got - expected).max() <= 1e-4


def test_rows_of_different_lengths(whisper80, extractor):
    """Each row is cut and padded as if alone: its own length, its own maximum for the clamp."""
    rows = [_signal("sweep", 2.0), _signal("noise", 0.7, seed=3) * 0.01, _signal("clipped", 31.0)]
    feeds = audio.prepare_audio(rows)
    assert feeds["audio_lengths"].tolist() == [32_000, 11_200, 480_000]
    (got,) = whisper80.run(None, feeds)
    for i, row in enumerate(rows):
        expected = extractor(row, sampling_rate=RATE, return_tensors="np").input_features[0]
        assert np.abs(got[i] - expected).max() <= 1e-4


def test_lengths_zero_what_follows(whisper80, extractor):
    """Samples past a row's length are zeroed in the graph, whatever they hold."""
    x = _signal("noise", 3.0)
    feeds = {"audio": x[None], "audio_lengths": np.array([RATE], np.int64)}
    (got,) = whisper80.run(None, feeds)
    expected = extractor(x[:RATE], sampling_rate=RATE, return_tensors="np").input_features
    assert np.abs(got - expected).max() <= 1e-4


def test_128_bins(tmp_path, extractor):
    spec = audio.FeatureSpec(n_mels=128)
    path = audio.build_features(None, tmp_path / "f.onnx", spec=spec)
    x = _signal("sweep", 4.0)
    big = type(extractor)(feature_size=128)
    expected = big(x, sampling_rate=RATE, return_tensors="np").input_features
    (got,) = ort.InferenceSession(str(path)).run(None, audio.prepare_audio(x))
    assert got.shape == (1, 128, 3000)
    assert np.abs(got - expected).max() <= 1e-4


def test_spec_from_configs():
    spec = audio.feature_spec(
        {"model_type": "whisper", "num_mel_bins": 128, "max_source_positions": 1500},
        {"feature_size": 128, "chunk_length": 30, "hop_length": 160},
    )
    assert spec == audio.FeatureSpec(n_mels=128)
    tiny = audio.feature_spec(
        {"model_type": "whisper", "num_mel_bins": 16, "max_source_positions": 32}
    )
    assert (tiny.n_mels, tiny.n_samples, tiny.frames) == (16, 10_240, 64)
    from onnxmerge.errors import InvalidMergedModelError

    with pytest.raises(InvalidMergedModelError, match="not Whisper"):
        audio.feature_spec({"model_type": "marian"})
    with pytest.raises(InvalidMergedModelError, match="480000 samples"):
        audio.feature_spec({"model_type": "whisper", "num_mel_bins": 80}, {"chunk_length": 20})
    with pytest.raises(InvalidMergedModelError, match="mel bins"):
        audio.feature_spec({"model_type": "whisper", "num_mel_bins": 80}, {"feature_size": 128})


@pytest.mark.parametrize(
    ("pcm", "kwargs", "message"),
    [
        (np.zeros((1, 2, 16_000), np.float32), {}, "mono PCM"),
        ([np.zeros((2, 16_000), np.float32)], {}, "mono PCM"),
        (np.zeros((1, 0), np.float32), {}, "no samples"),
        ([], {}, "empty batch"),
        (np.array([0.0, np.nan], np.float32), {}, "NaN"),
        (np.zeros(16_000, np.int16), {}, "float PCM"),
        (np.zeros(44_100, np.float32), {"sampling_rate": 44_100}, "resample"),
    ],
)
def test_bad_audio_is_refused(pcm, kwargs, message):
    with pytest.raises(audio.AudioInputError, match=message):
        audio.prepare_audio(pcm, **kwargs)


def test_whisper_prompt_from_the_configs():
    """transformers' rules: forced_decoder_ids give the prompt unless language or task is given;
    an English-only model has no language or task token; no-timestamps closes the prompt."""
    from onnxmerge.errors import GenerationError

    multilingual = {
        "decoder_start_token_id": 1,
        "lang_to_id": {"<|en|>": 10, "<|fr|>": 11},
        "task_to_id": {"transcribe": 20, "translate": 21},
        "no_timestamps_token_id": 30,
        "forced_decoder_ids": [[1, 10], [2, 21], [3, 30]],
    }
    assert audio.whisper_prompt(multilingual) == [1, 10, 21, 30]
    assert audio.whisper_prompt(multilingual, language="fr") == [1, 11, 20, 30]
    assert audio.whisper_prompt(multilingual, language="<|fr|>", task="translate") == [
        1,
        11,
        21,
        30,
    ]
    english = {"decoder_start_token_id": 1, "no_timestamps_token_id": 30}
    assert audio.whisper_prompt(english) == [1, 30]
    assert audio.whisper_prompt({"decoder_start_token_id": 1}) == [1]
    undetected = {**multilingual, "forced_decoder_ids": [[1, None], [2, 20]]}
    with pytest.raises(GenerationError, match="detects the language"):
        audio.whisper_prompt(undetected)
    with pytest.raises(GenerationError, match="task 'summarize'"):
        audio.whisper_prompt(multilingual, language="en", task="summarize")
