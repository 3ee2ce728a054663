"""Session-wide access to the tiny model zoo of onnxmerge/testing/zoo.py and to the demo model's
export."""

from __future__ import annotations

import functools
import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from onnxmerge.demo import DEMO_MODEL_DIR
from onnxmerge.testing.exports import export_onnx, package_versions, staging
from onnxmerge.testing.zoo import ARCHITECTURES, TinyExport, cache_root

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


def _demo_export_key() -> str:
    digest = hashlib.sha256()
    for path in sorted(DEMO_MODEL_DIR.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    versions = package_versions(("torch", "transformers", "optimum", "optimum-onnx", "onnx"))
    for name, version in versions.items():
        digest.update(f"{name}={version}".encode())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def demo_export() -> Path:
    """An optimum export of the shipped demo model, with its tokenizer, cached on disk."""
    pytest.importorskip("optimum.exporters.onnx", reason="exporting the demo model needs optimum")
    return cached_demo_export()


def cached_demo_export() -> Path:
    entry = cache_root() / f"demo--{_demo_export_key()}"
    if entry.is_dir():
        return entry
    with staging(entry) as folder:
        export_onnx(DEMO_MODEL_DIR, folder, "text2text-generation-with-past")
        for path in DEMO_MODEL_DIR.iterdir():
            if path.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy2(path, folder / path.name)
    return entry
