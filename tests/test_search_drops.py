"""Rows whose search ended leave the batch (``drop_finished``), as CTranslate2 drops them: every
row's tokens stay what they are when all rows run to the batch's end, as in transformers."""

from __future__ import annotations

import numpy as np
import pytest

from onnxmerge.runtime import _search as search
from onnxmerge.runtime._accelerations import Accelerations
from onnxmerge.runtime.processors import build_processors
from onnxmerge.settings import resolve_settings

START, EOS, PAD, VOCAB = 2, 1, 0, 40


def _dropping(drop: bool) -> Accelerations:
    return Accelerations(drop_finished=drop)


class _PerInput:
    """Next logits from each row's input and last token, so that a row that lands on another
    row's state after a drop gets other tokens. Notes the rows of every step."""

    def __init__(self, table: np.ndarray, batch: int):
        self.table = table
        self.inputs = np.arange(batch)
        self.last = np.full(batch, START)
        self.kept: list[list[int]] = []
        self.rows: list[int] = []

    def _logits(self) -> np.ndarray:
        self.rows.append(self.last.size)
        return self.table[(self.last * 7 + self.inputs * 13) % len(self.table)].copy()

    def start(self) -> np.ndarray:
        return self._logits()

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        self.last = np.asarray(tokens)
        return self._logits()

    def expand(self, n: int) -> None:
        self.inputs, self.last = np.repeat(self.inputs, n), np.repeat(self.last, n)

    def reorder(self, rows: np.ndarray, *, within_batch: bool = False) -> None:
        self.inputs, self.last = self.inputs[rows], self.last[rows]

    def keep(self, rows: np.ndarray) -> None:
        self.kept.append(rows.tolist())
        self.reorder(rows)


def _table(seed: int) -> np.ndarray:
    """Logits whose eos is likely in some states and unlikely in others: lengths vary."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((97, VOCAB)).astype(np.float32) * 2
    table[:, EOS] += rng.uniform(-4.0, 2.5, size=97).astype(np.float32)
    return table


def _search(kind: str, seed: int, batch: int, *, drop: bool, **overrides):
    given = {"eos_token_id": EOS, "pad_token_id": PAD, "decoder_start_token_id": START}
    settings = resolve_settings({}, {}, {**given, "max_new_tokens": 12, **overrides}, 1)
    runner = _PerInput(_table(seed), batch)
    prompt = np.full((batch, 1), START)
    run = search.greedy_or_sample if kind == "greedy" else search.beam_search
    got = run(runner, prompt, settings, build_processors(settings), accelerations=_dropping(drop))
    return got, runner


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("greedy", {}),
        ("greedy", {"no_repeat_ngram_size": 2, "min_new_tokens": 3}),
        ("beam", {"num_beams": 3}),
        ("beam", {"num_beams": 3, "early_stopping": True, "length_penalty": 0.6}),
        ("beam", {"num_beams": 3, "early_stopping": "never", "length_penalty": -0.5}),
        # Scored as if they could run to max_length, hypotheses seldom settle before it.
        ("beam", {"num_beams": 3, "early_stopping": "never", "length_penalty": 2.0}),
        ("beam", {"num_beams": 4, "num_return_sequences": 2, "repetition_penalty": 1.3}),
    ],
    ids=[
        "greedy",
        "greedy-processors",
        "beam",
        "beam-early",
        "beam-never",
        "beam-never-long",
        "beam-two-each",
    ],
)
def test_dropping_ended_rows_leaves_every_rows_tokens_as_they_were(kind, overrides):
    drops = 0
    for seed in range(12):
        kept, runner = _search(kind, seed, 16, drop=True, **overrides)
        expected, full = _search(kind, seed, 16, drop=False, **overrides)
        np.testing.assert_array_equal(kept, expected, err_msg=f"seed {seed}")
        assert full.kept == [] and len(set(full.rows[1:])) == 1
        drops += len(runner.kept)
        if runner.kept:  # the rows run shrink with each drop, never grow
            assert runner.rows[-1] < full.rows[-1]
            assert all(a >= b for a, b in zip(runner.rows[1:], runner.rows[2:], strict=False))
    if overrides.get("length_penalty") != 2.0:
        assert drops  # rows did leave, so the comparison above covers drops


def test_greedy_drops_the_rows_that_ended_as_they_end():
    # Rows 0 and 1 of 6 end on the first step (eos is their best token), the rest never do.
    table = np.zeros((97, VOCAB), np.float32)
    table[:, 5] = 1.0
    given = {"eos_token_id": EOS, "pad_token_id": PAD, "decoder_start_token_id": START}
    settings = resolve_settings({}, {}, {**given, "max_new_tokens": 4}, 1)
    runner = _PerInput(table, 6)
    first = runner.start

    def start() -> np.ndarray:
        logits = first()
        logits[:2, EOS] = 2.0
        return logits

    runner.start = start  # type: ignore[method-assign]
    prompt = np.full((6, 1), START)
    got = search.greedy_or_sample(
        runner, prompt, settings, build_processors(settings), accelerations=_dropping(True)
    )
    assert got[:2, 1:].tolist() == [[EOS, PAD, PAD, PAD]] * 2
    assert (got[2:, 1:] == 5).all()
    assert runner.kept == [[2, 3, 4, 5]] and runner.rows == [6, 4, 4, 4]


def test_rows_stay_where_a_processor_pairs_its_state_with_them():
    given = {"eos_token_id": EOS, "pad_token_id": PAD, "decoder_start_token_id": START}
    settings = resolve_settings({}, {}, {**given, "encoder_no_repeat_ngram_size": 2}, 1)
    encoder_ids = np.arange(18).reshape(9, 2)
    assert not build_processors(settings, encoder_ids).rows_may_drop
    assert build_processors(settings).rows_may_drop  # without encoder ids it is not built

    def kept(processors) -> list:
        runner = _PerInput(_table(0), 9)
        prompt = np.full((9, 1), START)
        search.greedy_or_sample(runner, prompt, settings, processors, accelerations=_dropping(True))
        return runner.kept

    assert kept(build_processors(settings, encoder_ids)) == []
    assert kept(build_processors(settings)) != []


class _ByStep(_PerInput):
    """Input 0 ends on step 7 or 8 (eos becomes likely); input 1 never ends and runs on."""

    def __init__(self):
        super().__init__(np.zeros((1, VOCAB), np.float32), 2)
        self.step = 0

    def _logits(self) -> np.ndarray:
        self.step += 1
        self.rows.append(self.inputs.size)
        out = np.full((self.inputs.size, VOCAB), -30.0, np.float32)
        out[:, 5] = 0.0
        first = self.inputs == 0
        out[first, 6], out[~first, 6] = -5.0, -1.0
        if self.step >= 7:
            out[first, EOS] = -3.0 if self.step == 7 else 0.0
        return out


def test_beam_search_ends_when_every_input_settled_before_it_would_have_stopped():
    # With early_stopping=True, input 0 is full and settles while its heuristic still holds; a
    # strongly negative length penalty settles input 1 first. Both settled: no step of no rows.
    given = {"eos_token_id": EOS, "pad_token_id": PAD, "decoder_start_token_id": START}
    overrides = {"max_new_tokens": 12, "num_beams": 2, "early_stopping": True}
    settings = resolve_settings({}, {}, {**given, **overrides, "length_penalty": -10.0}, 1)
    got = {}
    for drop in (False, True):
        runner = _ByStep()
        prompt = np.full((2, 1), START)
        got[drop] = search.beam_search(
            runner, prompt, settings, build_processors(settings), accelerations=_dropping(drop)
        )
        assert 0 not in runner.rows
    np.testing.assert_array_equal(got[True], got[False])
