"""Quantized single files: bytes on disk, memory, speed and quality per precision, with the anchors.

On the opus-mt-fr-en shape (seeded random weights, ``_common.export_cached``), in one run:

- bytes on disk over ``model.safetensors`` of onnxmerge's int8, uint8, fp16 and int4 files (the
  int4 one also with ``embedding="int4"``), next to onnxruntime's ``quantize_dynamic`` on each of
  optimum's files (transformers.js's ``_quantized`` files), ``quantize_dynamic(EnableSubgraph)``
  on the merged file, and CTranslate2's int8 ``model.bin`` converted from the same PyTorch folder
  (with a synthetic vocabulary: the model has no tokenizer);
- memory after load and greedy / beam-4 time of each file with ``Seq2SeqModel``, each in a fresh
  process (``bench_generate.py``'s worker), fp32 in the same run;
- quality: the shipped demo model's held-out numbers translated by each precision, compared with
  the fp32 file; and the cosine similarity of fp32 and quantized logits per tiny architecture.

``--quick`` uses the tiny Marian model, a few held-out numbers and one architecture.

Usage::

    python benchmarks/bench_quantize.py --out results.json [--cache-dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import _common  # noqa: E402

PRECISIONS = ("int8", "uint8", "fp16", "int4")
# The int4 file as quantize writes it (its embedding int8, gathered and multiplied as integers)
# and with embedding="int4" (the smallest file; its embedding dequantized whole at every step).
INT4_EMBEDDING = "int4, int4 embedding"
TARGETS = {"int8": 0.27, "uint8": 0.27, "fp16": 0.51, "int4": 0.16, INT4_EMBEDDING: 0.16}
OPTIMUM_FILES = (
    "encoder_model.onnx",
    "decoder_model.onnx",
    "decoder_with_past_model.onnx",
    "decoder_model_merged.onnx",
)


def _bytes(paths) -> int:
    return sum(Path(p).stat().st_size for p in paths)


def _dynamic(source: Path, target: Path, **extra) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(source, target, weight_type=QuantType.QInt8, extra_options=extra or None)
    return target


def anchors(export: _common.Export, merged: Path, scratch: Path) -> dict[str, int]:
    """Bytes of what others ship quantized, from the same weights."""
    quantized = {
        name: _dynamic(export.onnx_dir / name, scratch / name.replace(".onnx", "_quantized.onnx"))
        for name in OPTIMUM_FILES
    }
    subgraph = _dynamic(merged, scratch / "merged_quantize_dynamic.onnx", EnableSubgraph=True)
    return {
        "quantize_dynamic: encoder + decoder_model_merged (transformers.js _quantized)": _bytes(
            [quantized["encoder_model.onnx"], quantized["decoder_model_merged.onnx"]]
        ),
        "quantize_dynamic: all four optimum files": _bytes(quantized.values()),
        "quantize_dynamic(EnableSubgraph) on onnxmerge's model.onnx": _bytes([subgraph]),
        "CTranslate2 int8 model.bin": _ctranslate2_bytes(export, scratch),
    }


def _synthetic_tokenizer(folder: Path, vocab_size: int, pad_id: int, eos_id: int) -> None:
    from tokenizers import Tokenizer, models

    names = {eos_id: "</s>", pad_id: "<pad>"}
    unk_id = next(i for i in range(vocab_size) if i not in names)
    names[unk_id] = "<unk>"
    vocab = {names.get(i, f"tok{i}"): i for i in range(vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
            }
        )
    )


def _ctranslate2_bytes(export: _common.Export, scratch: Path) -> int | None:
    try:
        import ctranslate2
    except ImportError:
        return None
    folder = scratch / "pytorch-with-vocabulary"
    folder.mkdir()
    for path in export.pytorch_dir.iterdir():
        os.symlink(path, folder / path.name)
    config = json.loads((export.pytorch_dir / "config.json").read_text())
    _synthetic_tokenizer(
        folder, config["vocab_size"], config["pad_token_id"], config["eos_token_id"]
    )
    out = scratch / "ct2-int8"
    converter = ctranslate2.converters.TransformersConverter(os.fspath(folder))
    converter.convert(os.fspath(out), quantization="int8", force=True)
    return _bytes([out / "model.bin"])


def speed(files: dict[str, Path], source: str, repeats: int) -> dict[str, dict]:
    """Each file in a fresh process: memory after load, greedy and beam-4 time."""
    worker = REPO / "benchmarks" / "bench_generate.py"
    results = {}
    for name, path in files.items():
        argv = [sys.executable, os.fspath(worker), "--worker", "ours", "--path", os.fspath(path)]
        argv += ["--repeats", str(repeats), "--source", source]
        out = subprocess.run(argv, check=True, capture_output=True, text=True, cwd=REPO)
        run = json.loads(out.stdout.strip().splitlines()[-1])
        results[name] = {
            k: run[k] for k in ("rss_after_load_mb", "greedy_time", "beam4_time", "load_time")
        }
        results[name]["greedy_tokens"] = run["greedy_tokens"]
    return results


def demo_quality(scratch: Path, every: int) -> dict:
    """Held-out numbers translated exactly as the fp32 file does, per precision."""
    from onnxmerge import merge_seq2seq, quantize
    from onnxmerge.demo import LARGEST_NUMBER, english_number, french_number, is_held_out
    from onnxmerge.runtime import Seq2SeqModel
    from tests.zoo import demo_export

    folder = scratch / "demo"
    shutil.copytree(demo_export(), folder)
    merged = merge_seq2seq(folder)
    numbers = [n for n in range(LARGEST_NUMBER + 1) if is_held_out(n)][::every]
    sources = [french_number(n) for n in numbers]
    reference = Seq2SeqModel(merged).translate(sources)
    rows = {
        "fp32": {
            "same_as_fp32": 1.0,
            "correct": sum(t == english_number(n) for t, n in zip(reference, numbers, strict=True))
            / len(numbers),
        }
    }
    for precision in PRECISIONS:
        path = quantize(merged, weights=precision)
        got = Seq2SeqModel(path).translate(sources)
        rows[precision] = {
            "same_as_fp32": sum(a == b for a, b in zip(got, reference, strict=True)) / len(numbers),
            "correct": sum(t == english_number(n) for t, n in zip(got, numbers, strict=True))
            / len(numbers),
            "bytes": path.stat().st_size,
        }
    rows["fp32"]["bytes"] = merged.stat().st_size
    return {"numbers": len(numbers), "rows": rows}


def cosine_table(archs: list[str], scratch: Path) -> dict[str, dict[str, float]]:
    """Cosine similarity of fp32 and quantized logits, teacher-forced, per tiny architecture."""
    from onnxmerge import merge_seq2seq, quantize
    from tests import zoo as models
    from tests.quality import cosine, mergeable_variant, teacher_forced_logits

    table = {}
    for arch in archs:
        merged = merge_seq2seq(
            models.tiny_export(arch, mergeable_variant(arch)).onnx_dir, scratch / f"{arch}.onnx"
        )
        reference = teacher_forced_logits(merged)
        table[arch] = {
            p: cosine(
                reference,
                teacher_forced_logits(quantize(merged, scratch / f"{arch}_{p}.onnx", weights=p)),
            )
            for p in PRECISIONS
        }
    return table


def markdown(results: dict) -> list[str]:
    """The section of docs/benchmarks.md."""
    checkpoint = results["checkpoint_bytes"]
    lines = [
        f"## Quantized single files ({results['model']} shape)",
        "",
        "Written by `benchmarks/bench_quantize.py`; every onnxmerge file stores each weight once "
        "(embedding, LM head and both decoders share one quantized tensor).",
        "",
        "| file | bytes on disk | x model.safetensors | target |",
        "|---|---:|---:|---:|",
    ]
    for name, size in results["sizes"].items():
        precision = name.removeprefix("onnxmerge ")
        target = f"<= {TARGETS[precision]}x" if precision in TARGETS else ""
        lines.append(f"| {name} | {size / 1e6:.1f} MB | {size / checkpoint:.3f}x | {target} |")
    for name, size in results["anchors"].items():
        if size is not None:
            lines.append(f"| {name} | {size / 1e6:.1f} MB | {size / checkpoint:.3f}x | |")
    lines += [
        f"| model.safetensors | {checkpoint / 1e6:.1f} MB | 1.000x | |",
        "",
        "Seq2SeqModel per precision, each in a fresh process (batch 1, 32 source tokens, 32 new "
        "tokens, best of the runs); ratios over the fp32 file in the same run:",
        "",
        "| file | memory after load MB | greedy s | beam-4 s | memory | greedy | beam-4 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = results["speed"]["fp32"]
    for name, run in results["speed"].items():
        lines.append(
            f"| {name} | {run['rss_after_load_mb']:.0f} | {run['greedy_time']:.3f} | "
            f"{run['beam4_time']:.3f} | {run['rss_after_load_mb'] / base['rss_after_load_mb']:.2f}x"
            f" | {run['greedy_time'] / base['greedy_time']:.2f}x | "
            f"{run['beam4_time'] / base['beam4_time']:.2f}x |"
        )
    demo = results["demo_quality"]
    lines += [
        "",
        f"The shipped demo model on {demo['numbers']} held-out numbers (never seen in training):",
        "",
        "| precision | file bytes | same translation as fp32 | correct |",
        "|---|---:|---:|---:|",
    ]
    for precision, row in demo["rows"].items():
        lines.append(
            f"| {precision} | {row['bytes']} | {row['same_as_fp32']:.1%} | {row['correct']:.1%} |"
        )
    lines += [
        "",
        "Cosine similarity of fp32 and quantized logits over a teacher-forced sequence (tiny test "
        "models with wide random weights, std 0.5, harder to quantize than trained ones):",
        "",
        "| architecture | " + " | ".join(PRECISIONS) + " |",
        "|---|" + "---:|" * len(PRECISIONS),
    ]
    for arch, row in results["cosine"].items():
        lines.append(f"| {arch} | " + " | ".join(f"{row[p]:.4f}" for p in PRECISIONS) + " |")
    lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache-dir", type=Path, default=_common.DEFAULT_CACHE_DIR)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny model; checks the pipeline")
    args = parser.parse_args(argv)

    from benchmarks.bench_generate import source_ids
    from onnxmerge import merge_seq2seq, quantize
    from tests.zoo import ARCHITECTURES

    factory = _common.marian_config(args.quick)
    export = _common.export_cached(factory, "tied", args.cache_dir)
    scratch = Path(tempfile.mkdtemp(prefix="bench-quantize-"))
    try:
        merged = merge_seq2seq(export.onnx_dir, scratch / "model.onnx")
        files = {"fp32": merged}
        for precision in PRECISIONS:
            files[precision] = quantize(merged, weights=precision)
        files[INT4_EMBEDDING] = quantize(
            merged, scratch / "model_q4_int4_embedding.onnx", weights="int4", embedding="int4"
        )
        source = ",".join(map(str, source_ids(factory())))
        results = {
            "model": "tiny Marian" if args.quick else "opus-mt-fr-en",
            "checkpoint_bytes": export.checkpoint.stat().st_size,
            "sizes": {f"onnxmerge {name}": path.stat().st_size for name, path in files.items()},
            "anchors": anchors(export, merged, scratch),
            "speed": speed(files, source, 1 if args.quick else args.repeats),
            "demo_quality": demo_quality(scratch, 50 if args.quick else 1),
            "cosine": cosine_table(["marian"] if args.quick else list(ARCHITECTURES), scratch),
            "targets": TARGETS,
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratios = {k: v / results["checkpoint_bytes"] for k, v in results["sizes"].items()}
    results["targets_met"] = {p: ratios[f"onnxmerge {p}"] <= t for p, t in TARGETS.items()}
    _common.write_results(args.out, results)
    print("\n".join(markdown(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
