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
