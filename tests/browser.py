"""The translation site in Chromium: a local server for a site folder, the browser, the page.

Shared by the browser tests and the browser benchmark. Chromium is Debian's (no browser download),
driven through playwright; the page's npm packages are a ``node_modules`` folder linked into the
site. Nothing here imports playwright at module level.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import http.server
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class SiteServer(http.server.ThreadingHTTPServer):
    """A server on 127.0.0.1 at ``url``; ``sent`` counts the bytes sent per path."""

    def __init__(self, handler: Callable[..., http.server.BaseHTTPRequestHandler], isolated: bool):
        super().__init__(("127.0.0.1", 0), handler)
        self.isolated = isolated
        self.sent: collections.Counter[str] = collections.Counter()
        self.url = f"http://127.0.0.1:{self.server_address[1]}/"


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the site; counts the bytes of each file sent; isolates the page when asked."""

    server: SiteServer

    def end_headers(self) -> None:
        if self.server.isolated:
            # Cross-origin isolation lets onnxruntime-web run more than one wasm thread.
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()

    def copyfile(self, source, outputfile) -> None:
        sent = 0
        while chunk := source.read(1 << 20):
            outputfile.write(chunk)
            sent += len(chunk)
        self.server.sent[self.path.split("?")[0]] += sent

    def log_message(self, format, *args) -> None:  # noqa: A002
        pass


@contextlib.contextmanager
def serve(site: Path, node_modules: Path, *, isolated: bool = False) -> Iterator[SiteServer]:
    """Serve ``site``, with ``node_modules`` linked into it, on 127.0.0.1; the server's ``url`` is
    its root, ``sent`` the bytes sent per path."""
    link = site / "node_modules"
    if not link.exists():
        link.symlink_to(node_modules, target_is_directory=True)
    server = SiteServer(functools.partial(_Handler, directory=os.fspath(site)), isolated)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


# For measurements: nothing but the page uses the network or the processor.
QUIET_FLAGS = (
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


def launch_chromium(
    playwright: Any, node_modules: Path, flags: tuple[str, ...] = ()
) -> tuple[Any, str | None]:
    """``(browser, None)``, or ``(None, why)`` when Chromium or the page's packages are missing;
    ``flags`` are added to Chromium's command line."""
    from playwright.sync_api import Error

    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        return None, "chromium is not installed (scripts/setup.sh test installs it with apt-get)"
    if not (node_modules / "onnxruntime-web").is_dir():
        where = node_modules.parent
        return None, f"the page's packages are not installed: npm ci --ignore-scripts in {where}"
    # Chromium's sandbox refuses to start as root, which CI runs as.
    args = (["--no-sandbox"] if os.geteuid() == 0 else []) + list(flags)
    try:
        return playwright.chromium.launch(executable_path=executable, args=args), None
    except Error as e:
        return None, f"{executable} did not start under playwright: {e}"


def load_page(owner: Any, url: str, timeout_ms: int = 60_000, **page_options: Any):
    """Open ``url`` in a new page of ``owner`` (a browser or a context) and wait until the page
    says it is ready or failed (``body[data-state]``); returns the page and its script errors."""
    page = owner.new_page(**page_options)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_selector("body[data-state]", timeout=timeout_ms)
    return page, errors


def strip_pad(rows: list[list[int]], pad: int) -> list[list[int]]:
    """Token rows without their trailing pad (the first token always stays)."""
    out = []
    for row in rows:
        row = list(row)
        while len(row) > 1 and row[-1] == pad:
            row.pop()
        out.append(row)
    return out
