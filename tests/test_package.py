"""The package's public names resolve, lazily, to the objects they name."""

from __future__ import annotations

import onnxmerge


def test_every_public_name_resolves():
    for name in onnxmerge.__all__:
        assert getattr(onnxmerge, name) is not None, name


def test_build_generator_at_the_top_level():
    from onnxmerge import build_generator
    from onnxmerge.generator import build_generator as in_its_module

    assert build_generator is in_its_module
