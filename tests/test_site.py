"""The documentation site: it builds with every warning an error, every public name has a
docstring, the API reference renders in a browser, and the README stays a front door."""

from __future__ import annotations

import functools
import http.server
import importlib
import inspect
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import headline

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[1]
# Every module the API reference documents, and the package's own names.
PUBLIC_MODULES = (
    "onnxmerge",
    "onnxmerge.errors",
    "onnxmerge.merge",
    "onnxmerge.quantization",
    "onnxmerge.runtime",
    "onnxmerge.runtime.processors",
    "onnxmerge.runtime.speech",
    "onnxmerge.generator",
    "onnxmerge.generator.audio",
    "onnxmerge.web",
    "onnxmerge.batch",
    "onnxmerge.serve",
    "onnxmerge.translate",
    "onnxmerge.transformers",
    "onnxmerge.contract",
    "onnxmerge.inspection",
    "onnxmerge.settings",
)


def _undocumented(module_name: str) -> list[str]:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:  # an extra that is not installed (serve, transformers)
        pytest.skip(f"{module_name}: {e}")
    missing = []
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # constants are documented where they are defined, in prose
        own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        if not (own or "").strip():
            missing.append(f"{module_name}.{name}")
        if inspect.isclass(obj):
            missing += [
                f"{module_name}.{name}.{attr}"
                for attr, value in vars(obj).items()
                if not attr.startswith("_")
                and (inspect.isfunction(value) or isinstance(value, property))
                and not (value.__doc__ or "").strip()
            ]
    return missing


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_has_a_docstring(module_name: str) -> None:
    assert _undocumented(module_name) == []


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 120
    commands = [line for line in lines[:8] if line.startswith("scripts/setup.sh")]
    assert commands[0].startswith("scripts/setup.sh && .venv/bin/onnxmerge demo")
    assert commands[1].startswith("scripts/setup.sh test && .venv/bin/python -m pytest")


def test_readme_headline_table_is_the_benchmarks_output() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert headline.current(readme) == headline.render(), (
        "run `python benchmarks/headline.py --write`"
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed (pip install 'onnxmerge[docs]')")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(mkdocs.parent)},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_site_builds_with_warnings_as_errors(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "reference" / "merge" / "index.html").is_file()
    assert (site / "search" / "search_index.json").is_file()


@pytest.fixture()
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002
        pass


def test_api_page_shows_merge_seq2seq_signature_in_chromium(served: str, tmp_path: Path) -> None:
    playwright_api = pytest.importorskip("playwright.sync_api")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("chromium is not installed (scripts/setup.sh test installs it)")
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=flags)
        try:
            page = browser.new_page()
            page.goto(f"{served}/reference/merge/")
            signature = page.locator(".doc-signature").first.inner_text()
            page.goto(f"{served}/")
            page.screenshot(path=str(tmp_path / "landing.png"))
        finally:
            browser.close()
    assert "merge_seq2seq(" in signature
    assert "export_dir" in signature and "overwrite" in signature
    assert (tmp_path / "landing.png").stat().st_size > 10_000
