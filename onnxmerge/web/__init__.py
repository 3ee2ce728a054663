"""A static site that translates in the browser with one model file; see ``docs/web.md``.

``build_site(source, output)`` writes ``index.html``, ``translate.js`` with the ``page.js`` and
``page.css`` both pages share, the generator model, the tokenizer and a ``package.json`` that
pins onnxruntime-web and a JavaScript tokenizer.
"""

from __future__ import annotations

from onnxmerge.web._static_site import build_site

__all__ = ["build_site"]
