"""``onnxmerge translate``: one line in, one line out, in order; a bad line gets an empty line, its
own error on stderr and a non-zero exit at the end, and nothing else is lost or moved."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import textmodels as tm
from tests.test_light_generation import MAX_NEW, export, model  # noqa: F401 - fixtures

pytest.importorskip("onnxruntime")

ERROR_PREFIX = "onnxmerge: error: "


def run(*args: object, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "onnxmerge", *map(str, args)],
        capture_output=True,
        input=stdin,
        timeout=600,
    )
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


def id_lines(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, tm.VOCAB, size=int(rng.integers(1, 10))).tolist() for _ in range(count)]


def expected_line(model, ids: list[int]) -> str:  # noqa: F811 - the fixture's name
    alone = model.generate(np.asarray([ids]), max_new_tokens=MAX_NEW)
    return " ".join(map(str, alone[0, 1:].tolist()))


@pytest.mark.parametrize(
    "batching",
    [
        ["--max-batch-size", "3"],
        ["--max-batch-size", "16", "--batch-type", "tokens"],
        ["--max-batch-size", "1", "--parallel-batches", "2", "--threads", "2"],
    ],
)
def test_ids_come_out_in_input_order_as_generate_gives_them(model, tmp_path, batching):  # noqa: F811
    lines = id_lines(14)
    source = tmp_path / "ids.txt"
    source.write_text("".join(" ".join(map(str, ids)) + "\n" for ids in lines))
    result = run("translate", model.path, source, "--ids", "--max-new-tokens", MAX_NEW, *batching)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [expected_line(model, ids) for ids in lines]
    assert result.stderr == ""  # no progress display off a terminal


@pytest.mark.parametrize("at_once", [[], ["--max-batch-size", "1", "--parallel-batches", "2"]])
def test_bad_lines_get_an_empty_line_and_their_own_error(model, tmp_path, at_once):  # noqa: F811
    good = id_lines(3, seed=1)
    raw = [
        " ".join(map(str, good[0])).encode(),
        b"",
        b"7 eight 9",
        " ".join(map(str, good[1])).encode(),
        b"\xff\xfe 5",
        f"5 {tm.VOCAB + 4}".encode(),
        " ".join(map(str, good[2])).encode() + b"\r",  # a Windows line end is not part of it
    ]
    out = tmp_path / "out.txt"
    result = run(
        "translate",
        model.path,
        "-",
        "-o",
        out,
        "--ids",
        "--max-new-tokens",
        MAX_NEW,
        *at_once,
        stdin=b"\n".join(raw) + b"\n",
    )
    assert result.returncode == 3, result.stderr
    written = out.read_text().split("\n")
    assert written[:-1] == [
        expected_line(model, good[0]),
        "",
        "",
        expected_line(model, good[1]),
        "",
        "",
        expected_line(model, good[2]),
    ]
    errors = result.stderr.splitlines()
    assert errors[:4] == [
        "onnxmerge: line 2: empty line",
        "onnxmerge: line 3: --ids takes integers separated by spaces",
        "onnxmerge: line 5: not UTF-8 (byte 1); nothing translated",
        f"onnxmerge: line 6: id {tm.VOCAB + 4} is outside the vocabulary 0..{tm.VOCAB - 1}",
    ]
    assert errors[4] == (
        ERROR_PREFIX + "4 of 7 lines not translated (lines 2, 3, 5, 6); an "
        "empty line stands in for each"
    )
    assert len(errors) == 5


def test_json_reports_every_line_and_needs_an_output_file(model, tmp_path):  # noqa: F811
    source = tmp_path / "ids.txt"
    source.write_text("5 6 7\n\n8\n")
    out = tmp_path / "out.txt"
    result = run("translate", model.path, source, "--ids", "-o", out, "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 3
    assert report["lines"] == 3 and report["translated"] == 2
    assert report["errors"] == [{"line": 2, "message": "empty line"}]
    assert report["tokens"] == sum(len(line.split()) for line in out.read_text().splitlines())
    usage = run("translate", model.path, source, "--ids", "--json")
    assert usage.returncode == 2 and "--json needs -o OUT" in usage.stderr


def test_an_existing_output_needs_overwrite_and_stays_as_it_was(model, tmp_path):  # noqa: F811
    source = tmp_path / "ids.txt"
    source.write_text("5 6 7\n")
    out = tmp_path / "out.txt"
    out.write_text("keep me\n")
    refused = run("translate", model.path, source, "--ids", "-o", out)
    assert refused.returncode == 3 and "--overwrite" in refused.stderr
    assert out.read_text() == "keep me\n"
    overwrite = ("--overwrite", "--max-new-tokens", MAX_NEW)
    assert run("translate", model.path, source, "--ids", "-o", out, *overwrite).returncode == 0
    assert out.read_text() == expected_line(model, [5, 6, 7]) + "\n"
    assert list(tmp_path.glob(".out.txt.*")) == []  # no temporary file left behind


def test_ctrl_c_ends_batches_at_once_and_leaves_no_output(model, tmp_path):  # noqa: F811
    source = tmp_path / "ids.txt"
    source.write_text("".join(" ".join(map(str, ids)) + "\n" for ids in id_lines(20000)))
    out = tmp_path / "out.txt"
    args = ("translate", model.path, source, "--ids", "-o", out, "--max-batch-size", "1")
    process = subprocess.Popen(
        [sys.executable, "-m", "onnxmerge", *map(str, args), "--parallel-batches", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):  # the temporary output appears as translating starts
            if list(tmp_path.glob(".out.txt.*")) or process.poll() is not None:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert stderr.strip().endswith("onnxmerge: interrupted")
    assert not out.exists() and list(tmp_path.glob(".out.txt.*")) == []


def test_a_missing_source_is_refused(model, tmp_path):  # noqa: F811
    result = run("translate", model.path, tmp_path / "absent.txt", "--ids")
    assert result.returncode == 3 and "absent.txt: no such file" in result.stderr


def test_text_lines_translate_with_the_demo_model(demo_export, tmp_path):
    import shutil

    from onnxmerge import merge_seq2seq
    from onnxmerge.demo import english_number, french_number

    folder = Path(shutil.copytree(demo_export, tmp_path / "export"))
    merged = merge_seq2seq(folder)
    numbers = [243, 97, 71]
    long_line = " ".join(["mille"] * 80)  # more tokens than the model's 64 positions
    source = tmp_path / "fr.txt"
    source.write_text(
        "\n".join([french_number(numbers[0]), "", long_line, *map(french_number, numbers[1:])])
        + "\n"
    )
    result = run("translate", merged, source, "--batch-type", "tokens", "--max-batch-size", "20")
    assert result.returncode == 3, result.stderr
    assert result.stdout.splitlines() == [
        english_number(numbers[0]),
        "",
        "",
        *map(english_number, numbers[1:]),
    ]
    lines = result.stderr.splitlines()
    assert lines[0] == "onnxmerge: line 2: empty line"
    assert lines[1].startswith("onnxmerge: line 3: ")
    assert lines[1].endswith(" tokens, more than the model's 64 positions")


def test_progress_shows_lines_and_tokens_per_second_on_a_terminal_only(monkeypatch, capsys):
    from onnxmerge import cli

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    progress = cli._LineProgress(quiet=False)
    progress.drawn -= 1  # as if the last drawing were a second ago
    progress(7)
    progress(5)
    progress.finish()
    shown = capsys.readouterr().err
    assert "\r  1 lines, 7 tokens, " in shown
    assert "\r  2 lines, 12 tokens, " in shown and "tokens/s" in shown
    assert shown.endswith("\n")  # the finished line stays, the next output starts below it
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    quiet = cli._LineProgress(quiet=False)
    quiet(3)
    quiet.finish()
    assert capsys.readouterr().err == ""
