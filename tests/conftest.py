"""Session-wide access to the tiny model zoo in tests/models.py and to the demo model's export."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from onnxmerge.demo import DEMO_MODEL_DIR
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


def _demo_export_key() -> str:
    digest = hashlib.sha256()
    for path in sorted(DEMO_MODEL_DIR.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    for name in ("torch", "transformers", "optimum", "optimum-onnx", "onnx"):
        try:
            digest.update(f"{name}={importlib.metadata.version(name)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{name}=absent".encode())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def demo_export() -> Path:
    """An optimum export of the shipped demo model, with its tokenizer, cached on disk."""
    pytest.importorskip("optimum.exporters.onnx", reason="exporting the demo model needs optimum")
    return cached_demo_export()


def cached_demo_export() -> Path:
    from tests.models import cache_root

    entry = cache_root() / f"demo--{_demo_export_key()}"
    if entry.is_dir():
        return entry
    from optimum.exporters.onnx import main_export

    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo.", dir=entry.parent))
    try:
        main_export(
            os.fspath(DEMO_MODEL_DIR), output=staging, task="text2text-generation-with-past",
            do_validation=False,
        )
        for path in DEMO_MODEL_DIR.iterdir():
            if path.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy2(path, staging / path.name)
        try:
            os.replace(staging, entry)
        except OSError:
            if not entry.is_dir():  # another process cached the same export first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return entry
