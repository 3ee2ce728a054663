"""Whisper benchmark: audio in, tokens out, in one call, next to the feature extractor and a loop.

On the whisper-tiny shape (seeded random weights; the tiny test Whisper under ``--quick``), 10 s
of audio, greedy, a fixed number of new tokens (``min_new_tokens`` = ``max_new_tokens``):

1. Python: ``WhisperFeatureExtractor`` then ``Seq2SeqModel.generate`` on the merged file with
   Whisper's prompt, against one ``session.run`` of the audio generator
   (``build_generator(..., audio=True)``), taking turns in this process; the tokens are checked
   equal and the features' largest difference to the extractor's is recorded;
2. the browser: the transcription page (``onnxmerge web``) in Chromium, one wasm thread: bytes
   downloaded file by file, time to ready (download and session creation) and the median time of
   one transcription (``window.onnxmerge.transcribe``) after a warm-up, tokens checked against
   Python's; and the bytes transformers.js would download for the same model (its two files,
   ``encoder_model.onnx`` and ``decoder_model_merged.onnx``, fp32 as exported).

transformers.js itself is not run: it is not among the packages the tests install, and its page
needs the network for its model files. Records the processor (``_common.cpu_description``).

Usage: python benchmarks/bench_whisper.py [--quick] [--out benchmarks/out/whisper.json]
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _common  # noqa: E402
from tests.exports import export_onnx, staging  # noqa: E402

NODE_MODULES = REPO_ROOT / "tests" / "web" / "node_modules"
SECONDS = 10.0
RATE = 16_000
# whisper-tiny's special tokens, and the prompt its generate() builds for English transcription.
TINY_TOKENS = {
    "decoder_start_token_id": 50258,
    "eos_token_id": 50257,
    "pad_token_id": 50257,
    "bos_token_id": 50257,
}
TINY_GENERATION = {
    "lang_to_id": {"<|en|>": 50259, "<|fr|>": 50265},
    "task_to_id": {"transcribe": 50359, "translate": 50358},
    "no_timestamps_token_id": 50363,
    "is_multilingual": True,
    "begin_suppress_tokens": [220, 50257],
}


def whisper_tiny_config() -> Any:
    from transformers import WhisperConfig

    return WhisperConfig(
        vocab_size=51865, d_model=384, encoder_layers=4, decoder_layers=4,
        encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=1536,
        decoder_ffn_dim=1536, num_mel_bins=80, max_source_positions=1500,
        max_target_positions=448, **TINY_TOKENS,
    )  # fmt: skip


def export_whisper(quick: bool) -> Path:
    """The export folder of the benchmark's Whisper (cached under .cache/bench)."""
    if quick:
        from tests import zoo

        return zoo.tiny_export("whisper").onnx_dir
    import torch
    from transformers import GenerationConfig, WhisperForConditionalGeneration

    config = whisper_tiny_config()
    key = _common.cache_key(config, "whisper-asr-multilingual")
    root = _common.DEFAULT_CACHE_DIR / f"whisper_tiny-{key}"
    pytorch_dir, onnx_dir = root / "pytorch", root / "onnx"
    if not (pytorch_dir / "config.json").exists():
        with staging(pytorch_dir) as folder:
            torch.manual_seed(_common.SEED)
            model = WhisperForConditionalGeneration(config).eval()
            generation = GenerationConfig.from_model_config(config)
            for name, value in TINY_GENERATION.items():
                setattr(generation, name, value)
            generation._from_model_config = False  # else optimum rebuilds it from the config
            model.generation_config = generation
            model.save_pretrained(folder)
    if not (onnx_dir / _common.ENCODER_FILE).exists():
        with staging(onnx_dir) as folder:
            export_onnx(pytorch_dir, folder, "automatic-speech-recognition-with-past", tied=True)
    return onnx_dir


def _audio(spec) -> Any:
    """10 s of a chirp over noise; the tiny model's window (0.64 s) cuts it."""
    import numpy as np

    rng = np.random.default_rng(0)
    t = np.arange(int(SECONDS * RATE)) / RATE
    chirp = 0.3 * np.sin(2 * np.pi * (200 * t + 40 * t * t))
    return (chirp + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def python_side(
    export_dir: Path, work: Path, new_tokens: int, repeats: int, threads: int
) -> dict[str, Any]:
    import numpy as np
    from transformers import WhisperFeatureExtractor

    import onnxmerge
    from onnxmerge._ort import open_session, session_options
    from onnxmerge.generator import audio, build_generator

    options = (
        {"language": "en"}
        if (export_dir / "generation_config.json").exists()
        and ("lang_to_id" in json.loads((export_dir / "generation_config.json").read_text()))
        else {}
    )
    fixed = {"min_new_tokens": new_tokens, **options}
    merged = onnxmerge.merge_seq2seq(export_dir, work / "model.onnx")
    generator = build_generator(export_dir, work / "generator.onnx", audio=True,
                                generation_config=fixed)  # fmt: skip
    meta = json.loads(
        {p.key: p.value for p in __import__("onnx").load(
            str(generator), load_external_data=False).metadata_props}["onnxmerge.generator"]
    )  # fmt: skip
    prompt = np.array([meta.get("decoder_prompt") or [TINY_TOKENS["decoder_start_token_id"]]])
    spec = audio.spec_for_source(export_dir)
    samples = _audio(spec)
    extractor = WhisperFeatureExtractor(feature_size=spec.n_mels)
    extractor.n_samples, extractor.nb_max_frames = spec.n_samples, spec.frames
    session_opts = session_options(threads=threads)
    model = onnxmerge.Seq2SeqModel(merged, session_options=session_opts)
    session = open_session(generator, session_opts)

    def loop():
        features = extractor(samples, sampling_rate=RATE, return_tensors="np").input_features
        return model.generate(
            input_features=features, decoder_input_ids=prompt,
            min_new_tokens=new_tokens, max_new_tokens=new_tokens,
        )  # fmt: skip

    feeds = {**audio.prepare_audio(samples, spec=spec),
             "max_new_tokens": np.array(new_tokens, np.int64)}  # fmt: skip

    def one_call():
        return session.run(None, feeds)[0]

    loop_times, one_times = [], []
    loop(), one_call()  # warm-up
    for _ in range(repeats):  # taking turns, so that both see the same machine
        loop_times.append(_common.timed_runs(loop, 1)[0][0])
        one_times.append(_common.timed_runs(one_call, 1)[0][0])
    expected, got = loop(), one_call()
    feature_model = audio.build_features(None, work / "features.onnx", spec=spec)
    (ours,) = open_session(feature_model, session_opts).run(
        None, audio.prepare_audio(samples, spec=spec)
    )
    theirs = extractor(samples, sampling_rate=RATE, return_tensors="np").input_features
    return {
        "threads": threads,
        "prompt": prompt[0].tolist(),
        "loop_s": statistics.median(loop_times),
        "one_call_s": statistics.median(one_times),
        "tokens_equal": bool(np.array_equal(expected, got)),
        "features_max_abs_diff": float(np.abs(ours - theirs).max()),
        "sequences": got.tolist(),
        "merged_bytes": merged.stat().st_size,
        "generator_bytes": generator.stat().st_size,
        "generator": generator,
        "samples": samples,
    }


def browser_side(source: Path, work: Path, samples, new_tokens: int, repeats: int,
                 weights: str | None = None, language: str | None = None,
                 ) -> dict[str, Any]:  # fmt: skip
    """The transcription page built from ``source`` (quantized to ``weights`` first)."""
    from onnxmerge.web import build_site
    from tests.browser import launch_chromium, load_page, serve

    sync_api = __import__("playwright.sync_api", fromlist=["sync_playwright"])
    site = build_site(
        source, work / f"site-{weights or 'fp32'}", weights=weights, language=language
    )
    with sync_api.sync_playwright() as playwright:
        browser, missing = launch_chromium(playwright, NODE_MODULES)
        if browser is None:
            return {"skipped": missing}
        try:
            with serve(site, NODE_MODULES) as server:
                context = browser.new_context()
                page, _ = load_page(context, f"{server.url}?threads=1", timeout_ms=600_000)
                if page.get_attribute("body", "data-state") != "ready":
                    raise RuntimeError(f"the page did not load: {page.inner_text('#status')}")
                timings = page.evaluate("window.onnxmerge.app.timings")
                runs = page.evaluate(
                    """async ([samples, n, repeats]) => {
                         const row = Float32Array.from(samples);
                         const out = [];
                         for (let i = 0; i <= repeats; i++) {
                           out.push(await window.onnxmerge.transcribe([row], 16000, n));
                         }
                         return out;
                       }""",
                    [samples.tolist(), new_tokens, repeats],
                )
                sent = dict(sorted(server.sent.items()))
                context.close()
        finally:
            browser.close()
    return {
        "threads": 1,
        "load_s": timings["load_ms"] / 1000,
        "session_s": timings["session_ms"] / 1000,
        "transcription_s": statistics.median(r["ms"] for r in runs[1:]) / 1000,
        "bytes_downloaded": sum(sent.values()),
        "model_bytes": sum(v for k, v in sent.items() if k.endswith("generator.onnx")),
        "files": sent,
        "sequences": runs[-1]["sequences"],
    }


def markdown(data: dict[str, Any]) -> list[str]:
    """The section of docs/benchmarks.md (``run_all.py`` renders it from whisper.json)."""
    py, browser, ratios = data["python"], data["browser"], data["ratios"]
    cpu = data["cpu"]["model"]
    lines = [
        "## Whisper: audio in, tokens out, in one call",
        "",
        f"{data['model']} (random weights), {data['audio_s']:.0f} s of audio, greedy, "
        f"{data['new_tokens']} new tokens, one thread, {cpu} (`benchmarks/bench_whisper.py`). "
        "Python: `WhisperFeatureExtractor` then `Seq2SeqModel.generate` on the merged file, "
        "against one `session.run` of the audio generator, taking turns in one process.",
        "",
        "| | extractor + Python loop | one call | ratio | same tokens | features max diff |",
        "|---|---:|---:|---:|---|---:|",
        f"| Python, s per transcription | {py['loop_s']:.3f} | {py['one_call_s']:.3f} | "
        f"**{ratios['one_call_over_loop_python']:.2f}x** | {py['tokens_equal']} | "
        f"{py['features_max_abs_diff']:.1e} |",
        "",
    ]
    tjs = data.get("transformers_js", {})
    if "transcription_s" in browser:
        with_tjs = "transcription_s" in tjs

        def row(name: str, ours: str, theirs: str, ratio: float | None = None) -> str:
            cells = [name, ours] + (
                [theirs, f"**{ratio:.2f}x**" if ratio else ""] if with_tjs else []
            )
            return "| " + " | ".join(cells) + " |"

        head = ["| in Chromium (wasm, 1 thread) | onnxmerge page |"]
        if with_tjs:
            head = [
                "| in Chromium (wasm, 1 thread) | onnxmerge page | transformers.js 4.3 | ratio |"
            ]
        lines += [
            *head,
            "|---|---:|" + ("---:|---:|" if with_tjs else ""),
            row("downloaded, MB", _common.mb(browser["bytes_downloaded"]),
                _common.mb(tjs.get("bytes_downloaded")),
                ratios.get("page_bytes_over_transformers_js")),
            row("of which the model, MB", _common.mb(browser["model_bytes"]),
                _common.mb(tjs.get("model_bytes" if with_tjs else "x") or
                           data["transformers_js_model_bytes_fp32"])),
            row("time to ready, s", f"{browser['load_s']:.2f}", f"{tjs.get('load_s', 0):.2f}"),
            row("time per transcription, s", f"{browser['transcription_s']:.3f}",
                f"{tjs.get('transcription_s', 0):.3f}",
                ratios.get("transcription_over_transformers_js")),
            row("tokens equal Python's", str(browser["tokens_equal_python"]),
                str(tjs.get("tokens_equal_python"))),
            "",
        ]  # fmt: skip
        if with_tjs:

            def wasm(files: dict[str, int]) -> str:
                return _common.mb(sum(v for k, v in files.items() if k.endswith(".wasm")))

            lines += [
                "Same precision (fp32), so the model bytes are about equal: Whisper's encoder "
                "and decoder share no weights, and `decoder_model_merged.onnx` already stores "
                "the decoder once. The difference is onnxruntime-web's binary "
                f"({wasm(browser['files'])} MB of wasm for the page, {wasm(tjs['files'])} MB "
                "for transformers.js's WebGPU-capable build) and transformers.js's library. Both "
                "spend most of a transcription in the encoder, on the 30 s window whatever the "
                "audio's length.",
                "",
            ]
        else:
            lines += [f"transformers.js did not run: {tjs.get('skipped')}.", ""]
    else:
        lines += [f"The browser part did not run: {browser.get('skipped')}.", ""]
    if "int8" in data:
        q = data["int8"]
        ours8, theirs8, r8 = q["browser"], q["transformers_js"], q["ratios"]
        lines += [
            "At int8 (the page built with `--weights int8`; transformers.js's `q8` files, "
            "`quantize_dynamic` with QInt8 weights, as its conversion script writes them):",
            "",
            "| int8, in Chromium (wasm, 1 thread) | onnxmerge page | transformers.js 4.3 q8 "
            "| ratio |",
            "|---|---:|---:|---:|",
            f"| downloaded, MB | {_common.mb(ours8['bytes_downloaded'])} | "
            f"{_common.mb(theirs8['bytes_downloaded'])} | "
            f"**{r8['page_bytes_over_transformers_js']:.2f}x** |",
            f"| of which the model, MB | {_common.mb(ours8['model_bytes'])} | "
            f"{_common.mb(theirs8['model_bytes'])} | |",
            f"| time to ready, s | {ours8['load_s']:.2f} | {theirs8['load_s']:.2f} | |",
            f"| time per transcription, s | {ours8['transcription_s']:.3f} | "
            f"{theirs8['transcription_s']:.3f} | "
            f"**{r8['transcription_over_transformers_js']:.2f}x** |",
            f"| same tokens as each other | {q['same_tokens']} | | |",
            "",
        ]  # fmt: skip
    return lines


# transformers.js's own page: its feature extractor and its two files, on the wasm backend.
TJS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><link rel="icon" href="data:,">
<script type="importmap">{"imports": {
  "@huggingface/transformers":
    "./node_modules/@huggingface/transformers/dist/transformers.web.min.js",
  "onnxruntime-common": "./node_modules/onnxruntime-common/dist/esm/index.js",
  "onnxruntime-web/webgpu": "./node_modules/onnxruntime-web/dist/ort.webgpu.bundle.min.mjs"}}
</script></head><body><p>transformers.js</p>
<script type="module">
import { env, AutoFeatureExtractor, WhisperForConditionalGeneration }
  from "@huggingface/transformers";
env.allowRemoteModels = false;
env.allowLocalModels = true;
env.localModelPath = new URL("./models/", location.href).href;
env.useBrowserCache = false;
env.backends.onnx.wasm.wasmPaths =
  new URL("./node_modules/onnxruntime-web/dist/", location.href).href;
env.backends.onnx.wasm.numThreads = 1;
const started = performance.now();
try {
  const extractor = await AutoFeatureExtractor.from_pretrained("whisper");
  const model = await WhisperForConditionalGeneration.from_pretrained(
    "whisper", { device: "wasm", dtype: new URLSearchParams(location.search).get("dtype") });
  const load_ms = performance.now() - started;
  window.bench = {
    load_ms,
    async transcribe(samples, n, options) {
      const t0 = performance.now();
      const { input_features } = await extractor(Float32Array.from(samples));
      const out = await model.generate({
        inputs: input_features, max_new_tokens: n, min_new_tokens: n, ...options });
      const ms = performance.now() - t0;
      return { ms, sequences: out.tolist().map((row) => row.map(Number)) };
    },
  };
  document.body.dataset.state = "ready";
} catch (error) {
  window.benchError = String(error && error.stack || error);
  document.body.dataset.state = "failed";
}
</script></body></html>
"""


def transformers_js_side(
    export_dir: Path,
    work: Path,
    samples,
    new_tokens: int,
    repeats: int,
    options: dict,
    dtype: str = "fp32",
) -> dict[str, Any]:
    """transformers.js (``ONNXMERGE_TRANSFORMERS_JS``: a node_modules holding
    @huggingface/transformers) in the same Chromium, on the export's two files; for ``q8``
    each quantized with ``quantize_dynamic`` (QInt8 weights), as its conversion script does."""
    import os
    import shutil

    from onnxmerge.generator.audio import PREPROCESSOR_CONFIG
    from tests.browser import launch_chromium, load_page, serve

    modules = os.environ.get("ONNXMERGE_TRANSFORMERS_JS")
    if not modules or not (Path(modules) / "@huggingface" / "transformers").is_dir():
        return {
            "skipped": "ONNXMERGE_TRANSFORMERS_JS does not name a node_modules with "
            "@huggingface/transformers (npm install --ignore-scripts "
            "@huggingface/transformers@4.3.0)"
        }
    site = work / f"tjs-site-{dtype}"
    model_dir = site / "models" / "whisper"
    (model_dir / "onnx").mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(export_dir / name, model_dir / name)
    if (export_dir / PREPROCESSOR_CONFIG).exists():
        shutil.copyfile(export_dir / PREPROCESSOR_CONFIG, model_dir / PREPROCESSOR_CONFIG)
    else:
        from transformers import WhisperFeatureExtractor

        from onnxmerge.generator.audio import spec_for_source

        spec = spec_for_source(export_dir)
        extractor = WhisperFeatureExtractor(feature_size=spec.n_mels)
        extractor.n_samples, extractor.nb_max_frames = spec.n_samples, spec.frames
        extractor.chunk_length = spec.n_samples / spec.sampling_rate
        extractor.to_json_file(model_dir / PREPROCESSOR_CONFIG)
    for name in (_common.ENCODER_FILE, _common.DECODER_MERGED_FILE):
        if dtype == "q8":
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(
                export_dir / name,
                model_dir / "onnx" / name.replace(".onnx", "_quantized.onnx"),
                weight_type=QuantType.QInt8,
                extra_options={"EnableSubgraph": True, "MatMulConstBOnly": True},
            )
        else:
            os.link(export_dir / name, model_dir / "onnx" / name)
    (site / "index.html").write_text(TJS_PAGE)
    sync_api = __import__("playwright.sync_api", fromlist=["sync_playwright"])
    with sync_api.sync_playwright() as playwright:
        browser, missing = launch_chromium(playwright, NODE_MODULES)
        if browser is None:
            return {"skipped": missing}
        try:
            with serve(site, Path(modules)) as server:
                context = browser.new_context()
                page, errors = load_page(context, f"{server.url}?dtype={dtype}", timeout_ms=600_000)
                if page.get_attribute("body", "data-state") != "ready":
                    return {
                        "skipped": f"transformers.js failed: {page.evaluate('window.benchError')}"
                    }
                load_ms = page.evaluate("window.bench.load_ms")
                runs = page.evaluate(
                    """async ([samples, n, repeats, options]) => {
                         const out = [];
                         for (let i = 0; i <= repeats; i++) {
                           out.push(await window.bench.transcribe(samples, n, options));
                         }
                         return out;
                       }""",
                    [samples.tolist(), new_tokens, repeats, options],
                )
                sent = dict(sorted(server.sent.items()))
                context.close()
        finally:
            browser.close()
    return {
        "load_s": load_ms / 1000,
        "transcription_s": statistics.median(r["ms"] for r in runs[1:]) / 1000,
        "bytes_downloaded": sum(sent.values()),
        "model_bytes": sum(v for k, v in sent.items() if k.endswith(".onnx")),
        "files": sent,
        "sequences": runs[-1]["sequences"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = _common.arguments(__doc__, "whisper", "the tiny test Whisper, fewer repeats")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 5
    new_tokens = 8 if args.quick else 32
    export_dir = export_whisper(args.quick)
    with tempfile.TemporaryDirectory(prefix="bench-whisper-") as tmp:
        work = Path(tmp)
        python = python_side(export_dir, work, new_tokens, repeats, threads=1)
        generator, samples = python.pop("generator"), python.pop("samples")
        try:
            browser = browser_side(generator, work, samples, new_tokens, repeats)
        except ImportError as e:
            browser = {"skipped": f"playwright is not installed: {e}"}
        options = {"language": "en", "task": "transcribe"} if len(python["prompt"]) > 1 else {}
        try:
            tjs = transformers_js_side(export_dir, work, samples, new_tokens, repeats, options)
        except ImportError as e:
            tjs = {"skipped": f"playwright is not installed: {e}"}
        int8 = None
        if not args.quick and "transcription_s" in browser and "transcription_s" in tjs:
            # The same comparison at int8: onnxmerge.quantize against quantize_dynamic.
            ours8 = browser_side(
                export_dir, work, samples, new_tokens, repeats, "int8", options.get("language")
            )
            theirs8 = transformers_js_side(
                export_dir, work, samples, new_tokens, repeats, options, dtype="q8"
            )
            int8 = {
                "browser": ours8,
                "transformers_js": theirs8,
                "same_tokens": ours8["sequences"] == theirs8.get("sequences"),
                "ratios": {
                    "page_bytes_over_transformers_js": ours8["bytes_downloaded"]
                    / theirs8["bytes_downloaded"],
                    "transcription_over_transformers_js": ours8["transcription_s"]
                    / theirs8["transcription_s"],
                },
            }
    if "sequences" in browser:
        browser["tokens_equal_python"] = browser["sequences"] == python["sequences"]
    if "sequences" in tjs:
        # transformers.js returns the prompt too, as the generator does.
        tjs["tokens_equal_python"] = tjs["sequences"] == python["sequences"]
    tjs_fp32 = _common.files_bytes(export_dir, (_common.ENCODER_FILE, _common.DECODER_MERGED_FILE))
    results = {
        "model": "tiny-whisper" if args.quick else "whisper-tiny shape",
        "audio_s": SECONDS,
        "new_tokens": new_tokens,
        "python": python,
        "browser": browser,
        "transformers_js": tjs,
        **({"int8": int8} if int8 else {}),
        "transformers_js_model_bytes_fp32": tjs_fp32,
        "ratios": {
            "one_call_over_loop_python": python["one_call_s"] / python["loop_s"],
            "model_bytes_over_transformers_js_fp32": python["generator_bytes"] / tjs_fp32,
            **(
                {
                    "page_bytes_over_transformers_js": browser["bytes_downloaded"]
                    / tjs["bytes_downloaded"],
                    "transcription_over_transformers_js": browser["transcription_s"]
                    / tjs["transcription_s"],
                }
                if "transcription_s" in tjs and "transcription_s" in browser
                else {}
            ),
        },
        "cpu": _common.cpu_description(),
        "platform": platform.platform(),
        "versions": _common.package_versions(),
    }
    _common.write_results(args.out, results)
    hidden = ("browser", "transformers_js", "int8")
    shown = {k: v for k, v in results.items() if k not in hidden}
    print(json.dumps(shown, indent=1, default=str)[:3000])
    if "transcription_s" in browser:
        print(f"browser: ready {browser['load_s']:.2f} s, transcription "
              f"{browser['transcription_s']:.3f} s, {browser['bytes_downloaded']} bytes, tokens "
              f"equal Python's: {browser['tokens_equal_python']}")  # fmt: skip
    if "transcription_s" in tjs:
        print(f"transformers.js: ready {tjs['load_s']:.2f} s, transcription "
              f"{tjs['transcription_s']:.3f} s, {tjs['bytes_downloaded']} bytes, tokens "
              f"equal Python's: {tjs['tokens_equal_python']}")  # fmt: skip
    else:
        print(f"transformers.js: {tjs.get('skipped')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
