"""The merge stage: loading an export, judging each file's role, splicing the files into one
model, the checkpoint analysis and the orchestration that runs them with the rewrite passes;
and the one way every writer gets a merged model from what it is given (``resolve_source``,
``merged_model``).

The orchestrator is imported when one of its names is first asked for, so that a module that only
loads files (``merge._load``) does not pull in the rest of the stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onnxmerge.merge._every_dtype import merge_every_dtype
    from onnxmerge.merge._load import find_checkpoint, load_export
    from onnxmerge.merge._orchestrate import (
        DEFAULT_OUTPUT_NAME,
        MergeResult,
        merge_seq2seq,
        merge_seq2seq_with_report,
        rewrite_steps,
    )
    from onnxmerge.merge._resolve import Source, merged_model, resolve_source
    from onnxmerge.merge._roles import Role

__all__ = [
    "DEFAULT_OUTPUT_NAME",
    "MergeResult",
    "Role",
    "find_checkpoint",
    "load_export",
    "merge_every_dtype",
    "merge_seq2seq",
    "merge_seq2seq_with_report",
    "rewrite_steps",
    "Source",
    "merged_model",
    "resolve_source",
]


def __getattr__(name: str):
    if name in ("find_checkpoint", "load_export"):
        from onnxmerge.merge import _load as load

        return getattr(load, name)
    if name == "Role":  # which part of an export a file plays
        from onnxmerge.merge._roles import Role

        return Role
    if name == "merge_every_dtype":
        from onnxmerge.merge._every_dtype import merge_every_dtype

        return merge_every_dtype
    if name in ("Source", "merged_model", "resolve_source"):
        from onnxmerge.merge import _resolve as resolve

        return getattr(resolve, name)
    if name in __all__:
        from onnxmerge.merge import _orchestrate as orchestrate

        return getattr(orchestrate, name)
    raise AttributeError(f"module 'onnxmerge.merge' has no attribute {name!r}")
