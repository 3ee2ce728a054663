"""``generate_many``: length-sorted batches whose every result is what ``generate`` gives alone,
in input order (torch-free: the small export of tests/textmodels.py)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxmerge.errors import GenerationError
from onnxmerge.runtime import _corpus as corpus
from tests import textmodels as tm
from tests.test_light_generation import MAX_NEW, PAD, export, model  # noqa: F401 - fixtures

pytest.importorskip("onnxruntime")


def sources(count: int, seed: int = 0) -> list[np.ndarray]:
    """Mixed lengths (1 to 9 ids), none of them the pad id."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, tm.VOCAB, size=int(rng.integers(1, 10))) for _ in range(count)]


def alone(model, source, **settings) -> np.ndarray:  # noqa: F811 - the fixture's name
    return model.generate(np.asarray(source)[None], **settings)


@pytest.mark.parametrize(
    "settings",
    [
        {"max_new_tokens": MAX_NEW},
        {"max_new_tokens": MAX_NEW, "num_beams": 3},
        {"max_new_tokens": MAX_NEW, "num_beams": 3, "num_return_sequences": 2},
        {"max_new_tokens": MAX_NEW, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2},
    ],
    ids=["greedy", "beam3", "beam3-two-each", "processors"],
)
@pytest.mark.parametrize("batching", [(3, "examples"), (12, "tokens"), (1, "examples")], ids=str)
def test_each_result_is_what_generate_gives_alone(model, settings, batching):  # noqa: F811
    inputs = sources(20)
    size, kind = batching
    got = list(model.generate_many(inputs, max_batch_size=size, batch_type=kind, **settings))
    assert len(got) == len(inputs)
    lengths = set()
    for source, result in zip(inputs, got, strict=True):
        expected = alone(model, source, **settings)
        np.testing.assert_array_equal(result, expected)
        lengths.add(result.shape[1])
    assert len(lengths) > 1  # rows that ended early were cut back, not left padded


def test_streams_an_iterator_over_several_windows_in_order(model):  # noqa: F811
    inputs = sources(40, seed=1)  # max_batch_size 1: windows of 16 inputs
    got = list(model.generate_many(iter(inputs), max_batch_size=1, max_new_tokens=MAX_NEW))
    batched = list(model.generate_many(inputs, max_batch_size=64, max_new_tokens=MAX_NEW))
    for one, other in zip(got, batched, strict=True):
        np.testing.assert_array_equal(one, other)
    assert len(got) == 40


def test_a_mapping_with_a_mask_and_a_list_of_ids_are_inputs_too(model):  # noqa: F811
    ids = np.array([5, 17, 42, 9, PAD, PAD])
    mask = np.array([1, 1, 1, 1, 0, 0])
    items = [{"input_ids": ids, "attention_mask": mask}, [7, 8, 9], ids[:4]]
    got = list(model.generate_many(items, max_new_tokens=MAX_NEW))
    np.testing.assert_array_equal(
        got[0],
        model.generate(
            {"input_ids": ids[None], "attention_mask": mask[None]}, max_new_tokens=MAX_NEW
        ),
    )
    np.testing.assert_array_equal(got[1], alone(model, [7, 8, 9], max_new_tokens=MAX_NEW))
    # The masked input generates what its unpadded ids do.
    np.testing.assert_array_equal(got[0], got[2])


def test_token_batches_keep_the_padded_budget():
    lengths = [3, 10, 4, 4, 9, 2, 30]
    batches = corpus.cut_batches(lengths, [()] * 7, 20, "tokens")
    assert batches == [[6], [1, 4], [2, 3, 0, 5]]
    for batch in batches[1:]:
        assert len(batch) * max(lengths[i] for i in batch) <= 20
    assert corpus.cut_batches(lengths, [()] * 7, 3, "examples") == [[6, 1, 4], [2, 3, 0], [5]]
    # Inputs whose shapes padding cannot even out never share a batch.
    assert corpus.cut_batches([2, 2, 2], ["a", "b", "a"], 8, "examples") == [[0, 2], [1]]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_batch_size": 0}, "max_batch_size must be at least 1"),
        ({"max_batch_size": 2.5}, "max_batch_size must be an integer"),
        ({"batch_type": "sentences"}, "batch_type must be one of 'examples', 'tokens'"),
        ({"decoder_input_ids": np.ones((1, 1), np.int64)}, "prompt per input is not supported"),
    ],
)
def test_bad_options_are_generation_errors(model, options, message):  # noqa: F811
    with pytest.raises(GenerationError, match=message):
        next(model.generate_many([[5, 6]], **options))


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "input 1: input_ids is empty"),
        ([5, tm.VOCAB + 3], "input 1: input_ids holds"),
        ("le chat", "input 1: got text"),
        (np.ones((2, 3), np.int64), "input 1: input_ids has shape"),
    ],
)
def test_a_bad_input_is_named_by_its_index(model, bad, message):  # noqa: F811
    with pytest.raises(GenerationError, match=message):
        list(model.generate_many([[5, 6], bad, [7]], max_new_tokens=2))
