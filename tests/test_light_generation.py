"""Generation without torch: the runtime and the generator on a small seq2seq export written in
code (tests/textmodels.py), against a reference loop written here over the export's own files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests import textmodels as tm

pytest.importorskip("onnxruntime")

START, PAD = 2, 1
MAX_NEW = 6


class SourceSteps:
    """Encoder, decoder and decoder with past of the export, run as a generation loop runs them."""

    def __init__(self, folder: Path):
        self.encoder = tm.session(folder / tm.ENCODER)
        self.decoder = tm.session(folder / tm.DECODER)
        self.with_past = tm.session(folder / tm.DECODER_WITH_PAST)

    def start(self, input_ids: np.ndarray, mask: np.ndarray, rows: int = 1) -> np.ndarray:
        """Logits of the first step; every input repeated ``rows`` times (beams)."""
        input_ids, self.mask = np.repeat(input_ids, rows, 0), np.repeat(mask, rows, 0)
        (hidden,) = self.encoder.run(None, {"input_ids": input_ids, "attention_mask": self.mask})
        start = np.full((len(input_ids), 1), START, np.int64)
        feed = {
            "encoder_attention_mask": self.mask,
            "input_ids": start,
            "encoder_hidden_states": hidden,
        }
        names = [o.name for o in self.decoder.get_outputs()]
        out = dict(zip(names, self.decoder.run(None, feed), strict=True))
        self.past = {
            n.replace("present", "past_key_values"): v for n, v in out.items() if n != "logits"
        }
        return out["logits"][:, -1]

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        feed = {
            "encoder_attention_mask": self.mask,
            "input_ids": tokens.reshape(-1, 1),
            **self.past,
        }
        names = [o.name for o in self.with_past.get_outputs()]
        out = dict(zip(names, self.with_past.run(None, feed), strict=True))
        for name, value in out.items():
            if name != "logits":
                self.past[name.replace("present", "past_key_values")] = value
        return out["logits"][:, -1]

    def reorder(self, rows: np.ndarray) -> None:
        self.past = {n: v[rows] for n, v in self.past.items()}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def reference_greedy(folder, inputs, eos, *, repetition_penalty=1.0, min_new_tokens=0):
    steps = SourceSteps(folder)
    logits = steps.start(inputs["input_ids"], inputs["attention_mask"])
    tokens = np.full((len(logits), 1), START, np.int64)
    done = np.zeros(len(logits), bool)
    for step in range(MAX_NEW):
        scores = logits.astype(np.float32).copy()
        for row in range(len(scores)):
            seen = np.unique(tokens[row])
            penalised = scores[row, seen]
            scores[row, seen] = np.where(
                penalised < 0, penalised * repetition_penalty, penalised / repetition_penalty
            )
        if step < min_new_tokens:
            scores[:, eos] = -np.inf
        chosen = np.where(done, PAD, scores.argmax(-1))
        tokens = np.concatenate([tokens, chosen[:, None]], axis=1)
        done |= chosen == eos
        if done.all() or step == MAX_NEW - 1:
            return tokens
        logits = steps.advance(chosen)
    return tokens


def reference_beam(folder, inputs, eos, beams):
    """Beam search with eos suppressed: all beams run to the end; the best sum of log-probs wins."""
    steps = SourceSteps(folder)
    batch = len(inputs["input_ids"])
    logits = steps.start(inputs["input_ids"], inputs["attention_mask"], rows=beams)
    vocab = logits.shape[-1]
    scores = np.tile(np.array([0.0] + [-1e9] * (beams - 1)), batch)
    tokens = np.full((batch * beams, 1), START, np.int64)
    for step in range(MAX_NEW):
        candidates = log_softmax(logits)
        candidates[:, eos] = -np.inf
        candidates = (scores[:, None] + candidates).reshape(batch, beams * vocab)
        best = np.argsort(-candidates, axis=1, kind="stable")[:, :beams]
        rows = (np.arange(batch)[:, None] * beams + best // vocab).reshape(-1)
        chosen = (best % vocab).reshape(-1)
        scores = np.take_along_axis(candidates, best, axis=1).reshape(-1)
        tokens = np.concatenate([tokens[rows], chosen[:, None]], axis=1)
        steps.reorder(rows)
        if step < MAX_NEW - 1:
            logits = steps.advance(chosen)
    winners = scores.reshape(batch, beams).argmax(1) + np.arange(batch) * beams
    return tokens[winners]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """The with-past export, its eos chosen among the tokens greedy search emits (so rows end)."""
    opsets = dict.fromkeys((tm.ENCODER, tm.DECODER, tm.DECODER_WITH_PAST), 18)
    folder = tm.write_export(tmp_path_factory.mktemp("light") / "export", opsets=opsets)
    unbounded = reference_greedy(folder, tm.sample_inputs(seed=3, batch=3), eos=-1)
    eos = int(unbounded[0, 3])
    assert eos not in (START, PAD)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        eos_token_id=eos, pad_token_id=PAD, decoder_start_token_id=START, is_encoder_decoder=True
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": PAD, "decoder_start_token_id": START})
    )
    return folder, eos


@pytest.fixture(scope="module")
def model(export):
    from onnxmerge import Seq2SeqModel, merge_seq2seq

    folder, _ = export
    return Seq2SeqModel(merge_seq2seq(folder, folder.parent / "merged" / "model.onnx"))


@pytest.fixture(scope="module")
def plain_model(model):
    """The same file on the plain runtime: every acceleration off."""
    from onnxmerge.runtime import Accelerations, Seq2SeqModel

    return Seq2SeqModel(model.path, accelerations=Accelerations.off())


@pytest.fixture(params=["accelerated", "plain"])
def either_model(request, model, plain_model):
    """The token tests run on both: the accelerations change no token."""
    return model if request.param == "accelerated" else plain_model


def _inputs(seed: int = 3, batch: int = 3) -> dict[str, np.ndarray]:
    sample = tm.sample_inputs(seed=seed, batch=batch)  # the last row is padded
    return {"input_ids": sample["input_ids"], "attention_mask": sample["attention_mask"]}


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_greedy_matches_the_reference_loop(export, either_model, seed):
    folder, eos = export
    inputs = _inputs(seed)
    expected = reference_greedy(folder, inputs, eos)
    got = either_model.generate(inputs, max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(got, expected)


def test_the_ids_alone_are_the_main_input_as_transformers_takes_them(model):
    from onnxmerge.errors import GenerationError

    ids = tm.sample_inputs(seed=6, batch=2)["input_ids"][:2]
    expected = model.generate(input_ids=ids, max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(model.generate(ids, max_new_tokens=MAX_NEW), expected)
    with pytest.raises(GenerationError, match="passed twice"):
        model.generate(ids, input_ids=ids)
    with pytest.raises(GenerationError, match="numpy array"):
        model.generate(ids.tolist())


def test_greedy_stops_rows_at_eos_and_pads_them(export, model):
    folder, eos = export
    got = model.generate(_inputs(3), max_new_tokens=MAX_NEW)
    ended = got[0].tolist().index(eos)
    assert ended < got.shape[1] - 1 and set(got[0, ended + 1 :].tolist()) <= {PAD}


def test_processors_match_the_reference_loop(export, model):
    folder, eos = export
    inputs = _inputs(4)
    expected = reference_greedy(folder, inputs, eos, repetition_penalty=1.7, min_new_tokens=5)
    got = model.generate(inputs, max_new_tokens=MAX_NEW, repetition_penalty=1.7, min_new_tokens=5)
    np.testing.assert_array_equal(got, expected)
    assert eos not in got[:, 1:5]


def test_a_padded_row_generates_what_it_generates_alone(export, model):
    inputs = _inputs(5)
    batch = model.generate(inputs, max_new_tokens=MAX_NEW)
    last = {k: v[-1:] for k, v in inputs.items()}
    length = int(last["attention_mask"].sum())
    alone = model.generate({k: v[:, :length] for k, v in last.items()}, max_new_tokens=MAX_NEW)
    np.testing.assert_array_equal(batch[-1, : alone.shape[1]], alone[0])
    assert set(batch[-1, alone.shape[1] :].tolist()) <= {PAD}


@pytest.mark.parametrize("beams", [2, 3])
def test_beam_search_matches_the_reference_loop(export, either_model, beams):
    folder, eos = export
    inputs = _inputs(6)
    expected = reference_beam(folder, inputs, eos, beams)
    got = either_model.generate(
        inputs, max_new_tokens=MAX_NEW, num_beams=beams, suppress_tokens=[eos]
    )
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"num_beams": 3, "num_return_sequences": 2},
        {"do_sample": True, "top_k": 20, "seed": 7},
        {"do_sample": True, "num_beams": 2, "seed": 7},
        {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "min_new_tokens": 4},
    ],
    ids=["greedy", "beam3", "sampling", "beam-sampling", "processors"],
)
def test_the_plain_runtime_gives_the_accelerated_tokens(model, plain_model, settings):
    inputs = _inputs(4, batch=5)
    np.testing.assert_array_equal(
        plain_model.generate(inputs, max_new_tokens=MAX_NEW + 4, **settings),
        model.generate(inputs, max_new_tokens=MAX_NEW + 4, **settings),
    )


def test_accelerations_are_checked_before_the_file_is_read(tmp_path):
    from onnxmerge.errors import InvalidArgumentError
    from onnxmerge.runtime import Accelerations, Seq2SeqModel

    missing = tmp_path / "absent.onnx"  # never read: the arguments are refused first
    with pytest.raises(InvalidArgumentError, match="must be an onnxmerge.runtime.Accelerations"):
        Seq2SeqModel(missing, accelerations={"drop_finished": False})  # type: ignore[arg-type]
    for bad, message in [
        ({"drop_finished": 1}, "drop_finished must be True or False"),
        ({"greedy_most_of_row": 1.5}, "greedy_most_of_row must be a share between 0 and 1"),
        ({"topk_slabs": 0}, "topk_slabs must be a positive integer"),
        ({"greedy_first_float_steps": 8, "greedy_most_float_steps": 4}, "must not exceed"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message) as caught:
            Accelerations(**bad)
        assert caught.value.argument == "accelerations"
    with pytest.raises(TypeError):
        Accelerations(ring=False)  # type: ignore[call-arg]


def test_accelerations_off_switches_every_switch_and_keeps_the_thresholds():
    import dataclasses

    from onnxmerge.runtime import Accelerations

    off, on = Accelerations.off(), Accelerations()
    for field in dataclasses.fields(Accelerations):
        if field.type == "bool":
            assert getattr(on, field.name) is True and getattr(off, field.name) is False
        else:
            assert getattr(off, field.name) == getattr(on, field.name)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_generator_matches_the_reference_loop(export, model, tmp_path, search):
    from onnxmerge.generator import build_generator

    folder, eos = export
    inputs = _inputs(6)
    if search == "greedy":
        expected = reference_greedy(folder, inputs, eos)
        path = build_generator(model.path, tmp_path / "generator.onnx")
    else:
        expected = reference_beam(folder, inputs, eos, 2)
        path = build_generator(
            model.path,
            tmp_path / "generator.onnx",
            search="beam",
            num_beams=2,
            generation_config={"suppress_tokens": [eos]},
        )
    feeds = {**inputs, "max_new_tokens": np.array(MAX_NEW, np.int64)}
    sequences = tm.session(path).run(None, feeds)[0]
    np.testing.assert_array_equal(sequences, expected)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_generator_runs_on_an_opset_17_export(tmp_path, search):
    # Regression: Reduce* took their axes as an input, which only opset 18 and later accept.
    from onnxmerge import merge_seq2seq
    from onnxmerge.generator import build_generator

    folder = tm.write_export(tmp_path / "export")
    settings = {"eos_token_id": 3, "pad_token_id": PAD, "decoder_start_token_id": START}
    (folder / "generation_config.json").write_text(json.dumps(settings))
    merged = merge_seq2seq(folder, tmp_path / "merged" / "model.onnx")
    opsets = {o.domain: o.version for o in onnx.load(merged, load_external_data=False).opset_import}
    assert opsets.get("", opsets.get("ai.onnx")) == 17
    beams = {"num_beams": 2} if search == "beam" else {}
    path = build_generator(merged, tmp_path / "generator.onnx", search=search, **beams)
    feeds = {**_inputs(6), "max_new_tokens": np.array(MAX_NEW, np.int64)}
    sequences = tm.session(path).run(None, feeds)[0]
    assert sequences.shape[0] == 3 and sequences.shape[1] > 1
