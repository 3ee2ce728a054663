"""The transcription page: a Whisper site, a WAV file in Chromium, the tokens Python gives."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest

from onnxmerge.generator import audio
from onnxmerge.web import build_site
from tests.browser import load_page, serve

pytestmark = pytest.mark.export  # the tiny Whisper is exported with torch

ort = pytest.importorskip("onnxruntime")

NODE_MODULES = Path(__file__).parent / "web" / "node_modules"
RATE = 16_000


def _wav(path: Path, samples: np.ndarray, rate: int = RATE, channels: int = 1) -> np.ndarray:
    """Write 16-bit PCM; return the float samples a decoder reads back (int16 / 32768)."""
    pcm = np.round(np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return pcm.astype(np.float32) / 32768


def _tone(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    return 0.4 * np.sin(2 * np.pi * 330 * t) + 0.1 * rng.standard_normal(t.size)


@pytest.fixture(scope="module")
def whisper_site(tiny_export, tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("whisper-site") / "site"
    return build_site(tiny_export("whisper").onnx_dir, site)


def test_site_files_and_settings(whisper_site, tiny_export):
    names = {p.name for p in whisper_site.iterdir()}
    assert names == {
        "index.html",
        "transcribe.js",
        "page.js",
        "page.css",
        "package.json",
        "site.json",
        "generator.onnx",
    }
    settings = json.loads((whisper_site / "site.json").read_text())
    spec = audio.spec_for_source(tiny_export("whisper").onnx_dir)
    assert settings["audio"] == spec.as_dict()
    assert settings["tokenizer"] is False  # the tiny model has none: the page shows ids
    assert settings["prompt_length"] == 1
    # The model's max_length, less the prompt: as far as generate() goes by default.
    from onnxmerge.settings import resolve_settings

    folder = tiny_export("whisper").onnx_dir
    configs = [
        json.loads((folder / f).read_text()) for f in ("config.json", "generation_config.json")
    ]
    assert settings["max_new_tokens"] == resolve_settings(*configs, {}, 1).max_length - 1


def test_a_whisper_generator_without_audio_is_refused(tiny_export, tmp_path):
    from onnxmerge.errors import OnnxMergeError
    from onnxmerge.generator import build_generator

    generator = build_generator(tiny_export("whisper").onnx_dir, tmp_path / "g" / "generator.onnx")
    with pytest.raises(OnnxMergeError, match="reads input_features.*--audio"):
        build_site(generator, tmp_path / "site")
    assert not (tmp_path / "site").exists()


def test_page_transcribes_a_wav_into_pythons_tokens(browser, whisper_site, tmp_path):
    settings = json.loads((whisper_site / "site.json").read_text())
    spec = audio.FeatureSpec(**settings["audio"])
    session = ort.InferenceSession(str(whisper_site / "generator.onnx"))

    def python_tokens(rows: list[np.ndarray]) -> list[list[int]]:
        feeds = audio.prepare_audio(rows, sampling_rate=RATE, spec=spec)
        max_new = np.array(settings["max_new_tokens"], np.int64)
        return session.run(None, {**feeds, "max_new_tokens": max_new})[0].tolist()

    wav = tmp_path / "speech.wav"
    samples = _wav(wav, _tone(0.5, seed=1))
    with serve(whisper_site, NODE_MODULES) as server:
        page, errors = load_page(browser, server.url)
        assert page.get_attribute("body", "data-state") == "ready", page.text_content("#status")
        page.set_input_files("#audio-file", str(wav))
        page.click("#transcribe")
        page.wait_for_function("window.onnxmerge.last !== null", timeout=60_000)
        last = page.evaluate("window.onnxmerge.last")
        assert last["sequences"] == python_tokens([samples])
        shown = page.text_content("#output")
        assert shown == "token ids: " + " ".join(map(str, last["sequences"][0][1:]))
        # A batch through the script API: rows of different lengths, one past the window.
        rows = [_tone(0.3, seed=2), _tone(0.9, seed=3)]
        rows = [r.astype(np.float32) for r in rows]
        got = page.evaluate(
            "rows => window.onnxmerge.transcribe(rows.map(r => Float32Array.from(r)))",
            [r.tolist() for r in rows],
        )
        assert got["sequences"] == python_tokens(rows)
        # Bad input is refused in the page before onnxruntime runs, as prepare_audio refuses it.
        for call, message in (
            ("window.onnxmerge.transcribe([new Float32Array(0)])", "no samples"),
            ("window.onnxmerge.transcribe([Float32Array.from([0, NaN])])", "NaN"),
            ("window.onnxmerge.transcribe([new Float32Array(10)], 44100)", "resample"),
            ("window.onnxmerge.transcribe([[0.1, 0.2]])", "mono samples"),
        ):
            error = page.evaluate(f"{call}.then(() => null, e => e.message)")
            assert error is not None and message in error, (call, error)
        # A stereo file at another rate: decoded, mixed to mono and resampled in the page.
        stereo = tmp_path / "stereo.wav"
        _wav(stereo, np.repeat(_tone(0.5, seed=4), 2) * 0.5, rate=44_100, channels=2)
        page.evaluate("window.onnxmerge.last = null")
        page.set_input_files("#audio-file", str(stereo))
        page.click("#transcribe")
        page.wait_for_function("window.onnxmerge.last !== null", timeout=60_000)
        assert "2 channels mixed to mono" in page.text_content("#timing")
        page.close()
    assert not errors


def test_a_multilingual_whisper_needs_a_language(tiny_export, tmp_path):
    """The page's prompt is fixed when the site is built: language and task are options."""
    import shutil

    from onnxmerge.errors import GenerationError, OnnxMergeError

    export = Path(shutil.copytree(tiny_export("whisper").onnx_dir, tmp_path / "export"))
    config_file = export / "generation_config.json"
    config = json.loads(config_file.read_text())
    config.update(
        lang_to_id={"<|en|>": 110, "<|fr|>": 111}, task_to_id={"transcribe": 112, "translate": 113},
        no_timestamps_token_id=114, forced_decoder_ids=[[1, None], [2, 112]],
    )  # fmt: skip
    config_file.write_text(json.dumps(config))
    with pytest.raises(GenerationError, match="detects the language"):
        build_site(export, tmp_path / "site")
    assert not (tmp_path / "site").exists()
    site = build_site(export, tmp_path / "site", language="fr", task="translate")
    settings = json.loads((site / "site.json").read_text())
    assert settings["prompt_length"] == 4
    with pytest.raises(OnnxMergeError, match="Whisper models only"):
        build_site(tiny_export("marian").onnx_dir, tmp_path / "text", language="fr")
