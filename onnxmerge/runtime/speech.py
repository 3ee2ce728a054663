"""Speech in, text and timed segments out: Whisper's log-mel features in numpy and
long-form decoding of a whole recording (``docs/runtime.md``, "Long-form speech")."""

from __future__ import annotations

import json
import math
import os
import wave
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from onnxmerge.errors import GenerationError, InvalidArgumentError

PREPROCESSOR_CONFIG = "preprocessor_config.json"
MEL_FLOOR = 1e-10
MAX_FREQUENCY = 8000.0  # WhisperFeatureExtractor's mel bank stops there
_FRAMES_PER_BLOCK = 4096


@dataclass(frozen=True)
class Segment:
    """A stretch of speech: its start and end in seconds, its text (None without a tokenizer)
    and its token ids, timestamps included."""

    start: float
    end: float
    text: str | None
    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Transcription:
    """The whole text (None without a tokenizer) and its segments in order."""

    text: str | None
    segments: list[Segment]


def _slaney_mel(freq: np.ndarray) -> np.ndarray:
    mels = 3.0 * freq / 200.0
    high = freq >= 1000.0
    mels[high] = 15.0 + np.log(freq[high] / 1000.0) * (27.0 / math.log(6.4))
    return mels


def _slaney_hertz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    high = mels >= 15.0
    freq[high] = 1000.0 * np.exp((mels[high] - 15.0) / (27.0 / math.log(6.4)))
    return freq


def mel_bank(n_mels: int, n_fft: int = 400, sampling_rate: int = 16_000) -> np.ndarray:
    """WhisperFeatureExtractor's mel bank, ``[n_fft // 2 + 1, n_mels]`` (Slaney scale and norm)."""
    edges = _slaney_mel(np.array([0.0, MAX_FREQUENCY]))
    filter_freqs = _slaney_hertz(np.linspace(edges[0], edges[1], n_mels + 2))
    fft_freqs = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)
    diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    bank = np.maximum(0.0, np.minimum(-slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]))
    return bank * (2.0 / (filter_freqs[2:] - filter_freqs[:-2]))[None, :]


def log_mel(
    audio: np.ndarray,
    n_mels: int,
    *,
    n_fft: int = 400,
    hop_length: int = 160,
    sampling_rate: int = 16_000,
) -> np.ndarray:
    """Whisper's log-mel features of mono PCM, ``[n_mels, len(audio) // hop_length]`` float32,
    as ``WhisperFeatureExtractor(truncation=False)`` computes them: centered Hann frames, power
    spectrum, mel bank, log10 clamped 8 below the recording's peak, scaled by (x + 4) / 4."""
    signal = np.asarray(audio, dtype=np.float64)
    half = n_fft // 2
    padded = np.pad(signal, (half, half), mode="reflect")
    count = (padded.size - n_fft) // hop_length  # the extractor drops the last frame
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    bank = mel_bank(n_mels, n_fft, sampling_rate)
    mel = np.empty((count, n_mels))
    # Blocks of frames: an hour of audio framed at once would take gigabytes.
    for first in range(0, count, _FRAMES_PER_BLOCK):
        frames = np.arange(first, min(first + _FRAMES_PER_BLOCK, count))
        starts = frames[:, None] * hop_length + np.arange(n_fft)[None, :]
        power = np.abs(np.fft.rfft(padded[starts] * window, axis=1)) ** 2
        mel[frames] = power @ bank
    log = np.log10(np.maximum(mel, MEL_FLOOR))
    log = np.maximum(log, log.max() - 8.0)
    return ((log + 4.0) / 4.0).T.astype(np.float32)


def read_wav(
    source: str | os.PathLike | IO[bytes], *, name: str | None = None
) -> tuple[np.ndarray, int]:
    """Mono float32 PCM in [-1, 1] and its rate from an integer PCM WAV file, given by its path
    or as a binary file object (channels averaged).

    Args:
        source: the file's path, or a file object open for reading bytes.
        name: what messages call the file (default: its path, or ``the audio``).

    Raises:
        InvalidArgumentError: the file is missing or not an 8, 16 or 32-bit PCM WAV file.
    """
    if name is None:
        name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the audio"
    try:
        opened = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source
        with wave.open(opened, "rb") as reader:
            width, channels = reader.getsampwidth(), reader.getnchannels()
            rate, raw = reader.getframerate(), reader.readframes(reader.getnframes())
    except (OSError, EOFError, wave.Error) as error:
        raise InvalidArgumentError(
            f"{name} could not be read as a PCM WAV file ({error}); convert it, e.g. "
            "ffmpeg -i IN -ar 16000 -ac 1 OUT.wav",
            argument="audio",
        ) from error
    if width not in (1, 2, 4) or channels < 1:
        raise InvalidArgumentError(
            f"{name} has {channels} channels of {8 * width}-bit samples; give 8, 16 or 32-bit PCM",
            argument="audio",
        )
    if width == 1:  # 8-bit WAV is unsigned
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    else:
        kind = np.int16 if width == 2 else np.int32
        usable = len(raw) - len(raw) % width  # a truncated file may end mid-sample
        samples = np.frombuffer(raw[:usable], kind).astype(np.float32) / float(2 ** (8 * width - 1))
    whole = samples.size - samples.size % channels
    return samples[:whole].reshape(-1, channels).mean(axis=1), rate


def _preprocessor(folder: Path) -> dict[str, Any]:
    path = folder / PREPROCESSOR_CONFIG
    return json.loads(path.read_text()) if path.is_file() else {}


def _check_audio(audio: Any, sampling_rate: int, expected: int) -> np.ndarray:
    if sampling_rate != expected:
        raise InvalidArgumentError(
            f"the audio is sampled at {sampling_rate} Hz; the model reads {expected} Hz: "
            "resample it first (e.g. librosa.resample)",
            argument="sampling_rate",
        )
    pcm = np.asarray(audio)
    if pcm.ndim != 1 or pcm.size == 0 or not np.issubdtype(pcm.dtype, np.floating):
        raise InvalidArgumentError(
            f"audio must be mono float PCM in [-1, 1], [samples]; got {pcm.dtype} of shape "
            f"{pcm.shape} (average stereo channels, divide int16 by 32768)",
            argument="audio",
        )
    if not np.isfinite(pcm).all():
        raise InvalidArgumentError("audio holds NaN or infinite samples", argument="audio")
    return pcm


def transcribe(
    model: Any,
    audio: np.ndarray,
    sampling_rate: int,
    *,
    tokenizer: Any | None = None,
    progress: Callable[[float, float], None] | None = None,
    **generate_kwargs: Any,
) -> Transcription:
    """Transcribe a recording of any length with a merged Whisper model.

    Args:
        model: a ``Seq2SeqModel`` of a Whisper export.
        audio: mono float PCM, ``[samples]``.
        sampling_rate: the audio's rate; it must be the model's (16 kHz for Whisper).
        tokenizer: decodes the segments; by default the one beside the model, if any (without
            one, texts are None and segments keep their token ids).
        progress: called after each window with the seconds done and the seconds in all.
        **generate_kwargs: ``generate()``'s settings (``condition_on_prev_tokens``,
            ``temperature``, ``language``...).

    Returns:
        The text and its segments, with start and end in seconds.

    Raises:
        InvalidArgumentError: the audio is not mono float PCM at the model's rate.
        GenerationError: the model is not Whisper, or generation fails.
    """
    if model.model_type != "whisper":
        raise GenerationError(
            f"transcribe() needs a Whisper model; {model.path} is a {model.model_type!r}"
        )
    pre = _preprocessor(Path(model.path).parent)
    rate, hop = int(pre.get("sampling_rate", 16_000)), int(pre.get("hop_length", 160))
    pcm = _check_audio(audio, sampling_rate, rate)
    window = 2 * int(model.config.get("max_source_positions", 1500))
    # Audio within one window is zero-padded to it, as the feature extractor pads.
    samples = max(pcm.size, window * hop)
    padded = np.pad(pcm, (0, samples - pcm.size))
    n_fft = int(pre.get("n_fft", 400))
    bins = int(model.config["num_mel_bins"])
    features = log_mel(padded, bins, n_fft=n_fft, hop_length=hop, sampling_rate=rate)[None]
    if tokenizer is None:
        tokenizer = _tokenizer_beside(model)
    monitor = None
    if progress is not None:

        def monitor(positions: np.ndarray) -> None:
            progress(float(positions[0, 0]) * hop / rate, float(positions[0, 1]) * hop / rate)

    out = model.generate(
        input_features=features,
        return_timestamps=True,
        return_segments=True,
        monitor_progress=monitor,
        **generate_kwargs,
    )
    return _transcription(model, out["segments"][0], tokenizer)


def _tokenizer_beside(model: Any) -> Any | None:
    from onnxmerge.runtime._text import TOKENIZER_FILES, TextGenerator

    folder = Path(model.path).parent
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return TextGenerator.load_tokenizer(folder)


def _transcription(model: Any, segments: list[dict[str, Any]], tokenizer: Any) -> Transcription:
    stamps = model.generation_config.get("no_timestamps_token_id")
    found = []
    for segment in segments:
        tokens = [int(t) for t in segment["tokens"]]
        words = [t for t in tokens if stamps is None or t <= stamps]
        text = tokenizer.decode(words, skip_special_tokens=True) if tokenizer else None
        found.append(Segment(float(segment["start"]), float(segment["end"]), text, tokens))
    text = "".join(s.text or "" for s in found) if tokenizer else None
    return Transcription(text.strip() if text is not None else None, found)


__all__ = ["Segment", "Transcription", "log_mel", "mel_bank", "read_wav", "transcribe"]
