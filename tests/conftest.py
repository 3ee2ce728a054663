"""Session-wide access to the tiny model zoo in tests/models.py."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from tests.models import ARCHITECTURES, TinyExport


@pytest.fixture(scope="session")
def tiny_export() -> Callable[..., TinyExport]:
    """``tiny_export(arch, variant="default")``: a cached optimum export of a tiny model.

    Skips the requesting test when torch or optimum are not installed.
    """
    pytest.importorskip("torch", reason="building test models needs torch")
    pytest.importorskip("transformers", reason="building test models needs transformers")
    pytest.importorskip("optimum.exporters.onnx", reason="exporting test models needs optimum-onnx")
    from tests import models

    return functools.cache(models.tiny_export)


@pytest.fixture(params=ARCHITECTURES)
def arch(request: pytest.FixtureRequest) -> str:
    """Every architecture of the zoo, one test per architecture."""
    return request.param
