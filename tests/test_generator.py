"""The generator model: the decoding loop inside one ONNX graph, the tokens transformers gives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from onnxmerge._ort import open_session, session_options
from tests import zoo as tiny_zoo
from tests.zoo import ARCHITECTURES

pytestmark = pytest.mark.export

ort = pytest.importorskip("onnxruntime")

# GPT-2-style decoders of vision-encoder-decoder cannot be merged with past.
WITH_PAST = tuple(a for a in ARCHITECTURES if a != "vision-encoder-decoder")
BEAM_ARCHITECTURES = ("marian", "bart", "t5")
JS_DIR = Path(__file__).parent / "js"

BEAM_CASES = {
    "defaults": {},
    "ngram-penalty": {"no_repeat_ngram_size": 2, "repetition_penalty": 1.3},
    "early-stopping": {"early_stopping": True, "length_penalty": 0.6},
    "never": {"early_stopping": "never", "length_penalty": 1.5},
    "lengths-forced": {"min_new_tokens": 3, "forced_bos_token_id": 6, "forced_eos_token_id": 2},
}


def _session(path: Path):
    # One thread, no spin-waiting: idle onnxruntime threads would slow torch down in turn.
    return open_session(path, session_options(threads=1, spinning=False))


def _run(session, inputs: dict[str, np.ndarray], max_new_tokens: int) -> list[np.ndarray]:
    return session.run(None, {**inputs, "max_new_tokens": np.array(max_new_tokens, np.int64)})


def _transformers(pt_model, inputs: dict[str, np.ndarray], **kwargs):
    # Imported here, not at collection (the zoo's fixture skips without them).
    import torch
    from transformers import GenerationMixin

    tensors = {k: torch.from_numpy(v) for k, v in inputs.items()}
    with torch.no_grad():
        # Whisper's own generate() strips the prompt; the generic loop keeps the common layout.
        return GenerationMixin.generate(pt_model, **tensors, **kwargs)


def _expected(pt_model, inputs, **kwargs) -> np.ndarray:
    return _transformers(pt_model, inputs, **kwargs).numpy()


class _Zoo:
    """Merged models, generators and PyTorch models, each made once per session."""

    def __init__(self, tiny_export, root: Path):
        self.tiny_export = tiny_export
        self.root = root
        self.cache: dict = {}

    def merged(self, arch: str) -> Path:
        key = ("merged", arch)
        if key not in self.cache:
            import onnxmerge

            export = self.tiny_export(arch)
            self.cache[key] = onnxmerge.merge_seq2seq(export.onnx_dir, self.root / f"{arch}.onnx")
        return self.cache[key]

    def generator(self, arch: str, search: str = "greedy", **config) -> tuple[Path, object]:
        from onnxmerge.generator import build_generator

        key = ("generator", arch, search, json.dumps(config, sort_keys=True))
        if key not in self.cache:
            path = self.root / f"{arch}-{search}-{len(self.cache)}.onnx"
            build_generator(
                self.merged(arch), path, search=search, num_beams=3, generation_config=config
            )
            self.cache[key] = (path, _session(path))
        return self.cache[key]

    def pytorch(self, arch: str):
        key = ("pytorch", arch)
        if key not in self.cache:
            self.cache[key] = tiny_zoo.load_pytorch(self.tiny_export(arch))
        return self.cache[key]

    def inputs(self, arch: str, seed: int, batch: int = 2) -> dict[str, np.ndarray]:
        return tiny_zoo.sample_encoder_inputs(self.tiny_export(arch), batch=batch, seq=7, seed=seed)


@pytest.fixture(scope="session")
def zoo(tiny_export, tmp_path_factory) -> _Zoo:
    return _Zoo(tiny_export, tmp_path_factory.mktemp("generators"))


@pytest.mark.slow
@pytest.mark.parametrize("arch", WITH_PAST)
def test_greedy_matches_transformers(zoo, arch):
    _, session = zoo.generator(arch)
    pt_model = zoo.pytorch(arch)
    inputs = zoo.inputs(arch, 1)  # two rows, the second right-padded
    (sequences,) = _run(session, inputs, 20)
    assert sequences.dtype == np.int64
    np.testing.assert_array_equal(sequences, _expected(pt_model, inputs, max_new_tokens=20))


def test_greedy_matches_the_python_runtime(zoo):
    """Same file, same tokens as Seq2SeqModel.generate(), down to one new token."""
    import onnxmerge

    _, session = zoo.generator("marian")
    model = onnxmerge.Seq2SeqModel(zoo.merged("marian"))
    inputs = zoo.inputs("marian", 3, batch=3)
    for max_new_tokens in (1, 2, 9):
        (sequences,) = _run(session, inputs, max_new_tokens)
        np.testing.assert_array_equal(
            sequences, model.generate(**inputs, max_new_tokens=max_new_tokens)
        )


def test_loop_stops_when_every_row_has_ended(zoo):
    """Rows that end early are padded; the loop stops at the last eos, not at max_new_tokens."""
    arch, pad = "t5", 0
    pt_model = zoo.pytorch(arch)
    inputs = zoo.inputs(arch, 1)
    _, plain = zoo.generator(arch)
    (baseline,) = _run(plain, inputs, 30)
    assert baseline.shape[1] == 31  # random weights: the real eos never comes
    # Declare as eos the tokens each row picks at steps 3 and 6: the rows end there.
    eos = [int(baseline[0, 3]), int(baseline[1, 6])]
    _, session = zoo.generator(arch, eos_token_id=eos)
    (sequences,) = _run(session, inputs, 30)
    np.testing.assert_array_equal(
        sequences, _expected(pt_model, inputs, max_new_tokens=30, eos_token_id=eos)
    )
    ends = [int(np.flatnonzero(np.isin(row[1:], eos))[0]) + 1 for row in sequences]
    assert max(ends) <= 6
    assert sequences.shape[1] == max(ends) + 1
    short = int(np.argmin(ends))
    assert (sequences[short, ends[short] + 1 :] == pad).all()
    np.testing.assert_array_equal(
        sequences[:, : max(ends) + 1][0, : ends[0] + 1], baseline[0, : ends[0] + 1]
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BEAM_CASES))
@pytest.mark.parametrize("arch", BEAM_ARCHITECTURES)
def test_beam_matches_transformers(zoo, arch, case):
    config = BEAM_CASES[case]
    _, session = zoo.generator(arch, "beam", **config)
    pt_model = zoo.pytorch(arch)
    # Forced eos acts at max_new_tokens: a short run shows it.
    max_new_tokens = 6 if "forced" in case else 20
    for seed in (4,):
        inputs = zoo.inputs(arch, seed)
        sequences, scores = _run(session, inputs, max_new_tokens)
        expected = _transformers(
            pt_model,
            inputs,
            max_new_tokens=max_new_tokens,
            num_beams=3,
            return_dict_in_generate=True,
            output_scores=True,
            **config,
        )
        np.testing.assert_array_equal(sequences, expected.sequences.numpy())
        np.testing.assert_allclose(scores, expected.sequences_scores.numpy(), rtol=1e-4, atol=1e-5)


def test_processors_switched_on_by_the_generation_config(zoo):
    """suppress, begin-suppress, bad words (one and several tokens), forced bos, min new tokens."""
    arch = "bart"
    pt_model = zoo.pytorch(arch)
    inputs = zoo.inputs(arch, 6)
    _, plain = zoo.generator(arch)
    (baseline,) = _run(plain, inputs, 12)
    # Ban what greedy search picks, so every processor changes the output.
    first, second = int(baseline[0, 1]), int(baseline[0, 2])
    pair = [int(baseline[1, 3]), int(baseline[1, 4])]
    config = {
        "suppress_tokens": [first],
        "begin_suppress_tokens": [int(baseline[1, 1])],
        "bad_words_ids": [[second], pair],
        "min_new_tokens": 4,
    }
    for search, beams in (("greedy", 1), ("beam", 3)):
        _, session = zoo.generator(arch, search, **config)
        (sequences, *_) = _run(session, inputs, 12)
        expected = _expected(pt_model, inputs, max_new_tokens=12, num_beams=beams, **config)
        np.testing.assert_array_equal(sequences, expected)
        assert not np.isin(sequences[:, 1:], [first, second]).any()
    assert not np.array_equal(sequences[:, : baseline.shape[1]], baseline)

    _, forced = zoo.generator(arch, forced_bos_token_id=7, forced_eos_token_id=2)
    (sequences,) = _run(forced, inputs, 5)
    np.testing.assert_array_equal(
        sequences,
        _expected(pt_model, inputs, max_new_tokens=5, forced_bos_token_id=7, forced_eos_token_id=2),
    )
    assert (sequences[:, 1] == 7).all() and (sequences[:, -1] == 2).all()


def test_generation_config_of_the_model_is_applied(zoo):
    """Blenderbot's generation config bans encoder 3-grams; the graph applies it too."""
    import onnxmerge

    model = onnxmerge.Seq2SeqModel(zoo.merged("blenderbot"))
    assert model.resolve_settings().encoder_no_repeat_ngram_size == 3
    _, session = zoo.generator("blenderbot", "beam")
    inputs = zoo.inputs("blenderbot", 7)
    sequences, _ = _run(session, inputs, 10)
    expected = model.generate(**inputs, max_new_tokens=10, num_beams=3)
    np.testing.assert_array_equal(sequences, expected)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_file_is_valid_standard_and_stores_weights_once(zoo, search):
    import onnx

    path, _ = zoo.generator("bart", search)
    onnx.checker.check_model(str(path), full_check=True)
    generator = onnx.load(str(path))
    merged = onnx.load(str(zoo.merged("bart")))

    def nodes(graph):
        for node in graph.node:
            yield node
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from nodes(attr.g)
                for sub in attr.graphs:
                    yield from nodes(sub)

    domains = {n.domain for n in nodes(generator.graph)}
    assert domains <= {"", "ai.onnx"}, domains
    assert {o.domain for o in generator.opset_import} <= {"", "ai.onnx"}
    op_types = {n.op_type for n in nodes(generator.graph)}
    assert "Loop" in op_types and "If" not in {n.op_type for n in generator.graph.node}

    def weights(model):
        return {
            t.name: onnx.numpy_helper.to_array(t).tobytes()
            for t in model.graph.initializer
            if np.prod(t.dims) > 0
        }

    # The same tensors, byte for byte, stored once: none copied into the loop body.
    assert weights(generator) == weights(merged)
    # The loop adds graph structure only: a few kilobytes, whatever the model's size.
    assert path.stat().st_size < zoo.merged("bart").stat().st_size + 64 * 1024
    inputs = [i.name for i in generator.graph.input]
    assert inputs == ["input_ids", "attention_mask", "max_new_tokens"]
    outputs = [o.name for o in generator.graph.output]
    assert outputs == (["sequences"] if search == "greedy" else ["sequences", "sequences_scores"])


def test_export_folder_is_merged_first(zoo, tmp_path):
    from onnxmerge.generator import build_generator

    folder = tmp_path / "export"
    shutil.copytree(zoo.tiny_export("whisper").onnx_dir, folder)
    path = build_generator(folder)
    assert path == folder / "generator.onnx"
    assert not (folder / "model.onnx").exists()
    inputs = zoo.inputs("whisper", 8)
    (sequences,) = _run(_session(path), inputs, 6)
    np.testing.assert_array_equal(
        sequences, _expected(zoo.pytorch("whisper"), inputs, max_new_tokens=6)
    )


def test_refusals(zoo, tiny_export, tmp_path):
    import onnxmerge
    from onnxmerge.errors import GenerationError, InvalidMergedModelError, OnnxMergeError
    from onnxmerge.generator import build_generator

    no_past_dir = tiny_export("marian", "no-past").onnx_dir
    no_past = onnxmerge.merge_seq2seq(no_past_dir, tmp_path / "m.onnx")
    with pytest.raises(InvalidMergedModelError, match="without past"):
        build_generator(no_past, tmp_path / "g.onnx")
    with pytest.raises(OnnxMergeError, match="search"):
        build_generator(zoo.merged("marian"), tmp_path / "g.onnx", search="sample")
    with pytest.raises(GenerationError, match="max_new_tokens"):
        build_generator(
            zoo.merged("marian"), tmp_path / "g.onnx", generation_config={"max_new_tokens": 3}
        )
    with pytest.raises(GenerationError, match="encoder_repetition_penalty=1.5 is given in gen"):
        build_generator(
            zoo.merged("marian"),
            tmp_path / "g.onnx",
            generation_config={"encoder_repetition_penalty": 1.5},
        )
    assert not (tmp_path / "g.onnx").exists()


@pytest.mark.parametrize(
    ("arguments", "argument"),
    [
        ({"search": "sample"}, "search"),
        ({"search": "beam", "num_beams": 1}, "num_beams"),
        ({"generation_config": {"max_new_tokens": 3}}, "generation_config"),
    ],
)
def test_a_bad_argument_is_refused_before_the_source_is_read(tmp_path, arguments, argument):
    from onnxmerge.errors import OnnxMergeError
    from onnxmerge.generator import build_generator

    with pytest.raises(ValueError) as refused:
        build_generator(tmp_path / "missing.onnx", tmp_path / "out" / "g.onnx", **arguments)
    assert isinstance(refused.value, OnnxMergeError) and refused.value.argument == argument
    assert list(tmp_path.iterdir()) == []


def test_the_result_is_the_path_and_carries_the_report(zoo, tmp_path):
    from onnxmerge.errors import RefusedOutputError
    from onnxmerge.generator import GeneratorResult, build_generator

    merged = zoo.merged("marian")
    steps: list[str] = []
    written = build_generator(
        merged, tmp_path / "g.onnx", search="beam", num_beams=3, progress=steps.append
    )
    assert written == tmp_path / "g.onnx" and isinstance(written, Path)
    assert written.report == GeneratorResult(
        tmp_path / "g.onnx", "beam", 3, False, (tmp_path / "g.onnx").stat().st_size
    )
    assert steps == ["building the beam decoding loop"]
    assert written.read_bytes() == zoo.generator("marian", "beam")[0].read_bytes()
    with pytest.raises(RefusedOutputError, match="exists"):
        build_generator(merged, written)


def test_node_runtime_generates_the_same_tokens(zoo, tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    if not (JS_DIR / "node_modules" / "onnxruntime-node").is_dir():
        pytest.skip("onnxruntime-node is not installed: npm ci --ignore-scripts in tests/js")
    path, session = zoo.generator("marian", "beam")
    cases = []
    for seed, max_new_tokens in ((9, 12), (10, 3)):
        inputs = zoo.inputs("marian", seed)
        sequences, _ = _run(session, inputs, max_new_tokens)
        cases.append(
            {
                "inputs": {k: v.tolist() for k, v in inputs.items()},
                "max_new_tokens": max_new_tokens,
                "expected": sequences.tolist(),
            }
        )
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    env = {
        **os.environ,
        "ONNXMERGE_GENERATOR_MODEL": str(path),
        "ONNXMERGE_GENERATOR_CASES": str(cases_file),
    }
    done = subprocess.run(
        [node, "--test", "generate.test.mjs"],
        cwd=JS_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# pass 1" in done.stdout, done.stdout
