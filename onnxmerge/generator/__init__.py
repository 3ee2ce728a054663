"""One ONNX model from token ids to token ids: the decoding loop inside the graph.

``build_generator(source)`` writes a model whose inputs are the encoder inputs and
``max_new_tokens`` and whose output is ``sequences``; see ``docs/generator.md``.
"""

from __future__ import annotations

from onnxmerge.generator._build import (
    DEFAULT_OUTPUT_NAME,
    MAX_NEW_TOKENS,
    SEARCHES,
    SEQUENCES,
    SEQUENCES_SCORES,
    GeneratorResult,
    build_generator,
)

__all__ = [
    "build_generator",
    "GeneratorResult",
    "DEFAULT_OUTPUT_NAME",
    "MAX_NEW_TOKENS",
    "SEARCHES",
    "SEQUENCES",
    "SEQUENCES_SCORES",
]
