"""Weight bytes per layout, for every architecture of the test zoo.

The test models are tiny, so graph structure would dominate file sizes; this counts the bytes of
stored tensors instead (initializers and constants of every file of a layout), against the tensor
bytes of the PyTorch checkpoint. A ratio of 1.00 means every weight is stored once.

Usage: python benchmarks/bench_sizes.py [--out benchmarks/out/sizes.json] [--archs marian t5 ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _common  # noqa: E402

DEFAULT_OUT = _common.OUT_DIR / "sizes.json"
LAYOUTS = {
    "encoder+decoder+decoder_with_past": (
        "encoder_model.onnx",
        "decoder_model.onnx",
        "decoder_with_past_model.onnx",
    ),
    "encoder+decoder_model_merged": ("encoder_model.onnx", "decoder_model_merged.onnx"),
}


def tensor_bytes(path: Path) -> int:
    from onnxmerge import model_io

    model, _ = model_io.load_model(path)
    return model_io.tensor_bytes(model)


def checkpoint_tensor_bytes(pytorch_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(pytorch_dir / "model.safetensors"), "np") as f:
        for key in f.keys():
            total += f.get_tensor(key).nbytes
    return total


def measure(arch: str, variant: str) -> dict:
    from onnxmerge import merge_seq2seq
    from tests.zoo import tiny_export

    export = tiny_export(arch, variant)
    checkpoint = checkpoint_tensor_bytes(export.pytorch_dir)
    row = {"arch": arch, "variant": variant, "checkpoint_tensor_bytes": checkpoint, "layouts": {}}
    for name, files in LAYOUTS.items():
        total = sum(tensor_bytes(export.onnx_dir / f) for f in files)
        row["layouts"][name] = {"bytes": total, "ratio": total / checkpoint}
    with tempfile.TemporaryDirectory() as tmp:
        result = merge_seq2seq(export.onnx_dir, Path(tmp) / "model.onnx").report
        merged = tensor_bytes(result.path)
    row["layouts"]["onnxmerge"] = {"bytes": merged, "ratio": merged / checkpoint}
    row["transposed_found"] = len(result.transposed)
    return row


def markdown(rows: list[dict]) -> str:
    names = list(LAYOUTS) + ["onnxmerge"]
    lines = [
        "| architecture | LM head export | " + " | ".join(names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    for row in rows:
        cells = [f"{row['layouts'][n]['ratio']:.2f}x" for n in names]
        lines.append(f"| {row['arch']} | {row['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tests.zoo import ARCHITECTURES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--archs", nargs="+", default=[a for a in ARCHITECTURES if a != "vision-encoder-decoder"]
    )
    args = parser.parse_args(argv)
    rows = []
    for arch in args.archs:
        variants = ["head-copy", "head-tied"] if arch in ("marian", "bart", "t5") else ["default"]
        rows.extend(measure(arch, v) for v in variants)
    _common.write_results(args.out, {"benchmark": "sizes", "rows": rows})
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
