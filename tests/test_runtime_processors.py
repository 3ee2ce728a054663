"""The numpy logits processors against transformers' classes on random logits: equal exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from onnxmerge.runtime import processors as p
from onnxmerge.runtime._search import sample_tokens

pytestmark = pytest.mark.export

torch: Any = None
tlp: Any = None


@pytest.fixture(autouse=True, scope="module")
def _reference_modules() -> None:
    """torch and transformers' processors, imported for the tests, not at collection."""
    global torch, tlp
    torch = pytest.importorskip("torch")
    tlp = pytest.importorskip("transformers.generation.logits_process")


VOCAB = 50
ROWS = 6


def _inputs(seed: int, length: int = 9) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 12, size=(ROWS, length), dtype=np.int64)  # few ids: repeats and n-grams
    scores = (rng.standard_normal((ROWS, VOCAB)) * 3).astype(np.float32)
    return ids, scores


def _same(ours, theirs, *, length: int = 9, seeds=range(4)) -> None:
    for seed in seeds:
        ids, scores = _inputs(seed, length)
        expected = theirs(torch.from_numpy(ids), torch.from_numpy(scores.copy())).numpy()
        actual = ours(ids, scores.copy())
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty(penalty):
    _same(p.RepetitionPenalty(penalty), tlp.RepetitionPenaltyLogitsProcessor(penalty))


@pytest.mark.parametrize("penalty", [0.5, 1.7])
def test_encoder_repetition_penalty(penalty):
    encoder_ids = np.random.default_rng(7).integers(0, VOCAB, size=(2, 5))
    _same(
        p.EncoderRepetitionPenalty(penalty, encoder_ids),
        tlp.EncoderRepetitionPenaltyLogitsProcessor(penalty, torch.from_numpy(encoder_ids)),
    )


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 9])
def test_no_repeat_ngram(size, length):
    _same(p.NoRepeatNGram(size), tlp.NoRepeatNGramLogitsProcessor(size), length=length)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("length", [1, 2, 9])
def test_encoder_no_repeat_ngram(size, length):
    encoder_ids = np.random.default_rng(3).integers(0, 12, size=(2, 11))
    _same(
        p.EncoderNoRepeatNGram(size, encoder_ids),
        tlp.EncoderNoRepeatNGramLogitsProcessor(size, torch.from_numpy(encoder_ids)),
        length=length,
    )


def _ragged_rows() -> list[np.ndarray]:
    """Encoder ids of three inputs, each of its own length: generate_many's inputs without the
    padding their batch gives them."""
    rng = np.random.default_rng(5)
    return [rng.integers(0, 12, size=n) for n in (2, 7, 4)]


def test_encoder_repetition_penalty_takes_rows_of_their_own_lengths():
    rows = _ragged_rows()
    ids, scores = _inputs(1)
    got = p.EncoderRepetitionPenalty(1.7, rows)(ids, scores.copy())
    for i, row in enumerate(rows):  # encoder row i goes with score row i, as in transformers
        alone = tlp.EncoderRepetitionPenaltyLogitsProcessor(1.7, torch.from_numpy(row[None]))
        expected = alone(torch.from_numpy(ids[i : i + 1]), torch.from_numpy(scores[i : i + 1]))
        np.testing.assert_array_equal(got[i], expected.numpy()[0])
    np.testing.assert_array_equal(got[len(rows) :], scores[len(rows) :])


def test_encoder_no_repeat_ngram_takes_rows_of_their_own_lengths():
    rows = _ragged_rows()
    ids, scores = _inputs(1)
    got = p.EncoderNoRepeatNGram(2, rows)(ids, scores.copy())
    per_input = ROWS // len(rows)
    for i, row in enumerate(rows):
        lines = slice(i * per_input, (i + 1) * per_input)
        alone = tlp.EncoderNoRepeatNGramLogitsProcessor(2, torch.from_numpy(row[None]))
        expected = alone(torch.from_numpy(ids[lines]), torch.from_numpy(scores[lines].copy()))
        np.testing.assert_array_equal(got[lines], expected.numpy())


@pytest.mark.parametrize("eos", [[2], [2, 5]])
def test_no_bad_words(eos):
    words = [[3], [2], [4, 5], [1, 2, 3], [7, 7], [11]]
    _same(p.NoBadWords(words, eos), tlp.NoBadWordsLogitsProcessor(words, eos))


@pytest.mark.parametrize("length", [1, 4, 9])
def test_min_length_and_min_new_tokens(length):
    _same(p.MinLength(6, [2, 4]), tlp.MinLengthLogitsProcessor(6, [2, 4]), length=length)
    _same(
        p.MinNewTokens(2, 5, [3]),
        tlp.MinNewTokensLengthLogitsProcessor(2, 5, [3]),
        length=length,
    )


@pytest.mark.parametrize("length", [1, 2, 4])
def test_forced_bos_and_eos(length):
    _same(p.ForcedBOS(7), tlp.ForcedBOSTokenLogitsProcessor(7), length=length)
    _same(p.ForcedEOS(5, [2, 9]), tlp.ForcedEOSTokenLogitsProcessor(5, [2, 9]), length=length)


@pytest.mark.parametrize("length", [1, 2, 3])
def test_suppress_tokens(length):
    _same(
        p.SuppressTokens([1, 4, 49]), tlp.SuppressTokensLogitsProcessor([1, 4, 49]), length=length
    )
    _same(
        p.SuppressTokensAtBegin([3, 5], 2),
        tlp.SuppressTokensAtBeginLogitsProcessor([3, 5], 2),
        length=length,
    )


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.9])
def test_temperature(temperature):
    _same(p.Temperature(temperature), tlp.TemperatureLogitsWarper(temperature))


@pytest.mark.parametrize("top_k", [1, 5, 49, 80])
@pytest.mark.parametrize("keep", [1, 3])
def test_top_k(top_k, keep):
    _same(p.TopK(top_k, keep), tlp.TopKLogitsWarper(top_k, min_tokens_to_keep=keep))


@pytest.mark.parametrize("top_p", [0.0, 0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("keep", [1, 3])
def test_top_p(top_p, keep):
    _same(p.TopP(top_p, keep), tlp.TopPLogitsWarper(top_p, min_tokens_to_keep=keep))


def test_top_k_then_top_p_chain():
    chain = p.ProcessorList([p.Temperature(0.8), p.TopK(10), p.TopP(0.7)])
    theirs = tlp.LogitsProcessorList(
        [tlp.TemperatureLogitsWarper(0.8), tlp.TopKLogitsWarper(10), tlp.TopPLogitsWarper(0.7)]
    )
    _same(chain, theirs)


def test_log_softmax_matches_torch_closely():
    _, scores = _inputs(0)
    expected = torch.log_softmax(torch.from_numpy(scores), dim=-1).numpy()
    np.testing.assert_allclose(p.log_softmax(scores), expected, rtol=0, atol=1e-6)


def test_log_softmax_in_place_writes_the_same_values_over_the_scores():
    pytest.importorskip("onnxruntime")
    _, scores = _inputs(0)
    expected = p.log_softmax(scores.copy())
    own = scores.copy()
    assert p.log_softmax(own, in_place=True) is own
    np.testing.assert_array_equal(own, expected)
    # An array it may not write into, or a strided view, gets a new one.
    frozen = scores.copy()
    frozen.flags.writeable = False
    for given in (frozen, np.repeat(scores, 2, axis=1)[:, ::2]):
        result = p.log_softmax(given, in_place=True)
        assert not np.shares_memory(result, given)
        np.testing.assert_array_equal(result, expected)


def test_sample_tokens_follow_the_distribution_and_skip_zero_probability():
    probs = np.array([[0.0, 0.2, 0.0, 0.8, 0.0]] * 20000, dtype=np.float32)
    draws = sample_tokens(probs, np.random.default_rng(0))
    counts = np.bincount(draws, minlength=5) / len(draws)
    assert counts[0] == counts[2] == counts[4] == 0
    assert abs(counts[3] - 0.8) < 0.02


def test_sample_tokens_reproducible_with_a_seed():
    probs = np.random.default_rng(1).random((8, 30))
    a = sample_tokens(probs, np.random.default_rng(5))
    b = sample_tokens(probs, np.random.default_rng(5))
    np.testing.assert_array_equal(a, b)
