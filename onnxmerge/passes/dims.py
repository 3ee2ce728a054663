"""Keep symbolic dimensions of different source graphs apart.

A symbolic dimension (``dim_param``) means one size throughout a model, and onnxruntime plans
buffers on that promise. Each source file keeps it only within itself: tools that infer shapes
(onnxruntime's symbolic shape inference, which ``quantize_dynamic`` and the transformer optimizer
run) name the sizes they cannot express ``unk__0``, ``unk__1``, … anew in every file. The names on
the files' inputs and outputs are optimum's (``batch_size``, ``encoder_sequence_length``, …) and
do mean one size in every file; any other name that an earlier part already uses gets the later
part's tag as a prefix. Names used by one part only stay as they are, so an untouched export
merges unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import onnx_ir as ir

from onnxmerge.passes.base import StepResult, free_name

__all__ = ["DimSource", "SeparateSymbolicDims"]


class DimSource(NamedTuple):
    """One source graph's values: ``interface`` (inputs and outputs, whose names mean one size in
    every source) and ``interior`` (the rest, subgraphs included); ``tag`` prefixes its renamed
    dims."""

    tag: str
    interface: Sequence[ir.Value]
    interior: Sequence[ir.Value]


def _names(value: ir.Value) -> set[str]:
    if value.shape is None:
        return set()
    return {d.value for d in value.shape if isinstance(d, ir.SymbolicDim) and d.value}


class SeparateSymbolicDims(ir.passes.InPlacePass):
    """Rename interior symbolic dims that an earlier part uses too; count the names renamed.

    As with value names, the first source to use a name keeps it; later ones get their tag.
    Made from the sources before the splice (``merge.parts.dim_sources``); run on the spliced
    model, which holds the same values (the splice moves nodes, it does not copy values).
    """

    def __init__(self, sources: Sequence[DimSource]):
        super().__init__()
        self._interface_names = {
            name for source in sources for value in source.interface for name in _names(value)
        }
        self._sources = [(source.tag, list(source.interior)) for source in sources]

    def call(self, model: ir.Model) -> StepResult:
        taken: set[str] = set()
        renamed = 0
        for tag, values in self._sources:
            own = {n for v in values for n in _names(v)} - self._interface_names
            clashing = own & taken
            new_names = {name: free_name(f"{tag}/{name}", taken | own) for name in clashing}
            taken |= (own - clashing) | set(new_names.values())
            renamed += len(clashing)
            for value in values:
                if value.shape is not None and _names(value) & clashing:
                    value.shape = ir.Shape(
                        [
                            new_names[d.value]
                            if isinstance(d, ir.SymbolicDim) and d.value in clashing
                            else d
                            for d in value.shape
                        ]
                    )
        return StepResult.counted(model, "symbolic_dims_renamed", renamed)
