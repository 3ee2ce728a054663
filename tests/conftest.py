"""Session-wide access to the tiny model zoo of tests/zoo.py and to the demo model's export;
Chromium for the page tests; every test leaves the process's signal handling as it found it."""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.zoo import ARCHITECTURES, TinyExport

# Tests that build models with torch and optimum; `pytest -m "not export"` leaves them out.
EXPORT_FIXTURES = {"tiny_export", "demo_export"}
# The page's npm packages (`npm ci --ignore-scripts` in tests/web, done by scripts/setup.sh test).
WEB_NODE_MODULES = Path(__file__).parent / "web" / "node_modules"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if EXPORT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.export)


@pytest.fixture(autouse=True)
def signal_handling_kept() -> Iterator[None]:
    """Fails a test that leaves SIGINT's or SIGTERM's handler, or the blocked signals, changed
    (and puts them back): later tests of the worker would inherit it, and the children they
    start too (a child of a process that ignores SIGINT ignores it)."""
    before = _signal_handling()
    yield
    after = _signal_handling()
    if after != before:
        handlers, blocked = before
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        pytest.fail(f"the test changed this process's signal handling: {before} -> {after}")


def _signal_handling() -> tuple[dict[signal.Signals, object], set[signal.Signals]]:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    return handlers, signal.pthread_sigmask(signal.SIG_BLOCK, [])


@pytest.fixture(scope="session")
def tiny_export() -> Callable[..., TinyExport]:
    """``tiny_export(arch, variant="default")``: a cached optimum export of a tiny model.

    Skips the requesting test when torch or optimum are not installed.
    """
    pytest.importorskip("torch", reason="building test models needs torch")
    pytest.importorskip("transformers", reason="building test models needs transformers")
    pytest.importorskip("optimum.exporters.onnx", reason="exporting test models needs optimum-onnx")
    from tests import zoo

    return functools.cache(zoo.tiny_export)


@pytest.fixture(params=ARCHITECTURES)
def arch(request: pytest.FixtureRequest) -> str:
    """Every architecture of the zoo, one test per architecture."""
    return request.param


@pytest.fixture(scope="session")
def demo_export() -> Path:
    """An optimum export of the shipped demo model, with its tokenizer, cached on disk."""
    pytest.importorskip("optimum.exporters.onnx", reason="exporting the demo model needs optimum")
    from tests import zoo

    return zoo.demo_export()


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium through playwright, with the page's npm packages of tests/web; skips
    when either is missing."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the page is driven by playwright")
    from tests.browser import launch_chromium

    with sync_api.sync_playwright() as playwright:
        launched, missing = launch_chromium(playwright, WEB_NODE_MODULES)
        if launched is None:
            pytest.skip(missing)
        yield launched
        launched.close()
