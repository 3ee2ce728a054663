"""Seq2SeqModel.stream() and TextGenerator.stream(): each step's ids as it ends, the same ids
and text as generate() and translate(), and no step run after the caller leaves."""

from __future__ import annotations

import numpy as np
import pytest

from tests import zoo

pytestmark = pytest.mark.export
pytest.importorskip("onnxruntime")

SEARCHES = {
    "greedy": {"max_new_tokens": 12},
    "sampling": {"do_sample": True, "top_k": 20, "max_new_tokens": 12, "seed": 3},
    "beam3": {"num_beams": 3, "max_new_tokens": 12},
    "beam3-return2": {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 12},
}


@pytest.fixture(scope="module")
def merged_model(tiny_export, tmp_path_factory):
    import onnxmerge

    models: dict = {}

    def get(arch: str):
        if arch not in models:
            out = tmp_path_factory.mktemp(arch) / "model.onnx"
            onnxmerge.merge_seq2seq(tiny_export(arch).onnx_dir, out)
            models[arch] = (onnxmerge.Seq2SeqModel(out), tiny_export(arch))
        return models[arch]

    return get


def _joined(steps: list[dict[int, np.ndarray]], rows: int) -> list[list[int]]:
    joined: list[list[int]] = [[] for _ in range(rows)]
    for step in steps:
        for row, ids in step.items():
            assert ids.ndim == 1 and ids.dtype == np.int64
            joined[row].extend(ids.tolist())
    return joined


@pytest.mark.parametrize("arch", ["marian", "t5", "bart"])
@pytest.mark.parametrize("search", SEARCHES)
def test_streamed_ids_joined_are_generate_s(merged_model, arch, search):
    model, export = merged_model(arch)
    inputs = zoo.sample_encoder_inputs(export, batch=2, seq=7, seed=5)
    settings = SEARCHES[search]
    expected = model.generate(**inputs, **settings)
    steps = list(model.stream(**inputs, **settings))
    joined = _joined(steps, expected.shape[0])
    for row, ids in enumerate(joined):
        assert ids == expected[row, 1 : 1 + len(ids)].tolist()
        # Past the streamed ids, generate() has padding only: one fill value.
        assert len(set(expected[row, 1 + len(ids) :].tolist())) <= 1
    assert max(len(ids) for ids in joined) == expected.shape[1] - 1
    if settings.get("num_beams", 1) == 1:  # a step at a time
        assert len(steps) == expected.shape[1] - 1
        assert all(len(ids) == 1 for step in steps for ids in step.values())


class CountingSession:
    """Counts the decoder steps a model's session runs."""

    def __init__(self, model, monkeypatch):
        self.steps = 0
        session = model._session
        for name in ("first_step", "next_step"):
            original = getattr(session, name)

            def counted(*args, _original=original, **kwargs):
                self.steps += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(session, name, counted)


def test_the_first_ids_come_after_one_step_and_leaving_runs_no_more(merged_model, monkeypatch):
    model, export = merged_model("marian")
    inputs = zoo.sample_encoder_inputs(export, batch=1, seq=7, seed=5)
    counter = CountingSession(model, monkeypatch)
    # No eos before 60: the search would run 60 steps.
    stream = model.stream(**inputs, max_new_tokens=60, min_new_tokens=60)
    assert counter.steps == 0  # nothing runs before the first id is asked for
    first = next(stream)
    assert counter.steps == 1 and list(first) == [0]
    for _ in range(3):
        next(stream)
    assert counter.steps == 4
    stream.close()
    assert counter.steps == 4
    expected = model.generate(**inputs, max_new_tokens=4)
    again = [step[0][0] for step in model.stream(**inputs, max_new_tokens=4)]
    assert again == expected[0, 1:].tolist()


def test_a_bad_setting_is_refused_when_the_first_id_is_asked_for(merged_model):
    from onnxmerge.errors import GenerationError

    model, export = merged_model("marian")
    inputs = zoo.sample_encoder_inputs(export, batch=1, seq=7, seed=5)
    stream = model.stream(**inputs, num_beams=0)
    with pytest.raises(GenerationError):
        next(stream)


@pytest.fixture(scope="module")
def demo_model(demo_export, tmp_path_factory):
    import shutil

    from onnxmerge import Seq2SeqModel, merge_seq2seq

    folder = shutil.copytree(demo_export, tmp_path_factory.mktemp("demo") / "export")
    return Seq2SeqModel(merge_seq2seq(folder))


@pytest.mark.parametrize("search", ["greedy", "sampling", "beam3"])
@pytest.mark.parametrize("number", [7, 243, 1871, 9999])
def test_streamed_text_joined_is_translate_s(demo_model, search, number):
    from onnxmerge.demo import french_number
    from onnxmerge.runtime import TextGenerator

    settings = {k: v for k, v in SEARCHES[search].items() if k != "max_new_tokens"}
    generator = TextGenerator(demo_model)
    text = french_number(number)
    pieces = list(generator.stream_tokens(text, **settings))
    assert "".join(piece for _, piece in pieces) == demo_model.translate(text, **settings)
    ids = [token for token, _ in pieces]
    assert None not in ids  # every search here ends on eos
    encoded = generator.tokenizer([text], return_tensors="np")
    generated = demo_model.generate(encoded["input_ids"], **settings)[0, 1:]
    assert ids == generated[: len(ids)].tolist()


def test_the_first_text_piece_comes_after_one_step(demo_model, monkeypatch):
    from onnxmerge.demo import french_number
    from onnxmerge.runtime import TextGenerator

    counter = CountingSession(demo_model, monkeypatch)
    stream = TextGenerator(demo_model).stream(french_number(9871))
    next(stream)
    assert counter.steps == 1
    stream.close()
    assert counter.steps == 1


def test_text_stream_takes_one_text_and_one_sequence(demo_model):
    from onnxmerge.errors import GenerationError
    from onnxmerge.runtime import TextGenerator

    generator = TextGenerator(demo_model)
    with pytest.raises(GenerationError, match="one text"):
        next(generator.stream(["un", "deux"]))  # type: ignore[arg-type]
    with pytest.raises(GenerationError, match="num_return_sequences"):
        next(generator.stream("un", num_beams=2, num_return_sequences=2))


def _subword_tokenizer(kind: str):
    """A small tokenizer of a real kind, trained here: byte-level BPE (GPT-2, BART) or
    SentencePiece-like unigram with a metaspace (Marian, T5)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "Le café coûte trois euros, n'est-ce pas ?",
        "東京は日本の首都です。 Ünïcödé — “quotes” and emoji 🙂 too.",
        "Hello, world. It's a test; don't panic!\nNew line here.",
    ] * 20
    if kind == "bytes":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<pad>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    else:
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=["<pad>", "</s>"])
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")


@pytest.mark.parametrize("kind", ["bytes", "metaspace"])
def test_text_pieces_joined_are_the_decoded_sequence(kind):
    from onnxmerge.runtime import TextPieces

    tokenizer = _subword_tokenizer(kind)
    rng = np.random.default_rng(0)
    sentences = [
        "Le café coûte trois euros, n'est-ce pas ?",
        "東京は日本の首都です。 🙂 Hello, world.\nNew line here.",
    ]
    sequences = [tokenizer(s)["input_ids"] for s in sentences]
    sequences += [rng.integers(0, len(tokenizer), 40).tolist() for _ in range(20)]
    for ids in sequences:
        pieces = TextPieces(tokenizer)
        given = [pieces.push([i]) for i in ids]
        given.append(pieces.end())
        assert "".join(given) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any(p.endswith("\ufffd") for p in given[:-1])


@pytest.mark.parametrize("search", ["greedy", "beam3-return2"])
def test_streamed_ids_are_generate_s_with_accelerations_off(merged_model, search):
    from onnxmerge import Seq2SeqModel
    from onnxmerge.runtime import Accelerations

    model, export = merged_model("t5")
    plain = Seq2SeqModel(model.path, accelerations=Accelerations.off())
    inputs = zoo.sample_encoder_inputs(export, batch=3, seq=6, seed=9)
    settings = SEARCHES[search]
    expected = plain.generate(**inputs, **settings)
    joined = _joined(list(plain.stream(**inputs, **settings)), expected.shape[0])
    for row, ids in enumerate(joined):
        assert ids == expected[row, 1 : 1 + len(ids)].tolist()
    np.testing.assert_array_equal(expected, model.generate(**inputs, **settings))
