"""An optimum export laid out as a Hub repository for transformers.js, for tests and benchmarks.

Side files (configs, tokenizer) at the root; ``onnx/encoder_model{suffix}.onnx`` and
``onnx/decoder_model_merged{suffix}.onnx`` per dtype. q8 (``_quantized``) is made with
onnxruntime's ``quantize_dynamic``, QInt8 weights with subgraphs, as transformers.js's conversion
script does; any other dtype is a renamed copy, which is all a test of the layout needs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from onnxmerge.export_layout import DTYPE_SUFFIXES, MODELS_FOLDER

SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
MODEL_FILES = ("encoder_model.onnx", "decoder_model_merged.onnx")


def quantize_q8(model: Path, output: Path) -> None:
    """transformers.js's q8 file of ``model``: ``quantize_dynamic``, QInt8 weights."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        model,
        output,
        weight_type=QuantType.QInt8,
        extra_options={"EnableSubgraph": True, "MatMulConstBOnly": True},
    )


def hub_repository(export: Path, root: Path, dtypes: tuple[str, ...] = ("fp32", "q8")) -> Path:
    """Write ``export``'s files into ``root`` in transformers.js's layout; return ``root``."""
    models = root / MODELS_FOLDER
    models.mkdir(parents=True)
    for name in SIDE_FILES:
        if (export / name).is_file():
            shutil.copy(export / name, root / name)
    for dtype in dtypes:
        suffix = DTYPE_SUFFIXES[dtype]
        for name in MODEL_FILES:
            target = models / name.replace(".onnx", f"{suffix}.onnx")
            if dtype == "q8":
                quantize_q8(export / name, target)
            else:
                shutil.copy(export / name, target)
    return root


__all__ = [
    "SIDE_FILES",
    "MODEL_FILES",
    "quantize_q8",
    "hub_repository",
]
