"""The rewrite passes, one family per module, and what they share (``passes.base``).

- ``dims``: ``SeparateSymbolicDims``
- ``reshape_targets``: ``FoldReshapeTargets``
- ``dedup``: ``LiftLargeConstants``, ``DeduplicateInitializers``, ``HoistConstantNodes``,
  ``MergeEqualConstantNodes``, ``DropInitializerAliases``, ``RemoveUnusedInitializers``
- ``zero_bias``: ``DropZeroBias``
- ``tied_head``: ``GemmForTransposedWeights``

The quantization pass lives with the rest of quantization (``onnxmerge.quantization._rewrite``).
"""

from __future__ import annotations

from onnxmerge.passes.base import (
    NoMatch,
    StepResult,
    constant_array,
    counts,
    free_name,
    graph_of,
    initializer,
    is_op,
    name_of,
    records,
    replace_result,
    run,
    tensor_of,
)

__all__ = [
    "NoMatch",
    "StepResult",
    "constant_array",
    "counts",
    "free_name",
    "graph_of",
    "initializer",
    "is_op",
    "name_of",
    "records",
    "replace_result",
    "run",
    "tensor_of",
]
