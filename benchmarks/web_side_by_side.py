"""onnxmerge's page next to transformers.js in one Chromium, on one model (bench_web.py's part).

transformers.js (``@huggingface/transformers``, pinned in ``benchmarks/web/package.json``) runs
``benchmarks/web/index.html``: it loads ``onnx/encoder_model{suffix}.onnx`` and
``onnx/decoder_model_merged{suffix}.onnx`` of a Hub-layout folder and loops in JavaScript; its
fp32 files and its q8 files (``_quantized``, made with onnxruntime's ``quantize_dynamic`` as
transformers.js's script makes them). onnxmerge's page (``onnxmerge web``) runs one generator file
made from the same fp32 files, as they are and with int8 weights (``--weights int8``). Everything
is served from 127.0.0.1, each page in a fresh browser context (a first visit), 1 wasm thread.

Measured for each: the bytes the page downloads until it is ready (model files and runtime), the
time from navigation to ready (median of ``visits`` loads, the sides interleaved), the first
translation, the median translation of one line and of 8 lines (``repeats`` each), and whether
the tokens equal Python's (``Seq2SeqModel`` on the merge of the same precision's files: the fp32
files, our int8 file, the q8 files merged with ``--dtype q8``).
"""

from __future__ import annotations

import collections
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tests.browser import load_page, serve, strip_pad

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGE_DIR = REPO_ROOT / "benchmarks" / "web"
NODE_MODULES = PAGE_DIR / "node_modules"
MODEL_NAME = "model"
# (side, precision, what the page loads)
SIDES = (
    ("onnxmerge", "fp32"),
    ("transformers.js", "fp32"),
    ("onnxmerge", "int8"),
    ("transformers.js", "q8"),
)
PAIRS = (("fp32", "fp32"), ("int8", "q8"))  # (ours, theirs) at the same precision


def transformers_js_version() -> str | None:
    import json

    package = NODE_MODULES / "@huggingface" / "transformers" / "package.json"
    return json.loads(package.read_text())["version"] if package.exists() else None


def _parts(sent: dict[str, int]) -> dict[str, int]:
    parts: collections.Counter[str] = collections.Counter()
    for path, n in sent.items():
        if path.endswith(".onnx"):
            parts["model"] += n
        elif path.startswith("/node_modules/"):
            parts["runtime"] += n
        else:
            parts["page and configs"] += n
    return dict(parts)


def _to_eos(rows: list[list[int]], eos: int) -> list[list[int]]:
    """Each row up to its first end-of-sequence token (the start token excepted)."""
    out = []
    for row in rows:
        end = next((i for i, t in enumerate(row) if i > 0 and t == eos), len(row) - 1)
        out.append(list(row[: end + 1]))
    return out


def _python_sequences(model_path: Path, rows: list[list[int]], new_tokens: int, pad: int):
    import numpy as np

    from onnxmerge import Seq2SeqModel

    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, np.int64)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    model = Seq2SeqModel(model_path)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens).tolist()


def _visit(browser, folder: Path, node_modules: Path, query: str, ours: bool):
    """One first visit: a fresh context; the page, its ready time and the bytes sent until then."""
    server_cm = serve(folder, node_modules)
    server = server_cm.__enter__()
    context = browser.new_context()
    page, errors = load_page(context, f"{server.url}{query}", timeout_ms=900_000)
    state = page.get_attribute("body", "data-state")
    if state != "ready":
        why = page.evaluate("window.benchError || document.body.innerText")
        raise RuntimeError(f"{folder.name} did not load: {why} {errors}")
    ready_ms = page.evaluate(
        "window.onnxmerge.app.timings.ready_ms" if ours else "window.bench.readyMs"
    )
    sent = dict(server.sent)

    def close() -> None:
        context.close()
        server_cm.__exit__(None, None, None)

    return page, ready_ms, sent, close


_RUN_OURS = """async ([rows, n, repeats]) => {
  const out = [];
  for (let i = 0; i < repeats; i++) out.push(await window.onnxmerge.generate(rows, n));
  return out;
}"""
_RUN_THEIRS = """async ([rows, n, repeats, pad]) => {
  const out = [];
  for (let i = 0; i < repeats; i++) out.push(await window.bench.generate(rows, n, pad));
  return out;
}"""


def _translations(page, ours: bool, rows, new_tokens: int, repeats: int, pad: int):
    script = _RUN_OURS if ours else _RUN_THEIRS
    return page.evaluate(script, [rows, new_tokens, repeats, pad])


def measure(
    browser,
    name: str,
    export_dir: Path,
    one: list[list[int]],
    eight: list[list[int]],
    new_tokens: int,
    repeats: int,
    visits: int,
    texts: list[str] | None = None,
    tokenizer_dir: Path | None = None,
) -> dict[str, Any]:
    """Every side of :data:`SIDES` on one model; see the module's docstring."""
    import json

    import onnxmerge
    from onnxmerge.web import build_site
    from tests.hub import hub_repository

    with tempfile.TemporaryDirectory(prefix="bench-web-tjs-") as tmp:
        tmp = Path(tmp)
        served = tmp / "transformers.js"
        (served / "models").mkdir(parents=True)
        repo = hub_repository(export_dir, served / "models" / MODEL_NAME)
        (served / "index.html").write_bytes((PAGE_DIR / "index.html").read_bytes())
        config = json.loads((repo / "config.json").read_text())
        pad = int(config["pad_token_id"])
        eos = int(config["eos_token_id"])
        tokenizer = tokenizer_dir or repo
        if not (repo / "tokenizer.json").exists() and tokenizer_dir is not None:
            for f in ("tokenizer.json", "tokenizer_config.json"):
                if (tokenizer_dir / f).exists():
                    (repo / f).write_bytes((tokenizer_dir / f).read_bytes())
        merged = {
            "fp32": onnxmerge.merge_seq2seq(repo, tmp / "model.onnx"),
            "q8": onnxmerge.merge_seq2seq(repo, tmp / "model_quantized.onnx", dtype="q8"),
        }
        merged["int8"] = Path(onnxmerge.quantize(merged["fp32"], tmp / "model_int8.onnx"))
        sites = {
            precision: build_site(merged[precision], tmp / f"site-{precision}", tokenizer=tokenizer)
            for precision in ("fp32", "int8")
        }
        python = {
            p: {
                "one": _python_sequences(merged[p], one, new_tokens, pad),
                "eight": _python_sequences(merged[p], eight, new_tokens, pad),
            }
            for p in ("fp32", "int8", "q8")
        }
        runs: dict[tuple[str, str], dict[str, Any]] = {side: {"ready_ms": []} for side in SIDES}
        for visit in range(visits):
            for side, precision in SIDES:
                ours = side == "onnxmerge"
                folder = sites[precision] if ours else served
                modules = _ours_node_modules() if ours else NODE_MODULES
                query = "?threads=1" if ours else f"?model={MODEL_NAME}&dtype={precision}&threads=1"
                page, ready_ms, sent, close = _visit(browser, folder, modules, query, ours)
                run = runs[(side, precision)]
                run["ready_ms"].append(ready_ms)
                run["download_bytes"] = sum(sent.values())
                run["download_parts"] = _parts(sent)
                run["files"] = dict(sorted(sent.items()))
                if visit == visits - 1:
                    first = _translations(page, ours, one, new_tokens, 1, pad)[0]
                    ones = _translations(page, ours, one, new_tokens, repeats, pad)
                    _translations(page, ours, eight, new_tokens, 1, pad)  # warm-up of the shape
                    eights = _translations(page, ours, eight, new_tokens, repeats, pad)
                    reference = python[precision]
                    run.update(
                        first_translation_ms=first["ms"],
                        translation_ms=statistics.median(r["ms"] for r in ones),
                        translation_8_ms=statistics.median(r["ms"] for r in eights),
                        same_tokens=strip_pad(ones[-1]["sequences"], pad)
                        == strip_pad(reference["one"], pad)
                        and strip_pad(eights[-1]["sequences"], pad)
                        == strip_pad(reference["eight"], pad),
                        # transformers.js keeps generating for rows that ended while others
                        # go on: equal up to each row's end of sequence is the fair test.
                        same_tokens_to_eos=_to_eos(ones[-1]["sequences"], eos)
                        == _to_eos(reference["one"], eos)
                        and _to_eos(eights[-1]["sequences"], eos)
                        == _to_eos(reference["eight"], eos),
                        sequences_8=eights[-1]["sequences"],
                    )
                    if texts and not ours:
                        run["tokenizer_ids"] = page.evaluate(
                            "async (t) => await window.bench.encode(t)", texts
                        )
                    elif texts:
                        run["tokenizer_ids"] = page.evaluate(
                            "async (t) => (await window.onnxmerge.translate(t)).ids", texts
                        )
                close()
        result = {
            "model": name,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "visits": visits,
            "python_sequences_8": python,
            "sides": [
                {
                    "side": side,
                    "precision": precision,
                    "ready_s": statistics.median(run["ready_ms"]) / 1000,
                    **{k: v for k, v in run.items() if k != "ready_ms"},
                    "ready_ms_each": run.pop("ready_ms"),
                }
                for (side, precision), run in runs.items()
            ],
        }
        if texts:
            result["texts"] = texts
            result["python_tokenizer_ids"] = _python_ids(tokenizer, texts)
    return result


def _python_ids(folder: Path, texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [tokenizer.encode(t).ids for t in texts]


def _ours_node_modules() -> Path:
    return REPO_ROOT / "tests" / "web" / "node_modules"


def _same(side: dict[str, Any]) -> str:
    if side["same_tokens"]:
        return "yes"
    if side.get("same_tokens_to_eos"):
        return "up to each row's end; then more tokens"
    return "no"


def ratios(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """ours / transformers.js at the same precision: bytes, ready, translations."""
    by = {(s["side"], s["precision"]): s for s in result["sides"]}
    out = {}
    for ours, theirs in PAIRS:
        a, b = by[("onnxmerge", ours)], by[("transformers.js", theirs)]
        out[f"{ours} / {theirs}"] = {
            "download": a["download_bytes"] / b["download_bytes"],
            "ready": a["ready_s"] / b["ready_s"],
            "first_translation": a["first_translation_ms"] / b["first_translation_ms"],
            "translation": a["translation_ms"] / b["translation_ms"],
            "translation_8": a["translation_8_ms"] / b["translation_8_ms"],
        }
    return out


TARGETS = {"download": 0.75, "ready": 0.8, "translation": 0.8, "translation_8": 0.8}
TARGET_WORDS = {
    "download": "downloaded",
    "ready": "ready",
    "translation": "1 line",
    "translation_8": "8 lines",
}


def markdown(section: dict[str, Any], processor: str) -> list[str]:
    """The docs/benchmarks.md section of the side-by-side results."""
    lines = [
        "## In the browser, next to transformers.js",
        "",
        f"One headless Chromium {section['chromium']} on {processor}, 1 wasm thread on both "
        f"sides, every page a first visit from a local server (nothing from a CDN): "
        f"transformers.js {section['transformers_js']} (its jsDelivr bundle, its default "
        "asyncify wasm of onnxruntime-web "
        f"{section['onnxruntime_web_tjs']}) with `encoder_model` + `decoder_model_merged`, against "
        f"the page `onnxmerge web` writes (onnxruntime-web {section['onnxruntime_web_ours']}, "
        "one `generator.onnx`). q8 = transformers.js's `_quantized` files, onnxruntime's "
        "`quantize_dynamic` on each; int8 = `onnxmerge web --weights int8`. Ready: from "
        "navigation to a usable model, median of "
        f"{section['models'][0]['visits']} visits, the sides taking turns. Translations on token "
        "ids, greedy; median of "
        f"{section['models'][0]['repeats']} after the first. Tokens compared with `Seq2SeqModel` "
        "in Python on the merge of the same files. Written by `benchmarks/bench_web.py`.",
        "",
    ]
    for m in section["models"]:
        lines += [
            f"**{m['model']}** ({m['new_tokens']} new tokens at most):",
            "",
            "| page | weights | downloaded (model + runtime) | ready s | first translation ms | "
            "1 line ms | 8 lines ms | tokens = Python |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for s in m["sides"]:
            parts = s["download_parts"]
            lines.append(
                f"| {s['side']} | {s['precision']} | {s['download_bytes'] / 1e6:.2f} MB "
                f"({parts.get('model', 0) / 1e6:.2f} + {parts.get('runtime', 0) / 1e6:.2f}) | "
                f"{s['ready_s']:.2f} | {s['first_translation_ms']:.0f} | "
                f"{s['translation_ms']:.0f} | {s['translation_8_ms']:.0f} | "
                f"{_same(s)} |"
            )
        lines += [
            "",
            "| onnxmerge / transformers.js | downloaded | ready | first translation | 1 line | "
            "8 lines |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for pair, r in ratios(m).items():
            lines.append(
                f"| {pair} | {r['download']:.2f}x | {r['ready']:.2f}x | "
                f"{r['first_translation']:.2f}x | {r['translation']:.2f}x | "
                f"{r['translation_8']:.2f}x |"
            )
        lines.append("")
        missed = [
            f"{pair} {TARGET_WORDS[key]} {r[key]:.2f}x > {limit}x"
            for pair, r in ratios(m).items()
            for key, limit in TARGETS.items()
            if r[key] > limit
        ]
        lines.append(
            "Targets (onnxmerge / transformers.js at the same precision: downloaded <= 0.75x, "
            "ready <= 0.8x, 1 line and 8 lines <= 0.8x): "
            + (f"missed: {'; '.join(missed)}." if missed else "all met.")
        )
        lines.append("")
        if "texts" in m:
            by = {(s["side"], s["precision"]): s for s in m["sides"]}
            python_ids = m["python_tokenizer_ids"]
            for side in ("onnxmerge", "transformers.js"):
                ids = by[(side, "fp32")].get("tokenizer_ids")
                if ids is not None:
                    same = sum(a == b for a, b in zip(ids, python_ids, strict=True))
                    lines.append(
                        f"- {side}'s tokenizer gives Python's ids for {same} of "
                        f"{len(python_ids)} demo sentences"
                        + (
                            f" (`{m['texts'][0]}`: {ids[0]} against {python_ids[0]})"
                            if ids[0] != python_ids[0]
                            else ""
                        )
                        + "."
                    )
            lines.append("")
    return lines
