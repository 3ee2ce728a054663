"""The shipped demo model: number-word converters, tokenizer, and translation of unseen numbers."""

from __future__ import annotations

import json

import pytest

from onnxmerge.demo import (
    DEMO_MODEL_DIR,
    DEMO_SENTENCES,
    LARGEST_NUMBER,
    english_number,
    french_number,
    is_held_out,
)


@pytest.mark.parametrize(
    ("number", "french", "english"),
    [
        (0, "zéro", "zero"),
        (17, "dix-sept", "seventeen"),
        (21, "vingt et un", "twenty-one"),
        (70, "soixante-dix", "seventy"),
        (71, "soixante et onze", "seventy-one"),
        (77, "soixante-dix-sept", "seventy-seven"),
        (80, "quatre-vingts", "eighty"),
        (81, "quatre-vingt-un", "eighty-one"),
        (91, "quatre-vingt-onze", "ninety-one"),
        (97, "quatre-vingt-dix-sept", "ninety-seven"),
        (100, "cent", "one hundred"),
        (200, "deux cents", "two hundred"),
        (201, "deux cent un", "two hundred one"),
        (243, "deux cent quarante-trois", "two hundred forty-three"),
        (1000, "mille", "one thousand"),
        (1001, "mille un", "one thousand one"),
        (1980, "mille neuf cent quatre-vingts", "one thousand nine hundred eighty"),
        (1984, "mille neuf cent quatre-vingt-quatre", "one thousand nine hundred eighty-four"),
        (2000, "deux mille", "two thousand"),
        (3200, "trois mille deux cents", "three thousand two hundred"),
        (9999, "neuf mille neuf cent quatre-vingt-dix-neuf",
         "nine thousand nine hundred ninety-nine"),
    ],
)  # fmt: skip
def test_converters_spell_tricky_numbers(number: int, french: str, english: str) -> None:
    assert french_number(number) == french
    assert english_number(number) == english


def test_converters_give_every_number_its_own_words() -> None:
    numbers = range(LARGEST_NUMBER + 1)
    assert len({french_number(n) for n in numbers}) == len(numbers)
    assert len({english_number(n) for n in numbers}) == len(numbers)


@pytest.mark.parametrize("bad", [-1, LARGEST_NUMBER + 1])
def test_converters_refuse_numbers_out_of_range(bad: int) -> None:
    from onnxmerge.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="outside"):
        french_number(bad)
    with pytest.raises(ValueError, match="outside"):
        english_number(bad)
    with pytest.raises(InvalidArgumentError, match="expected an int"):
        english_number(2.0)  # type: ignore[arg-type]


def test_held_out_split_keeps_the_building_blocks_in_training() -> None:
    held_out = [n for n in range(LARGEST_NUMBER + 1) if is_held_out(n)]
    assert not any(n < 100 for n in held_out)
    assert 800 <= len(held_out) <= 1200


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    transformers = pytest.importorskip("transformers")
    loaded = transformers.MarianMTModel.from_pretrained(DEMO_MODEL_DIR, local_files_only=True)
    return loaded.eval()


def test_shipped_folder_holds_a_small_marian_checkpoint() -> None:
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "marian"
    assert config["decoder_start_token_id"] == config["pad_token_id"]
    assert (DEMO_MODEL_DIR / "generation_config.json").is_file()
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size < 3_000_000


def test_tokenizer_round_trips_and_ends_sources_with_eos(tokenizer) -> None:
    for n in (7, 71, 243, 1980, 1984, 9999):
        for text in (french_number(n), english_number(n)):
            ids = tokenizer(text)["input_ids"]
            assert ids[-1] == tokenizer.eos_token_id
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids, skip_special_tokens=True) == text
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("two hundred forty-three")["input_ids"])
    assert pieces == ["▁two", "▁hundred", "▁forty", "-", "three", "</s>"]


def _translate(model, tokenizer, sources: list[str]) -> list[str]:
    import torch

    batch = tokenizer(sources, return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = model.generate(**batch)
    return tokenizer.batch_decode(generated, skip_special_tokens=True)


def test_model_translates_numbers_it_never_saw(model, tokenizer) -> None:
    held_out = [n for n in range(LARGEST_NUMBER + 1) if is_held_out(n)][::20]
    assert len(held_out) >= 45
    translations = _translate(model, tokenizer, [french_number(n) for n in held_out])
    wrong = [
        (n, got) for n, got in zip(held_out, translations, strict=True) if got != english_number(n)
    ]
    assert len(wrong) <= 0.05 * len(held_out), wrong


def test_demo_sentences_translate_exactly(model, tokenizer) -> None:
    french_to_english = {french_number(n): english_number(n) for n in range(LARGEST_NUMBER + 1)}
    translations = _translate(model, tokenizer, list(DEMO_SENTENCES))
    assert translations == [french_to_english[source] for source in DEMO_SENTENCES]
    shown = [n for n in range(LARGEST_NUMBER + 1) if french_number(n) in DEMO_SENTENCES]
    assert sum(is_held_out(n) for n in shown) >= 2
