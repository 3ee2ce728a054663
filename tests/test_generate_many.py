"""``generate_many``: length-sorted batches whose every result is what ``generate`` gives alone,
in input order (torch-free: the small export of tests/textmodels.py)."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from onnxmerge._ort import cores
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
    "count, most, parallel, sizes",
    [
        (300, 64, 2, [50] * 6),  # cut full: 64, 64, 64, 64, 44, the last alone on one thread
        (1000, 64, 2, [63] * 8 + [62] * 8),
        (65, 64, 3, [22, 22, 21]),
        (2, 64, 4, [1, 1]),  # no empty batches: one input each at most
        (7, 3, 1, [3, 3, 1]),  # one at a time: cut full, as CTranslate2 does
    ],
)
def test_batches_at_once_get_a_multiple_of_them_evenly_sized(count, most, parallel, sizes):
    lengths = list(range(count))
    batches = corpus.cut_batches(lengths, [()] * count, most, "examples", parallel)
    assert [len(b) for b in batches] == sizes
    # Still longest first, every input once.
    assert [i for b in batches for i in b] == sorted(lengths, reverse=True)


def test_even_batches_keep_inputs_of_other_shapes_apart():
    batches = corpus.cut_batches([2, 3, 2, 5, 5], ["a", "b", "a", "b", "a"], 8, "examples", 2)
    assert batches == [[4, 0], [2], [3], [1]]
    # By tokens the budget already decides each batch: the cut stays as it is.
    lengths = [3, 10, 4, 4, 9, 2, 30]
    assert corpus.cut_batches(lengths, [()] * 7, 20, "tokens", 2) == [[6], [1, 4], [2, 3, 0, 5]]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_batch_size": 0}, "max_batch_size must be at least 1"),
        ({"max_batch_size": 2.5}, "max_batch_size must be an integer"),
        ({"batch_type": "sentences"}, "batch_type must be one of 'examples', 'tokens'"),
        ({"parallel_batches": 0}, "parallel_batches must be at least 1"),
        ({"parallel_batches": True}, "parallel_batches must be an integer"),
        ({"decoder_input_ids": np.ones((1, 1), np.int64)}, "prompt per input is not supported"),
    ],
)
def test_bad_options_are_generation_errors_at_the_call(model, options, message):  # noqa: F811
    read = []

    def inputs():
        read.append(True)
        yield [5, 6]

    with pytest.raises(GenerationError, match=message):
        model.generate_many(inputs(), **options)  # not at the first next(): nothing is read
    assert not read


class _Words:
    """A tokenizer of words ``w<id>``, enough for ``translate``."""

    def __call__(self, texts):
        return {"input_ids": [[int(w[1:]) for w in text.split()] for text in texts]}

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(f"w{i}" for i in row) for row in ids]


def test_translate_checks_its_options_without_texts_too(model):  # noqa: F811
    with pytest.raises(GenerationError, match="max_batch_size must be at least 1"):
        model.translate([], tokenizer=_Words(), max_batch_size=0)
    with pytest.raises(GenerationError, match="num_beams"):
        model.translate([], tokenizer=_Words(), num_beams=0)
    assert model.translate([], tokenizer=_Words()) == []
    assert model.translate(["w5 w6"], tokenizer=_Words(), max_new_tokens=2) == [
        model.translate("w5 w6", tokenizer=_Words(), max_new_tokens=2)
    ]


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


def test_encoder_side_processors_see_each_input_without_its_batch_padding(model, monkeypatch):  # noqa: F811
    from onnxmerge.runtime import _model

    seen: list[list[list[int]]] = []
    build = _model.build_processors

    def recording(settings, encoder_input_ids=None):
        seen.append([list(map(int, row)) for row in encoder_input_ids])
        return build(settings, encoder_input_ids)

    monkeypatch.setattr(_model, "build_processors", recording)
    inputs = sources(8, seed=2)
    settings = {"max_new_tokens": MAX_NEW, "encoder_no_repeat_ngram_size": 2}
    got = list(model.generate_many(inputs, max_batch_size=4, **settings))
    fed = sorted(map(tuple, (row for batch in seen for row in batch)))
    assert fed == sorted(tuple(map(int, source)) for source in inputs)  # no pad ids among them
    monkeypatch.setattr(_model, "build_processors", build)
    for source, result in zip(inputs, got, strict=True):
        np.testing.assert_array_equal(result, alone(model, source, **settings))


def test_an_iterator_that_refills_one_array_gives_each_input_its_own_result(model):  # noqa: F811
    inputs = sources(6, seed=4)
    buffer = np.empty(9, np.int64)

    def refilled():
        for source in inputs:
            view = buffer[: source.size]
            view[:] = source
            yield view

    got = list(model.generate_many(refilled(), max_new_tokens=MAX_NEW))
    for source, result in zip(inputs, got, strict=True):
        np.testing.assert_array_equal(result, alone(model, source, max_new_tokens=MAX_NEW))


@pytest.fixture
def eight_positions(model):  # noqa: F811
    """The same file, its config giving 8 positions to the encoder and the decoder, as a
    Marian config's max_position_embeddings does."""
    from onnxmerge import Seq2SeqModel

    limited = Seq2SeqModel(model.path)
    limited.config["max_position_embeddings"] = 8
    return limited


def test_a_source_past_the_positions_is_a_generation_error_naming_its_input(eight_positions):
    too_long = list(range(3, 12))
    message = "input_ids has 9 tokens, more than the model's 8 positions"
    with pytest.raises(GenerationError, match=f"input 1: {message}"):
        list(eight_positions.generate_many([[5, 6], too_long, [7]], max_new_tokens=2))
    with pytest.raises(GenerationError, match=message):
        eight_positions.generate(np.asarray([too_long]), max_new_tokens=2)
    assert eight_positions.generate(np.asarray([too_long[:8]]), max_new_tokens=2).shape[0] == 1


def test_a_length_past_the_decoder_positions_is_refused_before_anything_runs(eight_positions):
    # Every token but the last is fed back: 8 positions hold max_length 9.
    assert eight_positions.resolve_settings(max_new_tokens=8).max_length == 9
    with pytest.raises(GenerationError, match="give max_new_tokens of at most 8"):
        eight_positions.generate_many([[5, 6]], max_new_tokens=9)
    with pytest.raises(GenerationError, match="past the decoder's 8 positions"):
        eight_positions.generate(np.asarray([[5, 6]]), max_length=10)


@pytest.fixture(scope="module")
def one_thread_model(model):  # noqa: F811
    """The same file with one intra-op thread a batch, as batches at once should have it."""
    from onnxmerge import Seq2SeqModel

    return Seq2SeqModel(model.path, threads=1)


@pytest.mark.parametrize(
    "settings",
    [{"max_new_tokens": MAX_NEW}, {"max_new_tokens": MAX_NEW, "num_beams": 3}],
    ids=["greedy", "beam3"],
)
def test_batches_at_once_give_each_input_its_result_in_order(one_thread_model, settings, caplog):
    inputs = sources(50, seed=2)  # max_batch_size 2: windows of 32 inputs, batches across them
    one_at_a_time = list(one_thread_model.generate_many(inputs, max_batch_size=2, **settings))
    with caplog.at_level(logging.WARNING):
        at_once = one_thread_model.generate_many(
            iter(inputs), max_batch_size=2, parallel_batches=2, **settings
        )
        got = list(at_once)
    assert len(got) == 50
    for one, other in zip(got, one_at_a_time, strict=True):
        np.testing.assert_array_equal(one, other)
    if cores() >= 2:  # the batches' own two threads and no pool: within two cores
        assert not caplog.records


def test_batches_at_once_over_every_core_each_are_warned_about(model, caplog):  # noqa: F811
    with caplog.at_level(logging.WARNING, logger="onnxmerge.runtime._model"):
        list(model.generate_many(sources(3), parallel_batches=2, max_new_tokens=2))
    assert f"they compete; open the model with threads={max(1, cores() - 1)}" in caplog.text


def test_more_batches_at_once_than_cores_are_told_to_run_fewer(one_thread_model, caplog):
    with caplog.at_level(logging.WARNING, logger="onnxmerge.runtime._model"):
        list(one_thread_model.generate_many(sources(3), parallel_batches=cores() + 1))
    assert f"they compete; run at most {cores()} batches at once" in caplog.text


def test_threads_are_a_positive_count_without_session_options_beside_them(model):  # noqa: F811
    import onnxruntime as ort

    from onnxmerge import Seq2SeqModel

    with pytest.raises(GenerationError, match="threads must be a positive integer"):
        Seq2SeqModel(model.path, threads=0)
    with pytest.raises(GenerationError, match="not both"):
        Seq2SeqModel(model.path, threads=1, session_options=ort.SessionOptions())
    one = Seq2SeqModel(model.path, threads=np.int64(1))
    assert one.session.get_session_options().intra_op_num_threads == 1


def test_batches_at_once_yield_the_windows_before_a_bad_input(one_thread_model):
    inputs: list = sources(40, seed=3)
    inputs[35] = []  # in the third window of 16 (max_batch_size 1)
    results = one_thread_model.generate_many(
        inputs, max_batch_size=1, parallel_batches=2, max_new_tokens=2
    )
    got = []
    with pytest.raises(GenerationError, match="input 35"):
        for result in results:
            got.append(result)
    assert len(got) == 32


@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "beam3"])
def test_rows_that_ended_leave_the_batch_and_the_tokens_stay(model, monkeypatch, beams):  # noqa: F811
    from onnxmerge.runtime import Accelerations, Seq2SeqModel

    keeping = Seq2SeqModel(model.path, accelerations=Accelerations(drop_finished=False))
    rows: dict[str, list[int]] = {"dropping": [], "keeping": []}
    for name, runtime in (("dropping", model), ("keeping", keeping)):
        session, noted = runtime._session, rows[name]

        def noting(tokens, cache, *args, step=session.next_step, noted=noted, **kwargs):
            noted.append(len(tokens))
            return step(tokens, cache, *args, **kwargs)

        monkeypatch.setattr(session, "next_step", noting)
    batch = corpus.pad_right([np.asarray(s)[None] for s in sources(16, seed=4)], PAD)
    settings = {"max_new_tokens": 12, "num_beams": beams}
    mask = (batch != PAD).astype(np.int64)
    dropped = model.generate(batch, attention_mask=mask, **settings)
    kept = keeping.generate(batch, attention_mask=mask, **settings)
    np.testing.assert_array_equal(dropped, kept)
    shrinking, full = rows["dropping"], rows["keeping"]
    assert len(set(full)) == 1 and full[0] == 16 * beams
    assert shrinking[-1] < full[0] and sum(shrinking) < sum(full[: len(shrinking)])


def _rows_of_each_step(model, monkeypatch) -> list[int]:  # noqa: F811
    """The rows of every cached step ``model`` runs from now on."""
    session = model._session
    rows: list[int] = []

    def noting(tokens, cache, *args, step=session.next_step, **kwargs):
        rows.append(len(tokens))
        return step(tokens, cache, *args, **kwargs)

    monkeypatch.setattr(session, "next_step", noting)
    return rows


@pytest.mark.parametrize(
    "settings",
    [
        {"min_new_tokens": 8, "max_new_tokens": 8},
        {"min_new_tokens": 8, "max_new_tokens": 8, "num_return_sequences": 2, "do_sample": True},
        {"min_new_tokens": 8, "max_new_tokens": 8, "num_beams": 3},
    ],
    ids=["greedy", "sampling-two-each", "beam3"],
)
def test_abandoned_inputs_leave_their_running_batch_at_the_next_step(model, monkeypatch, settings):  # noqa: F811
    inputs = sources(6, seed=2)
    rows = _rows_of_each_step(model, monkeypatch)
    asked: list[int] = []

    def abandoned(index: int) -> bool:
        asked.append(index)
        return index in (1, 4) and len(rows) >= 2  # inputs 1 and 4 leave after two steps

    seeded = {"seed": 3} if settings.get("do_sample") else {}
    got = list(
        model.generate_many(inputs, max_batch_size=6, abandoned=abandoned, **settings, **seeded)
    )
    assert sorted(set(asked)) == list(range(6))  # asked by index in inputs, not by batch row
    per_input = settings.get("num_beams", settings.get("num_return_sequences", 1))
    # Sampling keeps every row (its draws are the batch's): the rows of inputs left run on.
    staying = 6 if settings.get("do_sample") else 4
    assert rows[:2] == [6 * per_input] * 2 and set(rows[2:]) == {staying * per_input}
    rows.clear()
    full = list(model.generate_many(inputs, max_batch_size=6, **settings, **seeded))
    for index, (cut, whole) in enumerate(zip(got, full, strict=True)):
        if index in (1, 4):  # cut short: what they had generated when they left, then padding
            generated = (cut[:, 1:] != PAD).sum(axis=1)
            assert generated.max() < 8
            for row, whole_row, length in zip(cut, whole, generated + 1, strict=True):
                np.testing.assert_array_equal(row[:length], whole_row[:length])
        elif not settings.get("do_sample"):  # draws depend on the batch, ids on nothing else
            np.testing.assert_array_equal(cut, whole)


@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "beam3"])
def test_a_batch_whose_rows_cannot_leave_ends_once_every_input_is_abandoned(
    model,  # noqa: F811
    monkeypatch,
    beams,
):
    steps = _rows_of_each_step(model, monkeypatch)
    # The encoder-side n-gram ban pairs its state with the batch's rows: none may leave.
    settings = {"min_new_tokens": 8, "max_new_tokens": 8, "num_beams": beams}
    settings["encoder_no_repeat_ngram_size"] = 3
    got = list(model.generate_many(sources(4), abandoned=lambda index: len(steps) >= 3, **settings))
    assert len(got) == 4 and steps == [4 * beams] * 3


def test_abandoned_must_be_a_function(model):  # noqa: F811
    with pytest.raises(GenerationError, match="abandoned must be a function"):
        model.generate_many([[5, 6]], abandoned=True)


@pytest.mark.parametrize(
    "settings",
    [{"max_new_tokens": MAX_NEW}, {"max_new_tokens": MAX_NEW, "num_beams": 3}],
    ids=["greedy", "beam3"],
)
def test_generate_many_on_the_plain_runtime_gives_the_same_tokens(model, settings):  # noqa: F811
    from onnxmerge.runtime import Accelerations, Seq2SeqModel

    plain = Seq2SeqModel(model.path, accelerations=Accelerations.off())
    inputs = sources(20, seed=6)
    accelerated = list(model.generate_many(inputs, max_batch_size=4, **settings))
    for one, other in zip(
        plain.generate_many(inputs, max_batch_size=4, **settings), accelerated, strict=True
    ):
        np.testing.assert_array_equal(one, other)


def test_leaving_batches_at_once_early_ends_the_running_batches_at_their_next_step(
    one_thread_model, monkeypatch
):
    session = one_thread_model._session
    step = session.next_step
    after_close: list[str] = []
    closing = threading.Event()

    def slow_step(*args, **kwargs):
        if closing.is_set():
            after_close.append(threading.current_thread().name)
        time.sleep(0.002)  # batches still mid-search when the caller leaves
        return step(*args, **kwargs)

    monkeypatch.setattr(session, "next_step", slow_step)
    results = one_thread_model.generate_many(
        sources(40), max_batch_size=1, parallel_batches=2, min_new_tokens=40, max_new_tokens=40
    )
    assert next(results).shape == (1, 41)  # the first window of 16 done; the second running
    closing.set()
    results.close()
    # Each running batch ends at its next step (a batch started just then may take one); left
    # to run, each would take its remaining dozens.
    assert len(after_close) <= 4


def test_ordered_map_sets_stop_only_when_its_caller_leaves_early():
    stop = threading.Event()
    assert list(corpus.ordered_map(lambda i: i, range(9), 2, stop)) == list(range(9))
    assert not stop.is_set()

    def watches(i: int) -> int:
        if i and not stop.wait(5):
            raise AssertionError("stop was not set")
        raise corpus.Stopped

    results = corpus.ordered_map(lambda i: i if i == 0 else watches(i), range(9), 2, stop)
    assert next(results) == 0
    results.close()  # returns once the running calls saw stop, not after their 5 s
    assert stop.is_set()


def test_ordered_map_keeps_the_order_of_calls_that_end_out_of_order():
    delays = [0.03, 0.0, 0.02, 0.0, 0.01, 0.0, 0.0]

    def slow(i: int) -> int:
        time.sleep(delays[i])
        return i * 10

    threads: set[str] = set()

    def noted(i: int) -> int:
        threads.add(threading.current_thread().name)
        return slow(i)

    assert list(corpus.ordered_map(noted, range(7), 3)) == [i * 10 for i in range(7)]
    assert len(threads) > 1 and threading.current_thread().name not in threads
    assert list(corpus.ordered_map(slow, range(7), 1)) == [i * 10 for i in range(7)]


def test_ordered_map_raises_a_calls_error_when_its_result_is_due():
    def fails_at_two(i: int) -> int:
        if i == 2:
            raise ValueError("two")
        return i

    results = corpus.ordered_map(fails_at_two, range(20), 2)  # more than are queued at once
    assert [next(results), next(results)] == [0, 1]
    with pytest.raises(ValueError, match="two"):
        next(results)
    assert list(results) == []  # nothing after it, not the results of later calls in its place


def test_ordered_map_yields_what_came_before_an_error_of_the_items():
    def items():
        yield from range(3)
        raise GenerationError("input 3: bad")

    results = corpus.ordered_map(lambda i: i, items(), 4)
    assert [next(results) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(GenerationError, match="input 3"):
        next(results)


def test_ordered_map_closed_early_drops_the_calls_not_yet_started():
    started: list[int] = []
    gate = threading.Event()

    def waits(i: int) -> int:
        started.append(i)
        gate.wait(5)
        return i

    results = corpus.ordered_map(waits, range(100), 2)
    threading.Timer(0.05, gate.set).start()
    assert next(results) == 0
    results.close()  # the queued calls are cancelled; those running end
    assert len(started) <= 6
