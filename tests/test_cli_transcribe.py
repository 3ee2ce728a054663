"""``onnxmerge transcribe FILE.wav`` run as a user runs it: segments, JSON, progress, errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.export

pytest.importorskip("onnxruntime")

RATE = 16_000
# Whisper's timestamp fields for the tiny vocabulary (see tests/test_runtime_longform.py).
TIMESTAMPS = {"no_timestamps_token_id": 94, "begin_suppress_tokens": [2], "suppress_tokens": [1]}


def _run(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onnxmerge", "transcribe", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def whisper_file(tiny_export, tmp_path_factory) -> Path:
    """A merged tiny Whisper whose generation config has the timestamp fields."""
    import onnxmerge

    folder = tmp_path_factory.mktemp("whisper-export")
    export = shutil.copytree(tiny_export("whisper").onnx_dir, folder / "onnx")
    config_path = export / "generation_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, **TIMESTAMPS}))
    out = folder / "model.onnx"
    onnxmerge.merge_seq2seq(export, out)
    return out


def _wav(path: Path, seconds: float, channels: int = 1) -> np.ndarray:
    rng = np.random.default_rng(2)
    t = np.arange(int(seconds * RATE)) / RATE
    mono = 0.4 * np.sin(2 * np.pi * 330.0 * t) + 0.05 * rng.standard_normal(t.size)
    pcm = np.round(mono * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(2)
        writer.setframerate(RATE)
        writer.writeframes(np.repeat(pcm[:, None], channels, axis=1).tobytes())
    return pcm.astype(np.float32) / 32768.0


def test_segments_as_json_equal_transcribe(whisper_file, tmp_path):
    from onnxmerge.runtime import Seq2SeqModel
    from onnxmerge.runtime.speech import transcribe

    audio = _wav(tmp_path / "speech.wav", 3.0, channels=2)  # stereo: channels averaged
    result = _run(tmp_path / "speech.wav", "-m", whisper_file, "--json")
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    expected = transcribe(Seq2SeqModel(whisper_file), audio, RATE)
    assert got["text"] is None  # the tiny model has no tokenizer
    assert [(s["start"], s["end"], s["tokens"]) for s in got["segments"]] == [
        (s.start, s.end, s.tokens) for s in expected.segments
    ]
    assert len(got["segments"]) > 1


def test_text_output_shows_times_and_steps(whisper_file, tmp_path):
    _wav(tmp_path / "speech.wav", 1.5)
    result = _run(tmp_path / "speech.wav", "--model", whisper_file, "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines and all(line.startswith("[") and "->" in line for line in lines)
    assert "transcribing 1.5 s" in result.stderr


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda p: p.write_bytes(b"not a wav"), "could not be read as a PCM WAV file"),
        (lambda p: None, "could not be read as a PCM WAV file"),
    ],
)
def test_bad_files_are_one_line_errors(whisper_file, tmp_path, make, fragment):
    path = tmp_path / "bad.wav"
    make(path)
    result = _run(path, "-m", whisper_file)
    assert result.returncode == 3
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if fragment in line]


def test_another_rate_is_refused(whisper_file, tmp_path):
    path = tmp_path / "slow.wav"
    with wave.open(str(path), "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(8000)
        writer.writeframes(np.zeros(8000, np.int16).tobytes())
    result = _run(path, "-m", whisper_file)
    assert result.returncode == 3
    assert "sampled at 8000 Hz" in result.stderr
