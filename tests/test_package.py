"""The package's public names resolve, lazily, to the objects they name."""

from __future__ import annotations

import importlib
import re

import pytest

import onnxmerge
from onnxmerge.errors import OnnxMergeError

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
    ("onnxmerge.testing.hub", "hub_repository"),
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
