"""Hub repositories laid out for transformers.js: configs at the root, models under onnx/, one
suffix per dtype (onnxmerge.export_layout), through the Python API and the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from onnxmerge import (
    ExportFolderError,
    InvalidMergedModelError,
    OnnxMergeError,
    contract,
    export_layout,
    merge_every_dtype,
    merge_seq2seq,
    merge_seq2seq_with_report,
    model_io,
)
from onnxmerge.cli import ExitCode, main
from tests import textmodels as tm
from tests.hub import MODEL_FILES, hub_repository

TJS_FILES = MODEL_FILES


@pytest.fixture()
def tiny_repo(tmp_path) -> Path:
    """The ONNX-text test model laid out for transformers.js, fp32 and an fp16-named copy."""
    export = tm.write_export(tmp_path / "export", layout="merged_only")
    (export / "generation_config.json").write_text('{"decoder_start_token_id": 0}')
    return hub_repository(export, tmp_path / "repo", ("fp32", "fp16"))


# ---------------------------------------------------------------- resolving the layout


def test_a_root_resolves_to_its_onnx_folder_and_its_own_configs(tiny_repo) -> None:
    layout = export_layout.resolve(tiny_repo)
    assert layout.model_dir == tiny_repo / "onnx"
    assert layout.config_dir == tiny_repo
    assert layout.dtype == "fp32" and layout.present == ("fp32", "fp16")
    assert {p.name for p in layout.files} == set(TJS_FILES)
    fp16 = export_layout.resolve(tiny_repo, "fp16")
    assert {p.name for p in fp16.files} == {
        "encoder_model_fp16.onnx",
        "decoder_model_merged_fp16.onnx",
    }


def test_the_onnx_folder_itself_takes_the_configs_from_the_root(tiny_repo) -> None:
    layout = export_layout.resolve(tiny_repo / "onnx", "fp16")
    assert layout.model_dir == tiny_repo / "onnx" and layout.config_dir == tiny_repo


def test_a_missing_dtype_is_refused_with_the_dtypes_present(tiny_repo) -> None:
    with pytest.raises(
        ExportFolderError, match=r"no q4 model files.*fp32 .*fp16 .*one of fp32, fp16"
    ):
        merge_seq2seq(tiny_repo, dtype="q4")
    with pytest.raises(ExportFolderError, match="unknown dtype 'q3'"):
        merge_seq2seq(tiny_repo, dtype="q3")
    assert not list(tiny_repo.glob("model*.onnx"))


def test_without_fp32_files_the_default_names_the_dtypes_present(tiny_repo) -> None:
    for name in TJS_FILES:
        (tiny_repo / "onnx" / name).unlink()
    with pytest.raises(ExportFolderError, match="no fp32 model files.*fp16"):
        merge_seq2seq(tiny_repo)


def test_suffixed_names_are_parsed_longest_part_first() -> None:
    assert export_layout.part_and_dtype(Path("decoder_model_merged_q4f16.onnx")) == (
        "decoder_model_merged",
        "q4f16",
    )
    assert export_layout.part_and_dtype(Path("decoder_model_quantized.onnx")) == (
        "decoder_model",
        "q8",
    )
    assert export_layout.part_and_dtype(Path("decoder_model.onnx_data")) is None
    assert export_layout.part_and_dtype(Path("model.onnx")) is None
    assert export_layout.part_and_dtype(Path("encoder_model_int3.onnx")) is None


# ---------------------------------------------------------------- merging


def test_a_root_merges_with_its_configs_and_writes_beside_them(tiny_repo) -> None:
    result = merge_seq2seq_with_report(tiny_repo)
    assert result.path == tiny_repo / "model.onnx"
    assert result.dtype == "fp32" and result.config_dir == tiny_repo
    assert {f.path for f in result.inputs} == {tiny_repo / "onnx" / n for n in TJS_FILES}
    model = pytest.importorskip("onnx").load(result.path, load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta[contract.META_CONFIG]) == json.loads(
        (tiny_repo / "config.json").read_text()
    )
    assert json.loads(meta[contract.META_SOURCES])["dtype"] == "fp32"


def test_every_dtype_is_merged_into_its_own_file(tiny_repo) -> None:
    results = merge_every_dtype(tiny_repo)
    assert [r.path.name for r in results] == ["model.onnx", "model_fp16.onnx"]
    assert [r.dtype for r in results] == ["fp32", "fp16"]
    assert results[1].inputs[0].path.name.endswith("_fp16.onnx")
    # The fp16 files are copies of the fp32 ones here: the same model, but the record differs.
    assert results[0].output_bytes == pytest.approx(results[1].output_bytes, abs=64)


def test_a_failed_dtype_leaves_none_of_the_files(tiny_repo) -> None:
    (tiny_repo / "onnx" / "decoder_model_merged_fp16.onnx").write_bytes(b"not a model")
    with pytest.raises(OnnxMergeError):
        merge_every_dtype(tiny_repo)
    assert not list(tiny_repo.glob("model*.onnx"))


def test_a_flat_folder_without_config_merges_on_the_model_s_own_sizes(tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    folder = tm.write_export(tmp_path / "onnx", layout="merged_only", config=False)
    result = merge_seq2seq_with_report(folder)
    assert result.config_dir == folder and result.dtype == "fp32"
    from onnxmerge.samples import token_counts
    from onnxmerge.verify import verify

    counts = token_counts(result.path)
    assert counts == {"input_ids": tm.VOCAB, "decoder_input_ids": tm.VOCAB}
    assert verify(result.path, folder).ok


# ---------------------------------------------------------------- the command line


def test_the_cli_says_which_dtype_it_merged_and_which_others_there_are(tiny_repo, capsys) -> None:
    assert main(["merge", str(tiny_repo / "onnx")]) == ExitCode.OK
    out = capsys.readouterr().out
    assert f"dtype fp32 (no suffix) from {tiny_repo / 'onnx'}; configs from {tiny_repo}" in out
    assert "also present: fp16" in out
    assert "decoder_model_merged.onnx" in out and "_fp16" not in out.split("also present")[0]
    assert main(["merge", str(tiny_repo), "--dtype", "fp16", "--json"]) == ExitCode.OK
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "fp16" and report["path"] == str(tiny_repo / "model_fp16.onnx")
    assert {Path(f["path"]).name for f in report["inputs"]} == {
        "encoder_model_fp16.onnx",
        "decoder_model_merged_fp16.onnx",
    }


def test_the_cli_refuses_a_missing_dtype_in_one_line(tiny_repo, capsys) -> None:
    assert main(["merge", str(tiny_repo), "--dtype", "bnb4"]) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert "no bnb4 model files" in err and "fp32, fp16" in err
    with pytest.raises(SystemExit) as usage:
        main(["merge", str(tiny_repo), "--dtype", "all", "-o", "x.onnx"])
    assert usage.value.code == ExitCode.USAGE


def test_the_cli_merges_every_dtype(tiny_repo, capsys) -> None:
    assert main(["merge", str(tiny_repo), "--dtype", "all", "--json"]) == ExitCode.OK
    reports = json.loads(capsys.readouterr().out)
    assert [r["dtype"] for r in reports] == ["fp32", "fp16"]
    assert (tiny_repo / "model.onnx").is_file() and (tiny_repo / "model_fp16.onnx").is_file()


def test_batch_finds_the_models_under_onnx(tiny_repo) -> None:
    from onnxmerge.batch._sources import EXPORT, kind_of

    assert kind_of(tiny_repo) == EXPORT
    assert kind_of(tiny_repo / "onnx") == EXPORT


# ---------------------------------------------------------------- web after merge


def test_the_merge_record_tells_a_current_merge_from_a_stale_one(tiny_repo) -> None:
    merged = merge_seq2seq(tiny_repo)
    layout = export_layout.resolve(tiny_repo)
    recorded = model_io.read_metadata(merged).get(contract.META_SOURCES)
    assert export_layout.is_merge_of(recorded, layout)
    assert not export_layout.is_merge_of(recorded, export_layout.resolve(tiny_repo, "fp16"))
    config = json.loads((tiny_repo / "config.json").read_text())
    (tiny_repo / "config.json").write_text(json.dumps({**config, "note": "changed"}))
    assert not export_layout.is_merge_of(recorded, layout)


# ---------------------------------------------------------------- the demo model, q8 too


@pytest.fixture(scope="module")
def demo_repo(demo_export, tmp_path_factory) -> Path:
    pytest.importorskip("onnxruntime.quantization")
    return hub_repository(demo_export, tmp_path_factory.mktemp("hub") / "repo")


def test_the_demo_model_merges_fp32_and_q8_and_generates_what_its_files_do(demo_repo) -> None:
    ort = pytest.importorskip("onnxruntime")
    from onnxmerge import Seq2SeqModel

    results = merge_every_dtype(demo_repo, overwrite=True)
    assert [r.dtype for r in results] == ["fp32", "q8"]
    ids = np.array([[33, 29, 56, 2, 24, 0]], np.int64)
    mask = np.ones_like(ids)
    for result in results:
        assert result.path == demo_repo / export_layout.output_name(result.dtype)
        ours = Seq2SeqModel(result.path).generate(input_ids=ids, attention_mask=mask)
        suffix = export_layout.DTYPE_SUFFIXES[result.dtype]
        theirs = _greedy_with_files(ort, demo_repo / "onnx", suffix, ids, mask, ours.shape[1] - 1)
        assert ours.tolist() == theirs
    # The q8 file holds the q8 weights: smaller, and verified against the q8 files.
    from onnxmerge.verify import verify

    assert results[1].output_bytes < 0.7 * results[0].output_bytes
    assert verify(results[1].path, demo_repo).ok


def _greedy_with_files(ort, folder: Path, suffix: str, ids, mask, steps: int) -> list[list[int]]:
    """Greedy search as transformers.js runs it: the encoder, then the merged decoder a step at
    a time with its own cache."""
    config = json.loads((folder.parent / "config.json").read_text())
    encoder = ort.InferenceSession(folder / f"encoder_model{suffix}.onnx")
    decoder = ort.InferenceSession(folder / f"decoder_model_merged{suffix}.onnx")
    hidden = encoder.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    tokens = [config["decoder_start_token_id"]]
    past: dict[str, np.ndarray] = {}
    for info in decoder.get_inputs():
        if info.name.startswith("past_key_values"):
            heads, dim = info.shape[1], info.shape[3]
            past[info.name] = np.zeros((1, heads, 0, dim), np.float32)
    for step in range(steps):
        feed = {
            "input_ids": np.array([[tokens[-1]]], np.int64),
            "encoder_attention_mask": mask,
            "encoder_hidden_states": hidden,
            "use_cache_branch": np.array([step > 0]),
            **past,
        }
        names = [o.name for o in decoder.get_outputs()]
        out = dict(zip(names, decoder.run(None, feed), strict=True))
        tokens.append(int(out["logits"][0, -1].argmax()))
        for name, value in out.items():
            if name.startswith("present"):
                key = name.replace("present", "past_key_values")
                if step == 0 or ".decoder." in name:
                    past[key] = value
        if tokens[-1] == config["eos_token_id"]:
            break
    return [tokens]


def test_the_demo_files_without_any_config_merge_and_verify(demo_export, tmp_path) -> None:
    """Regression: without config.json the output check fed ids up to 97 to the demo model's
    85-row embedding (``indices element out of data bounds, idx=89``) and refused it."""
    pytest.importorskip("onnxruntime")
    from onnxmerge.samples import token_counts
    from onnxmerge.verify import verify

    folder = tmp_path / "models"
    folder.mkdir()
    for name in TJS_FILES:
        shutil.copy(demo_export / name, folder / name)
    merged = merge_seq2seq(folder)
    vocab = json.loads((demo_export / "config.json").read_text())["vocab_size"]
    assert token_counts(merged) == {"input_ids": vocab, "decoder_input_ids": vocab}
    assert verify(merged, folder).ok


def test_the_demo_repository_root_makes_a_site_with_its_tokenizer(demo_repo, tmp_path) -> None:
    from onnxmerge.web import build_site

    steps: list[str] = []
    site = build_site(demo_repo, tmp_path / "site", dtype="q8", progress=steps.append)
    assert (site / "tokenizer.json").read_bytes() == (demo_repo / "tokenizer.json").read_bytes()
    assert (site / "generator.onnx").stat().st_size > 0
    assert any("merg" in s for s in steps)


def test_web_after_merge_uses_the_merged_file_or_merges_afresh(demo_export, tmp_path) -> None:
    from onnxmerge.web import build_site

    folder = Path(shutil.copytree(demo_export, tmp_path / "export"))
    merged = merge_seq2seq(folder)
    steps: list[str] = []
    build_site(folder, tmp_path / "site", progress=steps.append)
    assert f"using {merged}, the merge of these files" in steps
    # The generation config changes: the merged file is not the merge of the folder any more.
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "max_length": 7}))
    before = merged.read_bytes()
    steps.clear()
    site = build_site(folder, tmp_path / "site2", progress=steps.append)
    assert any("not the merge of these files" in s for s in steps)
    assert merged.read_bytes() == before  # the folder's file is left alone
    assert json.loads((site / "site.json").read_text())["max_new_tokens"] == 6
    with pytest.raises(InvalidMergedModelError, match="already a merged model"):
        merge_seq2seq(folder, tmp_path / "again.onnx")  # merge itself still refuses it


def test_batch_converts_a_hub_repository_in_the_dtype_asked_for(demo_repo, tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    from onnxmerge.batch import CONVERTED, convert_many

    [result] = convert_many([demo_repo], tmp_path / "zoo", jobs=0, dtype="q8")
    assert result.status == CONVERTED, result.error
    folder = tmp_path / "zoo" / result.name
    assert (folder / "tokenizer.json").read_bytes() == (demo_repo / "tokenizer.json").read_bytes()
    recorded = json.loads(model_io.read_metadata(folder / "model.onnx")[contract.META_SOURCES])
    assert recorded["dtype"] == "q8"
