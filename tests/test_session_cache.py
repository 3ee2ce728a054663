"""The session cache: onnxruntime's optimized graph saved once, read by later loads, never stale."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests import textmodels as tm

ort = pytest.importorskip("onnxruntime")

from onnxmerge import Seq2SeqModel, merge_seq2seq  # noqa: E402
from onnxmerge._ort import session_options  # noqa: E402
from onnxmerge.runtime._session_cache import ENTRY_DATA, ENTRY_MODEL  # noqa: E402


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    folder = tm.write_export(tmp_path_factory.mktemp("cache") / "export")
    config = json.loads((folder / "config.json").read_text())
    ids = {"eos_token_id": 0, "pad_token_id": 1, "decoder_start_token_id": 2}
    config.update(ids, is_encoder_decoder=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps(ids))
    return folder


@pytest.fixture(params=[False, True], ids=["one-file", "external-data"])
def merged(request, export, tmp_path) -> Path:
    return merge_seq2seq(export, tmp_path / "model" / "model.onnx", external_data=request.param)


def _generate(model: Seq2SeqModel) -> np.ndarray:
    inputs = tm.sample_inputs(seed=3, batch=3)
    return model.generate(
        input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=5
    )


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if not p.name.startswith("."))


def test_the_second_load_reads_the_saved_graph_and_generates_the_same(merged, tmp_path):
    cache = tmp_path / "cache"
    expected = _generate(Seq2SeqModel(merged))
    first = Seq2SeqModel(merged, session_cache=cache)
    assert first._session.wrote_cache_entry  # the first load optimizes and saves the graph
    (entry,) = _entries(cache)
    assert first._session.opened == entry / ENTRY_MODEL  # and then reads it as later loads do
    assert (entry / ENTRY_MODEL).is_file() and (entry / ENTRY_DATA).stat().st_size > 0
    second = Seq2SeqModel(merged, session_cache=cache)
    assert second._session.opened == entry / ENTRY_MODEL
    assert not second._session.wrote_cache_entry
    assert second.info == first.info  # the contract's metadata travels with the saved graph
    for model in (first, second):
        np.testing.assert_array_equal(_generate(model), expected)


def test_a_changed_model_gets_a_new_entry_in_place_of_the_old(merged, tmp_path):
    cache = tmp_path / "cache"
    Seq2SeqModel(merged, session_cache=cache)
    (old,) = _entries(cache)
    later = os.stat(merged).st_mtime_ns + 10**9
    os.utime(merged, ns=(later, later))  # what rewriting the file in place changes
    model = Seq2SeqModel(merged, session_cache=cache)
    assert model._session.wrote_cache_entry
    (new,) = _entries(cache)
    assert new != old and new.name.rsplit("-", 1)[0] == old.name.rsplit("-", 1)[0]


def test_a_changed_file_beside_the_model_is_not_read_from_an_old_entry(merged, tmp_path):
    cache = tmp_path / "cache"
    Seq2SeqModel(merged, session_cache=cache)
    # external data may have any name: any file beside the model counts
    (merged.parent / "weights.bin").write_bytes(b"new weights")
    assert Seq2SeqModel(merged, session_cache=cache)._session.wrote_cache_entry
    assert not Seq2SeqModel(merged, session_cache=cache)._session.wrote_cache_entry


def test_other_session_settings_get_their_own_entry(merged, tmp_path):
    cache = tmp_path / "cache"
    basic = session_options()
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    Seq2SeqModel(merged, session_cache=cache)
    model = Seq2SeqModel(merged, session_options=basic, session_cache=cache)
    assert model._session.wrote_cache_entry  # a graph optimized otherwise is not reused
    assert len(_entries(cache)) == 2  # and both stay: neither replaces the other
    for options in (None, basic):
        model = Seq2SeqModel(merged, session_options=options, session_cache=cache)
        assert not model._session.wrote_cache_entry


def test_a_saved_graph_is_opened_without_optimizing_it_again(merged, tmp_path):
    Seq2SeqModel(merged, session_cache=tmp_path / "cache")
    model = Seq2SeqModel(merged, session_cache=tmp_path / "cache")
    used = model.session.get_session_options().graph_optimization_level
    assert used == ort.GraphOptimizationLevel.ORT_DISABLE_ALL


def test_data_beside_a_linked_model_is_in_the_key(merged, tmp_path):
    if not (merged.parent / "model.onnx_data").exists():
        pytest.skip("the one-file model has no data file")
    deployed = tmp_path / "deploy"
    deployed.mkdir()
    (deployed / "model.onnx").symlink_to(merged)
    data = deployed / "model.onnx_data"  # onnxruntime reads the data beside the link
    data.write_bytes((merged.parent / "model.onnx_data").read_bytes())
    cache = tmp_path / "cache"
    Seq2SeqModel(deployed / "model.onnx", session_cache=cache)
    later = data.stat().st_mtime_ns + 10**9
    os.utime(data, ns=(later, later))
    assert Seq2SeqModel(deployed / "model.onnx", session_cache=cache)._session.wrote_cache_entry


@pytest.mark.parametrize("damage", ["unreadable model", "model deleted"])
def test_a_broken_entry_is_written_again(merged, tmp_path, damage):
    cache = tmp_path / "cache"
    Seq2SeqModel(merged, session_cache=cache)
    (entry,) = _entries(cache)
    if damage == "model deleted":  # e.g. a delete that stopped halfway
        (entry / ENTRY_MODEL).unlink()
    else:
        (entry / ENTRY_MODEL).write_bytes(b"not a model")
    assert Seq2SeqModel(merged, session_cache=cache)._session.wrote_cache_entry
    assert Seq2SeqModel(merged, session_cache=cache)._session.opened == entry / ENTRY_MODEL


def test_a_cache_that_cannot_be_written_leaves_the_load_as_without_it(merged, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    model = Seq2SeqModel(merged, session_cache=blocked / "cache")
    assert model._session.opened == merged and not model._session.wrote_cache_entry
    np.testing.assert_array_equal(_generate(model), _generate(Seq2SeqModel(merged)))


def test_the_callers_session_options_are_left_as_given(merged, tmp_path):
    options = session_options()
    own = "session.optimized_model_external_initializers_min_size_in_bytes"
    options.add_session_config_entry(own, "4096")
    level = options.graph_optimization_level
    for _ in range(2):  # the writing load, then the reading one
        Seq2SeqModel(merged, session_options=options, session_cache=tmp_path / "cache")
        assert options.optimized_model_filepath == ""
        assert options.graph_optimization_level == level
        assert options.get_session_config_entry(own) == "4096"
