"""The translation site: what build_site writes and refuses, and the page in Chromium.

The browser tests serve a site built from the shipped demo model on 127.0.0.1, load it in Debian's
chromium through Playwright and check that the page's tokens equal the Python runtime's. The
page's npm packages come from tests/web (``npm ci --ignore-scripts``, done by
``scripts/setup.sh test``), linked into the site as its node_modules.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import onnxmerge
from onnxmerge import cli
from onnxmerge.demo import LARGEST_NUMBER, french_number, is_held_out
from onnxmerge.errors import InvalidMergedModelError, OnnxMergeError, RefusedOutputError
from onnxmerge.web import build_site
from tests.browser import load_page, serve, strip_pad

REPO_ROOT = Path(__file__).resolve().parents[1]
WEB_DIR = Path(__file__).parent / "web"
NODE_MODULES = WEB_DIR / "node_modules"
# The docs' picture of the page; the test rewrites it only when asked, never as a side effect.
SCREENSHOT = REPO_ROOT / "docs" / "img" / "web.png"
UPDATE_SCREENSHOT = "ONNXMERGE_UPDATE_SCREENSHOT"
HELD_OUT = [n for n in range(LARGEST_NUMBER + 1) if is_held_out(n)]


def _tokenizer_folder(folder: Path) -> Path:
    from onnxmerge.demo import DEMO_MODEL_DIR

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(DEMO_MODEL_DIR / name, folder / name)
    return folder


# ---------------------------------------------------------------------------------------------
# build_site without a browser


def test_site_pins_the_packages_the_browser_test_installs() -> None:
    from importlib import resources

    site = json.loads((resources.files("onnxmerge.web") / "assets" / "package.json").read_text())
    tested = json.loads((WEB_DIR / "package.json").read_text())
    assert site["dependencies"] == tested["dependencies"]
    lock = json.loads((WEB_DIR / "package-lock.json").read_text())
    for name, version in site["dependencies"].items():
        assert lock["packages"][f"node_modules/{name}"]["version"] == version


def test_refuses_a_folder_that_is_not_empty(tmp_path) -> None:
    source = _tokenizer_folder(tmp_path / "src") / "model.onnx"
    source.write_bytes(b"")
    site = tmp_path / "site"
    site.mkdir()
    (site / "keep.txt").write_text("mine")
    with pytest.raises(RefusedOutputError, match="not empty.*overwrite"):
        build_site(source, site)
    assert [p.name for p in site.iterdir()] == ["keep.txt"]


def test_refuses_an_output_that_holds_the_source(tmp_path) -> None:
    folder = _tokenizer_folder(tmp_path / "export")
    with pytest.raises(RefusedOutputError, match="holds the input"):
        build_site(folder, tmp_path, overwrite=True)
    assert (folder / "tokenizer.json").is_file()


def test_refuses_a_source_without_tokenizer_json(tmp_path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(OnnxMergeError, match=r"no tokenizer\.json in .*--tokenizer"):
        build_site(tmp_path / "model.onnx", tmp_path / "site")
    assert not (tmp_path / "site").exists()


def test_a_failed_build_leaves_no_site_and_no_staging(tmp_path) -> None:
    source = _tokenizer_folder(tmp_path / "src") / "model.onnx"
    source.write_bytes(b"not a model")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(InvalidMergedModelError, match="not a readable ONNX model"):
        build_site(source, out / "site")
    assert list(out.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# sites of the demo model


@pytest.fixture(scope="module")
def demo_merged(demo_export, tmp_path_factory) -> Path:
    from onnxmerge import merge_seq2seq

    folder = _tokenizer_folder(tmp_path_factory.mktemp("demo-merged"))
    return merge_seq2seq(demo_export, folder / "model.onnx")


def _quantized(demo_merged: Path) -> Path:
    out = demo_merged.parent / "model_int8.onnx"
    if not out.exists():
        onnxmerge.quantize(demo_merged, out, weights="int8")
    return out


SITE_FILES = {
    "index.html",
    "translate.js",
    "page.js",
    "page.css",
    "package.json",
    "site.json",
    "generator.onnx",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def demo_site(demo_export, tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("sites") / "fp32"
    code = cli.main(["web", os.fspath(demo_export), "-o", os.fspath(site), "--json",
                     "--example", "deux cent quarante-trois"])  # fmt: skip
    assert code == cli.ExitCode.OK
    return site


def test_cli_writes_the_site_files(demo_site, demo_export) -> None:
    assert {p.name for p in demo_site.iterdir()} == SITE_FILES
    settings = json.loads((demo_site / "site.json").read_text())
    assert settings["max_new_tokens"] == 31  # generation_config max_length 32, minus the start
    assert settings["pad_token_id"] == 84
    assert settings["examples"] == ["deux cent quarante-trois"]
    assert (demo_site / "tokenizer.json").read_bytes() == (
        demo_export / "tokenizer.json"
    ).read_bytes()


def test_overwrite_replaces_a_site_from_a_generator_file(demo_site, tmp_path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "old.txt").write_text("old")
    written = build_site(demo_site / "generator.onnx", site, overwrite=True)
    assert written == site and {p.name for p in site.iterdir()} == SITE_FILES
    assert written.report.files == {p.name: p.stat().st_size for p in site.iterdir()}
    assert not written.report.audio
    assert (site / "generator.onnx").read_bytes() == (demo_site / "generator.onnx").read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["site"]  # no staging or old folder left


def test_an_unknown_precision_leaves_nothing_behind(tmp_path) -> None:
    # Refused before the source (which does not exist) is looked for.
    with pytest.raises(ValueError, match="not a precision") as refused:
        build_site(tmp_path / "missing.onnx", tmp_path / "site", weights="int3")
    assert isinstance(refused.value, OnnxMergeError) and refused.value.argument == "weights"
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_generator_source_refuses_what_it_cannot_change(demo_site, tmp_path) -> None:
    with pytest.raises(ValueError, match="to quantize") as refused:
        build_site(demo_site / "generator.onnx", tmp_path / "site", weights="int8")
    assert isinstance(refused.value, OnnxMergeError) and refused.value.argument == "weights"
    with pytest.raises(ValueError, match="Whisper models only") as refused:
        build_site(demo_site / "generator.onnx", tmp_path / "site", language="fr")
    assert refused.value.argument == "language"
    assert [p.name for p in tmp_path.iterdir()] == []


# ---------------------------------------------------------------------------------------------
# the page in Chromium


@contextlib.contextmanager
def _page(browser, site: Path) -> Iterator:
    """The site's page, loaded; it raised no script error."""
    with serve(site, NODE_MODULES) as server:
        page, errors = load_page(browser, server.url, viewport={"width": 800, "height": 640})
        yield page
        page.close()
    assert not errors


def _python_translation(model_path: Path, texts: list[str]) -> tuple[list[list[int]], list[str]]:
    from onnxmerge.runtime import Seq2SeqModel, TextGenerator

    model = Seq2SeqModel(model_path)
    generator = TextGenerator(model)
    encoded = generator.tokenizer(texts, return_tensors="np", padding=True)
    names = set(model.encoder_input_names)
    sequences = model.generate({k: v for k, v in encoded.items() if k in names})
    return sequences.tolist(), model.translate(texts)


@pytest.fixture(scope="module")
def demo_page(browser, demo_site):
    """The fp32 demo site, loaded once: session creation dominates the time of these tests."""
    with _page(browser, demo_site) as page:
        yield page


def _check_translations(page, model_path: Path, screenshot: Path | None) -> None:
    assert page.get_attribute("body", "data-state") == "ready", page.inner_text("#status")
    assert "loaded in" in page.inner_text("#status")
    typed = [french_number(n) for n in HELD_OUT[::150]]
    batch = [french_number(n) for n in HELD_OUT[::20]]
    page.fill("#source", "\n".join(typed))
    page.evaluate("window.onnxmerge.last = null")
    page.click("#translate")
    page.wait_for_function("window.onnxmerge.last !== null", timeout=30_000)
    shown = page.inner_text("#output").splitlines()
    last = page.evaluate("window.onnxmerge.last")
    assert "ms per sentence" in page.inner_text("#timing")
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=os.fspath(screenshot))
    from_api = page.evaluate("texts => window.onnxmerge.translate(texts)", batch)

    expected_typed = _python_translation(model_path, typed)
    expected_batch = _python_translation(model_path, batch)
    assert strip_pad(last["sequences"], 84) == strip_pad(expected_typed[0], 84)
    assert shown == last["texts"] == expected_typed[1]
    assert strip_pad(from_api["sequences"], 84) == strip_pad(expected_batch[0], 84)
    assert from_api["texts"] == expected_batch[1]


def test_page_translates_held_out_numbers_like_python(demo_page, demo_merged, tmp_path) -> None:
    screenshot = SCREENSHOT if os.environ.get(UPDATE_SCREENSHOT) else tmp_path / "web.png"
    _check_translations(demo_page, demo_merged, screenshot)
    assert screenshot.stat().st_size > 0


def test_quantized_page_translates_held_out_numbers_like_python(
    browser, demo_merged, tmp_path
) -> None:
    quantized = _quantized(demo_merged)
    site = build_site(quantized, tmp_path / "site", tokenizer=demo_merged.parent)
    with _page(browser, site) as page:
        _check_translations(page, quantized, None)


def test_page_tokenizes_numbers_like_python(demo_page, demo_site) -> None:
    from tokenizers import Tokenizer

    from onnxmerge.demo import english_number

    python = Tokenizer.from_file(os.fspath(demo_site / "tokenizer.json"))
    python.no_padding()
    numbers = sorted({*range(100), *range(0, LARGEST_NUMBER + 1, 7)})
    texts = [f(n) for n in numbers for f in (french_number, english_number)]
    expected = [e.ids for e in python.encode_batch(texts)]
    got = demo_page.evaluate(
        "texts => texts.map(t => window.onnxmerge.app.tokenizer.encode(t).ids)", texts
    )
    assert got == expected
    decoded = demo_page.evaluate(
        "rows => rows.map(r => window.onnxmerge.app.tokenizer.decode(r, "
        "{skip_special_tokens: true}))",
        expected,
    )
    assert decoded == python.decode_batch(expected, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("init_script", "route", "message"),
    [
        ("delete window.WebAssembly", None, "lacks WebAssembly"),
        (None, "**/node_modules/**", "npm install --ignore-scripts"),
    ],
)
def test_page_says_what_the_browser_lacks(browser, demo_site, init_script, route, message) -> None:
    with serve(demo_site, NODE_MODULES) as server:
        page = browser.new_page()
        if route:
            page.route(route, lambda r: r.fulfill(status=404, body="missing"))
        if init_script:
            page.add_init_script(init_script)
        page.goto(server.url)
        page.wait_for_selector("body[data-state=failed]", timeout=30_000)
        status = page.inner_text("#status")
        assert page.is_disabled("#translate")
        page.close()
    assert message in status
