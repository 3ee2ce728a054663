"""``onnxmerge.translate.translate_lines`` without the command: one result per line, in order; a
blank line gives a blank translation, a bad line its error, and the lines after it go on."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from onnxmerge.errors import GenerationError
from onnxmerge.translate import LineResult, open_model, translate_lines
from tests import textmodels as tm
from tests.test_light_generation import MAX_NEW, export, model  # noqa: F401 - fixtures

pytest.importorskip("onnxruntime")


def generated(model, ids: list[int]) -> str:  # noqa: F811 - the fixture's name
    alone = model.generate(np.asarray([ids]), max_new_tokens=MAX_NEW)
    return " ".join(map(str, alone[0, 1:].tolist()))


@pytest.fixture(scope="module")
def demo(demo_export, tmp_path_factory):
    from onnxmerge import merge_seq2seq

    folder = Path(shutil.copytree(demo_export, tmp_path_factory.mktemp("demo") / "export"))
    return open_model(merge_seq2seq(folder))


def test_a_blank_line_translates_to_a_blank_line(demo):
    """Regression: a blank line (documents separate paragraphs with them) was an error."""
    results = list(translate_lines(demo, [b"un", b"deux", b""]))
    assert results == [
        LineResult(1, "one", tokens=results[0].tokens),
        LineResult(2, "two", tokens=results[1].tokens),
        LineResult(3, ""),
    ]
    assert all(r.ok for r in results) and results[0].tokens > 0


def test_text_lines_as_str_or_bytes_with_their_line_ends_and_a_byte_order_mark(demo):
    from onnxmerge.demo import english_number, french_number

    numbers = [243, 97, 71]
    as_bytes = [b"\xef\xbb\xbf" + french_number(numbers[0]).encode() + b"\r\n", b"  \n"]
    as_bytes += [french_number(n).encode() + b"\n" for n in numbers[1:]]
    as_text = [line.decode("utf-8") for line in as_bytes]  # the mark stays, as "\ufeff"
    expected = [english_number(numbers[0]), "", *map(english_number, numbers[1:])]
    for lines in (as_bytes, as_text):
        results = translate_lines(demo, lines, max_batch_size=2, batch_type="examples")
        assert [r.text for r in results] == expected


def test_bad_lines_get_their_error_and_keep_their_place(model):  # noqa: F811
    lines = [b"5 6 7", b"7 eight 9", b"\xff 5", f"5 {tm.VOCAB}".encode(), b"", b"8 9"]
    results = list(
        translate_lines(model, lines, ids=True, max_batch_size=1, max_new_tokens=MAX_NEW)
    )
    assert [r.number for r in results] == [1, 2, 3, 4, 5, 6]
    ok = [generated(model, [5, 6, 7]), generated(model, [8, 9])]
    assert [r.text for r in results] == [ok[0], "", "", "", "", ok[1]]
    assert [r.error for r in results] == [
        None,
        "--ids takes non-negative integers separated by spaces",
        "not UTF-8 (byte 1); nothing translated",
        f"id {tm.VOCAB} is outside the vocabulary 0..{tm.VOCAB - 1}",
        None,
        None,
    ]
    assert [r.tokens for r in results] == [len(r.text.split()) for r in results]


@pytest.mark.parametrize("parallel_batches", [1, 2])
def test_results_come_in_input_order_as_generate_gives_them(export, model, parallel_batches):  # noqa: F811
    folder, _ = export  # `model` merged it into folder.parent / "merged"
    lines = [[int(i) for i in np.random.default_rng(n).integers(3, tm.VOCAB, size=n % 7 + 1)]
             for n in range(12)]  # fmt: skip
    opened = open_model(folder.parent / "merged" / "model.onnx", parallel_batches=parallel_batches)
    results = translate_lines(
        opened,
        (" ".join(map(str, ids)) for ids in lines),
        ids=True,
        max_batch_size=8,
        batch_type="tokens",
        parallel_batches=parallel_batches,
        max_new_tokens=MAX_NEW,
    )
    assert [r.text for r in results] == [generated(opened, ids) for ids in lines]


def test_a_translation_with_a_line_break_stays_on_its_line(model):  # noqa: F811
    class Tokenizer:
        def __call__(self, text):
            return {"input_ids": [5, 6, 7]}

        def decode(self, ids, skip_special_tokens):
            return "two\nhundred\r\nthree"

    results = translate_lines(model, ["deux cent trois"], tokenizer=Tokenizer(), max_new_tokens=2)
    assert [r.text for r in results] == ["two hundred three"]


def test_a_model_of_no_token_ids_and_bad_settings_are_refused_before_a_line_is_read(model):  # noqa: F811
    class Whisper:
        main_input = "input_features"
        path = Path("whisper.onnx")

    def lines():
        raise AssertionError("a line was read")
        yield b""

    with pytest.raises(GenerationError, match="reads input_features, not token ids") as caught:
        translate_lines(Whisper(), lines(), ids=True)  # type: ignore[arg-type]
    assert caught.value.argument == "model"
    with pytest.raises(ValueError, match="max_new_tokens"):
        translate_lines(model, lines(), ids=True, max_new_tokens=0)
