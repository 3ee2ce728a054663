"""Beam search's named steps in the runtime, each on a small case computed by hand here.

One input, two beams, a vocabulary of three with eos 1, a prompt of one token (the start, 2).
"""

from __future__ import annotations

import dataclasses
import mmap
from pathlib import Path

import numpy as np
import pytest

from onnxmerge.runtime import _search as search
from onnxmerge.runtime._accelerations import Accelerations
from onnxmerge.runtime.processors import (
    ProcessorList,
    build_processors,
    log_softmax,
    numpy_log_softmax,
    softmax,
)
from onnxmerge.settings import resolve_settings
from tests.smaps import SMAPS, mapping_fields

START, EOS, NEG = 2, 1, np.float32(-1.0e9)


def _settings(**overrides):
    given = {"eos_token_id": EOS, "pad_token_id": 0, "decoder_start_token_id": START}
    return resolve_settings({}, {}, {**given, "num_beams": 2, **overrides}, 1)


def _config(batch: int = 1, **overrides) -> search._BeamConfig:
    return search._beam_config(_settings(**overrides), batch, 1)


def _mid_search(cfg: search._BeamConfig) -> search._Beams:
    """After one step (cur_len 2): beams [2, 0] and [2, 2]; one hypothesis finished at -0.2."""
    beams = search._initial_beams(cfg, np.array([[START]]), 0)
    beams.running_sequences[0, :, 1] = [0, 2]
    beams.running_beam_scores[:] = [[-1.0, -2.0]]
    beams.running_beam_indices[0, :, 0] = [0, 0]
    beams.sequences[0, 0, 1] = EOS
    beams.beam_scores[:] = [[-0.2, NEG]]
    beams.beam_indices[0, 0, 0] = 0
    beams.is_sent_finished[:] = [[True, False]]
    return beams


# Step at cur_len 2 over [batch, beams * vocab]; the best four: beam 1 eos, beam 0 eos, beam 0
# token 0, beam 1 token 0.
# The fast top-k as the runtime runs it (slabs 0 is a plain stable sort).
SLABS = Accelerations().topk_slabs

LOG_PROBS = np.array([[-1.0, -0.5, -3.0, -2.0, -0.1, -4.0]], np.float32)


def test_topk_indices_put_the_lower_index_first_on_ties():
    values = np.array([[1.0, 3.0, 3.0, 0.0, 2.0]])
    assert search._topk_indices(values, 2, SLABS).tolist() == [[1, 2]]
    assert search._topk_indices(values, 3, SLABS).tolist() == [[1, 2, 4]]
    assert search._topk_indices(values, 5, SLABS).tolist() == [[1, 2, 4, 0, 3]]


def _rows_with_ties(rng: np.random.Generator, dtype: type) -> np.ndarray:
    """Rows wide enough for the bounded path, with -inf, repeated top values and a -inf row."""
    values = rng.standard_normal((3, int(rng.integers(1000, 4000)))).astype(dtype)
    values[rng.random(values.shape) < 0.3] = -np.inf
    if rng.random() < 0.5:  # ties around the top
        top = np.sort(values[0])[-rng.integers(1, 12) :]
        values[0, rng.integers(0, values.shape[1], size=len(top))] = top
    if rng.random() < 0.2:
        values[1] = -np.inf
        values[1, rng.integers(0, values.shape[1], size=3)] = 0.5
    return values


def _stable_topk(values: np.ndarray, k: int) -> np.ndarray:
    """What both top-k functions must return: a stable sort's first k, NaN last."""
    return np.argsort(-values, axis=1, kind="stable")[:, :k]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])  # log-probs; beam sampling's keys
def test_topk_indices_are_a_stable_sorts_with_ties_and_neg_inf(monkeypatch, dtype):
    rng = np.random.default_rng(0)
    partitioned = 0
    full = search._topk_by_partition

    def counted(values, k):
        nonlocal partitioned
        partitioned += 1
        return full(values, k)

    monkeypatch.setattr(search, "_topk_by_partition", counted)
    for _ in range(150):
        values = _rows_with_ties(rng, dtype)
        k = int(rng.integers(1, 12))
        expected = _stable_topk(values, k)
        np.testing.assert_array_equal(search._topk_indices(values, k, SLABS), expected)
        np.testing.assert_array_equal(full(values, k), expected)
    assert partitioned == 0  # ties and masked rows are not partitioned


def test_a_row_masked_but_for_a_few_tokens_takes_them_then_the_first_masked_columns(monkeypatch):
    """A forced eos masks all but one token per beam: the row's k-th largest is -inf. Such rows
    are not partitioned (a batch of 200 rows of 4 beams took 1.4 s so, each last step)."""
    monkeypatch.setattr(search, "_topk_by_partition", None)  # not called
    values = np.full((3, 4 * 1000), -np.inf, np.float32)
    values[:, [7, 1007, 2007, 3007]] = [[-1.0, -2.0, -1.0, -3.0]]
    values[2] = np.linspace(-5, -1, values.shape[1])  # an open row beside them
    top = search._topk_indices(values, 8, SLABS)
    assert top[0].tolist() == top[1].tolist() == [7, 2007, 1007, 3007, 0, 1, 2, 3]
    np.testing.assert_array_equal(top, _stable_topk(values, 8))


def test_topk_indices_skip_nan_as_a_stable_sort_does():
    values = np.random.default_rng(1).standard_normal((2, 4000)).astype(np.float32)
    values[values > 2.5] = np.nan
    np.testing.assert_array_equal(search._topk_indices(values, 4, SLABS), _stable_topk(values, 4))
    np.testing.assert_array_equal(search._topk_by_partition(values, 4), _stable_topk(values, 4))


def test_log_softmax_and_softmax_keep_the_textbook_values():
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((2, 4, 3, 20011)) * 20).astype(np.float32)
    logits[..., ::7] = -np.inf
    for scores in (logits, logits[:, :, -1, :]):  # the last position, as the runner hands it
        shifted = scores - scores.max(axis=-1, keepdims=True)
        exp = np.exp(shifted)
        total = exp.sum(axis=-1, keepdims=True)
        np.testing.assert_array_equal(numpy_log_softmax(scores), shifted - np.log(total))
        np.testing.assert_array_equal(softmax(scores), exp / total)
        # onnxruntime's kernel, where installed, sums in another order.
        np.testing.assert_allclose(
            log_softmax(scores), shifted - np.log(total), rtol=1e-6, atol=1e-6
        )
        assert (np.isneginf(log_softmax(scores)) == np.isneginf(scores)).all()


def test_beam_config_keeps_enough_candidates_for_every_eos():
    cfg = _config(batch=3, eos_token_id=[1, 4])
    assert cfg.beams_to_keep == 6  # (1 + two eos) * two beams
    assert cfg.top_num_beam_mask.tolist() == [True, True, False, False, False, False]
    assert cfg.batch_offset.tolist() == [[0], [2], [4]]
    assert _config(eos_token_id=None).beams_to_keep == 4


@pytest.mark.parametrize(("pad", "eos", "fill"), [(0, EOS, EOS), (5, EOS, 5), (None, None, -1)])
def test_initial_beams_pad_with_pad_or_eos(pad, eos, fill):
    # transformers writes `pad or eos[0]`: a pad id of 0 falls back to eos.
    cfg = _config(eos_token_id=eos, max_new_tokens=3)
    beams = search._initial_beams(cfg, np.array([[START]]), pad)
    assert beams.running_sequences.tolist() == [[[START, fill, fill, fill]] * 2]
    assert beams.running_beam_scores.tolist() == [[0.0, NEG]]
    assert beams.beam_scores.tolist() == [[NEG, NEG]]
    assert (beams.running_beam_indices == -1).all() and not beams.is_sent_finished.any()


def test_beam_log_probs_add_each_beams_score():
    cfg = _config()
    logits = np.zeros((2, 3), np.float32)
    got = search._beam_log_probs(cfg, _mid_search(cfg), 2, logits, ProcessorList())
    third = np.log(np.float32(3.0))
    np.testing.assert_allclose(got, [[-1 - third] * 3 + [-2 - third] * 3], rtol=1e-6)


@pytest.mark.parametrize("max_new_tokens", [9, 2])
def test_top_candidates_extend_the_best_beams(max_new_tokens):
    cfg = _config(max_new_tokens=max_new_tokens)
    found = search._top_candidates(cfg, _mid_search(cfg), 2, LOG_PROBS, False, None)
    assert found.log_probs.tolist() == [[np.float32(-0.1), -0.5, -1.0, -2.0]]
    assert found.sequences[0, :, :3].tolist() == [[2, 2, 1], [2, 0, 1], [2, 0, 0], [2, 2, 0]]
    assert found.beam_indices[0, :, :2].tolist() == [[0, 1], [0, 0], [0, 0], [0, 1]]
    # The third token reaches max_length 3 when two new tokens are allowed: every candidate ends.
    ends = [True] * 4 if max_new_tokens == 2 else [True, True, False, False]
    assert found.hits.tolist() == [ends]


def _candidates(cfg):
    return search._top_candidates(cfg, _mid_search(cfg), 2, LOG_PROBS, False, None)


def test_keep_running_drops_candidates_that_end():
    cfg = _config(max_new_tokens=9)
    beams = _mid_search(cfg)
    search._keep_running(cfg, beams, _candidates(cfg))
    assert beams.running_sequences[0, :, :3].tolist() == [[2, 0, 0], [2, 2, 0]]
    assert beams.running_beam_scores.tolist() == [[-1.0, -2.0]]
    assert beams.running_beam_indices[0, :, :2].tolist() == [[0, 0], [0, 1]]


@pytest.mark.parametrize("early_stopping", [False, True])
def test_keep_finished_merges_new_hypotheses_by_length_penalised_score(early_stopping):
    cfg = _config(max_new_tokens=9, length_penalty=1.0, early_stopping=early_stopping)
    beams = _mid_search(cfg)
    if early_stopping:
        beams.is_sent_finished[:] = True  # a full input takes no new hypothesis
    search._keep_finished(cfg, beams, _candidates(cfg), 2)
    if early_stopping:
        assert beams.beam_scores.tolist() == [[np.float32(-0.2), NEG]]
        return
    # Both eos candidates finish, scored over two generated tokens: -0.05 and -0.25.
    assert beams.beam_scores.tolist() == [[np.float32(-0.05), np.float32(-0.2)]]
    assert beams.sequences[0, :, :3].tolist() == [[2, 2, 1], [2, 1, EOS]]
    assert beams.is_sent_finished.tolist() == [[True, True]]
    assert beams.beam_indices[0, 0, :2].tolist() == [0, 1]


@pytest.mark.parametrize(
    ("early_stopping", "best_running", "done"),
    [(False, -1.0, True), (False, -0.2, False), ("never", -1.0, False), ("never", -1.9, True)],
)
def test_beams_done_when_no_running_beam_can_win(early_stopping, best_running, done):
    cfg = _config(max_new_tokens=9, length_penalty=1.0, early_stopping=early_stopping)
    beams = _mid_search(cfg)
    beams.beam_scores[:] = [[-0.05, -0.2]]
    beams.is_sent_finished[:] = True
    beams.running_beam_scores[:] = [[best_running, -5.0]]
    # cur_len 3: best_running / 2 generated tokens ("never": / 9, the most there can be) against
    # the worst finished, -0.2.
    assert search._beams_done(cfg, beams, _candidates(cfg), 3) is done


def test_beams_done_when_every_candidate_ends():
    cfg = _config(max_new_tokens=2)
    beams = _mid_search(cfg)
    beams.running_beam_scores[:] = [[-0.1, -5.0]]  # still improvable
    assert search._beams_done(cfg, beams, _candidates(cfg), 3)


def test_returned_sequences_cut_to_the_longest_hypothesis():
    cfg = _config(max_new_tokens=4)
    beams = _mid_search(cfg)
    beams.beam_indices[0, 0, :3] = [0, 1, 0]
    results = search._Results(beams.sequences, beams.beam_indices)
    got = search._returned_sequences(results, 1)
    assert got.tolist() == [beams.sequences[0, 0, :4].tolist()]
    assert search._returned_sequences(results, 2).shape == (2, 4)


class _Runner:
    """Fixed next-token probabilities per step; records what beam search asks of it."""

    def __init__(self, steps: list[list[list[float]]]):
        self.steps = [np.log(np.array(s, np.float32)) for s in steps]
        self.calls: list[tuple] = []

    def start(self) -> np.ndarray:
        return self.steps[0]

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        self.calls.append(("advance", tokens.tolist()))
        return self.steps[len([c for c in self.calls if c[0] == "advance"])]

    def expand(self, n: int) -> None:
        self.calls.append(("expand", n))

    def reorder(self, rows: np.ndarray, *, within_batch: bool = False) -> None:
        self.calls.append(("reorder", rows.tolist(), within_batch))


def test_beam_search_runs_the_prompt_once_and_reorders_the_cache():
    # Step 1: token 0 (0.6) and token 2 (0.3) run on. Step 2 (the last): beam 0 then eos,
    # 0.6 * 0.8 = 0.48, beats beam 1 then token 0, 0.3 * 0.5 = 0.15.
    runner = _Runner([[[0.6, 0.1, 0.3]], [[0.1, 0.8, 0.1], [0.5, 0.25, 0.25]]])
    settings = _settings(max_new_tokens=2)
    got = search.beam_search(runner, np.array([[START]]), settings, ProcessorList())
    assert got.tolist() == [[START, 0, EOS]]
    assert runner.calls == [("expand", 2), ("reorder", [0, 0], True), ("advance", [0, 2])]


class _Bigram:
    """A runner whose next logits depend on each row's last token, so beams reorder."""

    def __init__(self, table: np.ndarray, last: np.ndarray):
        self.table, self.last = table, last

    def start(self) -> np.ndarray:
        return self.table[self.last]

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        self.last = tokens
        return self.table[tokens]

    def expand(self, n: int) -> None:
        self.last = np.repeat(self.last, n)

    def reorder(self, rows: np.ndarray, *, within_batch: bool = False) -> None:
        self.last = self.last[rows]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"no_repeat_ngram_size": 2, "min_new_tokens": 4, "forced_eos_token_id": EOS},
        {"do_sample": True, "top_k": 40},
    ],
)
def test_beam_search_tokens_do_not_depend_on_which_top_k_runs(overrides):
    table = (np.random.default_rng(3).standard_normal((600, 600)) * 3).astype(np.float32)
    prompt = np.array([[START], [5], [9]])
    settings = _settings(num_beams=4, max_new_tokens=10, **overrides)

    def generate(accelerations):
        runner = _Bigram(table, prompt[:, 0])
        processors = build_processors(settings)
        return search.beam_search(
            runner,
            prompt,
            settings,
            processors,
            np.random.default_rng(0),
            accelerations=accelerations,
        )

    bounded = generate(Accelerations())
    np.testing.assert_array_equal(bounded, generate(Accelerations.off()))
    np.testing.assert_array_equal(bounded, generate(Accelerations(topk_slabs=7)))


@pytest.mark.parametrize("masked", [False, True], ids=["open", "all-but-one-masked"])
def test_first_step_takes_beam_zeros_columns_with_the_full_answer(masked):
    """On the first step the other beams score -1e9 plus their log-probs: the shortcut through
    beam 0's columns picks what the full top-k picks, and falls back where beam 0 runs out."""
    cfg = search._beam_config(_settings(num_beams=4), 3, 1)
    cfg = dataclasses.replace(cfg, topk_slabs=SLABS)
    rng = np.random.default_rng(0)
    log_probs = log_softmax(rng.standard_normal((12, 500)).astype(np.float32))
    if masked:  # beam 0 of input 1 keeps one finite candidate: the others come from -1e9
        log_probs[4, 1:] = -np.inf
    scores = np.tile(np.array([0, NEG, NEG, NEG], np.float32), 3)
    flat = (log_probs + scores[:, None]).reshape(3, -1)
    expected = search._topk_by_partition(flat, cfg.beams_to_keep)
    np.testing.assert_array_equal(search._first_step_topk(cfg, 1, flat), expected)
    np.testing.assert_array_equal(search._first_step_topk(cfg, 2, flat), expected)


def test_beam_reorders_move_only_the_rows_that_change_in_the_runners_own_cache():
    from onnxmerge.runtime._runners import SessionSteps
    from onnxmerge.runtime._session import Cache

    rng = np.random.default_rng(3)
    decoder = tuple(rng.standard_normal((6, 2, 3, 4)).astype(np.float32) for _ in range(2))
    encoder = (rng.standard_normal((6, 2, 5, 4)).astype(np.float32),)
    expected = [t.copy() for t in decoder]
    steps = SessionSteps(
        session=None, encoder_inputs={}, prompt=np.zeros((6, 1), np.int64), max_length=8
    )
    steps._cache = Cache(attention_mask=None, decoder=decoder, encoder=encoder)
    for rows in ([1, 0, 2, 2, 5, 4], [0, 0, 0, 3, 3, 3], [2, 0, 1, 3, 4, 5]):  # cycles, copies
        rows = np.array(rows)
        steps.reorder(rows, within_batch=True)
        expected = [t[rows] for t in expected]
        for got, want in zip(steps.cache.decoder, expected, strict=True):
            np.testing.assert_array_equal(got, want)
    assert steps.cache.decoder[0] is decoder[0]  # moved within the arrays, not copied whole
    assert steps.cache.encoder[0] is encoder[0]

    # Arrays the runner cannot write (another holder's) are reordered into new ones.
    frozen = decoder[0].copy()
    frozen.flags.writeable = False
    steps._cache = Cache(attention_mask=None, decoder=(frozen,), encoder=encoder)
    steps.reorder(np.array([1, 0, 2, 3, 4, 5]), within_batch=True)
    np.testing.assert_array_equal(steps.cache.decoder[0], frozen[[1, 0, 2, 3, 4, 5]])
    assert steps.cache.decoder[0] is not frozen

    # One buffer behind two tensors would be moved twice in place: it is reordered into new ones.
    shared = decoder[1].copy()
    steps._cache = Cache(attention_mask=None, decoder=(shared, shared), encoder=encoder)
    rows = np.array([1, 0, 2, 3, 4, 5])
    expected_shared = shared[rows]
    steps.reorder(rows, within_batch=True)
    for got in steps.cache.decoder:
        np.testing.assert_array_equal(got, expected_shared)


@pytest.mark.parametrize("per_input", [False, True], ids=["row per row", "row per input"])
def test_rows_that_stay_move_to_the_front_of_the_runners_own_cache(per_input):
    # A dropped row's copy of the cache would be a second cache while the first goes (and
    # onnxruntime's arena keeps the first step's).
    from onnxmerge.runtime._runners import SessionSteps
    from onnxmerge.runtime._session import Cache

    rng = np.random.default_rng(4)
    beams = 2 if per_input else 1
    decoder = tuple(rng.standard_normal((8, 2, 3, 4)).astype(np.float32) for _ in range(2))
    encoder = tuple(rng.standard_normal((8 // beams, 2, 5, 4)).astype(np.float32) for _ in range(2))
    mask = rng.integers(0, 2, (8 // beams * beams, 5))
    cache = Cache(attention_mask=mask, decoder=decoder, encoder=encoder, per_input=per_input)
    # Beam search keeps whole inputs, its beams reordered within them: any order is safe.
    for rows in ([0, 1, 4, 5, 6, 7], [1, 0, 7, 6], [2, 3]):
        rows = np.array(rows)
        expected = cache.reorder(rows)
        steps = SessionSteps(
            session=None, encoder_inputs={}, prompt=np.zeros((8, 1), np.int64), max_length=8
        )
        steps._cache = Cache(
            attention_mask=mask,
            decoder=tuple(t.copy() for t in decoder),
            encoder=tuple(t.copy() for t in encoder),
            per_input=per_input,
        )
        held = steps.cache.decoder + steps.cache.encoder
        steps.keep(rows)
        got = steps.cache
        for kept, want, before in zip(
            got.decoder + got.encoder, expected.decoder + expected.encoder, held, strict=True
        ):
            np.testing.assert_array_equal(kept, want)
            assert np.shares_memory(kept, before)
        np.testing.assert_array_equal(got.attention_mask, expected.attention_mask)
        assert got.per_input == per_input

    # Arrays the runner cannot write are copied, as before.
    frozen = decoder[0].copy()
    frozen.flags.writeable = False
    steps._cache = Cache(attention_mask=None, decoder=(frozen,), encoder=())
    steps.keep(np.array([3, 1]))
    np.testing.assert_array_equal(steps.cache.decoder[0], frozen[[3, 1]])
    assert not np.shares_memory(steps.cache.decoder[0], frozen)


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.shares_memory(a, b))


@pytest.mark.parametrize("ring", [False, True])
def test_present_buffers_never_hold_a_past_that_the_step_reads_after_writing(ring):
    from onnxmerge.runtime._runners import PresentBuffers

    layers, rows = 3, 2
    buffers = PresentBuffers(6, vocab=5, logits_dtype=np.float32, ring=ring)
    past = [np.zeros((rows, 2, 1, 4), np.float32) for _ in range(2 * layers)]
    for _ in range(5):
        presents = buffers.next(past)
        for i, present in enumerate(presents):
            assert present.shape == past[i].shape[:2] + (past[i].shape[2] + 1, 4)
            assert not any(_overlap(present, other) for other in presents[:i])
            # Layer i's nodes run after layers before it have read their pasts, not before
            # its own and later layers' have: with the ring only those may be overwritten.
            still_read = past[(i // 2) * 2 :] if ring else past
            assert not any(_overlap(present, p) for p in still_read)
        past = presents
    tensors = len(buffers._slots)
    assert tensors == (2 * (layers + 1) if ring else 4 * layers)


def test_present_buffers_give_the_logits_one_array_every_step():
    from onnxmerge.runtime._runners import PresentBuffers

    buffers = PresentBuffers(6, vocab=5, logits_dtype=np.float32)
    first = buffers.logits(3, flat=False)
    assert first.shape == (3, 1, 5) and buffers.logits(3, flat=True).shape == (3, 5)
    assert _overlap(buffers.logits(3, flat=False), first)


def _vm_flags(array: np.ndarray) -> list[str]:
    return mapping_fields(array.ctypes.data)["VmFlags"].split()


@pytest.mark.skipif(not SMAPS.exists(), reason="reads Linux's smaps")
@pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE")
    or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="no transparent huge pages",
)
def test_present_buffers_ask_for_no_huge_pages_and_the_logits_do():
    # A present buffer faults in a few pages at every step; asked for huge pages, each fault
    # could compact memory first: tens of milliseconds more a step at a few hundred rows.
    from onnxmerge.runtime._runners import PresentBuffers

    buffers = PresentBuffers(64, vocab=1 << 20, logits_dtype=np.float32)
    presents = buffers.next([np.zeros((64, 8, 1, 64), np.float32) for _ in range(2)])
    assert all("hg" not in _vm_flags(p) for p in presents)
    assert "hg" in _vm_flags(buffers.logits(4, flat=True))  # written once, read over and over


def test_a_kernel_without_huge_pages_still_maps_arrays(monkeypatch):
    from onnxmerge.runtime._memory import anonymous_array

    class Refusing(mmap.mmap):
        def madvise(self, *args):  # as a kernel without transparent huge pages answers
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", Refusing)
    array = anonymous_array(1 << 20, np.dtype(np.float32))
    array[:] = 1.5
    assert array.shape == (1 << 20,) and float(array.sum()) == 1.5 * (1 << 20)


PAST_READER = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2] past, float[1] k, bool cond) => (float[3] present, float[2] other) {
    shape = Shape(past)
    present = Concat<axis = 0>(past, k)
    other = READER
}
"""
BRANCHES = (
    "If<then_branch = t () => (float[2] x) { x = Neg(past) },"
    " else_branch = e () => (float[1] y) { y = Identity(k) }>(cond)"
)


def _renamed(graph, names: dict[str, str]) -> None:
    """The ONNX text parser takes no dots in names: give the graph the contract's names."""
    for value in [*graph.input, *graph.output]:
        value.name = names.get(value.name, value.name)
    for node in graph.node:
        node.input[:] = [names.get(n, n) for n in node.input]
        node.output[:] = [names.get(n, n) for n in node.output]
        for attribute in node.attribute:
            if attribute.HasField("g"):
                _renamed(attribute.g, names)


def _structure(graph, tmp_path):
    """``graph`` as the runtime reads it (``_wire.graph_structure``)."""
    import onnx

    from onnxmerge._wire import graph_structure

    path = tmp_path / "model.onnx"
    onnx.save(onnx.helper.make_model(graph), path)
    return graph_structure(path)


@pytest.mark.parametrize(
    "reader, dies",
    [("Identity(k)", True), ("Neg(past)", False), (BRANCHES, False)],
    ids=["shape and own present", "another node", "a branch"],
)
def test_pasts_die_by_layer_where_only_their_own_present_reads_them(reader, dies, tmp_path):
    import onnx

    from onnxmerge.runtime._graph_reads import pasts_read_only_into_presents

    graph = onnx.parser.parse_model(PAST_READER.replace("READER", reader)).graph
    past = "past_key_values.0.decoder.key"
    _renamed(graph, {"past": past, "present": "present.0.decoder.key"})
    assert pasts_read_only_into_presents(_structure(graph, tmp_path), [past]) is dies


LAYERED = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[1] p0k, float[1] p0v, float[1] p1k, float[1] p1v, float[1] x)
    => (float[2] q0k, float[2] q0v, float[2] q1k, float[2] q1v) {
    q0k = Concat<axis = 0>(p0k, x)
    q0v = Concat<axis = 0>(p0v, x)
    h = Add(q0k, q0v)
    FIRST
    q1k = Concat<axis = 0>(p1k, y)
    q1v = Concat<axis = 0>(p1v, y)
}
"""


@pytest.mark.parametrize(
    "first, follows",
    [
        ("y = ReduceSum(h)", True),  # layer 1 reads layer 0's output
        ("y = Identity(x)", False),  # layers side by side: any order may run
        ("y = Identity(q0k)", False),  # layer 0's value may be written after layer 1's
    ],
)
def test_presents_follow_layers_where_each_layer_needs_the_one_before(first, follows, tmp_path):
    import onnx

    from onnxmerge.runtime._graph_reads import presents_follow_layers

    graph = onnx.parser.parse_model(LAYERED.replace("FIRST", first)).graph
    names = {f"q{i}{k[0]}": f"present.{i}.decoder.{k}" for i in (0, 1) for k in ("key", "value")}
    _renamed(graph, names)
    assert presents_follow_layers(_structure(graph, tmp_path), list(names.values())) is follows


@pytest.mark.parametrize("writeable", [True, False])
def test_greedy_search_processes_the_runners_logits_in_place_where_it_may(writeable):
    """A copy of every step's [rows, vocab] logits cost an int8 greedy corpus an eighth of its
    time: the processors write over the runner's own array, and copy only one it cannot write."""
    table = (np.random.default_rng(4).standard_normal((40, 40)) * 3).astype(np.float32)
    table[:, EOS] = -50  # no row ends: every step's token is the best one left
    best = np.argmax(table, axis=1)
    handed = []

    class Runner:
        def start(self):
            return self.step(np.array([START, 5]))

        def advance(self, tokens):
            return self.step(tokens)

        def step(self, tokens):
            logits = table[tokens]
            logits.flags.writeable = writeable
            handed.append(logits)
            return logits

    settings = _settings(num_beams=1, max_new_tokens=3, bad_words_ids=[[int(t)] for t in best])
    prompt = np.array([[START], [START]])
    tokens = search.greedy_or_sample(Runner(), prompt, settings, build_processors(settings))
    banned = table.copy()
    banned[:, best] = -np.inf
    previous = np.array([START, 5])
    for step, logits in enumerate(handed):
        np.testing.assert_array_equal(tokens[:, step + 1], np.argmax(banned[previous], axis=1))
        np.testing.assert_array_equal(logits, banned[previous] if writeable else table[previous])
        previous = tokens[:, step + 1]
