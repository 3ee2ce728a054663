"""One Seq2SeqModel shared by threads gives each caller the tokens a serial call gives."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

THREADS = 8
CALLS_PER_THREAD = 6


@pytest.fixture(scope="module")
def shared_model(tiny_export, tmp_path_factory):
    import onnxmerge

    export = tiny_export("marian")
    out = onnxmerge.merge_seq2seq(export.onnx_dir, tmp_path_factory.mktemp("threads") / "m.onnx")
    return onnxmerge.Seq2SeqModel(out), export


def test_eight_threads_get_the_tokens_of_serial_calls(shared_model):
    from tests import zoo

    model, export = shared_model
    # Different inputs, batch sizes and searches, so a mixed-up cache shows in the tokens.
    jobs = []
    for i in range(THREADS * CALLS_PER_THREAD):
        inputs = zoo.sample_encoder_inputs(export, batch=1 + i % 3, seq=4 + i % 5, seed=i)
        jobs.append((inputs, {"num_beams": 1 + (i % 2) * 2, "max_new_tokens": 6 + i % 4}))
    serial = [model.generate(**inputs, **kwargs) for inputs, kwargs in jobs]
    with ThreadPoolExecutor(THREADS) as pool:
        threaded = list(pool.map(lambda job: model.generate(**job[0], **job[1]), jobs))
    for expected, actual in zip(serial, threaded, strict=True):
        np.testing.assert_array_equal(actual, expected)
    assert len({s.tobytes() for s in serial}) > THREADS  # the jobs really differ
