"""``onnxmerge translate``: one line in, one line out, in order; a blank line gives a blank line;
a bad line gets an empty line, its own error on stderr and a non-zero exit at the end, and nothing
else is lost or moved. The library under it is tested in test_translate_lines.py."""

from __future__ import annotations

import json
import os
import signal
import stat
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
        b"1_2 3",  # int() would read 12
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
    written = out.read_text().split("\n")  # the blank line 2 is translated: into a blank line
    assert written[:-1] == [
        expected_line(model, good[0]),
        "",
        "",
        "",
        expected_line(model, good[1]),
        "",
        "",
        expected_line(model, good[2]),
    ]
    errors = result.stderr.splitlines()
    assert errors[:4] == [
        "onnxmerge: line 3: --ids takes non-negative integers separated by spaces",
        "onnxmerge: line 4: --ids takes non-negative integers separated by spaces",
        "onnxmerge: line 6: not UTF-8 (byte 1); nothing translated",
        f"onnxmerge: line 7: id {tm.VOCAB + 4} is outside the vocabulary 0..{tm.VOCAB - 1}",
    ]
    assert errors[4] == (
        ERROR_PREFIX + "4 of 8 lines not translated (lines 3, 4, 6, 7); an "
        "empty line stands in for each"
    )
    assert len(errors) == 5


def test_json_reports_every_line_and_needs_an_output_file(model, tmp_path):  # noqa: F811
    source = tmp_path / "ids.txt"
    source.write_text("5 6 7\n\nfive\n8\n")
    out = tmp_path / "out.txt"
    result = run("translate", model.path, source, "--ids", "-o", out, "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 3
    assert report["lines"] == 4 and report["translated"] == 3  # the blank line is one
    message = "--ids takes non-negative integers separated by spaces"
    assert report["errors"] == [{"line": 3, "message": message}]
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


@pytest.mark.parametrize(
    "sent, code, said",
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_signal_ends_batches_at_once_and_leaves_no_output(model, tmp_path, sent, code, said):  # noqa: F811
    source = tmp_path / "ids.txt"
    # Minutes of work: the run is still translating whenever the signal comes (20,000 lines
    # took about a minute, which a loaded machine's wait for the temporary output could reach).
    source.write_text("".join(" ".join(map(str, ids)) + "\n" for ids in id_lines(100_000)))
    out = tmp_path / "out.txt"
    args = ("translate", model.path, source, "--ids", "-o", out, "--max-batch-size", "1")
    # The command as a shell starts it: signals not blocked and not ignored. A child inherits
    # both from the process that starts it, and a test worker that others ran in first may have
    # either (the full suite's CI run twice got a child that never saw the signal).
    as_a_shell_starts_it = (
        "import os, signal, sys\n"
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'onnxmerge', *sys.argv[1:]])\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", as_a_shell_starts_it, *map(str, args), "--parallel-batches", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):  # the temporary output appears as translating starts
            if list(tmp_path.glob(".out.txt.*")) or process.poll() is not None:
                break
            time.sleep(0.1)
        assert process.poll() is None and list(tmp_path.glob(".out.txt.*"))
        time.sleep(0.5)
        process.send_signal(sent)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == code, stderr
    assert stderr.strip().endswith(f"onnxmerge: {said}")
    assert not out.exists() and list(tmp_path.glob(".out.txt.*")) == []


def test_a_missing_source_is_refused(model, tmp_path):  # noqa: F811
    result = run("translate", model.path, tmp_path / "absent.txt", "--ids")
    assert result.returncode == 3 and "absent.txt: no such file" in result.stderr
    folder = run("translate", model.path, tmp_path, "--ids")
    assert folder.returncode == 3 and f"{tmp_path} is a folder" in folder.stderr


def test_a_pipe_is_a_source_and_a_byte_order_mark_is_not_part_of_the_first_line(model):  # noqa: F811
    result = run(
        "translate",
        model.path,
        "/dev/stdin",  # as <(...) and named pipes are: not regular files
        "--ids",
        "--max-new-tokens",
        MAX_NEW,
        stdin=b"\xef\xbb\xbf5 6 7\n5 6 7\n",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [expected_line(model, [5, 6, 7])] * 2


def test_an_output_path_that_cannot_be_written_is_refused_before_the_model_loads(model, tmp_path):  # noqa: F811
    source = tmp_path / "ids.txt"
    source.write_text("5 6 7\n")
    (tmp_path / "folder").mkdir()
    for output, message in [
        (tmp_path / "folder", "is a folder; give a file path"),
        (source / "out.txt", f"{source} is a file, not a folder"),
        (source, "is the input"),
    ]:
        result = run("translate", model.path, source, "--ids", "-o", output, "--overwrite")
        assert result.returncode == 3 and message in result.stderr, result.stderr
        assert "loading" not in result.stderr
    assert source.read_text() == "5 6 7\n"


def test_the_output_gets_the_permissions_a_new_file_gets_or_keeps_those_it_had(model, tmp_path):  # noqa: F811
    source = tmp_path / "ids.txt"
    source.write_text("5 6 7\n")
    fresh = tmp_path / "made" / "here" / "out.txt"  # its folders are made too
    umask = os.umask(0o022)
    try:
        assert run("translate", model.path, source, "--ids", "-o", fresh).returncode == 0
        kept = tmp_path / "kept.txt"
        kept.write_text("old\n")
        kept.chmod(0o640)
        assert (
            run("translate", model.path, source, "--ids", "-o", kept, "--overwrite").returncode == 0
        )
    finally:
        os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640
    assert kept.read_text() == fresh.read_text() != "old\n"


def test_text_lines_translate_with_the_demo_model(demo_export, tmp_path):
    import shutil

    from onnxmerge import Seq2SeqModel, merge_seq2seq
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
    assert lines[0].startswith("onnxmerge: line 3: ")  # the blank line 2 is no error
    assert lines[0].endswith(" tokens, more than the model's 64 positions")
    # 64 decoder positions hold 64 new tokens after the start token, every one but the last fed
    # back; one more is refused before any line runs, not in onnxruntime mid-file.
    demo = Seq2SeqModel(merged)
    ids = np.asarray([[5, 6, 7, 0]])
    assert demo.generate(ids, max_new_tokens=64, min_new_tokens=64).shape == (1, 65)
    out = tmp_path / "en.txt"
    past = run("translate", merged, source, "--max-new-tokens", 65, "-o", out)
    assert past.returncode == 3 and "give max_new_tokens of at most 64" in past.stderr
    assert not out.exists()


def test_a_blank_line_translates_to_a_blank_line(demo_export, tmp_path):
    """Regression: documents separate paragraphs with blank lines, and each was reported as an
    error ("line 3: empty line") with exit code 3."""
    import shutil

    from onnxmerge import merge_seq2seq

    merged = merge_seq2seq(Path(shutil.copytree(demo_export, tmp_path / "export")))
    result = run("translate", merged, stdin=b"un\ndeux\n\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n") == ["one", "two", "", ""]  # 3 lines, the last empty
    assert result.stderr == ""


def test_progress_shows_lines_and_tokens_per_second_on_a_terminal_only(
    model,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    from onnxmerge.cli import main

    source = tmp_path / "ids.txt"
    source.write_text("5 6 7\nfive\n8 9\n")
    args = ["translate", str(model.path), str(source), "--ids", "--max-new-tokens", str(MAX_NEW)]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main([*args, "-o", str(tmp_path / "out.txt")]) == 3
    shown = capsys.readouterr().err
    tokens = sum(len(line.split()) for line in (tmp_path / "out.txt").read_text().splitlines())
    assert "  loading the model ... " in shown
    assert f"\r  2 lines, {tokens} tokens, " in shown and "tokens/s\033[K\n" in shown
    assert "onnxmerge: line 2: --ids takes" in shown
    assert shown.endswith("an empty line stands in for each\n")  # below the status line
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(args) == 3  # the translations go to the terminal: no status line beside them
    assert " tokens/s" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert main([*args, "-o", str(tmp_path / "again.txt")]) == 3
    assert capsys.readouterr().err.splitlines()[0].startswith("onnxmerge: line 2: ")


def test_the_progress_status_line_is_erased_before_a_line_of_its_own(monkeypatch, capsys):
    from onnxmerge.cli import Progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    progress = Progress(quiet=False)
    progress.show("  1 lines", every=0.2)  # too soon after the start: not drawn
    progress.show("  2 lines")
    progress.line("an error")
    progress.show("  3 lines")
    progress.finish()
    assert capsys.readouterr().err == "\r  2 lines\033[K\r\033[Kan error\n\r  3 lines\033[K\n"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    quiet = Progress(quiet=False)
    quiet.show("  1 lines")
    quiet.finish()
    assert capsys.readouterr().err == ""
