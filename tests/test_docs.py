"""Every code block of README.md and docs/*.md runs here, against the shipped demo model's export.

The conventions (which blocks run, how output is compared, the ``<!-- doctest: ... -->`` markers)
are described in docs/architecture.md, "Examples in the documentation". In short: each page's
blocks run in order in a work folder of their own, where ``opus-mt-fr-en-onnx/`` and
``demo/export/`` are copies of the demo model's optimum export and ``my-marian/`` its PyTorch
folder; console output shown on the page must be what the command prints.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from onnxmerge.cli import ExitCode
from onnxmerge.demo import DEMO_MODEL_DIR

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PYTHON, CONSOLE, SHELL, TEXT = "python", "console", "shell", "text"
LANGUAGES = {"python": PYTHON, "py": PYTHON, "console": CONSOLE, "bash": SHELL, "sh": SHELL,
             "shell": SHELL, "text": TEXT}  # fmt: skip
MARKERS = ("skip", "fresh", "shortened", "signature")

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doctest:\s*(.*?)\s*-->\s*$")
_PROGRESS = re.compile(r"^  \S.* \.\.\. \d+(\.\d+)? s$")
_TIME = re.compile(r"\d+(\.\d+)? s$")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str  # the fence's info string
    text: str
    markers: dict[str, str] = field(default_factory=dict)  # name -> argument

    @property
    def kind(self) -> str | None:
        return LANGUAGES.get(self.language)

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def extract(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the doctest markers on the lines before each."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, language = opening.groups()
        end = i + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence[0] * len(fence))
            and set(lines[end].strip()) == {fence[0]}
        ):
            end += 1
        markers, above = {}, i - 1
        while above >= 0 and (found := _MARKER.match(lines[above])):
            name, _, argument = found.group(1).partition(" ")
            markers[name] = argument.strip()
            above -= 1
        blocks.append(Block(page, i + 1, language, "\n".join(lines[i + 1 : end]), markers))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in extract(page)]
CODE_BLOCKS = [block for block in ALL_BLOCKS if block.kind not in (TEXT, None)]


def problems_of(block: Block) -> list[str]:
    problems = []
    if block.kind is None:
        problems.append(
            f"fence language {block.language!r} is not one of {sorted(LANGUAGES)}: show output "
            "under the command that prints it (console), or use text for a diagram"
        )
    for name, argument in block.markers.items():
        if name not in MARKERS:
            problems.append(f"unknown marker {name!r}; known: {', '.join(MARKERS)}")
        if name == "skip" and not re.fullmatch(r"\(.+\)", argument):
            problems.append("a skip marker needs its reason: <!-- doctest: skip (why) -->")
        if name == "signature" and (block.kind != PYTHON or not argument):
            problems.append("<!-- doctest: signature module.name --> goes on a python block")
    return problems


def test_every_block_has_a_known_language_and_valid_markers() -> None:
    found = [f"{b.where}: {p}" for b in ALL_BLOCKS for p in problems_of(b)]
    assert not found, "\n".join(found)


def test_the_pages_hold_examples_that_run() -> None:
    ran = [b for b in CODE_BLOCKS if "skip" not in b.markers]
    assert len(ran) >= 20 and len(ran) > 2 * (len(CODE_BLOCKS) - len(ran))


def test_the_checks_catch_stale_output_and_signatures(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        '<!-- doctest: shortened -->\n```console\n$ x\n{"a": [1], "b": 2}\n```\n\n'
        "<!-- doctest: signature onnxmerge.merge_seq2seq -->\n```python\n"
        "merge_seq2seq(export_dir, output=None, *, overwrite=True)\n```\n"
    )
    shortened, signature = extract(page)
    compare(
        shortened, "x", ["  loading ... 0.4 s", '{"a": [1]}'], '  loading ... 3.0 s\n{"a": [1, 2]}'
    )
    with pytest.raises(AssertionError, match=r"\.a\[0\]: 3 printed, 1 shown"):
        compare(shortened, "x", ['{"a": [1]}'], '{"a": [3], "b": 2}')
    with pytest.raises(AssertionError, match="progress lines not printed"):
        compare(shortened, "x", ["  saving ... 0.1 s"], "  loading ... 0.1 s")
    with pytest.raises(AssertionError, match="the page shows"):
        compare(shortened, "x", ["tensors: 136 in, 89 out"], "tensors: 136 in, 91 out")
    with pytest.raises(AssertionError) as raised:
        check_signature(signature)
    assert "overwrite: documented default True, real False" in str(raised.value)
    assert "external_data is not documented" in str(raised.value)


# ---------------------------------------------------------------------------------------------
# running a page


def make_materials(root: Path, export: Path) -> Path:
    """What a page's work folder starts with, and a bin folder beside it for the commands."""
    shutil.copytree(export, root / "opus-mt-fr-en-onnx")
    shutil.copytree(export, root / "demo" / "export")
    shutil.copytree(DEMO_MODEL_DIR, root / "my-marian")
    bin_dir = root.parent / f"{root.name}-bin"
    bin_dir.mkdir()
    for name, command in (("onnxmerge", "-m onnxmerge"), ("python", "")):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" {command} "$@"\n')
        script.chmod(0o755)
    return root


@pytest.fixture(scope="session")
def docs_materials(demo_export, tmp_path_factory) -> Path:
    """Made once per session, copied into each page's work folder."""
    return make_materials(tmp_path_factory.mktemp("docs") / "materials", demo_export)


class Page:
    """A page's work folder and Python namespace, kept from one block to the next."""

    def __init__(self, materials: Path, scratch: Path):
        self.materials, self.scratch = materials, scratch
        self.bin = materials.parent / f"{materials.name}-bin"
        self.done = 0  # blocks of the page run so far
        self.folders = 0
        self.fresh()

    def fresh(self) -> None:
        self.folders += 1
        self.work = Path(shutil.copytree(self.materials, self.scratch / f"work{self.folders}"))
        self.namespace: dict = {"__name__": "__doc_example__"}

    def run(self, block: Block) -> None:
        if "fresh" in block.markers:
            self.fresh()
        if "skip" in block.markers:
            return
        if "signature" in block.markers:
            check_signature(block)
        elif block.kind == PYTHON:
            self.run_python(block)
        elif block.kind == CONSOLE:
            self.run_console(block)
        elif block.kind == SHELL:
            result = self.shell(block.text)
            assert result.returncode == 0, (
                f"{block.where}: exit {result.returncode}\n{result.stdout}"
            )

    def run_python(self, block: Block) -> None:
        code = compile(block.text, block.where, "exec")
        cwd = os.getcwd()
        os.chdir(self.work)
        try:
            exec(code, self.namespace)
        finally:
            os.chdir(cwd)

    def shell(self, script: str) -> subprocess.CompletedProcess[str]:
        """``script`` run by bash in the work folder; stdout and stderr in one stream, in order."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="80")
        env["PATH"] = f"{self.bin}{os.pathsep}{env['PATH']}"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return subprocess.run(
            ["bash", "-c", script],
            cwd=self.work,
            env=env,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def run_console(self, block: Block) -> None:
        commands = parse_console(block.text)
        mark = "@@doctest-end-of-command@@"
        script = "".join(
            f"{command}\n__rc=$?; echo; echo {mark} $__rc; (exit $__rc)\n"
            for command, _ in commands
        )
        pieces = self.shell(script).stdout.split(f"\n{mark} ")
        # pieces: output 0, then "exit code i-1\noutput i" for each later command, "exit code n-1\n"
        outputs = [pieces[0], *(piece.partition("\n")[2] for piece in pieces[1:-1])]
        codes = [int(piece.partition("\n")[0]) for piece in pieces[1:]]
        for i, (command, expected) in enumerate(commands):
            shown = i + 1 < len(commands) and commands[i + 1][0] == "echo $?"
            assert codes[i] == 0 or shown, (
                f"{block.where}: `{command}` exited {codes[i]}\n{outputs[i]}"
            )
            compare(block, command, expected, outputs[i])


def parse_console(text: str) -> list[tuple[str, list[str]]]:
    """``$ command`` lines, each with the output lines shown under it."""
    commands: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:].strip(), []))
        elif commands:
            commands[-1][1].append(line)
        elif line.strip():
            raise AssertionError(f"console text before the first `$ ` command: {line!r}")
    return commands


def compare(block: Block, command: str, expected: list[str], actual: str) -> None:
    """Output shown on the page must be the output; progress lines may be left out of the page."""
    expected = _trim(expected)
    if not expected:
        return
    got = _trim(actual.splitlines())
    shown_progress = [_TIME.sub("N s", line) for line in expected if _PROGRESS.match(line)]
    real_progress = iter(_TIME.sub("N s", line) for line in got if _PROGRESS.match(line))
    missing = [line for line in shown_progress if line not in real_progress]
    where = f"{block.where}: `{command}`"
    assert not missing, f"{where}: progress lines not printed: {missing}\n{actual}"
    expected_rest = "\n".join(line for line in expected if not _PROGRESS.match(line))
    got_rest = "\n".join(line for line in got if not _PROGRESS.match(line))
    try:
        expected_json = json.loads(expected_rest)
    except ValueError:
        assert got_rest == expected_rest, (
            f"{where}: printed\n{got_rest}\n\nthe page shows\n{expected_rest}"
        )
        return
    differences = json_differences(
        expected_json, json.loads(got_rest), "shortened" in block.markers
    )
    assert not differences, f"{where}: the JSON printed differs:\n" + "\n".join(differences[:20])


def _trim(lines: list[str]) -> list[str]:
    lines = [line.rstrip() for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def json_differences(expected, actual, shortened: bool, at: str = "") -> list[str]:
    """Where ``actual`` is not ``expected``; ``shortened`` lets objects leave out keys and lists
    their last items."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        found = [f"{at}.{k}: missing" for k in expected if k not in actual]
        if not shortened:
            found += [f"{at}.{k}: not shown" for k in actual if k not in expected]
        for k, v in expected.items():
            if k in actual:
                found += json_differences(v, actual[k], shortened, f"{at}.{k}")
        return found
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) > len(actual) or (len(expected) < len(actual) and not shortened):
            return [f"{at}: {len(actual)} items, {len(expected)} shown"]
        return [
            d
            for i, (e, a) in enumerate(zip(expected, actual, strict=False))
            for d in json_differences(e, a, shortened, f"{at}[{i}]")
        ]
    if expected == actual and type(expected) is type(actual):
        return []
    return [f"{at}: {json.dumps(actual)} printed, {json.dumps(expected)} shown"]


# ---------------------------------------------------------------------------------------------
# signatures


def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise AssertionError(f"cannot import {dotted}")


def check_signature(block: Block) -> None:
    """A documented signature names every parameter, with the real defaults.

    A parameter documented with the default ``...`` stands for inputs passed by name
    (``**kwargs``); a bare ``*`` in the documented signature makes keyword-only checked too.
    """
    target = block.markers["signature"]
    real = inspect.signature(_resolve(target))
    text = block.text[block.text.index("(") :]
    doc = ast.parse(f"def documented{text}:\n    pass").body[0].args
    documented: dict[str, tuple[str, object]] = {}
    positional = doc.posonlyargs + doc.args
    missing = [None] * (len(positional) - len(doc.defaults))
    for arg, default in zip(positional, missing + doc.defaults, strict=True):
        documented[arg.arg] = ("positional", default)
    for arg, default in zip(doc.kwonlyargs, doc.kw_defaults, strict=True):
        documented[arg.arg] = ("keyword", default)
    wrong = []
    takes_named = any(p.kind is p.VAR_KEYWORD for p in real.parameters.values())
    named = {
        name: p for name, p in real.parameters.items()
        if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }  # fmt: skip
    for name, (kind, default) in documented.items():
        given = None if default is None else ast.literal_eval(default)
        if name not in named:
            if not (given is Ellipsis and takes_named):
                wrong.append(f"{name} is documented but {target} has no such parameter")
            continue
        p = named[name]
        if given is not Ellipsis and (p.default is p.empty) != (default is None):
            wrong.append(f"{name}: documented {'with' if default else 'without'} a default")
        elif default is not None and given is not Ellipsis and p.default != given:
            wrong.append(f"{name}: documented default {given!r}, real {p.default!r}")
        if doc.kwonlyargs and (kind == "keyword") != (p.kind is p.KEYWORD_ONLY):
            wrong.append(f"{name}: keyword-only is {p.kind is p.KEYWORD_ONLY} in the code")
    wrong += [f"{name} is not documented" for name in named if name not in documented]
    assert not wrong, f"{block.where}: signature of {target}:\n" + "\n".join(wrong)


# ---------------------------------------------------------------------------------------------
# one test per block, in page order; a block runs the page's earlier blocks first if needed


@pytest.fixture(scope="session")
def pages(docs_materials, tmp_path_factory) -> dict[Path, Page]:
    return {page: Page(docs_materials, tmp_path_factory.mktemp(page.stem)) for page in PAGES}


@pytest.mark.parametrize("block", CODE_BLOCKS, ids=[b.where for b in CODE_BLOCKS])
def test_block(block: Block, pages: dict[Path, Page]) -> None:
    page = pages[block.page]
    blocks = [b for b in CODE_BLOCKS if b.page == block.page]
    index = blocks.index(block)
    if page.done > index:  # rerun from the top, as on a fresh read
        page.done = 0
        page.fresh()
    while page.done < index:
        earlier = blocks[page.done]
        page.done += 1
        try:
            page.run(earlier)
        except Exception as error:
            raise AssertionError(f"an earlier block of the page failed: {earlier.where}") from error
    page.done += 1
    if "skip" in block.markers:
        pytest.skip(f"{block.where}: {block.markers['skip'][1:-1]}")
    page.run(block)


# ---------------------------------------------------------------------------------------------
# the exit codes


def test_exit_code_table_in_cli_md_is_the_code() -> None:
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (.+?) \|$", section, flags=re.MULTILINE)
    assert {int(code): meaning for code, meaning in rows} == {
        int(code): code.meaning for code in ExitCode
    }


# ---------------------------------------------------------------------------------------------
# python -m tests.test_docs PAGE...: write what the console examples print into the pages


def write_outputs(page: Path, materials: Path, scratch: Path) -> None:
    """Replace the output shown under each command of the page's console blocks by the real one.

    Commands shown without output, and blocks marked ``shortened`` or ``skip``, are left as they
    are; progress lines are written only under commands that showed some.
    """
    state = Page(materials, scratch)
    rewritten: dict[int, list[str]] = {}
    for block in [b for b in CODE_BLOCKS if b.page == page]:
        if block.kind != CONSOLE or "skip" in block.markers:
            state.run(block)
            continue
        if "shortened" in block.markers:  # for its effects; its output is edited by hand
            state.shell("\n".join(command for command, _ in parse_console(block.text)))
            continue
        if "fresh" in block.markers:
            state.fresh()
        body, code = [], 0
        for command, shown in parse_console(block.text):
            result = state.shell(command)
            out = _trim(result.stdout.splitlines())
            if not any(_PROGRESS.match(line) for line in shown):
                out = [line for line in out if not _PROGRESS.match(line)]
            if command == "echo $?":
                out = [str(code)]
            body += [f"$ {command}", *(out if _trim(shown) else [])]
            code = result.returncode
        rewritten[block.line] = body
    lines = page.read_text(encoding="utf-8").splitlines()
    for line, body in sorted(rewritten.items(), reverse=True):  # last first: lines stay valid
        end = line
        while not _FENCE.match(lines[end]):
            end += 1
        lines[line:end] = body
    page.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    import tempfile

    from tests.zoo import demo_export

    with tempfile.TemporaryDirectory() as tmp:
        materials = make_materials(Path(tmp) / "materials", demo_export())
        for arg in sys.argv[1:]:
            write_outputs(Path(arg).resolve(), materials, Path(tempfile.mkdtemp(dir=tmp)))
