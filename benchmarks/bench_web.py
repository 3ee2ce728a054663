"""Browser benchmark: the translation site in Chromium (onnxruntime-web, wasm) next to Python.

For the shipped demo model and the opus-mt-fr-en shape (seeded random weights), one run:

1. builds the site (``onnxmerge.web.build_site``) from the optimum export and counts the bytes
   the page downloads, file by file, as the local server sends them;
2. loads the page in Chromium with 1 and 2 wasm threads (2 threads need a cross-origin isolated
   page: the server sends COOP/COEP for that run) and reads the page's own timings: session
   creation, then the median time of one translation (``generate`` on fixed token ids, batch 1)
   after a warm-up; the tokens are checked against the Python runtime's;
3. in the same process, with the same token ids and thread counts, times ``Seq2SeqModel``
   (session creation, ``generate``) on the merged file and onnxruntime on the same generator file;
4. sizes what transformers.js would download for the same model: ``encoder_model.onnx`` +
   ``decoder_model_merged.onnx`` as exported (fp32) and each quantized with onnxruntime's
   ``quantize_dynamic`` (q8: QInt8 weights, subgraphs included, as transformers.js's script does).

The opus-mt-fr-en shape has no ``tokenizer.json`` (its tokenizer is sentencepiece), so its site
carries the demo tokenizer as a stand-in and is timed on token ids only.

5. next to transformers.js in the same Chromium (``benchmarks/web_side_by_side.py``): its fp32
   and q8 files against our fp32 and int8 single files; needs transformers.js from npm
   (``npm ci --ignore-scripts`` in benchmarks/web), else that part says why it was left out.

Needs chromium and the page's npm packages (``npm ci --ignore-scripts`` in tests/web, done by
``scripts/setup.sh test``); without them it writes the reason and no figures.
``--quick``: the demo model only, fewer repeats.

Usage: python benchmarks/bench_web.py [--quick] [--side-by-side-only] [--out OUT.json]
"""

from __future__ import annotations

import collections
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _common, web_side_by_side  # noqa: E402
from tests import zoo  # noqa: E402
from tests.browser import (  # noqa: E402
    QUIET_FLAGS,
    launch_chromium,
    load_page,
    serve,
    strip_pad,
)

NODE_MODULES = REPO_ROOT / "tests" / "web" / "node_modules"
THREADS = (1, 2)


# ---------------------------------------------------------------- models


def transformers_js_bytes(export_dir: Path, work: Path) -> dict[str, int]:
    """Bytes of the two files transformers.js loads for a seq2seq model, fp32 and q8."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    files = (_common.ENCODER_FILE, _common.DECODER_MERGED_FILE)
    q8 = 0
    for name in files:
        out = work / name.replace(".onnx", "_quantized.onnx")
        quantize_dynamic(
            export_dir / name,
            out,
            weight_type=QuantType.QInt8,
            extra_options={"EnableSubgraph": True, "MatMulConstBOnly": True},
        )
        q8 += _common.files_bytes(work, [out.name])
    return {"fp32": _common.files_bytes(export_dir, files), "q8": q8}


# ---------------------------------------------------------------- Python side


def python_side(
    merged: Path, generator: Path, ids: list[list[int]], new_tokens: int, threads: int, repeats: int
) -> dict[str, Any]:
    import numpy as np

    from onnxmerge import Seq2SeqModel
    from onnxmerge._ort import open_session, session_options

    options = session_options(threads=threads)
    inputs = {
        "input_ids": np.array(ids, np.int64),
        "attention_mask": np.ones((1, len(ids[0])), np.int64),
    }
    start = time.perf_counter()
    model = Seq2SeqModel(merged, session_options=options)
    runtime_session_s = time.perf_counter() - start
    start = time.perf_counter()
    session = open_session(generator, options)
    generator_session_s = time.perf_counter() - start
    feeds = {**inputs, "max_new_tokens": np.array(new_tokens, np.int64)}
    runtime_s, _, sequences = _common.median_time(
        lambda: model.generate(**inputs, max_new_tokens=new_tokens), repeats
    )
    generator_s, _, _ = _common.median_time(lambda: session.run(None, feeds)[0], repeats)
    return {
        "threads": threads,
        "runtime_session_s": runtime_session_s,
        "runtime_translation_s": runtime_s,
        "generator_session_s": generator_session_s,
        "generator_translation_s": generator_s,
        "sequences": sequences.tolist(),
    }


# ---------------------------------------------------------------- browser side


def browser_side(
    browser, site: Path, ids: list[list[int]], new_tokens: int, threads: int, repeats: int
) -> dict[str, Any]:
    with serve(site, NODE_MODULES, isolated=threads > 1) as server:
        context = browser.new_context()  # a cold cache: every file is downloaded
        try:
            timings, runs = _page_runs(
                context, f"{server.url}?threads={threads}", ids, new_tokens, repeats
            )
        finally:
            context.close()
    return {
        "threads": threads,
        "threads_used": timings["threads"],
        "cross_origin_isolated": timings["cross_origin_isolated"],
        "session_s": timings["session_ms"] / 1000,
        "load_s": timings["load_ms"] / 1000,
        "translation_s": statistics.median(r["ms"] for r in runs[1:]) / 1000,
        "bytes_downloaded": sum(server.sent.values()),
        "files": dict(sorted(server.sent.items())),
        "sequences": runs[-1]["sequences"],
    }


def _page_runs(context, url: str, ids: list[list[int]], new_tokens: int, repeats: int):
    """The page's own timings, then ``repeats`` + 1 translations (the first is a warm-up)."""
    page, _ = load_page(context, url, timeout_ms=600_000)
    if page.get_attribute("body", "data-state") != "ready":
        raise RuntimeError(f"the page did not load: {page.inner_text('#status')}")
    timings = page.evaluate("window.onnxmerge.app.timings")
    runs = page.evaluate(
        """async ([ids, n, repeats]) => {
             const out = [];
             for (let i = 0; i <= repeats; i++) {
               out.push(await window.onnxmerge.generate(ids, n));
             }
             return out;
           }""",
        [ids, new_tokens, repeats],
    )
    return timings, runs


def _download_parts(files: dict[str, int]) -> dict[str, int]:
    parts = collections.Counter()
    for path, sent in files.items():
        if path.endswith("generator.onnx"):
            parts["model"] += sent
        elif "/onnxruntime-web/" in path:
            parts["onnxruntime-web"] += sent
        elif "/@huggingface/tokenizers/" in path:
            parts["tokenizer library"] += sent
        elif path.startswith("/tokenizer"):
            parts["tokenizer.json + config"] += sent
        else:
            parts["page"] += sent
    return dict(parts)


def measure(
    name: str, export_dir: Path, ids: list[list[int]], new_tokens: int, repeats: int, browser
) -> dict[str, Any]:
    import onnxmerge
    from onnxmerge.generator import build_generator
    from onnxmerge.web import build_site

    with tempfile.TemporaryDirectory(prefix="bench-web-") as tmp:
        tmp = Path(tmp)
        merged = onnxmerge.merge_seq2seq(export_dir, tmp / "model.onnx")
        generator = build_generator(merged, tmp / "generator.onnx")
        tokenizer = export_dir if (export_dir / "tokenizer.json").exists() else None
        if tokenizer is None:
            from onnxmerge.demo import DEMO_MODEL_DIR

            tokenizer = DEMO_MODEL_DIR
        site = build_site(generator, tmp / "site", tokenizer=tokenizer)
        pad = json.loads((site / "site.json").read_text())["pad_token_id"]
        browser_runs = [browser_side(browser, site, ids, new_tokens, t, repeats) for t in THREADS]
        python_runs = [python_side(merged, generator, ids, new_tokens, t, repeats) for t in THREADS]
        same = all(
            strip_pad(b["sequences"], pad) == strip_pad(p["sequences"], pad)
            for b, p in zip(browser_runs, python_runs, strict=True)
        )
        tjs = transformers_js_bytes(export_dir, tmp)
        result = {
            "model": name,
            "source_tokens": len(ids[0]),
            "max_new_tokens": new_tokens,
            "generated_tokens": len(python_runs[0]["sequences"][0]) - 1,
            "same_tokens": same,
            "merged_bytes": merged.stat().st_size,
            "generator_bytes": generator.stat().st_size,
            "page_download_bytes": browser_runs[0]["bytes_downloaded"],
            "page_download_parts": _download_parts(browser_runs[0]["files"]),
            "transformers_js_model_bytes": tjs,
            "chromium": browser_runs,
            "python": python_runs,
        }
    for run in result["chromium"] + result["python"]:
        run.pop("sequences")
    return result


def _ids(config: dict, length: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    special = {config.get(k) for k in ("pad_token_id", "eos_token_id", "decoder_start_token_id")}
    ids = rng.integers(0, int(config["vocab_size"]), size=length).tolist()
    ids = [5 if i in special else i for i in ids]
    return [ids[:-1] + [config["eos_token_id"]]]


def _demo_ids(export_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    from onnxmerge.demo import DEMO_SENTENCES

    tokenizer = Tokenizer.from_file(os.fspath(export_dir / "tokenizer.json"))
    return [tokenizer.encode(DEMO_SENTENCES[2]).ids]


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def markdown(web: dict[str, Any]) -> list[str]:
    """The docs/benchmarks.md sections of a web.json."""
    lines = ["## In the browser (onnxruntime-web in Chromium)", ""]
    if "skipped" in web:
        return lines + [f"Not measured in this run: {web['skipped']}.", ""]
    lines = _markdown_alone(web) if "models" in web else []
    side = web.get("side_by_side")
    if side is None:
        return lines
    if "skipped" in side:
        return lines + [
            "## In the browser, next to transformers.js",
            "",
            f"Not measured in this run: {side['skipped']}.",
            "",
        ]
    cpu = web["platform"].get("cpu") or {}
    processor = cpu.get("model") or web["platform"]["machine"]
    return lines + web_side_by_side.markdown(side, f"{processor} ({web['platform']['cpus']} CPUs)")


def _markdown_alone(web: dict[str, Any]) -> list[str]:
    lines = ["## In the browser (onnxruntime-web in Chromium)", ""]
    models = web["models"]
    packages = web["platform"]["packages"]
    lines += [
        "The site `onnxmerge web` writes, loaded in headless Chromium "
        f"{web['chromium']} from a local server (onnxruntime-web "
        f"{packages.get('onnxruntime-web', '')}, wasm backend), next to "
        f"onnxruntime {packages.get('onnxruntime', '')} in Python on the same machine, in the "
        "same run, on the same token ids (batch 1, greedy; median of "
        f"{web['repeats']} after a warm-up). Written by `benchmarks/bench_web.py`.",
        "",
        "| bytes the page downloads (first visit) | "
        + " | ".join(m["model"] for m in models)
        + " |",
        "|---|" + "---:|" * len(models),
    ]
    parts = ("model", "onnxruntime-web", "tokenizer library", "tokenizer.json + config", "page")
    lines.append(
        "| **total** | " + " | ".join(f"**{_mb(m['page_download_bytes'])}**" for m in models) + " |"
    )
    for part in parts:
        label = "generator.onnx (the model)" if part == "model" else part
        lines.append(
            f"| {label} | "
            + " | ".join(_mb(m["page_download_parts"].get(part, 0)) for m in models)
            + " |"
        )
    for kind in ("fp32", "q8"):
        lines.append(
            f"| transformers.js model files, {kind} (encoder + decoder_model_merged) | "
            + " | ".join(_mb(m["transformers_js_model_bytes"][kind]) for m in models)
            + " |"
        )
    lines += [
        "",
        "transformers.js q8 = onnxruntime's `quantize_dynamic` on each file (QInt8 "
        "weights, subgraphs included); its runtime files come on top of those. The "
        "opus-mt-fr-en shape has no tokenizer.json (sentencepiece), so its site carries the "
        "demo tokenizer as a stand-in and is timed on token ids.",
        "",
    ]
    for m in models:
        python = {r["threads"]: r for r in m["python"]}
        lines += [
            f"**{m['model']}**: {m['source_tokens']} source tokens, "
            f"{m['generated_tokens']} generated; same tokens in Chromium as in Python: "
            f"{m['same_tokens']}.",
            "",
            "| runtime | threads | session creation s | translation ms | "
            "× Python runtime (session / translation) |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in m["chromium"]:
            p = python[r["threads"]]
            lines.append(
                f"| Chromium, onnxruntime-web wasm, generator.onnx | {r['threads_used']} | "
                f"{r['session_s']:.2f} | {r['translation_s'] * 1000:.0f} | "
                f"{r['session_s'] / p['runtime_session_s']:.1f}x / "
                f"{r['translation_s'] / p['runtime_translation_s']:.1f}x |"
            )
        for p in m["python"]:
            lines.append(
                f"| Python, Seq2SeqModel, model.onnx | {p['threads']} | "
                f"{p['runtime_session_s']:.2f} | "
                f"{p['runtime_translation_s'] * 1000:.0f} | 1x / 1x |"
            )
        for p in m["python"]:
            lines.append(
                f"| Python, onnxruntime, generator.onnx | {p['threads']} | "
                f"{p['generator_session_s']:.2f} | {p['generator_translation_s'] * 1000:.0f} | "
                f"{p['generator_session_s'] / p['runtime_session_s']:.1f}x / "
                f"{p['generator_translation_s'] / p['runtime_translation_s']:.1f}x |"
            )
        lines.append("")
    return lines


def side_by_side(
    browser, models: list[str], repeats: int, visits: int, new_tokens: int
) -> dict[str, Any]:
    """Part 5: the pages next to transformers.js; ``{"skipped": why}`` without transformers.js."""
    version = web_side_by_side.transformers_js_version()
    if version is None:
        return {
            "skipped": "transformers.js is not installed: npm ci --ignore-scripts in benchmarks/web"
        }
    from onnxmerge.demo import DEMO_SENTENCES

    tjs_ort = web_side_by_side.NODE_MODULES / "onnxruntime-web" / "package.json"
    ours_ort = NODE_MODULES / "onnxruntime-web" / "package.json"
    section: dict[str, Any] = {
        "chromium": browser.version,
        "transformers_js": version,
        "onnxruntime_web_tjs": json.loads(tjs_ort.read_text())["version"],
        "onnxruntime_web_ours": json.loads(ours_ort.read_text())["version"],
        "models": [],
    }
    if "demo" in models:
        demo = zoo.demo_export()
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(os.fspath(demo / "tokenizer.json"))
        eight = [tokenizer.encode(t).ids for t in DEMO_SENTENCES[:8]]
        section["models"].append(
            web_side_by_side.measure(
                browser,
                "demo model",
                demo,
                [tokenizer.encode(DEMO_SENTENCES[2]).ids],
                eight,
                31,
                repeats,
                visits,
                texts=list(DEMO_SENTENCES),
            )
        )
    if "opus" in models:
        from onnxmerge.demo import DEMO_MODEL_DIR

        opus = _common.export_cached(_common.opus_mt_config, "tied").onnx_dir
        config = json.loads((opus / "config.json").read_text())
        rows = [_ids(config, 16)[0]]
        eight = [_ids_seeded(config, 8 + 2 * i, seed=i + 1) for i in range(8)]
        section["models"].append(
            web_side_by_side.measure(
                browser,
                "opus-mt-fr-en shape",
                opus,
                rows,
                eight,
                new_tokens,
                repeats,
                visits,
                tokenizer_dir=DEMO_MODEL_DIR,
            )
        )
    for m in section["models"]:
        for s in m["sides"]:
            print(
                f"{m['model']}: {s['side']} {s['precision']}: {s['download_bytes']} B, ready "
                f"{s['ready_s']:.2f} s, first {s['first_translation_ms']:.0f} ms, 1 line "
                f"{s['translation_ms']:.0f} ms, 8 lines {s['translation_8_ms']:.0f} ms, same "
                f"tokens {s['same_tokens']}",
                flush=True,
            )
        print(json.dumps(web_side_by_side.ratios(m), indent=1), flush=True)
    return section


def _ids_seeded(config: dict, length: int, seed: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    special = {config.get(k) for k in ("pad_token_id", "eos_token_id", "decoder_start_token_id")}
    ids = [5 if i in special else i for i in rng.integers(0, config["vocab_size"], length).tolist()]
    return ids[:-1] + [config["eos_token_id"]]


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "web", "the demo model only")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32, help="for the opus-mt shape")
    parser.add_argument("--visits", type=int, default=3, help="page loads per side, side by side")
    parser.add_argument(
        "--side-by-side-only",
        action="store_true",
        help="only the pages next to transformers.js (part 5)",
    )
    parser.add_argument(
        "--side-by-side-models",
        default="demo,opus",
        help="models of part 5: demo, opus or both (comma-separated)",
    )
    args = parser.parse_args(argv)
    repeats = 2 if args.quick else args.repeats

    import onnxruntime
    from playwright.sync_api import sync_playwright

    packages = {**_common.package_versions(), "onnxruntime": onnxruntime.__version__}
    web_package = NODE_MODULES / "onnxruntime-web" / "package.json"
    if web_package.exists():
        packages["onnxruntime-web"] = json.loads(web_package.read_text())["version"]
    result: dict[str, Any] = {
        "benchmark": "web",
        "repeats": repeats,
        "platform": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "cpu": _common.cpu_description(),
            "packages": packages,
        },
    }
    with sync_playwright() as playwright:
        browser, skipped = launch_chromium(playwright, NODE_MODULES, QUIET_FLAGS)
        if browser is None:
            result["skipped"] = skipped
        elif args.side_by_side_only:
            result["chromium"] = browser.version
        else:
            result["chromium"] = browser.version
            models = []
            demo = zoo.demo_export()
            models.append(measure("demo model", demo, _demo_ids(demo), 31, repeats, browser))
            if not args.quick:
                opus = _common.export_cached(_common.opus_mt_config, "tied").onnx_dir
                config = json.loads((opus / "config.json").read_text())
                models.append(
                    measure(
                        "opus-mt-fr-en shape",
                        opus,
                        _ids(config, 16),
                        args.new_tokens,
                        repeats,
                        browser,
                    )
                )
            result["models"] = models
        if browser is not None:
            models = args.side_by_side_models.split(",")
            if args.quick:
                models = ["demo"]
            result["side_by_side"] = side_by_side(
                browser, models, repeats, 1 if args.quick else args.visits, args.new_tokens
            )
            browser.close()
    _common.write_results(args.out, result)
    if "skipped" in result:
        print(f"skipped: {result['skipped']}")
    for m in result.get("models", []):
        print(
            f"{m['model']}: page downloads {m['page_download_bytes']} B, same tokens "
            f"{m['same_tokens']}"
        )
        for run in m["chromium"]:
            print(
                f"  chromium {run['threads']} thread(s): session {run['session_s']:.2f} s, "
                f"translation {run['translation_s'] * 1000:.0f} ms"
            )
        for run in m["python"]:
            print(
                f"  python {run['threads']} thread(s): session {run['runtime_session_s']:.2f} s"
                f", translation {run['runtime_translation_s'] * 1000:.0f} ms"
            )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
