"""The package's public names resolve, lazily, to the objects they name; the wheel holds the
package and nothing of the tests."""

from __future__ import annotations

import importlib
import importlib.machinery
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import onnxmerge
from onnxmerge.errors import OnnxMergeError

REPO = Path(__file__).resolve().parents[1]

# The import paths the documentation gives; a module that moves keeps a re-export here.
DOCUMENTED = [
    ("onnxmerge.runtime", "Seq2SeqModel"),
    ("onnxmerge.generator", "build_generator"),
    ("onnxmerge.web", "build_site"),
    ("onnxmerge.batch", "convert_many"),
    ("onnxmerge.contract", "read_contract"),
    ("onnxmerge.settings", "GENERATE_KEYWORDS"),
    ("onnxmerge.runtime.processors", "build_processors"),
    ("onnxmerge.merge", "merge_seq2seq"),
    ("onnxmerge.quantization", "quantize"),
    ("onnxmerge.generator.audio", "build_features"),
    ("onnxmerge.translate", "translate_lines"),
]


def test_every_public_name_resolves():
    """Each name is onnxmerge's own object of that name (an error: one of the hierarchy)."""
    for name in onnxmerge.__all__:
        value = getattr(onnxmerge, name)
        if name == "__version__":
            assert re.fullmatch(r"\d+\.\d+\.\d+\S*", value), value
            continue
        assert value.__name__ == name, name
        assert value.__module__.startswith("onnxmerge."), (name, value.__module__)
        if name.endswith("Error"):
            assert issubclass(value, OnnxMergeError), name
    assert sorted(onnxmerge.__all__) == sorted(set(onnxmerge.__all__))


@pytest.mark.parametrize(("module", "name"), DOCUMENTED, ids=[m for m, _ in DOCUMENTED])
def test_documented_import_paths_resolve(module, name):
    value = getattr(importlib.import_module(module), name)  # AttributeError where it moved
    assert getattr(value, "__module__", module).startswith("onnxmerge."), value


def test_build_generator_at_the_top_level():
    from onnxmerge import build_generator
    from onnxmerge.generator import build_generator as in_its_module

    assert build_generator is in_its_module


@pytest.mark.parametrize("module", sorted({m for m, _ in DOCUMENTED}))
def test_documented_modules_say_what_they_export(module):
    """Each module the documentation imports from lists its public names, and each resolves."""
    loaded = importlib.import_module(module)
    exported = getattr(loaded, "__all__", None)
    assert exported, f"{module} has no __all__"
    missing = [name for name in exported if not hasattr(loaded, name)]
    assert not missing, (module, missing)
    assert len(exported) == len(set(exported)), module


def test_the_package_holds_no_test_tooling():
    """The pyproject's package pattern finds onnxmerge and its subpackages only."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    from setuptools import find_packages

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    setuptools_config = config["tool"]["setuptools"]
    packages = find_packages(REPO, **setuptools_config["packages"]["find"])
    assert "onnxmerge" in packages and "onnxmerge.runtime" in packages, packages
    assert [p for p in packages if p.split(".")[0] != "onnxmerge"] == []
    assert "onnxmerge.testing" not in packages
    data = [
        pattern for patterns in setuptools_config["package-data"].values() for pattern in patterns
    ]
    assert not [pattern for pattern in data if "testing" in pattern or "tests" in pattern], data
    # Asked of the package's own folders: an editable install of another checkout answers
    # importlib.util.find_spec from there. A leftover folder (an old __pycache__) would be found.
    found = importlib.machinery.PathFinder.find_spec("onnxmerge.testing", onnxmerge.__path__)
    assert found is None, "remove onnxmerge/testing/"


@pytest.mark.slow
def test_the_wheel_holds_the_package_and_no_tests(tmp_path):
    """A wheel built from a copy of the checkout (offline, a few seconds) lists onnxmerge only."""
    try:  # metadata, not find_spec("pip"): that makes setuptools' distutils shim warn
        metadata.version("pip"), metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        pytest.skip("building the wheel offline needs pip and setuptools in this environment")
    source = tmp_path / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", ".cache", "node_modules", "__pycache__", "*.egg-info", "build",
            "dist", "out",
        ),
    )  # fmt: skip
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", str(source), "--wheel-dir", str(tmp_path / "wheel")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-4000:]
    (wheel,) = (tmp_path / "wheel").glob("onnxmerge-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"onnxmerge", wheel.name.split("-py")[0] + ".dist-info"}, tops
    assert not [name for name in names if name.startswith("onnxmerge/testing/")]
    assert "onnxmerge/py.typed" in names and "onnxmerge/runtime/__init__.py" in names
    assert any(name.startswith("onnxmerge/web/assets/") for name in names)
    assert any(name.startswith("onnxmerge/demo/model/") for name in names)
