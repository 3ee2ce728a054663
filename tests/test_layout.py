"""The package's layout: module names and lint, checked like any other outcome."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import onnxmerge

PACKAGE = Path(onnxmerge.__file__).parent
REPO = PACKAGE.parent


def test_no_module_shadows_the_standard_library() -> None:
    names = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*/")}
    assert not names & set(sys.stdlib_module_names)


def test_the_tree_is_ruff_clean() -> None:
    if not (REPO / "pyproject.toml").exists():
        pytest.skip("not a source checkout")
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e .[test])")
    result = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def _tool(name: str) -> str:
    if not (REPO / "pyproject.toml").exists():
        pytest.skip("not a source checkout")
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        pytest.skip(f"{name} is not installed (pip install -e .[test])")
    return path


def test_the_tree_is_ruff_formatted() -> None:
    result = subprocess.run(
        [_tool("ruff"), "format", "--check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


# mypy is clean on onnxmerge/ (configured in pyproject.toml); this test holds it there.
MYPY_ERRORS_LEFT = 0


def test_mypy_finds_no_more_errors_than_are_left() -> None:
    mypy = _tool("mypy")
    result = subprocess.run([mypy, "onnxmerge"], cwd=REPO, capture_output=True, text=True)
    errors = [line for line in result.stdout.splitlines() if ": error: " in line]
    assert len(errors) <= MYPY_ERRORS_LEFT, "\n".join(errors)
