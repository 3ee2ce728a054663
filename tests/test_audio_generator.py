"""The generator with audio in front: PCM in, the tokens Whisper's generate() gives out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from onnxmerge._ort import open_session, session_options
from onnxmerge.generator import audio
from tests import zoo as tiny_zoo

pytestmark = pytest.mark.export

ort = pytest.importorskip("onnxruntime")
# torch and transformers are imported where used, not at collection (the zoo's fixture skips
# without them).

RATE = 16_000
# A multilingual generation config for the tiny model's 128 ids: languages, tasks, no-timestamps.
MULTILINGUAL = {
    "lang_to_id": {"<|en|>": 110, "<|fr|>": 111},
    "task_to_id": {"transcribe": 112, "translate": 113},
    "no_timestamps_token_id": 114,
    "is_multilingual": True,
    "forced_decoder_ids": [[1, None], [2, 112]],
    "begin_suppress_tokens": [5, 2],
    "suppress_tokens": [7, 9],
}


def _rows() -> list[np.ndarray]:
    """Three rows of different lengths, one longer than the tiny model's 0.64 s window."""
    rng = np.random.default_rng(0)
    t = np.arange(16_000) / RATE
    return [
        rng.uniform(-1, 1, 8_000).astype(np.float32),
        (0.3 * np.sin(2 * np.pi * 300 * t[:12_000])).astype(np.float32),
        np.clip(2 * np.sin(2 * np.pi * 900 * t), -1, 1).astype(np.float32),
    ]


def _session(path: Path):
    return open_session(path, session_options(threads=1, spinning=False))


def _features(spec: audio.FeatureSpec, rows: list[np.ndarray]) -> np.ndarray:
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=spec.n_mels)
    extractor.n_samples, extractor.nb_max_frames = spec.n_samples, spec.frames  # the tiny window
    return np.concatenate(
        [extractor(r, sampling_rate=RATE, return_tensors="np").input_features for r in rows]
    )


def _run(session, rows, spec, max_new_tokens: int) -> np.ndarray:
    feeds = audio.prepare_audio(rows, sampling_rate=RATE, spec=spec)
    return session.run(None, {**feeds, "max_new_tokens": np.array(max_new_tokens, np.int64)})[0]


@pytest.fixture(scope="module")
def whisper(tiny_export):
    return tiny_export("whisper")


@pytest.fixture(scope="module")
def spec(whisper) -> audio.FeatureSpec:
    return audio.spec_for_source(whisper.onnx_dir)


@pytest.fixture(scope="module")
def multilingual(whisper, tmp_path_factory):
    """The tiny Whisper with a multilingual generation config, as an export and in PyTorch."""
    root = tmp_path_factory.mktemp("multilingual")
    export, pytorch = root / "onnx", root / "pytorch"
    shutil.copytree(whisper.onnx_dir, export)
    shutil.copytree(whisper.pytorch_dir, pytorch)
    for folder in (export, pytorch):
        path = folder / "generation_config.json"
        config = json.loads(path.read_text())
        config.pop("_from_model_config", None)  # else transformers rebuilds it from config.json
        path.write_text(json.dumps({**config, **MULTILINGUAL}))
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(pytorch).eval()
    return export, model


def test_greedy_from_pcm_matches_generate(whisper, spec, tmp_path):
    import torch

    from onnxmerge.generator import build_generator

    path = build_generator(whisper.onnx_dir, tmp_path / "g.onnx", audio=True)
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    assert [i.name for i in model.graph.input] == ["audio", "audio_lengths", "max_new_tokens"]
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta[audio.META_FEATURES]) == spec.as_dict()
    rows = _rows()
    got = _run(_session(path), rows, spec, 12)
    features = torch.from_numpy(_features(spec, rows))
    pt_model = tiny_zoo.load_pytorch(whisper)
    with torch.no_grad():
        expected = pt_model.generate(input_features=features, max_new_tokens=12).numpy()
    # Whisper's generate() returns the tokens after its prompt, here the start token alone.
    np.testing.assert_array_equal(got[:, 1:], expected)
    assert (got[:, 0] == pt_model.generation_config.decoder_start_token_id).all()


@pytest.mark.parametrize("search", ["greedy", "beam"])
@pytest.mark.parametrize(
    "options",
    [{"language": "fr"}, {"language": "en", "task": "translate"}],
    ids=["fr", "en-translate"],
)
def test_prompt_is_whispers(multilingual, spec, tmp_path, search, options):
    """Start, language, task and no-timestamps tokens, as WhisperForConditionalGeneration.generate
    builds them from language=, task= and the config's forced_decoder_ids."""
    import torch

    from onnxmerge.generator import build_generator

    export, pt_model = multilingual
    path = build_generator(
        export,
        tmp_path / "g.onnx",
        search=search,
        num_beams=3,
        audio=True,
        generation_config=options,
    )
    rows = _rows()
    got = _run(_session(path), rows, spec, 10)
    features = torch.from_numpy(_features(spec, rows))
    beams = {"num_beams": 3} if search == "beam" else {}
    with torch.no_grad():
        expected = pt_model.generate(
            input_features=features, max_new_tokens=10, **beams, **options
        ).numpy()
    prompt = audio.whisper_prompt({**MULTILINGUAL, "decoder_start_token_id": 3}, **options)
    assert prompt == [
        3,
        111 if options["language"] == "fr" else 110,
        113 if options.get("task") == "translate" else 112,
        114,
    ]
    assert (got[:, : len(prompt)] == prompt).all()
    np.testing.assert_array_equal(got[:, len(prompt) :], expected)


def test_what_the_graph_does_not_do_is_refused(multilingual, tiny_export, tmp_path):
    from onnxmerge.errors import GenerationError, InvalidMergedModelError
    from onnxmerge.generator import build_generator

    export, _ = multilingual
    with pytest.raises(GenerationError, match="detects the language"):
        build_generator(export, tmp_path / "g.onnx", audio=True)
    with pytest.raises(GenerationError, match="timestamps"):
        build_generator(
            export,
            tmp_path / "g.onnx",
            audio=True,
            generation_config={"language": "en", "return_timestamps": True},
        )
    with pytest.raises(GenerationError, match="'de' is not one"):
        build_generator(export, tmp_path / "g.onnx", generation_config={"language": "de"})
    with pytest.raises(InvalidMergedModelError, match="input_features"):
        build_generator(tiny_export("marian").onnx_dir, tmp_path / "g.onnx", audio=True)
    assert not (tmp_path / "g.onnx").exists()


def test_feature_model_needs_a_source_or_a_spec(tmp_path):
    from onnxmerge.errors import InvalidArgumentError, RefusedOutputError

    with pytest.raises(InvalidArgumentError, match="FeatureSpec") as refused:
        audio.build_features(None, tmp_path / "features.onnx")
    assert refused.value.argument == "source"
    (tmp_path / "features.onnx").write_bytes(b"mine")
    with pytest.raises(RefusedOutputError, match="exists"):
        audio.build_features(None, tmp_path / "features.onnx", spec=audio.FeatureSpec())
    assert [p.name for p in tmp_path.iterdir()] == ["features.onnx"]


def test_feature_model_of_an_export(whisper, spec, tmp_path):
    path = audio.build_features(whisper.onnx_dir, tmp_path / "features.onnx")
    rows = _rows()
    (got,) = _session(path).run(None, audio.prepare_audio(rows, spec=spec))
    assert got.shape == (3, 16, 64)
    assert np.abs(got - _features(spec, rows)).max() <= 1e-4


def _cli(*args: object):
    import subprocess
    import sys

    command = [sys.executable, "-m", "onnxmerge", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def test_cli_merge_audio_and_features(whisper, spec, tmp_path):
    import onnx

    folder = Path(shutil.copytree(whisper.onnx_dir, tmp_path / "export"))
    result = _cli("merge", folder, "--generation", "greedy", "--audio", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["generator"]
    assert report["audio"] is True
    inputs = [i.name for i in onnx.load(report["path"], load_external_data=False).graph.input]
    assert inputs == ["audio", "audio_lengths", "max_new_tokens"]
    result = _cli("features", folder, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert Path(report["path"]) == folder / "features.onnx"
    assert (report["n_mels"], report["n_samples"]) == (spec.n_mels, spec.n_samples)
    again = _cli("features", folder)
    assert again.returncode == 3 and "exists" in again.stderr


def test_cli_audio_needs_generation(tmp_path, tiny_export):
    result = _cli("merge", tmp_path / "absent", "--audio")
    assert result.returncode == 2 and "--audio" in result.stderr
    result = _cli("features", tiny_export("marian").onnx_dir)
    assert result.returncode == 3 and "not Whisper" in result.stderr


def test_node_runtime_runs_the_audio_generator(whisper, spec, tmp_path):
    """onnxruntime-node reads the same PCM into the same tokens (tests/js/generate.test.mjs)."""
    import os
    import subprocess

    from onnxmerge.generator import build_generator

    node = shutil.which("node")
    js_dir = Path(__file__).parent / "js"
    if node is None:
        pytest.skip("node is not installed")
    if not (js_dir / "node_modules" / "onnxruntime-node").is_dir():
        pytest.skip("onnxruntime-node is not installed: npm ci --ignore-scripts in tests/js")
    path = build_generator(whisper.onnx_dir, tmp_path / "g.onnx", audio=True)
    feeds = audio.prepare_audio(_rows(), spec=spec)
    expected = _run(_session(path), _rows(), spec, 9)
    cases = [{
        "inputs": {"audio_lengths": feeds["audio_lengths"].tolist()},
        "float_inputs": {"audio": feeds["audio"].tolist()},
        "max_new_tokens": 9,
        "expected": expected.tolist(),
    }]  # fmt: skip
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {
        **os.environ,
        "ONNXMERGE_GENERATOR_MODEL": str(path),
        "ONNXMERGE_GENERATOR_CASES": str(tmp_path / "cases.json"),
    }
    done = subprocess.run(
        [node, "--test", "generate.test.mjs"], cwd=js_dir, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# pass 1" in done.stdout, done.stdout
