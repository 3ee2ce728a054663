"""Session-wide access to the tiny model zoo of onnxmerge/testing/zoo.py and to the demo model's
export."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from onnxmerge.testing.zoo import ARCHITECTURES, TinyExport

# Tests that build models with torch and optimum; `pytest -m "not export"` leaves them out.
EXPORT_FIXTURES = {"tiny_export", "demo_export"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if EXPORT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.export)


@pytest.fixture(scope="session")
def tiny_export() -> Callable[..., TinyExport]:
    """``tiny_export(arch, variant="default")``: a cached optimum export of a tiny model.

    Skips the requesting test when torch or optimum are not installed.
    """
    pytest.importorskip("torch", reason="building test models needs torch")
    pytest.importorskip("transformers", reason="building test models needs transformers")
    pytest.importorskip("optimum.exporters.onnx", reason="exporting test models needs optimum-onnx")
    from onnxmerge.testing import zoo

    return functools.cache(zoo.tiny_export)


@pytest.fixture(params=ARCHITECTURES)
def arch(request: pytest.FixtureRequest) -> str:
    """Every architecture of the zoo, one test per architecture."""
    return request.param


@pytest.fixture(scope="session")
def demo_export() -> Path:
    """An optimum export of the shipped demo model, with its tokenizer, cached on disk."""
    pytest.importorskip("optimum.exporters.onnx", reason="exporting the demo model needs optimum")
    from onnxmerge.testing import zoo

    return zoo.demo_export()
